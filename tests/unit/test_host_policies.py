"""Two host-side policies of a CPU device (2026-11-25): where a world-1 gather copies, and when a step trims.

* ``CopyEngine.copy(..., busy_cores_inline=True)`` copies at once on the
  caller's thread when the compute's threads already occupy every core, and
  on the worker thread otherwise (copies next to NVMe reads always take the
  worker).
* ``runtime/optim/step.host_memory_bounded``: the optimizer step gives freed host memory
  back to the OS where host memory is bounded (NVMe tiers, cpu tiers beside an
  accelerator), not for a model trained on the CPU from memory.
"""

from __future__ import annotations

import types

import pytest
import torch

from zinf_compiler.runtime.optim.step import host_memory_bounded
from zinf_compiler.runtime.copy_engine import INLINE_COPY_BYTES, CopyEngine
from zinf_compiler.runtime.trace import Tracer


@pytest.mark.parametrize("threads, ranks, cores, busy", [
    (2, 1, 2, True), (1, 2, 2, True), (1, 1, 2, False), (4, 1, 8, False), (2, 4, 8, True), (16, 1, 8, True)])
def test_cores_are_busy_when_the_ranks_threads_cover_them(monkeypatch, threads, ranks, cores, busy):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert CopyEngine.cores_busy() is busy


@pytest.mark.parametrize("busy", [True, False])
def test_an_inline_copy_is_done_on_return_only_when_the_cores_are_busy(monkeypatch, busy):
    monkeypatch.setattr(CopyEngine, "cores_busy", staticmethod(lambda: busy))
    engine = CopyEngine(Tracer())
    source = torch.randn(INLINE_COPY_BYTES // 4 + 1)  # more than a small copy, which runs inline anyway
    target = torch.empty_like(source)
    work = engine.copy(target, source, "gg", "gather (local copy)", busy_cores_inline=True)
    if busy:
        assert work.done() and torch.equal(target, source)
        assert engine._executor is None  # no worker thread was started
    else:
        work.wait()
        assert torch.equal(target, source)
        assert engine._executor is not None  # it ran on the worker


def test_a_small_copy_that_may_run_inline_does_so_on_idle_cores(monkeypatch):
    """Handing a copy of a few KiB to the worker costs more than making it (copy_engine.INLINE_COPY_BYTES)."""
    monkeypatch.setattr(CopyEngine, "cores_busy", staticmethod(lambda: False))
    engine = CopyEngine(Tracer())
    sources = [torch.randn(1000), torch.randn(10)]
    targets = [torch.empty(1000), torch.empty(10)]
    work = engine.copy(targets, sources, "gg", "gather (local copy)", busy_cores_inline=True)
    assert work.done() and engine._executor is None
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_a_copy_that_may_not_run_inline_takes_the_worker_even_with_busy_cores(monkeypatch):
    monkeypatch.setattr(CopyEngine, "cores_busy", staticmethod(lambda: True))
    engine = CopyEngine(Tracer())
    source = torch.arange(1000.0)
    target = torch.zeros(1000)
    work = engine.copy(target, source, "cg", "cpu to device")
    work.wait()
    assert torch.equal(target, source) and engine._executor is not None


def test_a_copy_answers_wait_done_without_raising_as_the_store_waits_on_it():
    """At world size 1 a gather or reduce is a copy (Comm), and the store fills its wait with the early
    optimizer steps (store_background._wait_working): ``wait_done`` reports the copy's end and leaves its
    error to ``synchronize()``."""
    import concurrent.futures

    from zinf_compiler.runtime.copy_engine import CopyWork

    running = concurrent.futures.Future()
    work = CopyWork(Tracer(), running)
    assert work.wait_done(0.001) is False
    running.set_exception(RuntimeError("copy failed"))
    assert work.wait_done(0.001) is True  # done, and the error waits for synchronize()
    with pytest.raises(RuntimeError, match="copy failed"):
        work.synchronize()
    assert CopyWork(Tracer()).wait_done(0.0) is True  # copied inline: nothing in flight


def _record(param_tier: str, opt_tier: str, device: str = "cpu"):
    return types.SimpleNamespace(param_tier=param_tier, opt_tier=opt_tier, device=torch.device(device))


@pytest.mark.parametrize("records, bounded", [
    ([_record("device", "device")], False),
    ([_record("cpu", "cpu")], False),  # a CPU device: the cpu tier is the compute's own memory
    ([_record("cpu", "cpu"), _record("device", "device")], False),
    ([_record("nvme", "cpu")], True),
    ([_record("cpu", "nvme")], True),
    ([_record("device", "device"), _record("nvme", "nvme")], True),  # one NVMe tier is enough
    ([_record("cpu", "cpu", "cuda")], True),  # host memory beside an accelerator's
    ([_record("device", "cpu", "cuda")], True),
    ([_record("device", "device", "cuda")], False),
])
def test_the_step_trims_host_memory_only_where_it_is_bounded(records, bounded):
    assert host_memory_bounded(records) is bounded
