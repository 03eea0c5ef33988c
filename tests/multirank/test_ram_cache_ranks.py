"""The RAM cache over the NVMe tier (option host_memory) at world size 2: both ranks make the same choice
without a collective, and the mixed run (half the parameters' states in RAM, half on NVMe, those stepped
during backward) trains like eager and loss for loss like the all-NVMe run.

In one process, bit for bit against the all-NVMe run: tests/integration/test_ram_cache.py."""

import pytest
import torch
from multirank import run_ranks
from plan_bytes import ram_per_element

import zinf_compiler as zinf
from zinf_compiler import ram_cache
from zinf_compiler.gpt import GPT, GPTConfig

MODEL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
WORLD = 2


def _host_memory_for_half_the_parameters() -> int:
    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL, frozen_scale=True))
    # The "auto" pinned pool of this model on each rank, made by the all-NVMe run that goes first.
    pinned = zinf.plan(model, None, {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                     "nvme_path": "/tmp"}, world_size=WORLD).pinned["parameters"]
    numel = -(-sum(p.numel() for p in model.parameters()) // WORLD)
    whole, grad = ram_per_element("cpu", "cpu")
    wanted = pinned + grad * numel + whole * numel // 2
    return int(wanted / (1 - ram_cache.HEADROOM_FRACTION))


@pytest.mark.slow  # (world 2, like the offload matrix in test_zero.py)
def test_ranks_cache_the_same_states_and_train_like_all_nvme_and_eager():
    nvme = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "max_norm": None}
    cached = {**nvme, "host_memory": _host_memory_for_half_the_parameters()}
    results = run_ranks(WORLD, "zero_worker", {"model": MODEL, "steps": 4, "batch": 2, "configs": [nvme, cached]})
    nvme_runs = [rank_results[0] for rank_results in results]
    cached_runs = [rank_results[1] for rank_results in results]
    reports = [run["report"] for run in cached_runs]
    assert reports[0]["cpu"]["params"] > 0 and reports[0]["nvme"]["params"] > 0, reports[0]
    for tier in ("cpu", "nvme"):  # equal shards on both ranks: the same choice holds the same bytes
        assert reports[0][tier] == reports[1][tier], (tier, reports)
    assert all(run["early_steps"]["committed"] > 0 for run in cached_runs), [r["early_steps"] for r in cached_runs]
    assert cached_runs[0]["zinf_losses"] == nvme_runs[0]["zinf_losses"]
    assert cached_runs[0]["param_errors"] == nvme_runs[0]["param_errors"]
    for eager, ours in zip(cached_runs[0]["eager_losses"], cached_runs[0]["zinf_losses"]):
        assert abs(eager - ours) <= 1e-5 * abs(eager)
    assert max(cached_runs[0]["param_errors"].values()) <= 1e-4, cached_runs[0]["param_errors"]
