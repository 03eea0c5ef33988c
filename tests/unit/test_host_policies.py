"""Two host-side policies of a CPU device (2026-11-25): where a world-1 gather copies, and when a step trims.

* ``CopyEngine.copy(..., busy_cores_inline=True)`` copies at once on the
  caller's thread when the compute's threads already occupy every core, and
  on the worker thread otherwise (copies next to NVMe reads always take the
  worker).
* ``runtime/optim/step.host_memory_bounded``: the optimizer step gives freed host memory
  back to the OS where host memory is a staging area beside an accelerator (cpu and
  NVMe tiers), and for an NVMe tier on a CPU device under glibc's own thresholds (a
  host_memory budget); not for a model trained on the CPU otherwise, whose next step
  reuses the pages (``runtime/host_memory.keep_freed_pages`` keeps them mapped for it).
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


@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("records, bounded_kept, bounded_default", [
    ([_record("device", "device")], False, False),
    ([_record("cpu", "cpu")], False, False),  # a CPU device: the cpu tier is the compute's own memory
    ([_record("cpu", "cpu"), _record("device", "device")], False, False),
    ([_record("nvme", "cpu")], False, True),  # a CPU device: trimmed only where the heap keeps glibc's defaults
    ([_record("cpu", "nvme")], False, True),
    ([_record("device", "device"), _record("nvme", "nvme")], False, True),  # one NVMe tier is enough
    ([_record("nvme", "nvme", "cuda")], True, True),
    ([_record("cpu", "cpu", "cuda")], True, True),  # host memory beside an accelerator's
    ([_record("device", "cpu", "cuda")], True, True),
    ([_record("device", "device", "cuda")], False, False),
])
def test_the_step_trims_host_memory_only_where_it_is_bounded(monkeypatch, kept, records, bounded_kept,
                                                             bounded_default):
    monkeypatch.setattr("zinf_compiler.runtime.optim.step.pages_kept", lambda: kept)
    assert host_memory_bounded(records) is (bounded_kept if kept else bounded_default)


# Both scripts below end by timing eight buckets with this: each one's minor faults.
_BUCKET_FAULTS = """
import resource
def faults_of_a_fresh_bucket():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bucket = torch.empty(64 * 1024**2 // 4)  # a gathered bucket of the default bucket_bytes
    bucket.fill_(1.0)
    del bucket
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""

_REUSE_SCRIPT = """
import sys, torch
from zinf_compiler.runtime import host_memory
kept = host_memory.keep_freed_pages()
""" + _BUCKET_FAULTS + """
print(kept, *[faults_of_a_fresh_bucket() for _ in range(8)])  # eight steps' buckets; the first maps its pages
"""


def _without_malloc_settings() -> dict:
    """This process's environment less glibc's malloc settings (which would make zinf leave the heap alone)."""
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}


def _buckets_faults(env_extra: dict) -> tuple[bool, list[int]]:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _REUSE_SCRIPT], env={**_without_malloc_settings(), **env_extra},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", [int(faults) for faults in out[1:]]


_BUCKET_PAGES = 64 * 1024**2 // 4096


@pytest.mark.skipif(__import__("zinf_compiler.runtime.host_memory", fromlist=["_"])._mallopt is None,
                    reason="not glibc: no mallopt, and the heap's thresholds are left as they are")
def test_kept_heap_pages_serve_the_next_steps_buckets_without_faults():
    """A 64 MiB bucket allocated, touched and freed eight times (a step's gathered bucket, eight steps): glibc's
    default maps each one afresh (a fault per page, 16k), the kept heap serves them from pages it holds; the
    user's own malloc settings leave glibc as it is.

    The kept heap may grow once more after the first bucket: posix_memalign asks for more than the freed chunk
    holds, and when a small allocation lands between that chunk and the heap's top (on busy cores, 1 run in 3
    on 2026-12-03) the second bucket takes new pages.  The two freed chunks then coalesce, and from there on
    (the last four) no bucket faults."""
    kept, faults = _buckets_faults({})
    assert kept, faults
    assert sum(faults[1:]) < _BUCKET_PAGES + 1000, faults
    assert sum(faults[4:]) < 1000, faults
    kept, faults = _buckets_faults({"MALLOC_ARENA_MAX": "2", "MALLOC_TOP_PAD_": "0"})
    assert not kept, faults
    assert all(fault_count > _BUCKET_PAGES // 2 for fault_count in faults[1:]), faults


_ADOPTION_SCRIPT = """
import json, sys, torch
import zinf_compiler
from zinf_compiler.runtime import host_memory
kept_after_each = []
for options in json.loads(sys.argv[1]):  # the models, built and stepped in turn in this one process
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compiler.optim.AdamW(model.parameters(), lr=1e-3)
    compiled(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    kept_after_each.append(host_memory.pages_kept())
""" + _BUCKET_FAULTS + """
print(json.dumps({"kept": kept_after_each, "faults": [faults_of_a_fresh_bucket() for _ in range(8)]}))
"""


@pytest.mark.skipif(__import__("zinf_compiler.runtime.host_memory", fromlist=["_"])._mallopt is None,
                    reason="not glibc: no mallopt, and the heap's thresholds are left as they are")
@pytest.mark.parametrize("budgets, kept_after_each", [
    ([False], [True]),
    ([True], [False]),
    ([False, True], [True, False]),  # the budget wins over the model before it: its peak is a bound
    ([True, False], [False, False]),  # and over the models after it
])
def test_a_cpu_model_keeps_the_heaps_pages_unless_a_host_memory_budget_bounds_the_process(tmp_path, budgets,
                                                                                          kept_after_each):
    """A real NVMe-tier compile and step on the CPU keeps the heap's pages; a model with a host_memory budget, in
    either order beside an unbudgeted one, leaves the process with glibc's thresholds: a 64 MiB bucket then
    takes fresh pages each time, as glibc's default does."""
    import json
    import subprocess
    import sys
    models = []
    for index, budget in enumerate(budgets):
        (tmp_path / f"model{index}").mkdir()
        options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                   "nvme_path": str(tmp_path / f"model{index}")}
        if budget:
            options["host_memory"] = "8GiB"
        models.append(options)
    out = subprocess.run([sys.executable, "-c", _ADOPTION_SCRIPT, json.dumps(models)], env=_without_malloc_settings(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["kept"] == kept_after_each, figures
    if kept_after_each[-1]:
        assert sum(figures["faults"][4:]) < 1000, figures
    else:
        assert all(fault_count > _BUCKET_PAGES // 2 for fault_count in figures["faults"][1:]), figures
