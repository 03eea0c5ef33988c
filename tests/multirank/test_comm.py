"""zinf's collectives on gloo equal torch.distributed's own (runtime/comm.py).

On gloo, zinf runs an all-gather as one broadcast per rank and a
reduce-scatter as one reduce per rank (2-4x faster there than gloo's own,
benchmarks/RESULTS.md "Collectives on gloo"), and refreshes stage 1-2
parameters by filling their slices in place.  Each must give exactly what
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` give, for slices of
any size (1 element up), fp32, bf16 and fp16, on the whole world and on a
subgroup, and still time out naming the call when a rank never joins.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multirank import run_ranks

CASE = st.fixed_dictionaries({
    "slice_numel": st.one_of(st.integers(1, 9), st.integers(1000, 70_000)),
    "dtype": st.sampled_from(["fp32", "bf16", "fp16"]),
    "short_by": st.integers(0, 5),
    "seed": st.integers(0, 1000),
})


@pytest.mark.slow  # 4 ranks; the default run's collectives: unit/test_collectives.py and every world-2 test
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases=st.lists(CASE, min_size=12, max_size=12))
def test_rooted_collectives_equal_torchs_own_at_world_4(cases):
    ranks = run_ranks(4, "comm_worker", {"cases": cases}, timeout=240)
    for rank, result in enumerate(ranks):
        assert result["rooted"], "gloo should use the rooted collectives"
        for case, found in zip(cases, result["cases"]):
            for group, differences in found.items():
                assert differences == {"all_gather": 0, "reduce_scatter": 0, "fill_slices": 0}, (rank, group, case)
    timeout = ranks[0]["timeout"]
    assert "the lonely gather" in timeout["message"] and timeout["seconds"] < 30
