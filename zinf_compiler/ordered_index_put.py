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
code keeps its setting.  Functional (the result is a new tensor): one copy of
the output more than the in-place kernel Inductor would otherwise call.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

@contextlib.contextmanager
def deterministic_algorithms():
    """Torch's deterministic algorithms on (warnings only) inside, the caller's setting restored after.
    Uninitialized memory stays unfilled unless the caller had the flag on (filling costs a pass per tensor)."""
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


def _ordered_arguments(node: torch.fx.Node) -> tuple | None:
    """(target, indices, values, mask) of an accumulating index_put node, or None for any other node."""
    if node.target in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return (*node.args[:3], None) if accumulate else None
    if _MASKED is not None and node.target == _MASKED.default:
        target, mask, indices, values = node.args[:4]
        return target, indices, values, mask
    return None


def order_accumulating_index_puts(aten_gm: torch.fx.GraphModule) -> int:
    """Point every accumulating ``index_put`` of ``aten_gm`` at :func:`index_put_in_order`; how many."""
    replaced = 0
    for node in [node for node in aten_gm.graph.nodes if node.op == "call_function"]:
        arguments = _ordered_arguments(node)
        if arguments is None:
            continue
        with aten_gm.graph.inserting_before(node):
            ordered = aten_gm.graph.call_function(torch.ops.zinf.index_put_in_order.default, arguments)
        ordered.meta.update(node.meta)
        node.replace_all_uses_with(ordered)
        aten_gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        aten_gm.recompile()
    return replaced
