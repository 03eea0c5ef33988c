"""Tensor-parallel models (torch's ``parallelize_module``: DTensor parameters) under zinf's dp sharding.

zinf shards each parameter's TP-local tensor over the data-parallel ranks (option ``mesh`` =
``mesh["dp"]``); the TP collectives stay in the graph as functional collectives.  AOTAutograd cannot be
handed a DTensor parameter as such: it would rebuild a DTensor gradient from the ``None`` zinf's backward
returns for a sharded parameter.  So the backend rewrites Dynamo's graph (:func:`unwrap_dtensor_inputs`)
so that each DTensor input becomes a plain input, its local tensor, followed by ``DTensor.from_local``;
each call passes a new alias of the local tensor (:func:`local_input`).  The user's parameters stay
DTensors; the store adopts and rests their local tensors (``runtime/tensor_parallel.local_of``).  The
gradient of ``from_local`` is the local gradient in the parameter's placements (a Partial one
all-reduced over tp first), which zinf then reduces over dp.

Stage 3 only, for now: at stages 1-2 the gradient autograd leaves on the call's alias never reaches the
optimizer, so :func:`check_params` refuses them, as it refuses a mesh that spans tp ranks.

Checkpoints (``zinf.save`` / ``load`` / ``export``): a piece of a checkpoint is a range of the *whole* flat
tensor (:func:`global_ranges` maps a rank's ranges of its TP-local tensor there), every rank writes its own
file, and what every tp rank holds alike (plain and Replicate parameters) is written by tp rank 0 alone.
So a checkpoint saved at one tp x dp layout loads at any other (tp 1 is the plain model).  Refused: several
tp meshes in one model, a tp mesh of more than one dimension, placements other than Shard and Replicate.
Issue 37 has the rest.
"""

from __future__ import annotations

import contextlib

import torch

# (context.py imports local_of from here, with flat_width; the optimizer's step reads model_tp_mesh and
# holds_own_slice from the runtime, where the layout of a DTensor parameter is read)
from .runtime.tensor_parallel import holds_own_slice, layout_of, local_of, model_tp_mesh  # noqa: F401


def flat_width(tensor: torch.Tensor) -> int:
    """How many graph inputs AOTAutograd flattens ``tensor`` into: 1 for a plain tensor; for a traceable
    subclass (``__tensor_flatten__``), its inner tensors and opaque objects, recursively (a DTensor: its local
    tensor and its device mesh, 2)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return 1
    attrs, _ = tensor.__tensor_flatten__()
    return sum(flat_width(inner) if isinstance(inner := getattr(tensor, attr), torch.Tensor) else 1 for attr in attrs)


def check_params(params: dict, names: dict, mesh, stage: int) -> None:
    """Refuse, before adoption, what would train a tensor-parallel model wrongly.

    ``params``: Dynamo position -> parameter; ``names``: position -> its module path; ``mesh``: the
    runtime MeshComm zinf shards over; ``stage``: the ZeRO stage.  A tensor-parallel parameter (a DTensor)
    must not be sharded, nor broadcast at adoption, across its own tp ranks, which hold different slices of it (silently wrong: every tp rank would train tp rank 0's slice; a 2-D mesh
    ``("dp", "tp")`` passed whole is read as replicate x shard, and would be).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded_over = None
    for position, param in params.items():
        if isinstance(param, DTensor):
            if stage < 3:
                # The graph takes a new alias of the local tensor at each call (local_input): at stages 1-2 the
                # gradient autograd leaves on it never reaches zinf's optimizer (measured: losses constant).
                raise ValueError(
                    f"zinf: parameter {names[position]} is a DTensor (tensor parallel): stage {stage} does not "
                    f"train it yet; use stage 3")
        layout = layout_of(param)
        if layout is None:
            continue
        if sharded_over is None:  # (only a tensor-parallel model reaches here: torch.distributed is up)
            sharded_over = set(dist.get_process_group_ranks(mesh.everyone.group or dist.group.WORLD))
        tp_ranks = set(dist.get_process_group_ranks(layout.mesh.get_group()))
        if len(tp_ranks & sharded_over) > 1:
            raise ValueError(
                f"zinf: option mesh spans ranks {sorted(tp_ranks & sharded_over)}, which hold different tensor-"
                f"parallel slices of {names[position]}; pass the data-parallel dimension (mesh[\"dp\"])")


