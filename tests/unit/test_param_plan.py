"""A parameter's plan (runtime/param_plan.py, issue 36 point 2): one pure function, and the store adopts by it.

Plans are built for drawn shapes, dtypes, tiers, tile rows and meshes (world
sizes 1-8) without compiling anything.  Their invariants are checked for
every rank of the mesh (the shards cover the parameter exactly once, padding,
alignment, swap keys), and the same plan is checked against what
``ParamStore.adopt`` actually lays out on each rank: the store is handed a
mesh object of plain sizes (no process group; every rank holds the same
values, so rank 0's broadcast is nothing to do).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import types

import pytest
import torch
from adopting import adopt_in
from hypothesis import given, settings, strategies as st

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.buckets import bucket_runs
from zinf_compiler.runtime.param_plan import OPTIMIZER_STATES, ParamPlan, plan_param
from zinf_compiler.runtime.comm import DONE
from zinf_compiler.runtime.records import DTYPES
from zinf_compiler.runtime.store import ParamStore
from zinf_compiler.runtime.swap_layout import ALIGNMENT
from zinf_compiler.runtime.units import ParamLayout
from zinf_compiler.tile_plan import split_rows

TIERS = ("device", "cpu", "nvme")


def _mesh(world: int, rank: int):
    """A model's mesh as the store reads it at adoption: sizes and this rank, no process group."""
    shard = types.SimpleNamespace(world_size=world, rank=rank, group=None)
    everyone = types.SimpleNamespace(world_size=world, rank=rank, broadcast=lambda *args, **kwargs: DONE)
    return types.SimpleNamespace(shard=shard, everyone=everyone, replicate=None,
                                 describe=lambda: f"a test mesh of {world} ranks")


@st.composite
def _cases(draw):
    """The inputs of one parameter's plan: (shape, dtype, settings for plan_param, requires_grad)."""
    dims = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int64]))
    param_dtype = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    world = draw(st.integers(1, 8))
    partition = draw(st.sampled_from(["allgather", "allgather", "broadcast"]))
    tile_rows = None
    if len(dims) >= 2 and dtype.is_floating_point and draw(st.booleans()):
        tile_rows = split_rows(dims[0], draw(st.integers(2, max(2, dims[0]))))
        tile_rows = tile_rows if len(tile_rows) > 1 else None
    settings_ = dict(stage=draw(st.integers(1, 3)), partition=partition, param_dtype=param_dtype,
                     param_tier=draw(st.sampled_from(TIERS)), opt_tier=draw(st.sampled_from(TIERS)),
                     tile_rows=tile_rows, bucket_bytes=draw(st.sampled_from([0, 1 << 10, 64 << 20])),
                     step_in_backward=draw(st.sampled_from([False, True, "auto"])))
    return tuple(dims), dtype, world, settings_, dtype.is_floating_point and draw(st.booleans())


def _plan(shape, dtype, world: int, rank: int, settings_: dict, requires_grad: bool, uid: int = 7) -> ParamPlan:
    given_ = dict(settings_, param_dtype=DTYPES[settings_["param_dtype"]])
    owner = 0 if settings_["partition"] == "broadcast" else None  # (a fresh store's first parameter: rank 0)
    return plan_param(uid=uid, shape=shape, dtype=dtype, device=torch.device("cpu"), world_size=world, rank=rank,
                      owner=owner, requires_grad=requires_grad, **given_)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_cases())
