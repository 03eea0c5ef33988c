"""An accumulating ``index_put`` that adds in order when the lowered graph runs (``zinf::index_put_in_order``).

Why: the embedding's backward decomposes to ``index_put(..., accumulate=True)``
(``_unsafe_masked_index_put_accumulate`` where torch has it).
Lowered with deterministic algorithms on (lowering.deterministic_lowering),
Inductor keeps it as a call to ATen's op rather than atomic adds of its own;
but ATen's CPU kernel chooses again when it runs, by the flag *then*: with the
user's default (off) it adds across threads in whatever order they come, and
the same step gave different last bits from one run to the next (the README's
example, from its second step).  This op runs ATen's with the flag on, so it
takes the sorted, in-order path, and restores the flag after: the user's own
code keeps its setting.  Functional (the result is a new tensor); where the
target is a zero tensor made for it alone (the embedding's backward), the op
makes the zeros itself and adds into them in place, so a step copies no more
than the in-place kernel Inductor would otherwise call.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

# The flag is the process's, not the thread's: two threads inside at once would each restore what the
# other set (the second reads "on" as the caller's setting and leaves it on for good, and the first turns it
# off under the second's kernel).  One at a time; re-entrant for a lowering that runs the op.
_FLAG_LOCK = threading.RLock()


@contextlib.contextmanager
def deterministic_algorithms():
    """Torch's deterministic algorithms on (warnings only) inside, the caller's setting restored after.
    Uninitialized memory stays unfilled unless the caller had the flag on (filling costs a pass per tensor).
    One thread inside at a time (``_FLAG_LOCK``)."""
    with _FLAG_LOCK:
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = fill if enabled else False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill


_MASKED = getattr(torch.ops.aten, "_unsafe_masked_index_put_accumulate", None)  # (a newer torch's decomposition)


@torch.library.custom_op("zinf::index_put_in_order", mutates_args=())
def index_put_in_order(target: torch.Tensor, indices: list[Optional[torch.Tensor]], values: torch.Tensor,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``target.index_put(indices, values, accumulate=True)`` (only where ``mask``, if given), the adds in a
    fixed order."""
    with deterministic_algorithms():
        if mask is None:
            return torch.ops.aten.index_put.default(target, indices, values, True)
        return _MASKED.default(target, mask, indices, values)


@index_put_in_order.register_fake
def _(target, indices, values, mask=None):
    return torch.empty_like(target)


@torch.library.custom_op("zinf::index_put_in_order_on_zeros", mutates_args=())
def index_put_in_order_on_zeros(size: list[int], dtype: torch.dtype, device: torch.device,
                                indices: list[Optional[torch.Tensor]], values: torch.Tensor,
                                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`index_put_in_order` on a target of zeros it makes itself: the embedding's backward, whose target
    is a new zero tensor the size of the weight.  Given that tensor, the functional op would copy it first
    (a vocabulary's worth of gradient, read and written once more a step, and held twice at once); here the
    adds go into the new zeros in place.  The same bits: ATen's functional ops are that copy, then these calls."""
    result = torch.zeros(size, dtype=dtype, device=device)
    if mask is not None:  # as ATen's masked op: indices clamped to the target, masked-out values zero
        indices = [None if index is None else index.clamp(min=-result.size(dim), max=result.size(dim) - 1)
                   for dim, index in enumerate(indices)]
        values = values.masked_fill(~mask, 0)
    with deterministic_algorithms():
        return result.index_put_(indices, values, accumulate=True)


@index_put_in_order_on_zeros.register_fake
def _(size, dtype, device, indices, values, mask=None):
    return torch.empty(size, dtype=dtype, device=device)


def _ordered_arguments(node: torch.fx.Node) -> tuple | None:
    """(target, indices, values, mask) of an accumulating index_put node, or None for any other node."""
    if node.target in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return (*node.args[:3], None) if accumulate else None
    if _MASKED is not None and node.target == _MASKED.default:
        target, mask, indices, values = node.args[:4]
        return target, indices, values, mask
    return None


def _fresh_zeros(target) -> torch.Tensor | None:
    """The example value of ``target`` when it is a zero tensor of static size made for this index_put alone
    (``aten.full(size, 0)`` with no other user), else None."""
    if not isinstance(target, torch.fx.Node) or len(target.users) != 1 or target.target not in (
            torch.ops.aten.full.default, torch.ops.aten.zeros.default):
        return None
    if target.target == torch.ops.aten.full.default and target.args[1] != 0:
        return None
    value = target.meta.get("val")
    if not isinstance(value, torch.Tensor) or not value.is_contiguous() or not all(
            isinstance(extent, int) for extent in value.shape):
        return None
    return value


def order_accumulating_index_puts(aten_gm: torch.fx.GraphModule) -> int:
    """Point every accumulating ``index_put`` of ``aten_gm`` at :func:`index_put_in_order` (at
    :func:`index_put_in_order_on_zeros` when its target is a fresh zero tensor); how many."""
    graph = aten_gm.graph
    replaced = 0
    for node in [node for node in graph.nodes if node.op == "call_function"]:
        arguments = _ordered_arguments(node)
        if arguments is None:
            continue
        target, indices, values, mask = arguments
        zeros = _fresh_zeros(target)
        with graph.inserting_before(node):
            if zeros is None:
                ordered = graph.call_function(torch.ops.zinf.index_put_in_order.default, arguments)
            else:
                ordered = graph.call_function(torch.ops.zinf.index_put_in_order_on_zeros.default,
                                              (list(zeros.shape), zeros.dtype, zeros.device, indices, values, mask))
        ordered.meta.update(node.meta)
        node.replace_all_uses_with(ordered)
        graph.erase_node(node)
        if zeros is not None:
            graph.erase_node(target)
        replaced += 1
    if replaced:
        aten_gm.recompile()
    return replaced
