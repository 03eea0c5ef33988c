"""``python -m zinf_compiler.plan_cli`` (issue 38): a table per option set from a model built on the meta device."""

from __future__ import annotations

import json

import pytest
import torch

from zinf_compiler import plan_cli


def test_the_command_prints_one_row_per_option_set(capsys):
    options = [{"stage": 3}, {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"}]
    argv = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--vocab", "128", "--batch", "2", "--seq", "16"]
    for one in options:
        argv += ["--options", json.dumps(one)]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| stage=")]
    assert len(rows) == 2
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert cells[0][3] == "0.0" and float(cells[1][3]) > 0  # only the NVMe set holds bytes on NVMe
    assert float(cells[1][6]) > 0  # and needs swap space
    assert "nvme_path" not in out  # (the temporary folder is not shown)


def test_the_default_table_covers_the_usual_option_sets(capsys):
    assert plan_cli.main(["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--seq", "8",
                          "--batch", "1", "--world-size", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| stage=")]
    assert len(rows) == len(plan_cli.CANDIDATES)


def test_the_device_to_train_on_is_said_or_taken_from_the_machine(capsys):
    """``--device cuda`` plans a GPU run on any machine (the device tier apart from the host's zinf bytes);
    ``--probe`` of a device this machine lacks is a usage error, not a traceback."""
    argv = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--seq", "8", "--batch", "1",
            "--options", json.dumps({"stage": 3})]
    assert plan_cli.main(argv + ["--device", "cuda"]) == 0
    gpu = capsys.readouterr().out
    assert "world size 1, on cuda;" in gpu
    assert plan_cli.main(argv + ["--device", "cpu"]) == 0
    cpu = capsys.readouterr().out
    assert "world size 1, on cpu;" in cpu

    def host_zinf(out: str) -> float:  # the "host (zinf)" column of the one row
        row = next(line for line in out.splitlines() if line.startswith("| stage="))
        return float(row.strip("|").split("|")[5].replace(",", ""))

    assert host_zinf(gpu) == 0.0 < host_zinf(cpu)  # on a CPU device the device tier is host memory
    assert plan_cli.main(argv) == 0
    assert ("on cuda;" if torch.cuda.is_available() else "on cpu;") in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            plan_cli.main(argv + ["--device", "cuda", "--probe"])
        assert "which it does not have" in capsys.readouterr().err