def test_the_plans_of_every_rank_cover_the_parameter_once_padded_and_aligned(case):
    shape, dtype, world, settings_, requires_grad = case
    plans = [_plan(shape, dtype, world, rank, settings_, requires_grad) for rank in range(world)]
    numel = torch.Size(shape).numel()
    covered = torch.zeros(numel, dtype=torch.int64)
    for plan in plans:
        assert plan.compute_dtype == (DTYPES[settings_["param_dtype"]] if dtype.is_floating_point else dtype)
        assert (plan.param_tier, plan.opt_tier, plan.stage) == (settings_["param_tier"], settings_["opt_tier"],
                                                                settings_["stage"])
        assert plan.tile_rows == (settings_["tile_rows"] if dtype.is_floating_point else None)
        if plan.partition == "broadcast":
            assert plan.local_numel == (numel if plan.rank == plan.owner else 0)
            assert plan.local_ranges == (((0, numel, 0),) if plan.rank == plan.owner else ())
        else:
            assert plan.local_numel == plan.shard_numel
        if plan.tile_rows is None:
            if plan.partition == "allgather":
                assert 0 <= plan.shard_numel * world - numel < world  # padding under one element per rank
        else:
            assert len(plan.tile_local_ranges) == len(plan.tile_shard_numels) == len(plan.tile_rows)
            slot = 0
            for tile, rows in enumerate(plan.tile_rows):
                tile_numel = rows * plan.row_numel
                if plan.partition == "allgather":
                    assert 0 <= plan.tile_shard_numels[tile] * world - tile_numel < world  # padding per row tile
                    assert plan.tile_local_ranges[tile] == (slot, slot + plan.tile_shard_numels[tile])
                assert plan.tile_slot_numel(tile) % plan.tile_align == 0
                slot += plan.tile_slot_numel(tile)
            assert slot == plan.shard_numel
            nvme_tiles = plan.param_tier == "nvme" and plan.partition == "allgather"
            itemsize = plan.compute_dtype.itemsize
            assert plan.tile_align * itemsize == (ALIGNMENT if nvme_tiles else itemsize)
        for first, stop, local_start in plan.local_ranges:
            assert 0 <= first < stop <= numel and 0 <= local_start and local_start + stop - first <= plan.local_numel
            covered[first:stop] += 1
        # The shard's swap keys: distinct, in order, inside the shard, holding every element it owns; the
        # optimizer state's own, unless the shard is the master.
        keys, swap_end = [key for key, _, _ in plan.shard_swap], 0
        for _, start, count in plan.shard_swap:
            assert start >= swap_end
            swap_end = start + count
        assert len(set(keys)) == len(keys)
        for first, stop, local_start in plan.local_ranges:
            assert any(start <= local_start and local_start + stop - first <= start + count
                       for _, start, count in plan.shard_swap)
        assert plan.state_groups[0][0] == 0 and plan.state_groups[-1][1] == plan.local_numel
        state_keys = {key for state in OPTIMIZER_STATES for key, _, _ in plan.state_swap(state)}
        if plan.params_in_master:
            masters = plan.state_swap("master")
            assert plan.shard_swap == tuple((key, start, stop - start) for key, start, stop in masters)
            assert all(start * 4 % ALIGNMENT == 0 for _, start, _ in plan.shard_swap)
        else:
            assert not set(keys) & state_keys
    assert torch.equal(covered, torch.ones(numel, dtype=torch.int64))  # every element, on exactly one rank


