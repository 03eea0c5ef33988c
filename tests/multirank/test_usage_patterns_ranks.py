"""Everyday ways of calling models at world 2, each equal to DDP or a clear error (issue: no silent wrong
results); the one-process cases are in tests/integration/test_usage_patterns.py."""

from __future__ import annotations

import pytest

from multirank import run_ranks


def test_a_collective_on_one_rank_only_times_out_naming_the_call_after_its_models_own_timeout():
    # Before: a rank-0-only full_state_dict hung forever.  Before issue 27 the process had one timeout too,
    # the last compile's: model A (3 s) then waited model B's 120 s.
    rank0, _ = run_ranks(2, "collective_worker", {"timeouts": [3, 120]}, timeout=120)
    assert rank0["error"] == "ZinfCollectiveTimeout", rank0
    assert "all_gather of 0.weight" in rank0["message"] and "collective_timeout=3" in rank0["message"]
    assert rank0["seconds"] < 30


@pytest.mark.slow
def test_parameters_no_graph_uses_are_averaged_over_ranks_like_ddp():
    # Before: a graph break inside the loop over blocks left the head outside every graph, and at world 2
    # each rank stepped it with its own gradient: silently 0.07 away from eager after one step.
    cases = [{"options": {"stage": stage}, "max_norm": max_norm} for stage in (0, 3) for max_norm in (None, 0.05)]
    for rank_result in run_ranks(2, "uncaptured_worker", {"cases": cases}, timeout=300):
        assert all(worst < 1e-5 for worst in rank_result), (cases, rank_result)
