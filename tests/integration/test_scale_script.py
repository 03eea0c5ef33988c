"""benchmarks/scale.py, the GPU scale ladder, run on the CPU at toy sizes (``GPU_CHECK_DEVICE=cpu``) through
scripts/gpu_check.sh as a lent GPU session runs it: a GPU is lent 15 minutes now and then, and a script that fails
there costs the whole lend.  What is checked is what the GPU run's figures rest on: every system trains (loss
falling, finite), zinf's first loss equals torch.compile's on the same initial weights, the bound and its parts
are the probed rates' arithmetic, and the files stay within what the device tool brings back."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import scale  # noqa: E402


def run_scale(tmp_path, scale_args: str) -> dict:
    out = tmp_path / "out"
    # gpu_check.sh runs ``python3``, which on the GPU machine is the one holding torch: here, this environment's.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", OUT=str(out), SCALE_ARGS=scale_args, PATH=path)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "scale"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    # The device tool brings back at most 8 files, 16 MiB each, two folders down.
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= 8 and all(path.stat().st_size < 16 << 20 for path in files), files
    return json.loads((out / "scale.json").read_text())


def check_rows(result: dict, systems: list[str]) -> dict:
    rows = {row["system"]: row for row in result["rows"]}
    rates = result["rates"]
    for system in systems:
        row = rows[system]
        assert "error" not in row, row.get("error", "") + row.get("log_tail", "")
        assert row["all_finite"] and row["losses"][-1] < row["losses"][0], row["losses"]
        rung = scale.RUNGS[row["rung"]]
        expected = scale.bound(rung, system, rates, row)
        assert row["bound"] == expected
        assert row["bound"]["seconds"] == max(row["bound"]["parts"].values()) > 0
        assert row["model_tflops"] == pytest.approx(scale.model_flops(rung) / row["step_s"] / 1e12)
        assert row["peak_rss_bytes"] > 0
    return rows


def test_the_scale_ladder_runs_zinf_beside_torch_compile_on_the_cpu(tmp_path):
    result = run_scale(tmp_path, "--rungs toy --systems compile,zinf --trace-rung toy --trace-system zinf")
    rows = check_rows(result, ["compile", "zinf"])
    # Same initial weights and batch: zinf's first loss is torch.compile's (both fp32 parameters, bf16 autocast).
    assert rows["zinf"]["losses"][0] == pytest.approx(rows["compile"]["losses"][0], rel=1e-5)
    assert rows["zinf"]["predicted_step_s"] > 0 and rows["zinf"]["memory_report"]["device"]["params"] > 0
    assert (tmp_path / "out" / "trace_toy_zinf.json.gz").stat().st_size > 0


@pytest.mark.slow  # every system on two rungs (about two minutes)
def test_every_system_of_the_scale_ladder_runs_or_says_why_not(tmp_path):
    result = run_scale(tmp_path, "--rungs toy,toy-ckpt")
    for rung in ("toy", "toy-ckpt"):
        rows = {row["system"]: row for row in result["rows"] if row["rung"] == rung}
        assert set(rows) == set(scale.SYSTEMS)
        trained = [name for name, row in rows.items() if "skipped" not in row]
        assert {"compile", "zinf", "zinf_cpu", "zinf_opt_cpu", "zinf_nvme", "fsdp2_cpu"} <= set(trained)
        check_rows({"rates": result["rates"], "rows": [rows[name] for name in trained]}, trained)
        # The cpu tier's bound counts its host optimizer and its copies both ways.
        assert {"compute", "host_optimizer", "host_to_device", "device_to_host"} <= set(rows["zinf_cpu"]["bound"]["parts"])
        # The NVMe tier's bound counts the disk bytes its RAM cache left on NVMe.
        if rows["zinf_nvme"]["nvme_state_bytes"]:
            assert "disk" in rows["zinf_nvme"]["bound"]["parts"]
        for name, row in rows.items():
            if "skipped" in row:
                assert name.startswith("ds_") and "deepspeed" in row["skipped"].lower()
