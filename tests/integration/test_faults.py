"""Issue 12 item 7: a disk that fills up during training, then has space again.

Each test trains eager PyTorch and zinf side by side, fills the disk during a
gradient or optimizer-step swap write (an OSError injected into the swap
engine's ``pwritev``, nothing else replaced), frees it, and goes on: zinf
must either refuse with a clear error or apply the failed step fully or not
at all, and from there match eager training that does the same.
"""

import copy
import errno
import os

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime import aio as aio_module
from zinf_compiler.runtime.aio import AioError
from zinf_compiler.api import RUNTIME

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
BATCHES = synthetic_batches(CFG, 4, 5)
# As in tests/support/equivalence.py: fused AdamW on both sides runs the same arithmetic.
ADAMW = dict(lr=1e-2, eps=1e-6, fused=True)


class Disk:
    """The swap engine's disk: ``fill(after=n)`` lets n more piece writes land, then refuses with ENOSPC."""

    def __init__(self, monkeypatch):
        self.real_pwritev = os.pwritev
        self.allowed = None  # None: room for everything
        self.refused = 0
        monkeypatch.setattr(aio_module.os, "pwritev", self._pwritev)

    def _pwritev(self, fd, buffers, offset):
        if self.allowed is not None:
            if self.allowed == 0:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            self.allowed -= 1
        return self.real_pwritev(fd, buffers, offset)

    def fill(self, after: int = 0) -> None:
        self.allowed = after

    def free(self) -> None:
        self.allowed = None