@pytest.fixture(scope="module")
def swap_folder():
    with tempfile.TemporaryDirectory(prefix="zinf-param-plan-") as folder:
        yield folder


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_cases(), st.data())
def test_the_store_lays_out_each_parameter_as_its_plan_says(swap_folder, case, data):
    shape, dtype, world, settings_, requires_grad = case
    rank = data.draw(st.integers(0, world - 1))
    plan = _plan(shape, dtype, world, rank, settings_, requires_grad, uid=0)  # (a fresh store's first uid)
    values = (torch.randn(shape) * 100).to(dtype)
    param = torch.nn.Parameter(values.clone(), requires_grad=requires_grad)
    store = ParamStore(RUNTIME.comm)
    folder = tempfile.mkdtemp(dir=swap_folder)  # (each example its own swap engine and files)
    store.configure_offload(folder, 32 << 20,
                            aio_block_size=1 << 20, aio_queue_depth=4, aio_threads=1)
    try:
        record = adopt_in(store, param, "w", mesh=_mesh(world, rank), **settings_)
        assert record.plan == plan  # the store's layout is the plan
        assert (record.tile_rows, record.param_tier, record.opt_tier, record.shard_numel, record.local_numel) == \
               (plan.tile_rows, plan.param_tier, plan.opt_tier, plan.shard_numel, plan.local_numel)
        assert record.owned_ranges() == list(plan.local_ranges)
        # What the store holds on its tiers: this rank's elements where the plan says, zero padding elsewhere.
        expected = torch.zeros(plan.local_numel, dtype=plan.holding_dtype)
        flat = values.reshape(-1)
        for first, stop, local_start in plan.local_ranges:
            expected[local_start : local_start + stop - first] = flat[first:stop].to(plan.holding_dtype)
        local = torch.cat([chunk for _, chunk in store.local_value_chunks(record)] or [expected[:0]])
        if record.owns_state or plan.param_tier != "nvme":
            assert torch.equal(local.to(plan.compute_dtype), expected.to(plan.compute_dtype))
        if plan.param_tier != "nvme":
            assert record.shard.numel() == plan.local_numel
        elif record.owns_state:
            assert all(os.path.exists(record.swap.path(key)) for key, _, _ in plan.shard_swap)
        if plan.opt_tier == "nvme" and record.owns_state and dtype.is_floating_point and requires_grad:
            assert all(os.path.exists(record.swap.path(key)) for key, _, _ in plan.state_swap("master"))
        elif record.master is not None:
            assert record.master.numel() == plan.local_numel
    finally:
        for engine in store.engines():
            engine.close()


def test_bucket_membership_comes_from_the_plans_in_order_through_bucket_runs():
    def layout(uid: int, numel: int, bucket_bytes: int, tiled: bool = False) -> ParamLayout:
        return ParamLayout(name=f"p{uid}", plan=plan_param(
            uid=uid, device=torch.device("cpu"), shape=(2, numel // 2) if tiled else (numel,), dtype=torch.float32,
            stage=3, partition="allgather", param_dtype=torch.float32, world_size=2, rank=0, param_tier="device",
            opt_tier="device", tile_rows=(1, 1) if tiled else None, bucket_bytes=bucket_bytes))

    layouts = [layout(0, 16, 128), layout(1, 16, 128), layout(2, 16, 128), layout(3, 16, 128, tiled=True),
               layout(4, 16, 0)]
    limits = [layout.bucket_bytes for layout in layouts]
    assert bucket_runs(layouts, limits, [0] * 5) == [[0, 1], [2], [3], [4]]
    assert bucket_runs(layouts, limits, ["a", "b", "b", "b", "b"]) == [[0], [1, 2], [3], [4]]
    assert bucket_runs([layouts[0], None, layouts[1]], [128, 0, 128], [0] * 3) == [[0], [1], [2]]  # one not adopted moves alone


def test_a_plan_is_frozen_and_refuses_tiles_that_do_not_split_the_rows():
    plan = plan_param(uid=0, shape=(4, 3), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                      partition="allgather", param_dtype=torch.bfloat16, param_tier="nvme", opt_tier="nvme", world_size=2, rank=1,
                      tile_rows=(2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.local_numel = 0
    assert plan.tile_align == ALIGNMENT // 2 and plan.shard_swap == (("param.0.t0", 0, 2048),
                                                                       ("param.0.t1", 2048, 2048))
    assert plan.local_ranges == ((3, 6, 0), (9, 12, 2048))
    with pytest.raises(Exception, match="do not split"):
        plan_param(uid=0, shape=(4, 3), dtype=torch.float32, device=torch.device("cpu"), stage=3, partition="allgather",
                   param_dtype=torch.float32, param_tier="device", opt_tier="device", world_size=1, rank=0,
                   tile_rows=(1, 2))
