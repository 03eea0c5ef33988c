"""In-process unit tests of the optimizer step taken during backward (runtime/optim/early_adam.py, issue 26).

Two stores of their own, fed the same gradients through the store's reduce
ops: one steps after backward only (NvmeAdam.step), the other early, as each
gradient lands, committing at the step.  The two must hold bit-equal masters,
moments and parameters after every step, whatever voids an early step
(accumulation, clipping, a changed learning rate, zero_grad).  Sub-groups are
made small (1024 elements) so that each parameter streams in several.
"""

from __future__ import annotations

import functools
import time
import types

import pytest
import torch

from adopting import adopt_in

from zinf_compiler.runtime import param_plan, swap_layout
from zinf_compiler.runtime.optim.early_adam import EarlyAdam
from zinf_compiler.runtime.optim.nvme_adam import NvmeAdam
from zinf_compiler.runtime.records import POOL_WAIT_SECONDS
from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.store import ParamStore

GROUP_NUMEL = 1024
SHAPES = {"a": (5, 500), "b": (3, 7)}  # 2,500 elements: three sub-groups; 21: one
# One block's worth for a bucket: many small parameters (biases, norms) and a few sub-grouped matrices, whose
# simultaneous early steps fill their pool with one staging each (the fp16 GPT of test_mixed_precision did).
BUCKET_SHAPES = {"w": (4, 64), **{f"s{i}": (64,) for i in range(20)}, **{f"m{i}": (64, 64) for i in range(4)}}


@pytest.fixture(autouse=True)
def small_sub_groups(monkeypatch):
    small = functools.partial(swap_layout.sub_groups, group_numel=GROUP_NUMEL)
    monkeypatch.setattr(param_plan, "sub_groups", small)  # the one place that cuts sub-groups


class Side:
    """One store with its parameters on NVMe at stage 3 and an NvmeAdam over them, early or not."""

    def __init__(self, folder, early: bool, param_dtype: str = "fp32", grads_in_ram: bool = False,
                 shapes: dict = SHAPES):
        self.store = ParamStore(RUNTIME.comm)
        folder.mkdir()
        self.store.configure_offload(str(folder), 32 << 20, aio_block_size=1 << 20, aio_queue_depth=4,
                                     aio_threads=2)
        torch.manual_seed(0)
        self.params = {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in shapes.items()}
        self.records = {}
        for name, param in self.params.items():
            record = adopt_in(self.store, param, name, stage=3, partition="allgather", param_dtype=param_dtype,
                                      param_tier="nvme", opt_tier="nvme", step_in_backward=early,
                                      grad_ram_bytes=1 << 30 if grads_in_ram else 0)
            self.store.release_full_storage([record])
            self.records[name] = record
        self.group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
        self.adam = NvmeAdam(self.store, decoupled_weight_decay=True, records=list(self.records.values()))
        if early:
            self.adam.early = EarlyAdam(self.adam, [(record, self.group) for record in self.records.values()])

    def backward(self, grads: dict[str, torch.Tensor], bucketed: bool = False) -> None:
        """The backward graph's reduce ops, last parameter first; ``bucketed``: all in one unit (one reduce),
        so that every parameter's early step starts at once."""
        names = list(reversed(list(grads)))
        for run in ([names] if bucketed else [[name] for name in names]):
            unit = self.store.unit([self.records[name] for name in run])
            self.store.reduce_grad_start(unit, [grads[name] for name in run])
            self.store.reduce_grad_wait(unit)

    def step(self, clipped: float | None = None) -> set:
        """``opt.step()``: (clipping), commit what counts, step the rest after backward."""
        records = list(self.records.values())
        if clipped is not None:
            for record in records:
                record.gradient.scale(clipped)
        engine = records[0].swap
        with engine.transaction():
            early = self.adam.early.commit(clipped is not None) if self.adam.early is not None else set()
            late = [types.SimpleNamespace(record=r) for r in records if r.uid not in early]
            self.adam.step(late, [self.group] * len(late))
        return early

    def zero_grad(self) -> None:
        self.store.drop_grads(self.records.values())

    def state(self) -> dict[str, torch.Tensor]:
        """Every record's master, moments and parameter value as they read now."""
        out = {}
        for name, record in self.records.items():
            stepped = self.adam.steps.get(record.uid, 0) > 0  # the moments exist from the first step on
            for state in ("master", "exp_avg", "exp_avg_sq") if stepped else ("master",):
                out[f"{name}.{state}"] = torch.cat([
                    self.store.read_swap(record.swap, key, torch.float32, stop - start, torch.device("cpu"))
                    for key, start, stop in record.plan.state_swap(state)])
            out[f"{name}.param"] = self.store.full_param(record)
        return out

    def close(self) -> None:
        for engine in self.store.engines():
            engine.close()


@pytest.fixture
def sides(tmp_path, request):
    made = []

    def make(**kwargs):
        late = Side(tmp_path / f"late{len(made)}", early=False, **kwargs)
        early = Side(tmp_path / f"early{len(made)}", early=True, **kwargs)
        made.extend([late, early])
        return late, early

    yield make
    for side in made:
        side.close()


