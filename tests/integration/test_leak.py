"""A dropped model gives everything back (issue: no silent wrong results, case 6).

Before, the store held every adopted parameter forever: five rounds of
compile/train/drop grew the store's resting bytes by a model's states each
round and RSS with it.  Now the store holds parameters weakly; when a model
and its optimizer are collected, their shards, gradients, masters, moments,
swap files and accounted bytes go (at the next zinf entry point).
"""

import json
import os
import subprocess
import sys

import pytest

from repo_paths import worker_script

ROUNDS = 5


@pytest.mark.slow  # five rounds of fresh compiles per tier
@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_five_rounds_of_compile_train_drop_give_everything_back(tier, tmp_path):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, worker_script("leak_worker"), tier, str(tmp_path), str(ROUNDS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(done.stdout.strip().splitlines()[-1])
    for index, after in enumerate(rounds):
        where = f"after drop {index + 1} ({tier})"
        assert after["records"] == 0, where
        # The ledger: nothing resting but the process-wide pinned staging pool, nothing in flight.
        assert after["resting"] == {"device": 0, "cpu": after["pinned_pool"]}, where
        assert after["transient"] == {"device": 0, "cpu": 0}, where
        assert after["swap_files"] == 0 and after["swap_bytes"] == 0, where
        assert after["state_bytes"] > 0, where
    # The first round pays one-time costs (Dynamo, Inductor-free compile caches, the pool);
    # from then on RSS grows by less than 10% of one round's model states.
    one_round_states = rounds[0]["state_bytes"]
    growth = rounds[-1]["rss"] - rounds[0]["rss"]
    assert growth <= 0.10 * one_round_states, (
        f"RSS grew {growth / 2**20:.1f} MiB over rounds 2-{ROUNDS}; one round's model states are "
        f"{one_round_states / 2**20:.1f} MiB ({tier})")
