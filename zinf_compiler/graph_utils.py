"""Small FX helpers shared by the passes (graph surgery that keeps ``meta["val"]`` right)."""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def size_hint(size: Any) -> int:
    """A size as a plain int, without specializing the graph: a symbolic size (dynamic shapes) by the
    example value it was traced with, 0 if it has none.  ``int(symbolic)`` would install a guard
    (``s0 == 5``), and the graph would then recompile for every new size."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 0
    return int(size)


def nbytes_hint(value: Any) -> int:
    """Bytes of a tensor (its example value's when its shape is symbolic, see :func:`size_hint`); 0 if no tensor."""
    return size_hint(value.numel()) * value.element_size() if isinstance(value, torch.Tensor) else 0


def node_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node's position in ``graph``, to compare nodes by where they run."""
    return {node: position for position, node in enumerate(graph.nodes)}


def first_node(nodes: Iterable[torch.fx.Node], order: dict[torch.fx.Node, int]) -> torch.fx.Node:
    """The earliest of ``nodes`` in the graph (``order`` from :func:`node_order`)."""
    return min(nodes, key=order.__getitem__)


def last_node(nodes: Iterable[torch.fx.Node], order: dict[torch.fx.Node, int]) -> torch.fx.Node:
    """The latest of ``nodes`` in the graph (``order`` from :func:`node_order`)."""
    return max(nodes, key=order.__getitem__)


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s output is a view of its first input's memory: an ATen view op (``t``,
    ``view``, ``permute``, ``split``...), ``_unsafe_view`` (a view its schema does not declare), or an
    item of a view op's list (one of ``split``'s / ``unbind``'s views)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    return node.target is torch.ops.aten._unsafe_view.default or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node`` views (itself when it is no view)."""
    while is_view(node):
        node = node.args[0]
    return node


def memory_readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s memory: its users and, through views of it, theirs.  A view keeps
    the memory alive until its own last use (``t = aten.t(weight); addmm(b, x, t)`` reads the weight
    at the ``addmm``), so whatever frees or stops counting that memory goes after the last of these.
    The output node is left out: it is no use within the graph."""
    readers, seen, pending = [], set(), list(node.users)
    while pending:
        user = pending.pop()
        if user in seen or user.op == "output":
            continue
        seen.add(user)
        readers.append(user)
        if is_view(user):
            pending.extend(user.users)
    return readers


def placeholders_by_name(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """``graph``'s placeholders by node name (``primals_3``)."""
    return {node.name: node for node in graph.nodes if node.op == "placeholder"}


def output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """``graph``'s output node (searched from the end, where it sits)."""
    return next(node for node in reversed(graph.nodes) if node.op == "output")


def _fake_mode(graph: torch.fx.Graph, args: tuple) -> Any:
    """The fake mode of ``args``' values, else of the graph's inputs (an op may take no tensor)."""
    found = []
    torch.fx.node.map_arg(args, lambda node: found.append(node.meta.get("val")))
    found += [node.meta.get("val") for node in graph.nodes if node.op == "placeholder"]
    for value in found:
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def call_op(graph: torch.fx.Graph, op: Any, args: tuple, name: str | None = None) -> torch.fx.Node:
    """Insert ``op(*args)`` at the graph's insertion point, with ``meta["val"]`` from its fake kernel."""
    node = graph.call_function(op, args)
    if name:
        node._rename(name)
    mode = _fake_mode(graph, args)
    if mode is not None:
        fake_args = torch.fx.node.map_arg(args, lambda node: node.meta["val"])
        with mode:
            node.meta["val"] = op(*fake_args)
    return node