def _grads(seed: int, shapes: dict = SHAPES) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def _assert_bit_equal(late: Side, early: Side) -> None:
    expected, actual = late.state(), early.state()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} differs"


@pytest.mark.parametrize("param_dtype, grads_in_ram", [("fp32", False), ("fp32", True), ("bf16", False)])
def test_steps_taken_in_backward_equal_the_steps_after_it_bit_for_bit(sides, param_dtype, grads_in_ram):
    late, early = sides(param_dtype=param_dtype, grads_in_ram=grads_in_ram)
    for step in range(3):
        grads = _grads(step)
        for side in (late, early):
            side.backward(grads)
        before = early.state()
        early.adam.early.finish()
        # Done but not committed: every reader still sees the previous step.
        assert all(torch.equal(before[key], value) for key, value in early.state().items())
        late.step()
        assert early.step() == {r.uid for r in early.records.values()}, "every early step counts"
        _assert_bit_equal(late, early)
        for side in (late, early):
            side.zero_grad()
    assert early.adam.early.stats == {"started": 6, "committed": 6, "dropped": 0}
    assert early.store.pinned.in_use_bytes == 0 and early.adam.early.pool.in_use_bytes == 0
    assert early.store.transient["cpu"] == 0, "the gradient copies early steps hold are counted until used"


@pytest.mark.timeout(120)
def test_early_steps_started_together_by_one_bucket_finish_without_waiting_on_their_own_pool(sides):
    """A bucket's gradients land in one reduce, so every parameter's early step starts at once, and their reads
    can fill the pool before any update has the staging its bf16 parameter needs.  ``finish`` then gives back
    the newest reads instead of waiting for room that only it could make (which took POOL_WAIT_SECONDS per
    parameter, then dropped the step)."""
    late, early = sides(param_dtype="bf16", shapes=BUCKET_SHAPES)
    for step in range(2):
        grads = _grads(step, BUCKET_SHAPES)
        late.backward(grads)
        early.backward(grads, bucketed=True)
        started = time.perf_counter()
        late.step()
        assert early.step() == {r.uid for r in early.records.values()}, "every early step counts"
        assert time.perf_counter() - started < POOL_WAIT_SECONDS / 2, "a step waited on the early pool"
        _assert_bit_equal(late, early)
        for side in (late, early):
            side.zero_grad()
    count = 2 * len(BUCKET_SHAPES)
    assert early.adam.early.stats == {"started": count, "committed": count, "dropped": 0}
    assert early.adam.early.pool.in_use_bytes == 0


def test_a_gradient_arriving_after_the_early_step_voids_it_and_the_next_step_waits_for_the_last(sides):
    late, early = sides()
    for step in range(3):  # two micro-batches per step
        for micro in range(2):
            grads = _grads(10 * step + micro)
            for side in (late, early):
                side.backward(grads)
        late.step()
        committed = early.step()
        # The first step guessed one arrival (voided by the second); later steps wait for the second.
        assert committed == (set() if step == 0 else {r.uid for r in early.records.values()})
        _assert_bit_equal(late, early)
        for side in (late, early):
            side.zero_grad()
    assert early.adam.early.stats["dropped"] == 2 and early.adam.early.stats["committed"] == 4


def test_clipping_voids_the_early_steps_and_the_next_step_is_not_stepped_early(sides):
    late, early = sides(grads_in_ram=True)
    for step, clip in enumerate([0.5, None, None]):
        grads = _grads(step)
        for side in (late, early):
            side.backward(grads)
        late.step(clip)
        committed = early.step(clip)
        assert committed == (set() if step < 2 else {r.uid for r in early.records.values()})
        _assert_bit_equal(late, early)
        for side in (late, early):
            side.zero_grad()
    # Step 1 stepped nothing early (step 0 clipped); step 2 did.
    assert early.adam.early.stats["started"] == 4 and early.adam.early.stats["committed"] == 2


def test_a_learning_rate_changed_before_the_step_voids_the_early_steps(sides):
    late, early = sides()
    grads = _grads(0)
    for side in (late, early):
        side.backward(grads)
        side.group["lr"] = 5e-3  # a scheduler stepped between backward and opt.step()
    late.step()
    assert early.step() == set()
    _assert_bit_equal(late, early)


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("when", ["done", "half way"])
def test_zero_grad_before_the_step_drops_the_early_steps_and_their_held_copies(sides, param_dtype, when):
    late, early = sides(param_dtype=param_dtype)
    before = early.state()
    first_of_a = early.records["a"].uid
    if when == "half way":
        # Parameter "a" (three sub-groups) may start reading only its first sub-group until zero_grad:
        # the step is caught half way whatever the machine's speed.  (Polling for the moment instead
        # missed it on a loaded machine, stop 50's CI: the advances during backward had stepped all three.)
        engine, start_reads = early.adam.early, early.adam.early._start_reads

        def first_group_only(job, group, wait):
            if job.record.uid == first_of_a and group.start > 0 and not wait:
                return False  # "no room now": the job tries again at its next advance
            return start_reads(job, group, wait)

        engine._start_reads = first_group_only
    early.backward(_grads(0))
    if when == "done":
        early.adam.early.finish()
    else:  # "a" has stepped one sub-group, not all: its state and staging are held
        job = early.adam.early.jobs[first_of_a]
        deadline = time.monotonic() + 30
        while not (job.writing or job.keys) and time.monotonic() < deadline:
            time.sleep(0.001)
            early.adam.early.advance()
        assert job.keys and job.pending, "the first sub-group of a stepped, the others not started"
    early.zero_grad()
    assert early.adam.early.jobs == {} and early.adam.early.stats["dropped"] == 2
    early.adam.early.finish()  # the dropped jobs' transfers settle
    record = early.records["a"]
    assert not record.swap.holds([record.plan.state_key("master", 0)])
    assert early.step() == set()  # nothing to step: no gradient
    assert all(torch.equal(before[key], value) for key, value in early.state().items())
    assert early.adam.early.pool.in_use_bytes == 0 and early.store.transient["cpu"] == 0


