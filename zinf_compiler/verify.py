"""Invariants checked after capture and after every pass.

A pass that breaks one of these is a bug in the pass, so the error names it.
"""

from __future__ import annotations

import torch

from . import ops
from .context import GraphContext


class ZinfVerifyError(RuntimeError):
    """A pass left the graph in a state later stages cannot trust."""


def graph_signature(gm: torch.fx.GraphModule) -> tuple[tuple[str, ...], int]:
    """Placeholder names and output arity: what AOTAutograd's runtime relies on."""
    placeholders = tuple(node.name for node in gm.graph.nodes if node.op == "placeholder")
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    outputs = output.args[0]
    return placeholders, len(outputs) if isinstance(outputs, (tuple, list)) else 1


def verify_graph(
    gm: torch.fx.GraphModule,
    ctx: GraphContext,
    stage: str,
    signature: tuple[tuple[str, ...], int],
) -> None:
    """Raise :class:`ZinfVerifyError` unless ``gm`` is valid after ``stage``.

    Checks: FX lint (every use defined before it, one output node); the
    graph's calling signature is the one AOTAutograd compiled against; every
    call_function target is callable; every async start has exactly one wait
    and every gathered parameter exactly one release; once the partition
    pass has run at stage 3, nothing but the output reads a parameter input
    (it holds no memory between uses: only gathered values may be read); the
    generated Python compiles.
    """
    where = f"graph {ctx.graph_id} {ctx.kind}, after {stage!r}"
    try:
        gm.graph.lint()
    except Exception as err:  # lint raises bare RuntimeError/AssertionError
        raise ZinfVerifyError(f"{where}: graph lint failed: {err}") from err
    if graph_signature(gm) != signature:
        raise ZinfVerifyError(
            f"{where}: the pass changed the graph's inputs or output count "
            f"({signature} -> {graph_signature(gm)}); passes must keep the calling convention"
        )
    for node in gm.graph.nodes:
        if node.op == "call_function" and not callable(node.target):
            raise ZinfVerifyError(f"{where}: node {node.name} calls a non-callable {node.target!r}")
        if node.target in ops.START_TO_WAIT:
            waits = [user for user in node.users if user.target is ops.START_TO_WAIT[node.target]]
            if len(waits) != 1:
                raise ZinfVerifyError(f"{where}: async start {node.name} has {len(waits)} waits, needs exactly one")
        if node.target is ops.GATHER_WAIT:
            releases = [user for user in node.users if user.target is ops.RELEASE]
            if len(releases) != 1:
                raise ZinfVerifyError(f"{where}: gathered parameter {node.name} has {len(releases)} releases, needs one")
    if ctx.options.stage == 3 and "gathered" in ctx.facts:
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name in ctx.params:
                readers = [user.name for user in node.users if user.op != "output"]
                if readers:
                    raise ZinfVerifyError(
                        f"{where}: stage-3 parameter input {node.name} ({ctx.params[node.name].name}) is read by "
                        f"{readers}; between uses it holds no memory, so only its gathered value may be read")
    try:
        gm.recompile()
    except Exception as err:
        raise ZinfVerifyError(f"{where}: generated code does not compile: {err}") from err
