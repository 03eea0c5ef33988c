"""The planner's arithmetic (zinf_compiler/unit_plan.py) on drawn parameter tables, in-process (issue 27).

``buckets`` groups parameters, in use order, into the units the partition
pass gathers and reduces together.  What must hold for any table: every
parameter in exactly one bucket, order kept; a bucket's members share a block
(or a run outside any) and a unit (``can_share_unit``) and fit ``bucket_bytes`` (or a quarter of the
device cap) unless alone; greedy: a new bucket starts only where the rule
says it must; world size 1 never buckets.  ``unit_sizes`` is the store's own
``Unit`` arithmetic, and ``param_bytes_per_tier`` counts each tier's bytes.
"""

from __future__ import annotations

import types

import torch
from hypothesis import given, settings, strategies as st

from zinf_compiler import unit_plan
from zinf_compiler.module_paths import ModuleBlocks
from zinf_compiler.runtime.param_plan import plan_param
from zinf_compiler.runtime.units import ParamLayout, can_share_unit, unit_of


def _layout(uid: int, numel: int, world: int, *, dtype=torch.float32, tiled=False, partition="allgather",
            tier="device", stage=3) -> ParamLayout:
    shape = torch.Size((numel,)) if not tiled else torch.Size((2, numel))
    return ParamLayout(name=f"p{uid}", plan=plan_param(
        uid=uid, device=torch.device("cpu"), shape=shape, dtype=dtype, stage=stage, partition=partition,
        param_dtype=dtype, world_size=world,
        rank=0, owner=0 if partition == "broadcast" else None, param_tier=tier, opt_tier=tier,
        tile_rows=(1, 1) if tiled else None))


def _context(layouts: dict[int, ParamLayout], blocks: dict[int, str], world: int, bucket_bytes: int,
             cap: int | None):
    """What ``unit_plan`` reads of a GraphContext: the parameters' layouts, names and blocks, and the options."""
    names = {slot: (f"{blocks[slot]}.w{slot}" if blocks[slot] else f"head.w{slot}") for slot in layouts}
    inputs = {slot: types.SimpleNamespace(name=name) for slot, name in names.items()}
    captured = types.SimpleNamespace(layouts=layouts, world_size=world, live_bytes_cap=cap, inputs=inputs,
                                     module_blocks=ModuleBlocks(blocks=frozenset(b for b in blocks.values() if b)))
    return types.SimpleNamespace(captured=captured, options=types.SimpleNamespace(bucket_bytes=bucket_bytes))


@st.composite
def _tables(draw):
    world = draw(st.integers(1, 4))
    count = draw(st.integers(1, 12))
    layouts, blocks = {}, {}
    for slot in range(count):
        kind = draw(st.sampled_from(["plain", "plain", "plain", "tiled", "int", "broadcast", "bf16", "cpu"]))
        numel = draw(st.integers(1, 300))
        layouts[slot] = _layout(slot, numel, world, tiled=kind == "tiled",
                                dtype={"int": torch.int64, "bf16": torch.bfloat16}.get(kind, torch.float32),
                                partition="broadcast" if kind == "broadcast" else "allgather",
                                tier="cpu" if kind == "cpu" else "device")
        blocks[slot] = draw(st.sampled_from(["", "blocks.0", "blocks.1"]))
    order = draw(st.permutations(list(layouts)))
    bucket_bytes = draw(st.integers(0, 3000))
    cap = draw(st.one_of(st.none(), st.integers(0, 8000)))
    return world, layouts, blocks, order, bucket_bytes, cap


def _gathered_bytes(layout: ParamLayout) -> int:
    return layout.gathered_numel * layout.compute_dtype.itemsize


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_tables())
def test_buckets_keep_order_share_block_and_unit_fit_the_limit_and_close_only_where_they_must(table):
    world, layouts, blocks, order, bucket_bytes, cap = table
    ctx = _context(layouts, blocks, world, bucket_bytes, cap)
    groups = unit_plan.buckets(ctx, order)
    assert [slot for group in groups for slot in group] == list(order)
    limit = bucket_bytes  # world size 1 too: it buckets to save the runtime's per-unit work
    if cap is not None:
        limit = min(limit, cap // 4)
    if limit == 0:
        assert all(len(group) == 1 for group in groups)
    if world == 1:  # (but not NVMe-tier parameters there: see unit_plan.buckets)
        assert all(len(group) == 1 for group in groups if layouts[group[0]].param_tier == "nvme")
    for group in groups:
        if len(group) > 1:
            first = layouts[group[0]]
            assert len({blocks[slot] for slot in group}) == 1, group  # one block, or a run outside any
            assert all(can_share_unit(first, layouts[slot]) for slot in group), group
            assert sum(_gathered_bytes(layouts[slot]) for slot in group) <= limit
            unit = unit_of([layouts[slot] for slot in group])  # one collective can move it: raises otherwise
            assert unit.values_apart == (world == 1)  # world size 1: each value a tensor of its own
    for previous, group in zip(groups, groups[1:]):  # greedy: the next one could not have joined
        head, joining = layouts[previous[0]], layouts[group[0]]
        could_join = (limit > 0 and blocks[group[0]] == blocks[previous[-1]]
                      and not (world == 1 and joining.param_tier == "nvme")
                      and unit_plan._bucketable(layouts[previous[-1]]) and can_share_unit(head, joining)
                      and sum(_gathered_bytes(layouts[slot]) for slot in previous) + _gathered_bytes(joining) <= limit)
        assert not could_join, (previous, group)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(_tables())
def test_unit_sizes_are_the_stores_and_tier_bytes_count_each_shard_once(table):
    world, layouts, blocks, order, bucket_bytes, cap = table
    ctx = _context(layouts, blocks, world, bucket_bytes, cap)
    for group in unit_plan.buckets(ctx, order):
        assert unit_plan.unit_sizes(ctx, group, None) == unit_of([layouts[slot] for slot in group]).sizes
        if len(group) > 1:
            sizes = unit_plan.unit_sizes(ctx, group, None)
            assert sizes.gathered == sum(_gathered_bytes(layouts[slot]) for slot in group)
    ctx.params = {f"primals_{slot}": types.SimpleNamespace(position=slot, nbytes=layout.numel * layout.dtype.itemsize)
                  for slot, layout in layouts.items()}
    held = unit_plan.param_bytes_per_tier(ctx)
    # Stage 3: only shards are held between steps, each on its own tier.
    for tier in ("device", "cpu", "nvme"):
        assert held[tier] == sum(layout.shard_bytes for layout in layouts.values() if layout.param_tier == tier)
