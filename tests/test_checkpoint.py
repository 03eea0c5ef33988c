"""zinf.save / zinf.load: exact resume on every tier, resharding, crash safety, refusal of bad checkpoints."""

import os
import shutil

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, synthetic_batches

from checkpoint_worker import ADAMW, CFG
from multirank import run_ranks

BATCHES = synthetic_batches(CFG, 4, 6)


class Run:
    """A compiled GPT and its zinf optimizer, trained step by step on BATCHES."""

    def __init__(self, options: dict, optimizer=zinf.optim.AdamW):
        torch._dynamo.reset()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.compiled = torch.compile(self.model, backend="zinf", options={"lower": "eager", **options})
        self.opt = optimizer(self.model.parameters(), **ADAMW)

    def train(self, steps) -> list[float]:
        losses = []
        for step in steps:
            idx, targets = BATCHES[step]
            loss = self.compiled(idx, targets)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            losses.append(loss.item())
        return losses

    def state(self) -> dict:
        return {k: v.clone() for k, v in zinf.full_state_dict(self.compiled).items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


CONFIGS = {
    "stage3-device": dict(stage=3),
    "stage3-nvme": dict(stage=3, offload_param="nvme", offload_optimizer="nvme"),
    "stage3-nvme-tiled": dict(stage=3, offload_param="nvme", offload_optimizer="nvme", tile_threshold=4096,
                              tile_factor=2),
    "stage3-cpu-bf16": dict(stage=3, offload_param="cpu", offload_optimizer="cpu", param_dtype="bf16"),
    "stage2": dict(stage=2),
    "stage0": dict(stage=0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_in_a_new_model_is_bit_identical(name, tmp_path):
    """Train 6 steps; train 3, save, load into a fresh model and optimizer, train 3: the same bits."""
    options = dict(CONFIGS[name])
    if "nvme" in options.values():
        options["nvme_path"] = str(tmp_path)
    straight = Run(options)
    expected_losses = straight.train(range(6))
    expected = straight.state()
    del straight

    first = Run(options)
    first.train(range(3))
    zinf.save(tmp_path / "ckpt", first.compiled, first.opt, extra={"step": 2})
    del first

    resumed = Run(options)  # not compiled or adopted yet: the optimizer state waits for its first step
    assert zinf.load(tmp_path / "ckpt", resumed.compiled, resumed.opt) == {"step": 2}
    assert resumed.train(range(3, 6)) == expected_losses[3:]
    assert _equal(resumed.state(), expected)


def test_load_into_a_model_mid_training_rewinds_it(tmp_path):
    """A model and optimizer that have trained on load the checkpoint's state, moments and step counts."""
    options = dict(stage=3, offload_param="cpu", offload_optimizer="nvme", nvme_path=str(tmp_path))
    run = Run(options)
    run.train(range(2))
    zinf.save(tmp_path / "ckpt", run.compiled, run.opt)
    expected_losses = run.train(range(2, 5))
    expected = run.state()
    run.train(range(5, 6))  # moves on past the checkpoint (and leaves a gradient behind)
    idx, targets = BATCHES[0]
    run.compiled(idx, targets).backward()
    zinf.load(tmp_path / "ckpt", run.compiled, run.opt)
    assert run.train(range(2, 5)) == expected_losses
    assert _equal(run.state(), expected)


def test_a_save_replaces_the_checkpoint_at_its_path_and_latest_finds_the_newest(tmp_path):
    run = Run(dict(stage=3))
    run.train(range(1))
    zinf.save(tmp_path / "a", run.compiled, run.opt)
    run.train(range(1, 2))
    zinf.save(tmp_path / "b", run.compiled, run.opt)
    after_two = run.state()
    run.train(range(2, 3))
    zinf.save(tmp_path / "a", run.compiled, run.opt)  # replaces the older "a"
    os.makedirs(tmp_path / "c.partial")  # a killed save: ignored
    assert zinf.latest(tmp_path) == str(tmp_path / "a")
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c.partial"]
    zinf.load(tmp_path / "b", run.compiled, run.opt)
    assert _equal(run.state(), after_two)


def test_corrupt_truncated_uncommitted_and_mismatched_checkpoints_are_refused(tmp_path):
    run = Run(dict(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path)))
    run.train(range(2))
    good = tmp_path / "good"
    zinf.save(good, run.compiled, run.opt)
    run.train(range(2, 3))
    before = run.state()

    def damaged(name: str, edit) -> str:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        edit(copy)
        return copy

    def flip_byte(path, offset):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    data_file = "rank-00000.bin"
    corrupt = damaged("corrupt", lambda c: flip_byte(c / data_file, (c / data_file).stat().st_size // 2))
    with pytest.raises(zinf.ZinfCheckpointError, match=f"{corrupt / data_file}.* is corrupt.*CRC32"):
        zinf.load(corrupt, run.compiled, run.opt)
    truncated = damaged("truncated", lambda c: os.truncate(c / data_file, 100))
    with pytest.raises(zinf.ZinfCheckpointError, match=f"{truncated / data_file} has 100 bytes"):
        zinf.load(truncated, run.compiled, run.opt)
    manifest = damaged("manifest", lambda c: flip_byte(c / "rank-00000.json", 40))
    with pytest.raises(zinf.ZinfCheckpointError, match=f"manifest {manifest / 'rank-00000.json'} is corrupt"):
        zinf.load(manifest, run.compiled, run.opt)
    uncommitted = damaged("uncommitted", lambda c: os.unlink(c / "COMMITTED"))
    with pytest.raises(zinf.ZinfCheckpointError, match="no COMMITTED marker"):
        zinf.load(uncommitted, run.compiled, run.opt)
    os.rename(uncommitted, str(uncommitted) + ".partial")
    with pytest.raises(zinf.ZinfCheckpointError, match="the save was interrupted"):
        zinf.load(uncommitted, run.compiled, run.opt)
    assert _equal(run.state(), before)  # every refusal came before any change

    other = Run(dict(stage=3), optimizer=zinf.optim.SGD)
    with pytest.raises(zinf.ZinfCheckpointError, match="optimizer is AdamW, this one is SGD"):
        zinf.load(good, other.compiled, other.opt)
    torch.manual_seed(0)
    wider = GPT(type(CFG)(**{**CFG.__dict__, "n_embd": 48}))
    with pytest.raises(zinf.ZinfCheckpointError, match=r"wte.weight has shape \(64, 48\), the checkpoint \(64, 32\).*24 more shapes differ"):
        zinf.load(good, wider)
    zinf.load(good, run.compiled, run.opt)  # the original still loads after all that
    run.train(range(2, 3))
    assert _equal(run.state(), before)


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


def test_a_checkpoint_converts_to_safetensors_that_torch_dcp_loads(tmp_path):
    """The converter: no model, no ranks; the fp32 values, readable by safetensors and by DCP."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    run = Run(dict(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path)))
    run.train(range(2))
    zinf.save(tmp_path / "ckpt", run.compiled, run.opt)
    expected = run.state()
    zinf.checkpoint.to_safetensors(tmp_path / "ckpt", tmp_path / "converted")
    weights = safetensors_torch.load_file(tmp_path / "converted" / "model.safetensors")
    assert set(expected) - set(weights) == {"lm_head.weight"}  # tied to wte.weight: written once
    assert all(torch.equal(weights[name], expected[name]) for name in weights)
    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "HuggingFaceStorageReader"):
        return
    into = {name: torch.zeros_like(value) for name, value in weights.items()}
    dcp.load(into, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "converted")), no_dist=True)
    assert all(torch.equal(into[name], weights[name]) for name in weights)
