"""The same training run gives the same bytes: resumed or not, cores busy or quiet, optimizer early or late.

Issue 35: resuming a stage-3 NVMe run was not always bit-identical (2 of 6 runs on a busy 2-core machine
differed in last bits).  The cause was not zinf's timing-dependent choices but Inductor's CPU code:
scatter-adds (the embedding's backward) use atomic adds across threads, so with 2+ threads even plain
``torch.compile`` gives different last bits from run to run.  zinf now lowers with torch's deterministic
algorithms on (``lowering.deterministic_lowering``), and (2026-11-27) runs the index_puts Inductor leaves to
ATen with them on too (``ordered_index_put``): ATen's CPU kernel chooses its add order when it runs.

The GPT is 256 wide so that its embedding's backward adds 128 tokens x 256 = 32,768 values at world 1, the
size from which ATen's CPU kernel (with 2 threads) adds across threads unless told not to; the test's first
width (32) stayed under it and could not see that nondeterminism.

Each run here is the default a user gets (Inductor, stage 3, parameters and optimizer on NVMe, default
options) in fresh processes, 6 steps with a checkpoint every 3; the resumed runs stop after step 2 and
a new process resumes from the checkpoint.  Compared byte for byte with the uninterrupted run on a
quiet machine: every loss, the final parameters and the final checkpoint's data files (fp32 masters and
both Adam moments of every rank's shards).  The runs that could differ by timing:

* resumed with two busy-looping processes on the machine's cores all the while;
* ``overlap_optimizer`` forced on (steps committed during backward, checked > 0) and off (none).

This is the test behind docs/usage.md's "resumes bit-identically" and "a committed step is bit-equal to
the step after backward".
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

from multirank import run_ranks

BASE = dict(options={"lower": "inductor", "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
            batch=8, steps=6, save_every=3, n_embd=256)


@contextlib.contextmanager
def cores_busy(count: int = 2):
    """``count`` processes spinning on the CPU (the machine's 2 cores) for the duration."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _run(world: int, folder, options: dict | None = None, resume: bool = False) -> dict:
    """One run of BASE (``options`` added): straight, or 3 steps then a resumed process for the rest."""
    args = {**BASE, "options": {**BASE["options"], **(options or {})}, "root": str(folder / "ckpt"),
            "out": str(folder / "run.pt"), "threads": 2 if world == 1 else 1}
    folder.mkdir()
    results = []
    if resume:
        results += run_ranks(world, "checkpoint_worker", {**args, "steps": 3})
        results += run_ranks(world, "checkpoint_worker", {**args, "resume": True})
        assert [result["first"] for result in results[world:]] == [3] * world
    else:
        results += run_ranks(world, "checkpoint_worker", args)
    final = folder / "ckpt" / "step-0005"
    with open(f"{folder / 'run.pt'}.losses") as handle:
        losses = dict(line.split() for line in handle)  # step -> repr of the loss, both parts of a resumed run
    return {"losses": losses, "state": torch.load(folder / "run.pt")["state"],
            "data": {path.name: path.read_bytes() for path in sorted(final.glob("rank-*.bin"))},
            "early_committed": sum(result["early_committed"] for result in results)}


def _assert_same_bytes(expected: dict, actual: dict, what: str) -> None:
    assert actual["losses"] == expected["losses"], what
    assert actual["state"].keys() == expected["state"].keys()
    different = [name for name in expected["state"] if not torch.equal(expected["state"][name], actual["state"][name])]
    assert not different, f"{what}: parameters differ: {different}"
    assert actual["data"].keys() == expected["data"].keys() and actual["data"], what
    different = [name for name in expected["data"] if expected["data"][name] != actual["data"][name]]
    assert not different, f"{what}: optimizer state (checkpoint data) differs in {different}"


@pytest.mark.slow  # cores kept busy: over a minute; the default run's determinism: integration/test_checkpoint.py
@pytest.mark.parametrize("world", [1, 2])
def test_a_resumed_run_on_busy_cores_is_byte_identical(world, tmp_path):
    straight = _run(world, tmp_path / "straight")
    with cores_busy():
        busy = _run(world, tmp_path / "busy", resume=True)
    _assert_same_bytes(straight, busy, "resumed on busy cores")


@pytest.mark.slow  # four runs of fresh processes: 2.5 minutes at world 2
@pytest.mark.parametrize("world", [1, 2])
def test_the_optimizer_during_or_after_backward_gives_the_same_bytes(world, tmp_path):
    straight = _run(world, tmp_path / "straight")
    early = _run(world, tmp_path / "early", {"overlap_optimizer": True}, resume=True)
    assert early["early_committed"] > 0  # the steps taken during backward were the ones kept
    _assert_same_bytes(straight, early, "overlap_optimizer=True")
    late = _run(world, tmp_path / "late", {"overlap_optimizer": False}, resume=True)
    assert late["early_committed"] == 0
    _assert_same_bytes(straight, late, "overlap_optimizer=False")
