"""The ``offload`` pass: fetch offloaded parameter shards before their gather.

For each ``zinf.gather_start`` of a unit (a bucket, a parameter or a tile)
whose shards rest off the device (its parameters' layout says ``param_tier``
"cpu" or "nvme": the store's decision at adoption, from ``offload_param``),
insert the fetch steps of the paper right before it and chain the gather
after them:

    nvme:  nc_start -> nc_wait -> cg_start -> cg_wait -> gather_start(after=cg token)
    cpu:                          cg_start -> cg_wait -> gather_start(after=cg token)

nc moves the shard from NVMe into a pinned CPU buffer, cg from CPU memory to
the device.  On a CPU device the cpu tier needs no step: its shards already
rest where the gather reads them (as the device tier's do).  Which steps a
unit needs is :func:`~zinf_compiler.runtime.tiers.fetch_steps`, the rule the
store follows too.  Each step is a start/wait pair placed back to back here;
the schedule pass moves starts earlier.  Gradients need no nodes: the runtime
copies each reduced gradient shard to the optimizer's tier when its
reduce-scatter completes (``zinf.reduce_grad_wait``).

Records ``ctx.facts["fetched"]``: {slot: ["nc", "cg"] or ["cg"]}.
"""

from __future__ import annotations

import torch

from zinf_compiler import ops
from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import call_op
from zinf_compiler.runtime.tiers import fetch_steps

NAME = "offload"
KINDS = ("forward", "backward", "inference")


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
    """Insert the nc/cg fetch ops before each gather of a parameter resting on the cpu or nvme tier."""
    fetched = {}
    graph = gm.graph
    for gather in [n for n in graph.nodes if n.op == "call_function" and n.target is ops.GATHER_START]:
        slots, device = ops.arg(gather, "slots"), ops.arg(gather, "device")
        # A unit's parameters share one tier (runtime/units.py can_share_unit).
        steps = list(fetch_steps(ctx.captured.layouts[slots[0]].param_tier, device))
        if not steps:
            continue  # the shards already rest where the gather reads them: nothing to fetch
        # A tile's gather (the tile pass) fetches only that tile's slice of the shard.
        tile = ops.arg(gather, "tile")
        label = gather.name.removeprefix("gg_start_")
        with graph.inserting_before(gather):
            after = None
            if "nc" in steps:
                token = call_op(graph, ops.NC_START, (slots, device, tile), name=f"nc_start_{label}")
                after = call_op(graph, ops.NC_WAIT, (token, slots, tile), name=f"nc_wait_{label}")
            token = call_op(graph, ops.CG_START, (slots, device, after, tile), name=f"cg_start_{label}")
            after = call_op(graph, ops.CG_WAIT, (token, slots, tile), name=f"cg_wait_{label}")
        gather.args = (slots, device, after, tile)
        gather.kwargs = {}
        for slot in slots:
            fetched[slot] = steps
    ctx.facts["fetched"] = fetched
    return gm
