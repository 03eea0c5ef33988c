"""The NVMe optimizer step taken during backward, as each parameter's gradient lands.

Why: with the optimizer state on NVMe a step moves 24 bytes per parameter
(fp32 master and two moments, read and written).  Done after backward, that
I/O waits while the disk idled through forward and backward.  Here, as the
store adds a parameter's gradient (the last block's first), that parameter's
master and moments are read, stepped with the gradient as it stands, and
written back as *held* copies (``AioEngine.write(hold=True)``): every reader
keeps seeing the previous step.  ``opt.step()`` then commits each held step
whose premises still hold:

* no clipping scaled the gradients (``clip_grad_norm_`` found the norm under
  ``max_norm``, or was not called), and no fp16 overflow skipped the step;
* no gradient arrived for the parameter afterwards (accumulation over
  micro-batches, or a second graph that uses it);
* the hyperparameters (lr, betas, eps, weight_decay) and the step count are
  the ones it stepped with;
* every held write completed.

A committed step is bit-equal to the after-backward step: the same kernel on
the same inputs.  Anything else is dropped, and that parameter is stepped
after backward as before, from its gradient (still on disk or in RAM).  So
the result never depends on the guess; only the speed does.

Which arrival to step at: the last one of the step before (a parameter two
graphs use gets two per step; accumulating k micro-batches, k), by
runtime/optim/arrivals.py's rule, which the host-memory early step shares.

No thread: the pipeline moves on at the store's transfer points during
backward (:meth:`EarlyAdam.advance`), which never waits, and while the graph
waits on a transfer (``ParamStore._wait_working``).  It starts reads
while its own pinned pool has room and computes a group once its reads are
done.  ``opt.step()`` finishes what is left (:meth:`EarlyAdam.finish`).  Its
pool is its own quota of the process's pinned memory (``"early_optimizer"``,
drawn from the store's allocator), so the graph's fetches and this pipeline
never wait on each other's buffers.

Scope: parameters whose shard rests on NVMe (``offload_param="nvme"``, stage
3), with ``nvme_copies=2``.  The updated parameter is held too: it is the
master's keys (fp32) or held writes of its own keys.  A shard resting in
memory would need the updated copy kept aside until the verdict; such
parameters step after backward.

Master read once: an fp32 parameter resting on NVMe with its optimizer
(``ParamPlan.params_in_master``) has no file of its own; the graph's fetch
reads its master, and its early step would read the same bytes again a
moment later.  :class:`FetchedMasters` keeps a copy of what the fetch read,
in this pipeline's pool, and the step takes it as the sub-group's master
buffer, reading only the moments (4 of the 12 bytes per parameter saved).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from .arrivals import Arrivals, EarlyStep
from .fetched_masters import FetchedMasters, try_acquire
from .nvme_adam import (STATE_NAMES, SubGroup, stage_param, start_reads, start_writes, step_group, sub_group_plan,
                        take_buffers, wait_all)
from ..pool_sizes import READ_AHEAD, early_step_pool_bytes
from ..pinned import PinnedPool
from ..records import POOL_WAIT_SECONDS, listen_to_gradients

# Sub-groups read ahead per parameter: one computing while the next is read.


@dataclasses.dataclass(eq=False)
class _Job:
    """One parameter's early step: its sub-groups move from pending to reading to writing."""

    record: object
    grad: torch.Tensor | None  # the whole local fp32 gradient, on the CPU, until every group is computed
    grad_owned: bool  # ``grad`` is a copy made for this job (counted as transient CPU memory)
    hyper: tuple  # (lr, beta1, beta2, eps, weight_decay)
    step_count: int
    pending: list  # SubGroup not started
    reading: list = dataclasses.field(default_factory=list)
    writing: list = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)  # every key written held
    param_staging: object = None  # PinnedBuffer: the updated shard in compute dtype (own param keys)
    param_requests: list = dataclasses.field(default_factory=list)
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.error is not None

    @property
    def settled(self) -> bool:
        """Nothing in flight and no buffer held."""
        return not (self.reading or self.writing or self.param_requests) and self.param_staging is None

    @property
    def complete(self) -> bool:
        return self.settled and not self.pending and not self.stopped


