"""Conv nets (issue 25, points 1 and 8): equal to eager under Inductor at stage 3 on every tier,
and BatchNorm's running statistics at world size 2 equal to DistributedDataParallel's.

Before: Inductor's channels-last layout pass copied a convolution's resting
(storage-less) stage-3 weight before its gather, and the first backward
segfaulted; at world size 2 each rank kept its own running statistics where
DDP (``broadcast_buffers=True``, its default) copies rank 0's before every
forward.  The conv net runs in a worker process (tests/workers/conv_worker.py), so a
crash fails one test instead of the suite.
"""

from __future__ import annotations

import pytest

from multirank import run_ranks

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4
TIERS = [{"offload_param": tier, "offload_optimizer": tier} for tier in ("none", "cpu", "nvme")]


def _check(results, configs) -> None:
    for rank, rank_results in enumerate(results):
        for config, result in zip(configs, rank_results):
            where = f"rank {rank}, {config}"
            for step, (expected, actual) in enumerate(result["losses"]):
                assert abs(expected - actual) <= LOSS_RTOL * abs(expected), f"{where} step {step}: {result['losses']}"
            for kind in ("param_errors", "buffer_errors"):
                worst = max(result[kind], key=result[kind].get)
                assert result[kind][worst] <= PARAM_RTOL, f"{where}: {kind} {worst} {result[kind][worst]:.2e}"


@pytest.mark.slow
def test_conv_net_at_stage_3_under_inductor_equals_eager_on_every_tier():
    configs = [{"options": {"lower": "inductor", **tiers}} for tiers in TIERS]
    _check(run_ranks(1, "conv_worker", {"configs": configs}), configs)


@pytest.mark.slow  # world 2 by default: test_zero.py
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_batchnorm_statistics_at_world_2_equal_ddp(broadcast_buffers):
    # (With broadcast_buffers: also a clamping gradient hook, which must see each rank's own gradient.)
    # Each rank starts with its own running mean (rank added to it): DDP's default copies rank 0's
    # buffers at construction and before every forward; with broadcast_buffers=False each rank keeps its own.
    configs = [{"options": {"lower": "eager", "stage": stage, "broadcast_buffers": broadcast_buffers},
                "hook": broadcast_buffers} for stage in (2, 3)]
    results = run_ranks(2, "conv_worker", {"configs": configs})
    _check(results, configs)
    running_means = [rank_results[0]["running_mean"] for rank_results in results]
    assert running_means[0] != running_means[1]  # each rank's last batch: the ranks really differ, as in DDP
