"""zinf.save / zinf.load across processes: crash safety (SIGKILL mid-step and mid-save, then resume) at
world 2, and a checkpoint saved at world 2 loaded at worlds 1 and 4."""

import os

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, synthetic_batches

from checkpoint_worker import ADAMW, CFG
from multirank import run_ranks

# Fresh processes per run (about half a minute each); the default run's checkpoints:
# integration/test_checkpoint.py (save, load, resume in one process).
pytestmark = pytest.mark.slow


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _losses(path: str) -> dict[int, str]:
    """step -> the loss's repr, as a rank-0 worker logged it (exact bits)."""
    with open(path) as handle:
        return dict((int(step), loss) for step, loss in (line.split() for line in handle))


def test_sigkill_mid_step_and_mid_save_then_resume_is_bit_identical(tmp_path):
    """Acceptance 1: world size 2, parameters and optimizer on NVMe; killed twice, resumed twice."""
    base = dict(options=dict(stage=3, offload_param="nvme", offload_optimizer="nvme"), batch=8, steps=6,
                save_every=2)
    straight = tmp_path / "straight.pt"
    run_ranks(2, "checkpoint_worker", {**base, "root": str(tmp_path / "straight"), "out": str(straight)})
    root = tmp_path / "crashy"
    # Killed inside the save after step 3: step-0001 is committed, step-0003 is not.
    run_ranks(2, "checkpoint_worker", {**base, "root": str(root), "out": str(tmp_path / "b.pt"),
                                       "kill": {"at": 3, "where": "save"}}, killed_ok=True)
    assert sorted(os.listdir(root)) == ["step-0001", "step-0003.partial"]
    assert zinf.latest(root) == str(root / "step-0001")
    # Resumed from step 1; killed in the middle of step 4 (after its backward), having saved step 3.
    run_ranks(2, "checkpoint_worker", {**base, "root": str(root), "out": str(tmp_path / "c.pt"), "resume": True,
                                       "kill": {"at": 4, "where": "step"}}, killed_ok=True)
    assert zinf.latest(root) == str(root / "step-0003")
    results = run_ranks(2, "checkpoint_worker", {**base, "root": str(root), "out": str(tmp_path / "d.pt"),
                                                 "resume": True})
    assert [r["first"] for r in results] == [4, 4]
    expected = _losses(f"{straight}.losses")
    assert _losses(tmp_path / "b.pt.losses") == {s: expected[s] for s in range(4)}
    assert _losses(tmp_path / "c.pt.losses") == {s: expected[s] for s in (2, 3)}
    assert _losses(tmp_path / "d.pt.losses") == {s: expected[s] for s in (4, 5)}
    assert _equal(torch.load(tmp_path / "d.pt")["state"], torch.load(straight)["state"])


def test_save_at_world_2_loads_at_1_and_4_and_trains_like_eager(tmp_path):
    """Acceptance 3: another world size, partition layout, tile plan and tier on each side."""
    saved = tmp_path / "w2.pt"
    run_ranks(2, "checkpoint_worker", {
        "options": dict(stage=3, offload_param="nvme", offload_optimizer="nvme", tile_threshold=4096, tile_factor=2),
        "batch": 8, "steps": 2, "save_every": 2, "root": str(tmp_path), "out": str(saved)})
    runs = {
        1: dict(stage=3),
        4: dict(stage=3, offload_optimizer="cpu"),
    }
    torch.manual_seed(0)
    reference = GPT(CFG)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_losses = []
    for idx, targets in synthetic_batches(CFG, 8, 4):
        loss = reference(idx, targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    at_save = torch.load(saved)["state"]
    for world, options in runs.items():
        out = tmp_path / f"w{world}.pt"
        run_ranks(world, "checkpoint_worker", {"options": options, "batch": 8, "steps": 4, "resume": True,
                                               "root": str(tmp_path), "out": str(out)})
        result = torch.load(out)
        assert _equal(result["loaded_state"], at_save), world
        assert result["losses"] == pytest.approx(dict(zip(range(2, 4), ref_losses[2:])), abs=1e-5), world
        for name, expected in reference.state_dict().items():
            error = (result["state"][name] - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
            assert error <= 1e-4, (world, name, error.item())