def hyperparameters(group: dict) -> tuple:
    """The hyperparameters an early step was taken with (a change before opt.step() voids it)."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))


class EarlyAdam(EarlyStep):
    """Early steps of the parameters of one :class:`~zinf_compiler.runtime.nvme_adam.NvmeAdam`."""

    reuse_fetched_masters = True  # False: every master is read from disk (tests compare the two)

    def __init__(self, nvme_adam, records_and_groups: list[tuple[object, dict]]):
        """``records_and_groups``: each record to step early with the optimizer's live param group of it."""
        self.nvme_adam = nvme_adam
        self.records = [record for record, _ in records_and_groups]
        # uid -> the param group whose hyperparameters it steps with
        self.groups_by_uid = {record.uid: group for record, group in records_and_groups}
        self.jobs: dict[int, _Job] = {}  # uid -> its current early step
        self.dropped: list[_Job] = []  # cancelled jobs still settling their transfers
        self.arrivals = Arrivals()  # which arrival of each gradient to step at (runtime/optim/arrivals.py)
        self.pool: PinnedPool | None = None
        self.fetched_masters = FetchedMasters(nvme_adam.store.comm.tracer)
        self.stats = {"started": 0, "committed": 0, "dropped": 0}
        # Bytes of gradient copies counted as transient CPU memory, per model ledger: id -> [ledger, bytes].
        # Given back when each is used up, or all at once if the optimizer is dropped with steps in flight.
        self._counted: dict[int, list] = {}
        weakref.finalize(self, _uncount, nvme_adam.store, self._counted)
        for record in self.records:
            listen_to_gradients(record, self)  # the store tells of gradients
        nvme_adam.store.add_background_work(self)

    # --- the store's side (arrival, gradient_changed, gradients_dropped: arrivals.EarlyStep's) ---------

    def start(self, record, grad: torch.Tensor, owned: bool, ready=None) -> None:
        """Step ``record`` early with its whole local gradient ``grad`` (fp32, CPU; read, never written).

        ``owned``: ``grad`` is a copy made for this step, counted as transient CPU memory until used.
        ``ready``: the copy still bringing ``grad`` off the device, waited for here (or None).
        """
        if ready is not None:
            ready.synchronize()
        steps = self.nvme_adam.steps.get(record.uid, 0)
        groups = sub_group_plan(record)
        if owned:
            self._count(record.ledger, grad.numel() * 4, f"early step of {record.name}")
        self.jobs[record.uid] = _Job(record, grad, owned, hyperparameters(self.groups_by_uid[record.uid]),
                                     steps + 1, groups)
        self.stats["started"] += 1
        self.advance()

    def fetched_master(self, record, staging, offset: int, reads) -> None:
        """The graph's fetch read ``record``'s fp32 master (``reads``: its (key, element offset, elements) at
        byte ``offset`` of the pinned ``staging``): keep it for the early step, if one may come."""
        if (self.reuse_fetched_masters and not self.arrivals.skip_next and record.uid in self.groups_by_uid
                and record.owns_state and record.params_in_master):
            self.fetched_masters.offer(self._pool(), record, staging, offset, reads)

    def _cancel(self, uid: int) -> None:
        job = self.jobs.pop(uid, None)
        if job is None:
            return
        job.cancelled = True
        self._release_grad(job)
        job.record.swap.drop_held(job.keys)
        self.stats["dropped"] += 1
        self.dropped.append(job)

    # --- the pipeline ------------------------------------------------------------------

    def _pool(self) -> PinnedPool:
        if self.pool is None:
            self.pool = self.nvme_adam.store.pinned_memory.quota(
                "early_optimizer", early_step_pool_bytes([record.plan for record in self.records],
                                                         [record.plan for record in self.nvme_adam.records]))
        return self.pool

    def pool_for_late_step(self) -> PinnedPool:
        """The pool, lent to the optimizer's step after backward (NvmeAdam.step): by then :meth:`commit` has
        settled every job and dropped every kept master, so nothing of this pipeline holds a buffer."""
        pool = self._pool()
        if pool.in_use_bytes:
            raise RuntimeError(f"zinf: the early optimizer step still holds {pool.in_use_bytes:,} bytes of its "
                               "pool after its commit (a bug)")
        return pool

    def advance(self) -> bool:
        """Move every job on as far as it goes without waiting; True while any has transfers in flight (what
        lands next lets it move on again)."""
        self._pass(list(self.jobs.values()))
        self._pass(self.dropped)
        self.dropped = [job for job in self.dropped if not job.settled]
        return any(job.reading or job.writing or job.param_requests
                   for job in list(self.jobs.values()) + self.dropped)

    def _pass(self, jobs: list[_Job]) -> bool:
        """One non-blocking pass over ``jobs`` in order; True when something moved.

        A job starts reads only once every job before it has started all of
        its own, so the jobs hold few buffers at once (see :meth:`_pool`).
        """
        moved, may_read = False, True
        for job in jobs:
            moved |= self._progress(job, may_read)
            may_read = may_read and (not job.pending or job.stopped)
        return moved

    def _progress(self, job: _Job, may_read: bool) -> bool:
        """One non-blocking pass over ``job``; True when something moved."""
        moved = False
        if job.stopped and job.param_staging is not None and not job.param_requests:
            job.param_staging.release()  # stopped before its parameter's write: the staging goes back
            job.param_staging = None
            moved = True
        while job.writing and not job.writing[0].in_flight():
            self._settle(job, job.writing.pop(0))
            moved = True
        if job.param_requests and all(request.done() for request in job.param_requests):
            self._settle_param(job)
            moved = True
        while job.reading and not job.reading[0].in_flight() and self._staging_ready(job):
            self._finish_reads(job)
            moved = True
        while may_read and job.pending and not job.stopped and len(job.reading) < READ_AHEAD:
            if not self._start_reads(job, job.pending[0], wait=False):
                break
            job.reading.append(job.pending.pop(0))
            moved = True
        return moved

    def _staging_ready(self, job: _Job) -> bool:
        """Whether the job can take its next group's update: it needs no staging for its parameter, holds
        one, or gets one now without waiting (a wait here could be for a write only this thread finishes)."""
        record = job.record
        if record.params_in_master or job.param_staging is not None or job.stopped:
            return True
        job.param_staging = self._acquire_now(record.shard_bytes)
        return job.param_staging is not None

    def _acquire_now(self, nbytes: int):
        """A pool buffer without waiting, or None; kept masters make room only where nothing else would."""
        pool = self._pool()
        return self.fetched_masters.making_room(lambda: try_acquire(pool, nbytes), pool, only_when_idle=True)

    def _finish_reads(self, job: _Job) -> None:
        """The oldest reading group: step it (its reads waited for), or give it back if the job stopped."""
        group = job.reading.pop(0)
        if job.stopped:
            self._settle(job, group)
        else:
            self._compute(job, group)

    def _start_reads(self, job: _Job, group: SubGroup, wait: bool) -> bool:
        """nvme_adam's first stage, in the background; False when the pool has no room now (``wait`` False).

        A master the graph's fetch kept is taken instead of read.  Kept copies
        are only a saving: they make room (oldest first) where nothing else
        would (the pool holds nothing but them), and before anything waits.
        """
        fetched = self.fetched_masters.has(group)
        names = STATE_NAMES[1:] if fetched else STATE_NAMES
        pool = self._pool()
        if not self.fetched_masters.making_room(lambda: take_buffers(group, pool, names, 0), pool,
                                                only_when_idle=not wait, but=group):
            if not wait:
                return False  # buffers of steps in flight come back without waiting on this one
            take_buffers(group, pool, names, POOL_WAIT_SECONDS)
        if fetched:
            group.buffers["master"] = self.fetched_masters.take(group)
        try:
            start_reads(group, names, job.step_count == 1, background=True)
        except BaseException as err:  # a read that could not start: the job is void, its buffers settle
            job.error = job.error or err
        return True

    def _compute(self, job: _Job, group: SubGroup) -> None:
        record = job.record
        try:
            for request in group.requests:
                request.wait()
        except BaseException as err:
            job.error = job.error or err
            self._settle(job, group)
            return
        lr, beta1, beta2, eps, weight_decay = job.hyper
        master = step_group(self.nvme_adam.decoupled, group, job.grad[group.start : group.stop], job.step_count,
                            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        if group.stop == record.local_numel:
            self._release_grad(job)  # the last group: the gradient is used up
        try:
            start_writes(group, job.keys, hold=True, background=True)
            if not record.params_in_master:
                self._stage_param(job, group, master)
        except BaseException as err:
            job.error = job.error or err
        job.writing.append(group)

    def _release_grad(self, job: _Job) -> None:
        if job.grad is not None and job.grad_owned:
            self._count(job.record.ledger, -job.grad.numel() * 4, "")
        job.grad = None

    def _count(self, ledger, delta: int, what: str) -> None:
        self.nvme_adam.store.count_transient("cpu", delta, what, ledger)
        entry = self._counted.setdefault(id(ledger), [ledger, 0])
        entry[1] += delta

    def _stage_param(self, job: _Job, group: SubGroup, master: torch.Tensor) -> None:
        """The updated slice into the shard's staging (compute dtype); the whole shard written held at its end."""
        record = job.record
        if job.param_staging is None:  # finish(): nothing else holds the pool now (see _staging_ready)
            self.fetched_masters.drop_all()  # nothing may wait on a buffer only a later step would use
            job.param_staging = self._pool().acquire(record.shard_bytes, timeout=POOL_WAIT_SECONDS)
        if stage_param(job.param_staging, group, master):
            job.keys.extend(key for key, _, _ in record.swap_layout())
            job.param_requests = self.nvme_adam.store.write_param(record, job.param_staging, hold=True)

    def _settle(self, job: _Job, group: SubGroup) -> None:
        """Finish ``group``'s transfers (errors go to the job) and give its buffers back."""
        _wait_for_job(job, group.requests)
        group.requests = []
        for buffer in group.buffers.values():
            buffer.release()
        group.buffers = {}

    def _give_back_reads(self, job: _Job) -> None:
        """Undo ``job``'s newest reads: wait for them, give their buffers back, and read the group again later."""
        group = job.reading.pop()
        self._settle(job, group)
        job.pending.insert(0, group)

    def _settle_param(self, job: _Job) -> None:
        _wait_for_job(job, job.param_requests)
        job.param_requests = []
        if job.param_staging is not None:
            job.param_staging.release()
            job.param_staging = None

    def finish(self) -> None:
        """Run every job to its end, waiting where needed (``opt.step()``, with the graph done)."""
        jobs = list(self.jobs.values()) + self.dropped
        while not all(job.settled and (job.stopped or not job.pending) for job in jobs):
            if self._pass(jobs):
                continue
            # Nothing moves without waiting.  Writes first: settling them only gives buffers back.
            writer = next((job for job in jobs if job.writing or job.param_requests), None)
            if writer is not None:
                if writer.writing:
                    self._settle(writer, writer.writing.pop(0))
                else:
                    self._settle_param(writer)
                continue
            reader = next((job for job in jobs if job.reading), None)
            if reader is not None:
                # Its update may need a staging for its parameter, which only a buffer given back here can
                # make room for (several jobs start at once where a bucket's gradients land together): give
                # back the newest reads held, another job's or its own later ones, rather than wait.
                holder = next((job for job in reversed(jobs)
                               if job.reading and (job is not reader or len(job.reading) > 1)), None)
                if self._staging_ready(reader) or holder is None:
                    self._finish_reads(reader)  # (holder None: its one group fills the pool, which is too small)
                else:
                    self._give_back_reads(holder)
                continue
            # Nothing in flight: the pool holds at most the first unfinished job's staging.
            job = next((job for job in jobs if job.pending and not job.stopped), None)
            if job is None:
                raise RuntimeError("zinf: early optimizer steps stuck with nothing in flight (a bug): "
                                   + ", ".join(f"{j.record.name} pending={len(j.pending)} stopped={j.stopped} "
                                               f"staging={j.param_staging is not None}" for j in jobs))
            self._start_reads(job, job.pending[0], wait=True)
            job.reading.append(job.pending.pop(0))
        self.dropped = []

    # --- the verdict -----------------------------------------------------------------

    def commit(self, clipped: bool) -> set[int]:
        """At ``opt.step()``: finish, commit every early step that counts, and drop the rest.

        Commits go into the swap transaction the caller holds open.  Returns
        the uids committed (their step counts advanced); the caller steps the
        others after backward as before.  ``clipped``: clipping scaled the
        gradients after the early steps read them (none counts).
        """
        self.finish()
        self.fetched_masters.drop_all()  # the masters change now; a fetch of the next step reads them anew
        committed = set()
        for uid, job in self.jobs.items():
            self._release_grad(job)  # a job that stopped half way may still hold it
            record = job.record
            current = self.groups_by_uid.get(uid)
            counts = (not clipped and job.complete and record.gradient.multiplier == 1.0 and current is not None
                      and hyperparameters(current) == job.hyper
                      and self.nvme_adam.steps.get(uid, 0) + 1 == job.step_count
                      and record.swap.holds(job.keys))
            if counts:
                record.swap.commit_held(job.keys)
                self.nvme_adam.steps[uid] = job.step_count
                committed.add(uid)
            else:
                record.swap.drop_held(job.keys)
        self.stats["committed"] += len(committed)
        self.stats["dropped"] += len(self.jobs) - len(committed)
        self.jobs = {}
        self.arrivals.stepped(clipped)
        return committed


def _uncount(store, counted: dict[int, list]) -> None:
    """An EarlyAdam was dropped: stop counting the gradient copies its unfinished steps held."""
    for ledger, nbytes in counted.values():
        if nbytes:
            store.count_transient("cpu", -nbytes, "", ledger)
    counted.clear()


def _wait_for_job(job: _Job, requests: list) -> None:
    """Wait for every request; the first failure becomes the job's (it is then dropped at the verdict)."""
    try:
        wait_all(requests, raise_errors=True)
    except BaseException as err:  # AioError; anything else voids the early step just the same
        job.error = job.error or err
