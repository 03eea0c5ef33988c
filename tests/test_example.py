"""The README's main job (examples/train_gpt.py) runs and learns: a short version."""

import re
import subprocess
import sys

from conftest import REPO


def test_train_gpt_example_learns():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--steps", "40", "--lower", "eager",
         "--n-layer", "2", "--n-embd", "64", "--batch-size", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"final loss ([0-9.]+) after 40 steps \(first step ([0-9.]+)\)", done.stdout)
    assert match, done.stdout[-2000:]
    final, first = float(match.group(1)), float(match.group(2))
    assert final < 0.75 * first, (first, final)
    assert "sample: " in done.stdout


def test_train_gpt_example_rejects_unbuilt_option_clearly():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--steps", "1", "--param-dtype", "fp32",
         "--offload", "nvme"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 2 and "nvme" in done.stderr and "Traceback" not in done.stderr
