"""Issue 3 acceptance 3: the partition pass's gathers, releases and reductions, counted in the dumps."""

import re

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.dump import read_index
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _calls(text, op):
    """The first argument of each call of ``op`` (a unit's first parameter or gradient)."""
    return re.findall(rf"torch\.ops\.zinf\.{op}\.default\(\[?([a-z_0-9]+)", text)


@pytest.mark.parametrize("stage", [2, 3])
def test_one_gather_and_release_per_parameter_one_reduce_per_trainable(tmp_path, stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, frozen_scale=True))
    params = dict(model.named_parameters())  # tied lm_head.weight appears once
    trainable = [name for name, p in params.items() if p.requires_grad]
    compiled = torch.compile(model, backend="zinf", options={"lower": "eager", "stage": stage, "bucket_bytes": 0,
                                                             "dump_dir": str(tmp_path)})
    idx, targets = synthetic_batches(model.cfg, 2, 1)[0]
    compiled(idx, targets).backward()
    assert all(p.grad is None for p in model.parameters())

    (entry,) = read_index(str(tmp_path))["graphs"]
    folder = tmp_path / entry["folder"]
    files = {kind: {s["stage"]: s["file"] for s in stages} for kind, stages in entry["graphs"].items()}
    forward = (folder / files["forward"]["partition"]).read_text()
    backward = (folder / files["backward"]["partition"]).read_text()
    gathered = _calls(forward, "gather_start")
    if stage == 3:
        assert len(gathered) == len(set(gathered)) == len(params)
        waits = re.findall(r"(gathered_\w+)[^=]*= torch\.ops\.zinf\.gather_wait", forward)
        assert sorted(_calls(forward, "release")) == sorted(waits) and len(waits) == len(params)
        # Backward gathers again exactly the parameters it reads, and releases each.
        assert len(_calls(backward, "gather_start")) == len(_calls(backward, "release")) > 0
    else:
        assert gathered == [] and _calls(backward, "gather_start") == []
    reduces = _calls(backward, "reduce_grad_start")
    assert len(reduces) == len(trainable)
    assert len(_calls(backward, "reduce_grad_wait")) == len(trainable)
    # No gradient leaves the backward graph: every one went to the store.
    returned = re.search(r"return \((.*)\)", backward).group(1)
    assert set(x.strip() for x in returned.split(",") if x.strip()) == {"None"}


def test_partition_disabled_by_name_keeps_full_parameters():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    compiled = torch.compile(model, backend="zinf", options={"lower": "eager", "stage": 0, "disable_passes": ["partition"]})
    idx, targets = synthetic_batches(model.cfg, 2, 1)[0]
    compiled(idx, targets).backward()
    assert all(p.grad is not None for p in model.parameters())
