"""Issue 14 acceptance 1: the Triton kernels equal their torch references, under Triton's interpreter
on the CPU (every CI run) and compiled on a GPU where there is one (never skipped there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernels_match_torch(device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "kernels_worker.py"), device], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, result in results.items():
        if name.startswith("adamw"):
            # fp32 throughout, the same operations as torch's AdamW in another order.
            assert result["master"] <= 1e-6 and result["exp_avg"] <= 1e-6 and result["exp_avg_sq"] <= 1e-6, (
                name, result)
            assert result["out_exact"] and result["moved"], (name, result)
        else:
            assert result["exact"], (name, result)


def test_kernels_refuse_mismatched_tensors():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from zinf_compiler.runtime import kernels

    master = torch.zeros(8)
    with pytest.raises(ValueError, match="one size"):
        kernels.adamw_step_(master, torch.zeros(7), torch.zeros(8), torch.zeros(8), 1, lr=1e-3)
    with pytest.raises(ValueError, match="fp32"):
        kernels.adamw_step_(master, torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), 1, lr=1e-3)
    with pytest.raises(ValueError, match="step counts from 1"):
        kernels.adamw_step_(master, torch.zeros(8), torch.zeros(8), torch.zeros(8), 0, lr=1e-3)
    with pytest.raises(ValueError, match="one size"):
        kernels.cast_copy_(torch.zeros(3), torch.zeros(4))
