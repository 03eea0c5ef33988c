"""fp32 parameters trained on NVMe are read from their masters' swap files (ParamLayout.params_in_master).

With parameters and optimizer both on nvme and an fp32 shard, the shard and
the fp32 master are the same numbers: zinf keeps one copy on disk, reads the
parameters from the master's keys and writes nothing back after a step.  A
bf16 shard, or a parameter frozen when it is adopted, keeps files of its own.
"""

import copy
import gc
import os

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime import swap_layout
from zinf_compiler.api import RUNTIME

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCHES = synthetic_batches(CFG, 4, 4)
ADAMW = dict(lr=1e-2, eps=1e-6, fused=True)


def _swap_files(model) -> list[str]:
    folders = {RUNTIME.store.lookup(p).swap.folder for p in model.parameters()}
    return sorted(name for folder in folders for name in os.listdir(folder))


def _train_side_by_side(tmp_path, freeze: str | None = None, **options):
    tmp_path.mkdir(exist_ok=True)
    torch.manual_seed(0)
    eager = GPT(CFG)
    if freeze is not None:
        eager.get_parameter(freeze).requires_grad_(False)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="zinf", options={
        "lower": "eager", "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
        "nvme_path": str(tmp_path), **options})
    eager_opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], **ADAMW)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    for batch in BATCHES:
        expected = eager(*batch)
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        loss = compiled(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    state = zinf.full_state_dict(compiled)
    for name, value in eager.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return compiled, opt


@pytest.mark.parametrize("copies, group_numel", [(1, None), (2, None), pytest.param(1, 1024, marks=pytest.mark.slow)])
def test_fp32_parameters_on_nvme_have_one_copy_on_disk(tmp_path, monkeypatch, copies, group_numel):
    if group_numel is not None:  # several optimizer sub-groups (master keys) per parameter, each read in place
        monkeypatch.setattr(swap_layout.sub_groups, "__defaults__", (group_numel,))
    compiled, opt = _train_side_by_side(tmp_path, nvme_copies=copies)
    records = [RUNTIME.store.lookup(p) for p in compiled.parameters()]
    assert all(record.params_in_master for record in records)
    files = _swap_files(compiled)
    assert not [name for name in files if name.startswith("param.")], files
    keys = sum(len(record.plan.state_groups) for record in records)
    assert len([name for name in files if name.startswith("master.")]) == keys
    if group_numel is not None:
        assert keys > len(records)
    # Earlier tests' optimizers that are garbage go now, not at the gc.collect() below: their early quotas
    # must not vanish between the two readings (the full suite's order failed that way).
    gc.collect()
    # The report counts each file once: the masters as parameters, the moments as optimizer state.
    report = zinf.memory_report(compiled)
    local = sum(record.local_numel * 4 for record in records)
    assert report["nvme"]["params"] == local and report["nvme"]["optimizer"] == 2 * local, report["nvme"]
    # The process's pinned memory per consumer: the store's pool, and the early step's own quota (copies=2).
    pinned = report["pinned"]
    assert pinned["parameters"]["quota"] == RUNTIME.store.pinned.capacity_bytes, pinned
    assert 0 < pinned["parameters"]["peak"] <= pinned["parameters"]["quota"], pinned
    mine = 0
    if copies == 2:
        assert opt._nvme.early.stats["committed"] > 0 and opt._nvme.early.pool is not None
        # (The peak is the consumer's since its first quota: an earlier test's larger one may have set it.)
        assert pinned["early_optimizer"]["peak"] > 0 and pinned["early_optimizer"]["quota"] > 0, pinned
        mine = opt._nvme.early.pool.capacity_bytes
    early_before = pinned.get("early_optimizer", {"quota": 0})["quota"]
    del opt
    gc.collect()  # the early step's quota goes with its optimizer; the shared pools add up to buffers
    after = zinf.memory_report(compiled)
    # (Optimizers of earlier tests still alive in this process keep their own early quotas.)
    assert after["pinned"].get("early_optimizer", {"quota": 0})["quota"] == early_before - mine, after["pinned"]
    every_pool = sum(figures["quota"] for figures in after["pinned"].values())  # (the optimizers' own included)
    assert every_pool == after["buffers"]["cpu"], (after["pinned"], after["buffers"])


def test_bf16_shards_and_frozen_parameters_keep_their_own_files(tmp_path):
    compiled, _ = _train_side_by_side(tmp_path / "frozen", freeze="wpe.weight")
    frozen = [RUNTIME.store.lookup(p) for p in compiled.parameters() if not p.requires_grad]
    assert len(frozen) == 1 and not frozen[0].params_in_master
    assert f"param.{frozen[0].uid}.swap" in _swap_files(compiled)

    torch.manual_seed(0)
    model = GPT(CFG)
    (tmp_path / "bf16").mkdir()
    compiled = torch.compile(model, backend="zinf", options={
        "lower": "eager", "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
        "param_dtype": "bf16", "nvme_path": str(tmp_path / "bf16")})
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    compiled(*BATCHES[0]).backward()
    opt.step()
    records = [RUNTIME.store.lookup(p) for p in model.parameters()]
    assert not any(record.params_in_master for record in records)
    files = _swap_files(model)
    assert len([name for name in files if name.startswith("param.")]) == len(records)
