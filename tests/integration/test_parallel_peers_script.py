"""benchmarks/parallel_peers.py --meta at toy size: FSDP2, zinf and zinf on NVMe each build the model on the meta
device and fill it where it lives (FSDP2 through ``to_empty``, zinf through ``zinf.materialize``, TP DTensor slices
included), train equal to eager on the same name-derived initial values, and report peak RSS by phase.  The figures
in benchmarks/RESULTS.md (issue 52, acceptance 6) rest on that: a system whose losses left eager's gets no figures,
so a broken initialization would show as a mismatch here."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # six launches of four ranks: about two minutes on 2 cores
def test_meta_built_systems_train_like_eager_and_report_rss_by_phase(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "parallel_peers.py"), "--meta", "--skip-side", "--width", "64",
         "--blocks", "2", "--rows", "4", "--micro-batches", "2", "--warmup", "1", "--rounds", "1", "--steps", "2",
         "--tmp", str(tmp_path), "--nvme-options", '{"pinned_bytes": 67108864, "nvme_grad_ram_bytes": 0}'],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for composition in ("TP x DP", "PP x DP"):
        section = done.stdout.split(f"### {composition}")[1].split("###")[0]
        for system in ("FSDP2", "zinf stage 3", "zinf stage 3, nvme"):
            row = re.search(rf"^\| {re.escape(system)} \| (\S+) \| ([0-9.]+) \| ([0-9., ]+) \|", section, re.M)
            assert row and row.group(1) == "match", (composition, system, section)
        phases = re.search(r"Peak RSS by phase.*", section).group(0)
        assert phases.count("build") == 3 and phases.count("measured steps") == 3, phases
        assert "model states (fp32 weight, gradient, two Adam moments" in section
