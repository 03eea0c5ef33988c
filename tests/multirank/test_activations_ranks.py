"""Issue 16 at world 2: activation checkpointing ("block", "auto") and saved activations offloaded to CPU or
NVMe train like eager; the one-process tests are in tests/integration/test_activations.py."""

import pytest

from multirank import run_ranks
from test_zero import MODEL, _check

ACTIVATION_CONFIGS = [
    {"stage": 3, "activation_checkpointing": "block"},
    {"stage": 3, "activation_checkpointing": "auto", "activation_memory_budget": 0.3},
    {"stage": 3, "offload_activations": "cpu", "activation_offload_min_bytes": 0},
    {"stage": 3, "activation_checkpointing": "block", "offload_activations": "nvme", "activation_offload_min_bytes": 0},
    {"stage": 3, "activation_checkpointing": "auto", "offload_activations": "nvme", "activation_offload_min_bytes": 0,
     "activation_memory_budget": 0.25},
]


@pytest.mark.slow  # activations at world 1 in the default run: integration/test_activations.py
def test_activation_policies_and_tiers_match_eager_at_world_2():
    """Acceptance 1: each policy and activation tier at stage 3 trains like eager (losses 1e-5, params 1e-4),
    with clipping and an LR schedule, at world size 2.  World size 1 is covered in process (test_activations.py: dropout
    tests, Inductor, the memory report) to keep the suite's time."""
    results = run_ranks(2, "zero_worker", {"model": MODEL, "steps": 4, "batch": 2, "configs": ACTIVATION_CONFIGS})
    _check(results, 2)
