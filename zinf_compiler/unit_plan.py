"""What the passes read about units: which parameters share a bucket, and what each unit weighs.

The backend records each adopted parameter's fixed layout
(``ctx.captured.layouts``, :class:`~zinf_compiler.runtime.units.ParamLayout`)
before the graphs are rewritten.  The partition pass groups parameters into
buckets with :func:`buckets`; the schedule pass sizes every transfer with
:func:`unit_sizes`, the very arithmetic the store counts at run time
(:class:`~zinf_compiler.runtime.units.Unit`), so the two never disagree.

Bucketing rule.  Parameters are taken in the order the graph first uses
them (gathers) or produces their gradients (reductions).  A bucket is a run
of consecutive parameters of the same *block* (``blocks.3`` for
``blocks.3.attn.qkv.weight``: a repeated layer, by ``captured.module_blocks``,
which "block" checkpointing recomputes by too, see
zinf_compiler/module_paths.py; parameters outside any block form runs of
their own), closed when its gathered bytes would pass ``bucket_bytes`` (or
a quarter of ``max_live_bytes`` / ``device_memory_limit``, where set).  So a
transformer block moves as one all-gather in forward, one in backward and
one reduce-scatter, like FSDP2's per-block groups, and a bucket is held no
longer than its block runs.
Tiled, integer and ``partition="broadcast"`` parameters move alone.  World
size 1 buckets too: it has no collective to save, but every unit costs the
runtime's per-op work (benchmarks/overhead.py), so a block moves in one;
not NVMe-tier parameters, whose fetched masters the early step takes one unit
at a time (see :func:`buckets`).
The run-building rule itself (sharing a unit, the byte limit) is
runtime/buckets.py's, which the optimizer's own collectives use too.
"""

from __future__ import annotations

from typing import Iterable

from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import nbytes_hint
from zinf_compiler.runtime.buckets import bucket_runs
from zinf_compiler.runtime.units import UnitSizes, unit_of


def block_of(ctx: GraphContext, slot: int) -> str:
    """The block the parameter at Dynamo position ``slot`` belongs to (``blocks.3``), or "" outside any."""
    name = ctx.captured.inputs[slot].name
    return ctx.captured.module_blocks.block_of(name.rpartition(".")[0]) or ""


def buckets(ctx: GraphContext, slots: Iterable[int]) -> list[list[int]]:
    """``slots`` (parameters in use order) grouped into buckets, in the same order (see runtime/buckets.py)."""
    slots = list(slots)
    layouts = [ctx.captured.layouts.get(slot) for slot in slots]
    # World size 1 too: no collective to save there, but each op call costs the runtime's Python work,
    # so a block moves in one (its values stay apart: runtime/units.py's Unit.values_apart).
    limit = ctx.options.bucket_bytes
    cap = ctx.captured.live_bytes_cap
    if cap is not None:
        # Under a device cap a bucket is at most a quarter of it: the next one is
        # prefetched while it is used, and its values are copied out of its matrix.
        limit = min(limit, cap // 4)
    blocks = [block_of(ctx, slot) if layout is not None and _bucketable(layout) else None
              for slot, layout in zip(slots, layouts)]
    # Except NVMe-tier parameters at world size 1: there a step waits on the disk, not on the ops, and each
    # unit's fp32 masters, kept from its fetch for the early step (runtime/optim/fetched_masters.py), are taken
    # before the prefetch brings the next: a block's at once dropped the older copies before their step used
    # them (24 of 56 masters reused against 50; tests/integration/test_master_read_once.py).
    limits = [0 if ctx.captured.world_size == 1 and layout is not None and layout.param_tier == "nvme" else limit
              for layout in layouts]
    return [[slots[index] for index in run] for run in bucket_runs(layouts, limits, blocks)]


def _bucketable(layout) -> bool:
    return layout.partition == "allgather" and layout.tile_rows is None and layout.dtype.is_floating_point


def unit_sizes(ctx: GraphContext, slots: list[int], tile: int | None) -> UnitSizes:
    """Bytes the unit of ``slots`` (or of one's ``tile``) holds at each step, as the store counts them."""
    return unit_of([ctx.captured.layouts[slot] for slot in slots], tile).sizes


def value_bytes(nodes) -> int:
    """Bytes of the tensors graph ``nodes`` compute (a reduction's gradients, held while it starts)."""
    return sum(nbytes_hint(node.meta.get("val")) for node in nodes if hasattr(node, "meta"))


def unit_name(ctx: GraphContext, slots: list[int], tile: int | None) -> str:
    """A unit's name in the schedule: its parameters' names, joined, with ``[tile N]`` for one tile."""
    names = ", ".join(ctx.captured.inputs[slot].name for slot in slots)
    return names + (f"[tile {tile}]" if tile is not None else "")


def param_bytes_per_tier(ctx: GraphContext) -> dict[str, int]:
    """Bytes this rank holds of the graph's parameters between steps, per tier (as ``memory_report`` counts).

    A sharded parameter counts its local shard on its tier; stages 0-2 also
    keep the full parameter on the device (stage 3 frees it after compiling).
    """
    held = {"device": 0, "cpu": 0, "nvme": 0}
    for info in ctx.params.values():
        layout = ctx.captured.layouts.get(info.position)
        if layout is None:
            held["device"] += info.nbytes
            continue
        if not layout.shard_is_param:  # (else the full parameter below is its bytes)
            held[layout.param_tier] += layout.shard_bytes
        if layout.stage < 3:
            held["device"] += info.nbytes
    return held
