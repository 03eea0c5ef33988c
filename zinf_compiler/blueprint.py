"""What a plan reads of a model (zinf_compiler/planner.py), once for any number of option sets: a
:class:`Blueprint`, its parameters (shapes and dtypes only: a model built under ``torch.device("meta")`` is
fine), the device it will train on, and, from one forward and backward of the example inputs on fake tensors,
the FLOPs, the bytes autograd saves for backward, the bytes the other ops move and each weight's matmul sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass
class Blueprint:
    """What a plan reads of a model, once for any number of option sets: its parameters (name, tensor: shapes
    and dtypes only) and, with example inputs, the FLOPs of a forward and backward and the bytes autograd saves."""

    named: list[tuple[str, torch.Tensor]]
    flops: int | None = None
    saved: int | None = None
    moved: int | None = None  # bytes the ops other than matmuls read and write in one forward and backward
    # Per weight used as ``x @ W.T``: the elements of its inputs x and of its outputs (the tile pass's cost).
    weight_matmuls: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # Where the model will compute (zinf computes where the parameters are when it compiles): see compute_device.
    device: torch.device = torch.device("cpu")


def compute_device(model: torch.nn.Module, device: torch.device | str | None = None) -> torch.device:
    """The device ``model`` will train on: ``device`` if given, else its parameters' device, and for a model on
    the meta device (a blueprint, nothing allocated) this machine's accelerator if it has one, else the CPU.
    The plan depends on it: on an accelerator the device tier is not host memory and the step overlaps its parts."""
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    if first is not None and not first.is_meta:
        return first.device
    return default_device()


def default_device() -> torch.device:
    """This machine's GPU if it has one, else the CPU: where zinf takes a model with no device of its own yet to
    train (a meta-device blueprint it plans, a model ``zinf.materialize`` builds)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def blueprint(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None,
              device: torch.device | str | None = None) -> Blueprint:
    """``model``'s :class:`Blueprint` (the fake run happens here, once), to train on ``device``
    (:func:`compute_device`)."""
    device = compute_device(model, device)
    named = list(model.named_parameters())  # tied parameters once, under their first name
    if example_inputs is None:
        return Blueprint(named, device=device)
    return Blueprint(named, *_fake_run(model, example_inputs, device), device=device)


def _fake_run(model: torch.nn.Module, example_inputs: Sequence[Any],
              device: torch.device) -> tuple[int, int, int, dict]:
    """(FLOPs of one forward and backward, bytes autograd saves for backward, bytes the other ops move, the
    forward matmuls' operand sizes per weight: see :class:`_OpTraffic`), on fake tensors on ``device`` (its
    kernels, e.g. attention's, save what they save there) where this machine has it, else on the CPU.  The
    parameters, buffers and inputs are all made fake there, wherever the real ones are (meta, CPU or GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    saved: dict[int, int] = {}
    run_on = device if device.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params = {name: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=run_on),
                                           requires_grad=p.requires_grad)
                  for name, p in model.named_parameters()}
        buffers = {name: torch.zeros(b.shape, dtype=b.dtype, device=run_on) for name, b in model.named_buffers()}
        # (Values are never read: shapes, strides and dtypes decide what a fake run counts.)
        inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=run_on).requires_grad_(x.requires_grad)
                  if isinstance(x, torch.Tensor) else x for x in example_inputs]
        weights = {p.untyped_storage()._cdata: name for name, p in params.items()}  # storage -> parameter name

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in weights:
                saved[storage._cdata] = storage.nbytes()
            return tensor

        with FlopCounterMode(display=False) as flops, _OpTraffic(set(flops.flop_registry), weights) as traffic:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = torch.func.functional_call(model, {**params, **buffers}, tuple(inputs))
            loss = _a_loss(out)
            if loss.requires_grad:
                loss.backward()
    return (flops.get_total_flops() + traffic.attention_flops, sum(saved.values()), traffic.moved,
            traffic.weight_matmuls)


# Ops that allocate or re-label memory without reading or writing it.
_NOT_MOVING = {"empty", "empty_like", "empty_strided", "_unsafe_view", "detach", "lift_fresh", "alias"}


class _OpTraffic(TorchDispatchMode):
    """What FlopCounterMode leaves out of a forward and backward: the bytes every other op reads and writes
    (elementwise ops, norms, softmax, losses, copies; views move nothing), and the FLOPs of the CPU's
    attention kernels (torch's counter knows only the accelerators' ones); and, for the tile pass's cost, the
    forward matmuls ``x @ W.T`` of each weight (``weights``: storage -> parameter name): ``weight_matmuls``
    maps the name to the elements of its inputs ``x`` and outputs, summed over its uses."""

    def __init__(self, counted_ops: set, weights: Mapping[int, str]) -> None:
        super().__init__()
        self.counted_ops, self.moved, self.attention_flops = counted_ops, 0, 0
        self.weights, self.weight_matmuls = weights, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self._weight_matmul(args[-2:], out)
        if (func.overloadpacket in self.counted_ops or func.is_view or func.namespace != "aten"
                or func.overloadpacket.__name__ in _NOT_MOVING):
            return out
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            query, key = args[0], args[1]
            if name.endswith("backward"):  # the incoming gradient comes first
                query, key = args[1], args[2]
            # Two matmuls forward (QK^T, PV), four backward, of batch x heads x Tq x Tk x head_dim each.
            matmuls = 4 if name.endswith("backward") else 2
            self.attention_flops += 2 * matmuls * query.numel() * key.shape[-2]
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.moved += sum(t.numel() * t.element_size() for t in tensors)
        return out

    def _weight_matmul(self, operands, out: torch.Tensor) -> None:
        """Count ``x @ W.T`` (a forward ``linear``): W a weight, its rows the output's columns (the input
        gradient ``g @ W`` is the other orientation and not counted: the tile pass's cost is put in its terms)."""
        x, w_t = operands
        name = self.weights.get(w_t.untyped_storage()._cdata) if w_t.dim() == 2 else None
        if name is None or out.dim() != 2 or w_t.stride(0) != 1:  # (W.T is W's transposed view)
            return
        inputs, outputs = self.weight_matmuls.get(name, (0, 0))
        self.weight_matmuls[name] = (inputs + x.numel(), outputs + out.numel())


def _a_loss(out: Any) -> torch.Tensor:
    """A scalar to run backward from: the model's loss if it returns one, else the sum of its first output."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.dim() else out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    for value in reversed(values) if isinstance(out, tuple) else values:  # (a tuple's loss comes last)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float().sum() if value.dim() else value
    raise ValueError(f"zinf.plan: the model returned {type(out).__name__}; no tensor to run backward from")