def full_tensor(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``param`` given ``value``, its TP-local tensor (already whole over dp): gathered
    over the tp ranks (a collective on them) for a tensor-parallel parameter, ``value`` for any other."""
    from torch.distributed.tensor import DTensor

    layout = layout_of(param)
    if layout is None:
        return value
    if isinstance(value, DTensor):  # (a parameter zinf has not adopted yet: still the DTensor itself)
        return value.full_tensor()
    return DTensor.from_local(value, layout.mesh, layout.placements, run_check=False, shape=layout.shape,
                              stride=layout.stride).full_tensor()


def unwrap_dtensor_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[list, list[int]]:
    """Make each DTensor input of Dynamo's ``gm`` a plain input (its local tensor) followed by
    ``DTensor.from_local``, so AOTAutograd sees no tensor subclass input, and never rebuilds a DTensor
    gradient from the ``None`` zinf's backward returns for a sharded parameter.  Returns the example inputs
    for AOTAutograd and the rewritten positions (their callers pass :func:`local_input` there)."""
    from torch.distributed.tensor import DTensor

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    inputs, positions = list(example_inputs), []
    for position, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(example, DTensor):
            continue
        with gm.graph.inserting_after(node):
            rebuilt = gm.graph.call_function(
                DTensor.from_local, (node, example.device_mesh, tuple(example.placements)),
                {"run_check": False, "shape": example.shape, "stride": example.stride()})
        node.replace_all_uses_with(rebuilt, delete_user_cb=lambda user: user is not rebuilt)
        node.meta["example_value"] = example._local_tensor
        inputs[position] = local_input(example)
        positions.append(position)
    if positions:
        gm.recompile()
    return inputs, positions


@contextlib.contextmanager
def dtensor_outputs_refused(gm: torch.fx.GraphModule):
    """Around the compile of Dynamo's ``gm``: where AOTAutograd's partitioner fails on a graph that returns
    DTensors ("Node tangents_N was invalid, but is output"), raise an error saying what it is and what to do.
    Such a graph ends right after tensor-parallel ops: Dynamo split the model inside a TP region, as an
    exception raised there does (a plain graph break there trains: tests/multirank/test_tensor_parallel.py)."""
    from torch.distributed.tensor import DTensor

    try:
        yield
    except Exception as err:
        returned = [node.name for node in gm.graph.output_node().all_input_nodes
                    if isinstance(node.meta.get("example_value"), DTensor)]
        if "was invalid, but is output" not in str(err) or not returned:
            raise
        raise ValueError(
            f"zinf cannot compile this graph: it ends right after tensor-parallel ops and returns DTensors "
            f"({', '.join(returned)}), which AOTAutograd's partitioner fails on once zinf has made its DTensor "
            f"parameters local. Dynamo split the model inside a TP region (an exception raised there, or a graph "
            f"break Dynamo resumed from inside it): move the break before the region's first TP op or after its "
            f"last, or fix what raised there") from err


def local_input(param: torch.Tensor) -> torch.Tensor:
    """What a rewritten graph takes for DTensor ``param``: a new alias of its local tensor that requires
    grad as ``param`` does (autograd must run the graph's backward, where zinf reduces the gradient)."""
    return param._local_tensor.detach().requires_grad_(param.requires_grad)


# ---- Checkpoints: a TP-local tensor's elements as ranges of the whole (global) flat tensor ----

def global_shape(param: torch.Tensor, local_shape) -> torch.Size:
    """The whole tensor's shape: a DTensor's global one, else ``local_shape`` (the store record's)."""
    layout = layout_of(param)
    return layout.shape if layout is not None else torch.Size(local_shape)


def global_ranges(param: torch.Tensor, ranges) -> list[tuple[int, int, int]]:
    """``ranges`` ``(first, stop, local_start)`` of ``param``'s TP-local flat tensor, as ranges of its whole
    flat tensor (the same ``local_start``): what checkpoint pieces record, so that any tp x dp layout can read
    them.  The local tensor of a ``Shard(d)`` placement is, in the whole tensor, one contiguous run per index
    of the dims before ``d``; a range is split where a run ends.  A plain parameter's ranges are returned as
    they are.  Placements other than Shard and Replicate (Partial, strided shards) are refused."""
    from .runtime.checkpoint_files import ZinfCheckpointError

    layout = layout_of(param)
    if layout is None:
        return list(ranges)
    (placement,) = layout.placements  # (model_tp_mesh: a 1-D tp mesh)
    if placement.is_replicate():
        return list(ranges)
    if type(placement).__name__ != "Shard":
        raise ZinfCheckpointError(f"zinf checkpoints: a parameter placed {placement} over the tp mesh is not "
                                  f"supported (Shard and Replicate are)")
    shape, local_shape = list(layout.shape), list(param._local_tensor.shape)
    dim = placement.dim % len(shape)
    chunk = -(-shape[dim] // layout.mesh.size())  # torch.chunk's split: every shard but the last holds this many
    offset = layout.mesh.get_local_rank() * chunk
    run = local_shape[dim] * _product(shape[dim + 1:])  # the local elements in one contiguous global run
    stride = _product(shape[dim:])  # the global elements from one run's start to the next's
    base = offset * _product(shape[dim + 1:])
    out = []
    for first, stop, local_start in ranges:
        while first < stop:
            index, within = divmod(first, run)
            length = min(stop - first, run - within)
            start = index * stride + base + within
            out.append((start, start + length, local_start))
            first, local_start = first + length, local_start + length
    return out


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total
