"""The pass manager: run the pass pipeline over one ATen graph.

``run_passes(gm, ctx)`` dumps the captured graph, then for every pass in
``zinf_compiler.passes.PIPELINE`` that applies to ``ctx.kind`` and is not
disabled by name, runs ``pass.run(gm, ctx)``, verifies the result and dumps it.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from .context import GraphContext
from .dump import GraphDumper, op_counts
from .verify import graph_signature, verify_graph

log = logging.getLogger("zinf")


def run_passes(
    gm: torch.fx.GraphModule,
    ctx: GraphContext,
    dumper: GraphDumper,
    pipeline: Sequence | None = None,
) -> torch.fx.GraphModule:
    """Run every pass of ``pipeline`` (default: ``passes.PIPELINE``) that applies to ``ctx.kind`` and is not disabled.

    The captured graph and each pass's result are verified against the captured signature and dumped;
    returns the rewritten graph.
    """
    if pipeline is None:
        from zinf_compiler.passes import PIPELINE as pipeline
    started = time.perf_counter()
    signature = graph_signature(gm)
    verify_graph(gm, ctx, "capture", signature)
    dumper.dump_stage(gm, ctx, 0, "capture", None, 0.0)
    for step, graph_pass in enumerate(pipeline, start=1):
        if graph_pass.NAME in ctx.options.disable_passes:
            dumper.record_skipped(ctx, graph_pass.NAME, "disabled by option disable_passes")
            continue
        if ctx.kind not in graph_pass.KINDS:
            continue
        before = op_counts(gm)
        pass_started = time.perf_counter()
        gm = graph_pass.run(gm, ctx)
        seconds = time.perf_counter() - pass_started
        verify_graph(gm, ctx, graph_pass.NAME, signature)
        # A pass may describe what it did (``describe(ctx) -> lines``) for the dump header and index.
        # and a table (``table(ctx) -> dict``, written as ``<kind>.<pass>.json``).
        describe = getattr(graph_pass, "describe", None)
        table = getattr(graph_pass, "table", None)
        dumper.dump_stage(gm, ctx, step, graph_pass.NAME, before, seconds,
                          extra_header=describe(ctx) if describe is not None and dumper.enabled else None,
                          table=table(ctx) if table is not None and dumper.enabled else None)
    log.info("zinf: graph %d %s: %d ops after passes (%.2fs)", ctx.graph_id, ctx.kind,
             sum(op_counts(gm).values()), time.perf_counter() - started)
    return gm
