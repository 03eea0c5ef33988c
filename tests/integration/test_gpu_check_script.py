"""benchmarks/gpu_check.py, the CUDA path's check, run on the CPU (``GPU_CHECK_DEVICE=cpu``) so that the script a
GPU session depends on works before the session: a lent GPU is 15 minutes, and a script that fails there costs
them.  Two configurations: the RAM cache over NVMe and a budget that zinf.plan chooses the options under."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two compiles in child processes (about a minute)
def test_the_gpu_check_script_runs_its_configurations_on_the_cpu(tmp_path):
    result_path = tmp_path / "check.json"
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "check", "--jobs", "2",
                           "--only", "stage3-nvme-cache,budget-device", "--json", str(result_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(result_path.read_text())
    for name, result in results.items():
        assert result["ok"] and result["all_finite"], name
        assert result["loss_error"] < 1e-5 and result["param_error"] < 1e-3, (name, result)
    # The budget's row trains with the options zinf.plan chose under it (12 MiB: not everything on the device).
    chosen = results["budget-device"]["options"]
    assert chosen["device_memory_limit"] == 12 << 20
    assert "cpu" in (chosen.get("offload_param"), chosen.get("offload_optimizer"))
