"""zinf.save / zinf.load in one process: exact resume on every tier, refusal of bad checkpoints, conversion.

Crash safety and resharding across world sizes: tests/multirank/test_checkpoint_ranks.py."""

import os
import shutil

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, synthetic_batches

from checkpoint_worker import ADAMW, CFG

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


# The default run: the cpu (bf16) and nvme (tiled) tiers at stage 3; --all adds the rest (the device tier,
# nvme untiled, stages 2 and 0).
DEFAULT = ("stage3-nvme-tiled", "stage3-cpu-bf16")  # the device tier's resume: --all (suite time)


@pytest.mark.parametrize("name", [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CONFIGS])
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
        # Reported, not passed: the safetensors half above ran, the DCP half did not.
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.checkpoint.HuggingFaceStorageReader: "
                    f"the converted folder was read by safetensors only, not by DCP")
    into = {name: torch.zeros_like(value) for name, value in weights.items()}
    dcp.load(into, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "converted")), no_dist=True)
    assert all(torch.equal(into[name], weights[name]) for name in weights)
