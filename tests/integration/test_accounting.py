"""memory_report agrees with the OS: resident memory for the cpu tier, swap-file blocks for nvme.

Acceptance 6 of the offload issue: per-tier bytes within 10%.  Every
transition that changes what zinf holds is measured by both (see
tests/workers/accounting_worker.py); transitions that add nothing to a tier must
move the OS figure by no more than a few MiB of noise.
"""

import json
import os
import subprocess
import sys

import pytest

from repo_paths import worker_script

NOISE_BYTES = 8 << 20  # allocator, page-table and thread-stack noise on a transition that adds nothing


def run_worker(tier: str, folder: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, worker_script("accounting_worker"), tier, folder],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_agree(reported: int, measured: int, what: str) -> None:
    assert abs(measured - reported) <= 0.10 * abs(reported) + NOISE_BYTES, (
        f"{what}: memory_report says {reported / 2**20:.1f} MiB, the OS {measured / 2**20:.1f} MiB")


@pytest.mark.slow  # a fresh process per tier; memory_report by default: test_dumps.py, multirank/test_zero.py
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_memory_report_agrees_with_the_os(tier, tmp_path):
    result = run_worker(tier, str(tmp_path))
    assert set(result) == {"materialize", "backward", "first_step", "zero_grad"}
    for transition, figures in result.items():
        assert_agree(figures["report_cpu"], figures["rss"], f"{tier} tier, {transition}, resident memory")
        assert_agree(figures["report_nvme"], figures["disk"], f"{tier} tier, {transition}, swap files")
    # The transitions do move real bytes: the comparison is not 0 == 0.
    if tier == "cpu":
        assert result["materialize"]["report_cpu"] > 60 << 20  # 16.8M fp32 parameter shards
        assert result["first_step"]["report_cpu"] > 120 << 20  # two Adam moments
        assert result["zero_grad"]["report_cpu"] < -60 << 20  # gradient shards freed
    else:
        assert result["materialize"]["report_nvme"] > 60 << 20  # fp32 masters on disk (the parameters too)
        assert result["backward"]["report_nvme"] > 60 << 20  # gradients to disk
        assert result["first_step"]["report_nvme"] > 120 << 20  # moments on disk
        assert result["materialize"]["report_cpu"] > 0  # the pinned pool, touched once at creation
