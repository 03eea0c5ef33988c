"""The README's main job (examples/train_gpt.py) runs and learns: a short version."""

import re
import subprocess
import sys

from conftest import REPO


def test_train_gpt_example_learns(tmp_path):
    # The default run: every model state in NVMe swap files under --nvme-path.
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--steps", "40", "--lower", "eager",
         "--n-layer", "2", "--n-embd", "64", "--batch-size", "8", "--nvme-path", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"final loss ([0-9.]+) after 40 steps \(first step ([0-9.]+)\)", done.stdout)
    assert match, done.stdout[-2000:]
    final, first = float(match.group(1)), float(match.group(2))
    assert final < 0.75 * first, (first, final)
    assert "sample: " in done.stdout
    assert re.search(r"nvme tier on this rank: params [1-9]", done.stdout), done.stdout[-2000:]
    assert list(tmp_path.iterdir()) == [], "the private swap folder is removed at exit"


def test_train_gpt_example_rejects_a_bad_nvme_path_clearly():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--steps", "1", "--offload", "nvme",
         "--nvme-path", "/proc/zinf-cannot-be-here"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 2 and "--nvme-path" in done.stderr and "Traceback" not in done.stderr
