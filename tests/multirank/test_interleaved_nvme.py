"""Two NVMe models trained interleaved at world size 2: A's optimizer steps during backward are still in
flight through B's graphs (and may move on inside B's waits on gloo and on the disk); both models equal eager
within the suite's tolerance and the run that steps after backward byte for byte."""

import pytest
from multirank import run_ranks
from usage import PARAM_RTOL


# Slow (suite time), as are the other world-2 runs of early steps (test_zero.py's EARLY_CONFIGS, in
# test_offloaded_training_matches_eager[2]); the default run has early steps at world 1 only
# (tests/unit/test_early_adam.py).
@pytest.mark.slow
def test_two_nvme_models_trained_interleaved_equal_eager_and_the_late_step(tmp_path):
    for result in run_ranks(2, "interleaved_nvme_worker", {"root": str(tmp_path)}, timeout=300):
        early, late = result["early"], result["late"]
        # A's early steps were in flight through B's backward and were kept; none without overlap.
        assert all(stats is not None and stats["committed"] > 0 and stats["dropped"] == 0
                   for stats in early["early"]), early["early"]
        assert all(stats is None or stats["committed"] == 0 for stats in late["early"]), late["early"]
        assert early["bytes"] == late["bytes"], "the steps taken during backward changed the result"
        assert early["losses"] == late["losses"]
        assert max(early["errors"]) <= PARAM_RTOL, early["errors"]  # against eager torch.optim.AdamW, relative
