"""What the passes know about a graph: the ``ctx`` of ``pass(gm, ctx) -> gm``.

One Dynamo subgraph becomes one :class:`CapturedGraph`; AOTAutograd turns it
into a forward and a backward ATen graph (or one inference graph), each
rewritten with its own :class:`GraphContext`.  Passes read facts here and
record new ones in ``ctx.facts`` (documented keys only), never elsewhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

import torch

from .module_paths import ModuleBlocks, module_path_from_source
from .tensor_parallel import flat_width, local_of
from .options import ZinfOptions

_graph_ids = itertools.count()
_graph_ids_lock = threading.Lock()


@dataclasses.dataclass
class InputInfo:
    """One input of the Dynamo graph: a parameter, a buffer or a user tensor."""

    position: int  # index among the Dynamo graph's placeholders
    name: str  # module path for params and buffers (``blocks.0.attn.qkv.weight``)
    kind: str  # "param" | "buffer" | "input" | "other"
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    requires_grad: bool
    # ATen placeholders AOTAutograd flattens it into: 1, or a tensor subclass's inner tensors and opaque
    # objects (a DTensor: its local tensor and its device mesh, 2); its ATen placeholder is the first.
    flat_width: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (its shape times its dtype's size; 0 for an input that is no tensor)."""
        if self.shape is None or self.dtype is None:
            return 0
        numel = 1
        for size in self.shape:
            numel *= int(size)
        return numel * self.dtype.itemsize