class SideBySide:
    """An eager model and its zinf copy, trained on the same batches."""

    def __init__(self, tmp_path, offload_param="nvme", offload_optimizer="nvme", **extra):
        torch.manual_seed(0)
        self.eager = GPT(CFG)
        self.model = copy.deepcopy(self.eager)
        # Gradients in swap files unless a test says otherwise: their writes are what several faults hit.
        options = {"lower": "eager", "stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
                   "nvme_path": str(tmp_path), "nvme_grad_ram_bytes": 0, **extra}
        self.compiled = torch.compile(self.model, backend="zinf", options=options)
        self.eager_opt = torch.optim.AdamW(self.eager.parameters(), **ADAMW)
        self.opt = zinf.optim.AdamW(self.model.parameters(), **ADAMW)

    def eager_step(self, batch, apply=True) -> float:
        loss = self.eager(*batch)
        loss.backward()
        if apply:
            self.eager_opt.step()
        self.eager_opt.zero_grad()
        return loss.item()

    def both_steps(self, batch) -> None:
        expected = self.eager_step(batch)
        loss = self.compiled(*batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        assert loss.item() == pytest.approx(expected, rel=1e-5), "zinf and eager training diverged"

    def check_same_parameters(self) -> None:
        state = zinf.full_state_dict(self.compiled)
        for name, expected in self.eager.named_parameters():
            torch.testing.assert_close(state[name], expected.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _pinned_in_use() -> int:
    return RUNTIME.store.pinned.in_use_bytes


@pytest.mark.parametrize("fill_after", [0, 3])
def test_enospc_in_backward_gradient_writes_refuses_the_step_and_training_goes_on(tmp_path, monkeypatch, fill_after):
    run = SideBySide(tmp_path)
    disk = Disk(monkeypatch)
    run.both_steps(BATCHES[0])
    run.both_steps(BATCHES[1])
    before = zinf.full_state_dict(run.compiled)
    pinned = _pinned_in_use()

    disk.fill(after=fill_after)
    loss = run.compiled(*BATCHES[2])
    loss.backward()  # completes: a failed gradient write does not stop the backward graph half way
    assert disk.refused > 0
    disk.free()
    with pytest.raises(AioError) as err:
        run.opt.step()
    message = str(err.value)
    assert "optimizer step refused" in message and "could not be written" in message
    assert "no space left on device (ENOSPC)" in message and "opt.zero_grad()" in message
    with pytest.raises(AioError, match="optimizer step refused"):
        run.opt.step()  # still refused: the gradient is still incomplete
    after = zinf.full_state_dict(run.compiled)
    assert all(torch.equal(before[name], after[name]) for name in before), "a refused step changed parameters"
    run.opt.zero_grad()  # discards the incomplete gradients; no stale ENOSPC
    assert _pinned_in_use() == pinned, "the failure kept pinned staging buffers"
    # The failed step is not applied: eager skips it too.
    assert loss.item() == pytest.approx(run.eager_step(BATCHES[2], apply=False), rel=1e-5)
    run.both_steps(BATCHES[3])
    run.both_steps(BATCHES[4])
    run.check_same_parameters()


@pytest.mark.parametrize("offload_param, then", [("nvme", "retry"), ("nvme", "skip"), ("cpu", "skip")])
def test_enospc_in_optimizer_state_writes_leaves_the_step_not_applied(tmp_path, monkeypatch, offload_param, then):
    # The step after backward: with overlap_optimizer the writes may already be done by then (see
    # test_offload_errors.py for a disk that fills during backward's early steps).
    run = SideBySide(tmp_path, offload_param=offload_param, overlap_optimizer=False)
    disk = Disk(monkeypatch)
    run.both_steps(BATCHES[0])
    run.both_steps(BATCHES[1])

    pinned = _pinned_in_use()
    loss = run.compiled(*BATCHES[2])
    loss.backward()
    disk.fill(after=4)  # part of the step's writes land, then the disk is full
    with pytest.raises(AioError) as err:
        run.opt.step()
    assert "no space left on device (ENOSPC)" in str(err.value)
    assert "optimizer step was not applied: every NVMe swap file keeps the previous step" in str(err.value)
    disk.free()
    assert _pinned_in_use() == pinned, "the failed step kept pinned staging buffers"
    if then == "retry":
        run.opt.step()  # the same gradients, stepped once
        run.opt.zero_grad()
        assert loss.item() == pytest.approx(run.eager_step(BATCHES[2], apply=True), rel=1e-5)
    else:
        run.opt.zero_grad()  # skip the step: with cpu parameters, their in-memory shards were put back
        assert loss.item() == pytest.approx(run.eager_step(BATCHES[2], apply=False), rel=1e-5)
    run.both_steps(BATCHES[3])
    run.both_steps(BATCHES[4])
    run.check_same_parameters()


def test_enospc_in_parameter_writes_applies_the_step_and_the_next_step_call_writes_them(tmp_path, monkeypatch):
    # Optimizer state in memory, parameters on NVMe: the step updates the masters, then writes the parameters.
    run = SideBySide(tmp_path, offload_param="nvme", offload_optimizer="cpu")
    disk = Disk(monkeypatch)
    run.both_steps(BATCHES[0])

    pinned = _pinned_in_use()
    loss = run.compiled(*BATCHES[1])
    loss.backward()
    disk.fill(after=2)
    with pytest.raises(AioError) as err:
        run.opt.step()
    message = str(err.value)
    assert "was applied to the optimizer state in memory" in message and "call opt.step() again" in message
    assert "no space left on device (ENOSPC)" in message
    disk.free()
    assert _pinned_in_use() == pinned, "the failed step kept pinned staging buffers"
    run.opt.zero_grad()  # no stale ENOSPC from the writes of the failed step
    # The old parameters on disk are never read as if they were the new ones.
    with pytest.raises(AioError, match=r"no good copy: opt.step\(\) updated it in memory but could not write it"):
        run.compiled(*BATCHES[2])
    run.opt.step()  # writes them; no second update
    assert loss.item() == pytest.approx(run.eager_step(BATCHES[1], apply=True), rel=1e-5)
    run.check_same_parameters()
    run.both_steps(BATCHES[2])
    run.both_steps(BATCHES[3])
    run.check_same_parameters()


def test_with_one_copy_a_failed_step_says_the_state_is_lost_and_the_next_step_refuses(tmp_path, monkeypatch):
    run = SideBySide(tmp_path, nvme_copies=1)
    disk = Disk(monkeypatch)
    run.both_steps(BATCHES[0])
    pinned = _pinned_in_use()
    run.compiled(*BATCHES[1]).backward()
    disk.fill(after=4)
    with pytest.raises(AioError) as err:
        run.opt.step()
    message = str(err.value)
    assert "nvme_copies=1" in message and "lost" in message
    assert "keeps the previous step" not in message and "two copies" not in message
    disk.free()
    assert _pinned_in_use() == pinned, "the failed step kept pinned staging buffers"
    with pytest.raises(AioError, match=r"no good copy: its only copy was being overwritten in place \(nvme_copies=1\)"):
        run.opt.step()  # never trains on a mix of the old and the half-written state