@pytest.mark.parametrize("step_in_backward, copies, expected", [
    ("auto", 2, True),  # on a CPU device too since 2026-11-25 (gradients in RAM by default)
    (False, 2, False),
    (True, 2, True),
    ("auto", 1, False),  # a held copy needs the second slot of nvme_copies=2
])
def test_overlap_optimizer_auto_steps_in_backward_on_a_cpu_device(tmp_path, step_in_backward, copies, expected):
    store = ParamStore(RUNTIME.comm)
    store.configure_offload(str(tmp_path), 16 << 20, aio_block_size=1 << 20, aio_queue_depth=4, aio_threads=1,
                            nvme_copies=copies)
    param = torch.nn.Parameter(torch.randn(4, 8))
    record = adopt_in(store, param, "w", stage=3, partition="allgather", param_dtype="fp32", param_tier="nvme",
                         opt_tier="nvme", step_in_backward=step_in_backward)
    assert record.device.type == "cpu" and record.step_in_backward is expected
    for engine in store.engines():
        engine.close()
    if store.pinned is not None:
        store.pinned.close()


class _NeverDone:
    """A transfer handle the graph waits on (a gloo collective, an NVMe read) that does not finish while
    looked at: it records each wait's timeout."""

    def __init__(self, done_after: int | None = None):
        self.timeouts: list[float] = []
        self.done_after = done_after  # polls before it reports done (None: never)

    def wait_done(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        time.sleep(timeout)
        return self.done_after is not None and len(self.timeouts) >= self.done_after


def test_a_wait_on_a_transfer_carries_the_early_steps_on_and_ends_when_they_rest(sides):
    """While the graph waits (store._wait_working), the early steps whose reads land are stepped and
    written, not left for the next transfer point: a wait longer than their I/O leaves none in flight.
    The result is bit-equal to the step after backward all the same."""
    from zinf_compiler.runtime.records import BACKGROUND_POLL_SECONDS

    late, early = sides()
    for step in range(2):
        grads = _grads(step)
        for side in (late, early):
            side.backward(grads)
        jobs = list(early.adam.early.jobs.values())
        assert jobs and not all(job.complete for job in jobs), "the test needs early steps still in flight"
        handle = _NeverDone()
        early.store._wait_working(handle)  # returns once the early steps have nothing in flight
        assert handle.timeouts and set(handle.timeouts) == {BACKGROUND_POLL_SECONDS}
        assert all(job.complete for job in jobs), [(job.record.name, len(job.pending)) for job in jobs]
        idle = _NeverDone()
        early.store._wait_working(idle)  # nothing in flight: the wait is the caller's own at once
        assert idle.timeouts == []
        late.step()
        assert early.step() == {r.uid for r in early.records.values()}
        _assert_bit_equal(late, early)
        for side in (late, early):
            side.zero_grad()


def test_a_transfer_that_finishes_ends_the_wait_with_early_steps_still_in_flight(sides):
    late, early = sides()
    early.backward(_grads(0))
    assert any(job.reading or job.writing for job in early.adam.early.jobs.values())
    handle = _NeverDone(done_after=1)
    early.store._wait_working(handle)
    assert len(handle.timeouts) == 1  # the graph goes on as soon as its own transfer is done
    late.backward(_grads(0))
    late.step()
    early.step()  # opt.step() finishes what is in flight
    _assert_bit_equal(late, early)


def test_background_work_that_never_rests_gives_the_wait_back_after_the_pool_wait(monkeypatch):
    """A transfer of the background work that never ends (a hung disk) must not hide the graph's own
    transfer's timeout: the filling stops after POOL_WAIT_SECONDS and the caller's wait follows."""
    from zinf_compiler.runtime import store_background

    class Stuck:
        def advance(self) -> bool:
            return True  # always something in flight

    monkeypatch.setattr(store_background, "POOL_WAIT_SECONDS", 0.05)
    store = ParamStore(RUNTIME.comm)
    stuck = Stuck()
    store.add_background_work(stuck)
    handle = _NeverDone()
    started = time.monotonic()
    store._wait_working(handle)
    assert handle.timeouts and time.monotonic() - started < 5