@dataclasses.dataclass
class CapturedGraph:
    """A Dynamo subgraph handed to the backend, and the parameters it uses."""

    graph_id: int
    options: ZinfOptions
    inputs: list[InputInfo]
    # Real parameter tensors by Dynamo position, while compiling (adopted
    # then); emptied after, so a compiled graph never keeps a model alive.
    # User inputs are not kept either.
    param_tensors: dict[int, torch.Tensor]
    # Filled while the forward graph is rewritten: ATen placeholder name
    # (``primals_3``) -> the Dynamo input it carries.  The backward graph's
    # saved primals keep these names, which is how it finds its parameters.
    input_by_placeholder: dict[str, InputInfo] = dataclasses.field(default_factory=dict)
    # Dynamo positions of DTensor inputs, which the graph takes as their local tensors
    tp_slots: list[int] = dataclasses.field(default_factory=list)
    # Dynamo position -> rows per tile of a parameter the tile pass splits
    # (its layout in the store, fixed when the parameter was first adopted).
    tile_rows: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Dynamo position -> the fixed layout of the parameter adopted there
    # (:class:`zinf_compiler.runtime.units.ParamLayout`, a copy): what the
    # passes size units with (see zinf_compiler/unit_plan.py).
    layouts: dict[int, Any] = dataclasses.field(default_factory=dict)
    # Ranks the graph's parameters are sharded over (world_size of them) and, for HSDP, replicated
    # across: a runtime.comm.MeshComm, set by the backend (None outside it).
    mesh: Any = None
    world_size: int = 1
    # Caps the schedule pass keeps (set by the backend): device bytes gathered
    # or in flight (max_live_bytes, None: no cap) and pinned host bytes the nc
    # reads may hold (None: not offloaded to NVMe).
    live_bytes_cap: int | None = None
    pinned_capacity: int | None = None
    # The machine's cost model (:class:`zinf_compiler.cost_model.CostModel`),
    # profiled by the backend at the first compile; None outside the backend.
    cost_model: Any = None
    # What the checkpointing policy decided on the joint graph (zinf_compiler/recompute.py), for the dumps.
    activation_plan: dict | None = None
    # Forward value name -> its fake value, for each saved activation the
    # activations pass offloaded: the backward graph's placeholder of that name
    # receives a handle instead and fetches the value back.
    offloaded_activations: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The graph's module tree as blocks (zinf_compiler/module_paths.py): what the
    # partition pass buckets by and "block" checkpointing recomputes by.
    module_blocks: ModuleBlocks = dataclasses.field(default_factory=ModuleBlocks)
    # At world size > 1: digests the ranks compare before running this graph
    # (zinf_compiler/runtime/agreement.py): which parameters and buffers it
    # reads, and the options and shapes that decide its collectives.
    graph_print: int = 0
    config_print: int = 0

    @classmethod
    def from_dynamo(cls, gm: torch.fx.GraphModule, example_inputs: list[Any], options: ZinfOptions) -> "CapturedGraph":
        """Describe ``gm``'s placeholders (kind by Dynamo source) and keep its parameters, under a new graph id."""
        with _graph_ids_lock:
            graph_id = next(_graph_ids)
        inputs: list[InputInfo] = []
        param_tensors: dict[int, torch.Tensor] = {}
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        for position, node in enumerate(placeholders):
            example = example_inputs[position] if position < len(example_inputs) else None
            grapharg = node.meta.get("grapharg")
            source_name = grapharg.source.name if grapharg is not None and grapharg.source is not None else node.name
            if callable(source_name):  # older torch: Source.name() is a method
                source_name = source_name()
            if isinstance(example, torch.nn.Parameter) or "._parameters[" in source_name:
                kind = "param"
            elif "._buffers[" in source_name:
                kind = "buffer"
            elif isinstance(example, torch.Tensor):
                kind = "input"
            else:
                kind = "other"
            is_tensor = isinstance(example, torch.Tensor)
            local = local_of(example) if is_tensor else None  # (a DTensor's ATen placeholder is its local tensor)
            inputs.append(
                InputInfo(
                    position=position,
                    name=module_path_from_source(source_name),
                    kind=kind,
                    shape=tuple(local.shape) if is_tensor else None,
                    dtype=local.dtype if is_tensor else None,
                    requires_grad=bool(is_tensor and example.requires_grad),
                    flat_width=flat_width(example) if is_tensor else 1,
                )
            )
            if kind == "param" and is_tensor:
                param_tensors[position] = example
        return cls(graph_id=graph_id, options=options, inputs=inputs, param_tensors=param_tensors,
                   module_blocks=ModuleBlocks.from_graph(gm))

    def flat_inputs(self) -> list[tuple[int, InputInfo]]:
        """Each Dynamo input with the index of its first ATen placeholder (and, in the backward graph, of its
        gradient output), counted from the first one after any effect tokens.  A tensor subclass input (a
        DTensor) takes :attr:`InputInfo.flat_width` of them, its local tensor first."""
        flat, index = [], 0
        for info in self.inputs:
            flat.append((index, info))
            index += info.flat_width
        return flat

    @property
    def params(self) -> list[InputInfo]:
        """The inputs that are parameters, in Dynamo order."""
        return [info for info in self.inputs if info.kind == "param"]


@dataclasses.dataclass
class GraphContext:
    """The ``ctx`` every pass receives for one ATen graph.

    * ``kind``: "forward", "backward" or "inference".
    * ``params``: ATen placeholder name -> :class:`InputInfo` for every
      parameter placeholder of this graph (the parameter table).
    * ``facts``: what passes learned, by documented key, for later passes and
      the dumps.
    """

    captured: CapturedGraph
    kind: str
    params: dict[str, InputInfo]
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def options(self) -> ZinfOptions:
        """The options of the compile this graph belongs to (``captured.options``)."""
        return self.captured.options

    @property
    def graph_id(self) -> int:
        """The id of the Dynamo subgraph this ATen graph came from (its forward and backward share it)."""
        return self.captured.graph_id

    def param_bytes(self) -> int:
        """Bytes of the parameters this graph takes, whole (not this rank's shards): for the dump headers."""
        return sum(info.nbytes for info in self.params.values())

    @property
    def cost_model(self) -> Any:
        """The :class:`~zinf_compiler.cost_model.CostModel` of this machine (nominal rates outside the backend)."""
        if self.captured.cost_model is None:
            from .cost_model import CostModel, nominal_profile

            self.captured.cost_model = CostModel(nominal_profile(), self.captured.world_size)
        return self.captured.cost_model
