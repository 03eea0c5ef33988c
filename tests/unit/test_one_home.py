"""Facts with one home, checked without compiling: the tier vocabulary, the tile plan, the bucketing rule.

``runtime/tiers.py`` translates option values to where state rests and says
which fetch steps a shard needs (the offload pass and the store both ask it);
``zinf_compiler/tile_plan.py`` decides the tile rows (the tile pass and
``zinf.materialize`` both ask it); ``runtime/buckets.py`` builds buckets (the
graphs' and the optimizer's collectives both use it).
"""

from __future__ import annotations

import dataclasses

import torch

from zinf_compiler.options import parse_options
from zinf_compiler.runtime.buckets import bucket_runs
from zinf_compiler.runtime.tiers import TIERS, fetch_steps, store_tier
from zinf_compiler.runtime.param_plan import plan_param
from zinf_compiler.runtime.units import ParamLayout
from zinf_compiler.tile_plan import split_rows, tile_rows_for


def test_tiers_and_fetch_steps():
    assert [store_tier(value) for value in ("none", "cpu", "nvme")] == list(TIERS)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # (a device object only: no CUDA needed)
    assert fetch_steps("device", gpu) == fetch_steps("device", cpu) == ()
    assert fetch_steps("cpu", gpu) == ("cg",) and fetch_steps("cpu", cpu) == ()
    assert fetch_steps("nvme", gpu) == fetch_steps("nvme", cpu) == ("nc", "cg")


def test_tile_rows_for_is_the_rule_both_callers_use():
    options = parse_options({"stage": 3, "tile_factor": 3, "tile_threshold": 1000}, environ={})
    assert tile_rows_for("w", (10, 100), 4000, options, 2, None, 0) == split_rows(10, 3) == (4, 3, 3)
    assert tile_rows_for("w", (10, 100), 1000, options, 2, None, 0) is None  # not over the threshold
    assert tile_rows_for("w", (4000,), 16000, options, 2, None, 0) is None  # not 2-D
    assert tile_rows_for("w", (1, 4000), 16000, options, 2, None, 0) is None  # one row: factor 1
    for other in (dataclasses.replace(options, stage=2), dataclasses.replace(options, disable_passes=("tile",))):
        assert tile_rows_for("w", (10, 100), 4000, other, 2, None, 0) is None


def _layout(uid: int, numel: int, *, tiled: bool = False) -> ParamLayout:
    return ParamLayout(name=f"p{uid}", plan=plan_param(
        uid=uid, device=torch.device("cpu"), shape=(2, numel // 2) if tiled else (numel,), dtype=torch.float32,
        stage=3, partition="allgather",
        param_dtype=torch.float32, world_size=2, rank=0, param_tier="device", opt_tier="device",
        tile_rows=(1, 1) if tiled else None))


def test_bucket_runs_keys_limits_and_units():
    layouts = [_layout(0, 16), _layout(1, 16), _layout(2, 16), _layout(3, 16, tiled=True), _layout(4, 16)]
    # 64 bytes each: two fit a 128-byte limit; a tiled parameter shares no unit.
    assert bucket_runs(layouts, [128] * 5, ["a"] * 5) == [[0, 1], [2], [3], [4]]
    assert bucket_runs(layouts, [1 << 20] * 5, ["a", "a", "b", "b", "b"]) == [[0, 1], [2], [3], [4]]
    assert bucket_runs(layouts, [0] * 5, ["a"] * 5) == [[0], [1], [2], [3], [4]]  # limit 0: no buckets
    assert bucket_runs(layouts, [1 << 20] * 5, [None] * 5) == [[0], [1], [2], [3], [4]]
    assert bucket_runs([layouts[0], layouts[0]], [1 << 20] * 2, ["a"] * 2) == [[0], [1]]  # never with itself
    assert bucket_runs([None, layouts[1]], [1 << 20] * 2, ["a"] * 2) == [[0], [1]]  # not adopted: alone
