"""Issue 4 acceptance 5: NVMe errors stop training with a clear message and never take partial state as good."""

import errno
import os

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime import aio as aio_module
from zinf_compiler.runtime.aio import AioChecksumError, AioError
from zinf_compiler.api import RUNTIME

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
BATCHES = synthetic_batches(CFG, 4, 3)


def _compiled(nvme_path, **extra):
    torch.manual_seed(0)
    model = GPT(CFG)
    options = {"lower": "eager", "stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
               "nvme_path": str(nvme_path), **extra}
    return model, torch.compile(model, backend="zinf", options=options)


def _step(model, compiled, opt, batch):
    compiled(*batch).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("problem", ["missing", "too small"])
def test_bad_nvme_path_fails_before_training_with_nothing_adopted(tmp_path, monkeypatch, problem):
    folder = tmp_path / "missing" if problem == "missing" else tmp_path
    if problem == "too small":
        real = os.statvfs
        monkeypatch.setattr(aio_module.os, "statvfs",
                            lambda path: os.statvfs_result((4096, 4096, 10, 10, 2) + tuple(real(path))[5:]))
    model, compiled = _compiled(folder)
    with pytest.raises(Exception) as err:
        compiled(*BATCHES[0])
    message = str(err.value)
    assert "nvme_path" in message
    assert ("does not exist" in message) if problem == "missing" else ("needs" in message and "free" in message)
    # Nothing was sharded or released: the model is still whole and usable eagerly.
    assert all(RUNTIME.store.lookup(p) is None for p in model.parameters())
    assert torch.isfinite(model(*BATCHES[0]))


def test_enospc_during_the_optimizer_step_keeps_the_last_good_state(tmp_path, monkeypatch):
    # The step after backward (overlap_optimizer=True writes during backward: the next test).
    model, compiled = _compiled(tmp_path, overlap_optimizer=False)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, compiled, opt, BATCHES[0])
    good = zinf.full_state_dict(compiled)
    compiled(*BATCHES[1]).backward()
    calls = {"n": 0}
    real_pwritev = os.pwritev

    def disk_fills_up(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", disk_fills_up)
    with pytest.raises(AioError, match="is full"):
        opt.step()
    monkeypatch.undo()
    after_failure = zinf.full_state_dict(compiled)
    assert all(torch.equal(good[name], after_failure[name]) for name in good), "partial step taken as good"
    # Space is back: the step runs again from the kept gradients and state.
    opt.step()
    opt.zero_grad()
    assert not torch.equal(good["wte.weight"], zinf.full_state_dict(compiled)["wte.weight"])


def test_enospc_while_stepping_during_backward_falls_back_and_keeps_the_last_good_state(tmp_path, monkeypatch):
    """overlap_optimizer: the optimizer state's writes during backward fail (the gradients' do not): the early
    steps are dropped, the step after backward runs and meets the same full disk, and nothing is taken as good."""
    model, compiled = _compiled(tmp_path, overlap_optimizer=True)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, compiled, opt, BATCHES[0])
    good = zinf.full_state_dict(compiled)
    real_pwritev = os.pwritev

    def state_disk_full(fd, buffers, offset):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(("master.", "exp_avg")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", state_disk_full)
    compiled(*BATCHES[1]).backward()
    early = opt._nvme.early
    assert early.stats["started"] > 0 and early.stats["committed"] == 0
    with pytest.raises(AioError, match="is full"):
        opt.step()
    assert early.stats["committed"] == 0 and early.stats["dropped"] >= early.stats["started"]
    monkeypatch.undo()
    after_failure = zinf.full_state_dict(compiled)
    assert all(torch.equal(good[name], after_failure[name]) for name in good), "partial step taken as good"
    opt.step()  # space is back: the step after backward, from the kept gradients
    opt.zero_grad()
    assert not torch.equal(good["wte.weight"], zinf.full_state_dict(compiled)["wte.weight"])
    _step(model, compiled, opt, BATCHES[2])  # and the next backward steps early again
    assert early.stats["committed"] > 0


def test_corrupted_parameter_swap_file_is_an_error(tmp_path):
    model, compiled = _compiled(tmp_path)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, compiled, opt, BATCHES[0])
    record = RUNTIME.store.lookup(model.wte.weight)
    path = record.swap.path(record.swap_layout()[0][0])  # (an fp32 parameter lives in its master's file)
    with open(path, "r+b") as handle:
        data = bytearray(handle.read())
        for offset in range(0, len(data), 997):
            data[offset] ^= 0x5A  # both slots: whichever holds the live copy is damaged
        handle.seek(0)
        handle.write(data)
    with pytest.raises(Exception) as err:
        compiled(*BATCHES[1])
    assert isinstance(err.value, AioChecksumError) or "corrupt" in str(err.value)
