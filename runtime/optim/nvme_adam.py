"""Adam / AdamW stepped where the state rests: on NVMe, streamed in sub-groups.

Each nvme-tier parameter slice keeps its fp32 master and its two moments in
swap files, split into sub-groups of at most ``SUB_GROUP_NUMEL`` elements
(keys ``master.<uid>.<i>``, ``exp_avg.<uid>.<i>``, ``exp_avg_sq.<uid>.<i>``);
the reduced gradient waits in ``grad.<uid>.<i>`` (written by the store
during backward), or in CPU memory for the parameters the option
``nvme_grad_ram_bytes`` covers (``record.grad_in_ram``: no gradient I/O).
A step walks the sub-groups in order: the reads of group i+1 are in flight
while group i is updated (torch's fused CPU Adam kernel) and the writes of
group i-1 drain, so disk and compute overlap.  Updated low-precision
parameters go back to the parameter tier through the store; an fp32 nvme
parameter has no copy of its own to update (``record.params_in_master``: its
reads go to the master's keys).
"""

from __future__ import annotations

import dataclasses

import torch

from ..aio import AioError
from ..pool_sizes import optimizer_pool_bytes
from ..swap_layout import STATE_NAMES, SUB_GROUP_NUMEL  # noqa: F401  (SUB_GROUP_NUMEL: the docstring's)


def write_initial_master(store, record, local_fp32: torch.Tensor) -> None:
    """At adoption: the fp32 master slice to its swap files, group by group."""
    for key, start, stop in record.plan.state_swap("master"):
        store.write_swap(record.swap, key, local_fp32[start:stop])


def adam_kernel(decoupled: bool, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step_count: int, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """One Adam (AdamW if ``decoupled``) update of a sub-group, in place: torch's fused CPU kernel."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel([master], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step_count))], lr=float(lr),
           beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


@dataclasses.dataclass(eq=False)
class SubGroup:
    """One sub-group of a parameter's state being stepped: its pinned buffers and transfers in flight."""

    record: object
    index: int
    start: int
    stop: int
    buffers: dict = dataclasses.field(default_factory=dict)  # name -> PinnedBuffer
    requests: list = dataclasses.field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements in the sub-group."""
        return self.stop - self.start

    def in_flight(self) -> bool:
        """Whether any of its reads or writes is still running."""
        return not all(request.done() for request in self.requests)


# The stages of a sub-group's step, shared by the step after backward (NvmeAdam.step) and the one
# during backward (runtime/optim/early_adam.py): read its state, step it, write it, stage the parameter.


def sub_group_plan(record) -> list[SubGroup]:
    """The sub-groups of ``record``'s state, in order."""
    return [SubGroup(record, index, start, stop) for index, (start, stop) in enumerate(record.plan.state_groups)]


def take_buffers(group: SubGroup, pool, names, timeout: float) -> bool:
    """Take a pinned buffer of ``pool`` for each state in ``names``.

    Returns False, holding nothing, when ``timeout`` is 0 and the pool has
    no room now; a longer wait that times out raises.
    """
    for name in names:
        try:
            group.buffers[name] = pool.acquire(group.numel * 4, timeout=timeout)
        except TimeoutError:
            if timeout:
                raise
            for buffer in group.buffers.values():
                buffer.release()
            group.buffers = {}
            return False
    return True


def start_reads(group: SubGroup, names, first_step: bool, background: bool = False) -> None:
    """Start reading each state in ``names`` from its swap key into the group's buffers (the moments are
    zeros instead at a parameter's first step)."""
    for name in names:
        if name in ("exp_avg", "exp_avg_sq") and first_step:
            group.buffers[name].tensor(torch.float32, group.numel).zero_()
        else:
            key = group.record.plan.state_key(name, group.index)
            group.requests.append(group.record.swap.read(key, group.buffers[name], group.numel * 4,
                                                         background=background))


def step_group(decoupled: bool, group: SubGroup, grad: torch.Tensor, step_count: int, *, lr, beta1, beta2, eps,
               weight_decay) -> torch.Tensor:
    """Step a sub-group whose reads are done, in its buffers; returns its updated master."""
    master, exp_avg, exp_avg_sq = (group.buffers[name].tensor(torch.float32, group.numel) for name in STATE_NAMES)
    adam_kernel(decoupled, master, grad, exp_avg, exp_avg_sq, step_count, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay)
    group.requests = []  # the reads are done; from here the group's writes
    return master


def start_writes(group: SubGroup, keys: list | None = None, hold: bool = False, background: bool = False) -> None:
    """Start writing a stepped sub-group's state to its swap keys (each key added to ``keys`` first)."""
    record = group.record
    for name in STATE_NAMES:
        key = record.plan.state_key(name, group.index)
        if keys is not None:
            keys.append(key)
        group.requests.append(record.swap.write(key, group.buffers[name], group.numel * 4, hold=hold,
                                                background=background))


def stage_param(staging, group: SubGroup, master: torch.Tensor) -> bool:
    """Copy a stepped sub-group's master into ``staging`` (the whole shard in compute dtype, a PinnedBuffer);
    whether the shard is now complete (its last sub-group)."""
    record = group.record
    staging.tensor(record.compute_dtype, record.local_numel)[group.start : group.stop].copy_(master)
    return group.stop == record.local_numel


class NvmeAdam:
    """The streamed step for the nvme-tier parameters of one optimizer."""

    def __init__(self, store, decoupled_weight_decay: bool, records: list):
        """``records``: every parameter it may step (they size its pinned pool)."""
        self.store = store
        self.decoupled = decoupled_weight_decay
        self.records = list(records)
        self.pool = None  # PinnedPool: its own quota ("optimizer"), made at the first step after backward
        self.steps: dict[int, int] = {}  # uid -> optimizer steps taken
        self._shards_updated: list = []  # (record, group): in-memory shard slices the last step updated
        self.early = None  # EarlyAdam: the steps taken during backward (runtime/optim/early_adam.py)
        self.store_wait_seconds = 120.0

    def _start_reads(self, pool, group: SubGroup, first_step: bool) -> None:
        # The gradient too, unless it is read in place from the gradient shard in memory.
        names = STATE_NAMES + (() if group.record.grad_in_ram else ("grad",))
        take_buffers(group, pool, names, self.store_wait_seconds)
        start_reads(group, names, first_step)

    def _pool(self):
        """The pinned buffers of the step after backward: the early step's pool where there is one (idle once
        it has committed, and sized for this step too), else a quota of its own, made on first need; never
        the store's, whose graph fetches and gradient writes it would otherwise be sized for."""
        if self.early is not None:
            return self.early.pool_for_late_step()
        if self.pool is None:
            plans = [record.plan for record in self.records]
            self.pool = self.store.pinned_memory.quota("optimizer", optimizer_pool_bytes(plans))
        return self.pool

    def step(self, slots: list, hyper_by_slot: list[dict]) -> None:
        """Update every slot (record with its gradient shard) with its param group's hyperparameters.

        Run it inside a swap transaction (the optimizer does): if it raises,
        nothing written is committed, and :meth:`restore_memory_shards` undoes
        what it changed in memory.  Refuses (raises, having changed nothing)
        when a gradient could not be written during backward.  Whatever
        happens, every transfer it started has finished and every pinned
        buffer is back in the pool when it returns or raises.
        """
        plan = []
        for slot, hyper in zip(slots, hyper_by_slot):
            record = slot.record
            if not record.owns_state or not record.gradient:
                continue
            plan.extend((group, hyper) for group in sub_group_plan(record))
        self._shards_updated = []
        if not plan:
            return
        self.store.finish_grad_writes([group.record for group, _ in plan])
        pool = self._pool()
        param_staging = {}  # uid -> PinnedBuffer holding the updated shard in compute dtype (nvme param tier)
        held: list[SubGroup] = []  # groups holding pool buffers, oldest first
        overwriting = False  # a state write was started (nvme_copies=1: in place)
        try:
            held.append(plan[0][0])
            self._start_reads(pool, plan[0][0], self.steps.get(plan[0][0].record.uid, 0) == 0)
            for position, (group, hyper) in enumerate(plan):
                record = group.record
                if position + 1 < len(plan):
                    upcoming = plan[position + 1][0]
                    held.append(upcoming)
                    self._start_reads(pool, upcoming, self.steps.get(upcoming.record.uid, 0) == 0)
                for request in group.requests:
                    request.wait()
                if record.grad_in_ram:
                    grad = record.gradient.shard[group.start : group.stop]
                else:
                    grad = group.buffers["grad"].tensor(torch.float32, group.numel)
                if record.gradient.multiplier != 1.0:
                    grad.mul_(record.gradient.multiplier)  # clip_grad_norm_ on a gradient resting on disk
                step_count = self.steps.get(record.uid, 0) + 1
                beta1, beta2 = hyper["betas"]
                master = step_group(self.decoupled, group, grad, step_count, lr=float(hyper["lr"]), beta1=beta1,
                                    beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"])
                overwriting = True
                start_writes(group)
                self._publish_group(pool, record, group, master, param_staging)
                # Drain the previous groups' writes before their buffers go back to the pool.
                while held[0] is not group:
                    _settle(held.pop(0), raise_errors=True)
                if group.stop == record.local_numel:
                    self.steps[record.uid] = step_count
            while held:
                _settle(held.pop(0), raise_errors=True)
        except AioError as err:
            if overwriting and any(group.record.swap.copies == 1 for group, _ in plan):
                outcome = ("The optimizer step was not applied, and with nvme_copies=1 the state it was "
                           "overwriting in place is lost: training cannot go on from it (nvme_copies=2 keeps the "
                           "last good step through a failed write).")
            else:
                outcome = ("The optimizer step was not applied: every NVMe swap file keeps the previous step. Once "
                           "the cause is fixed, call opt.step() again (it steps from the same gradients) or "
                           "opt.zero_grad() to skip this step.")
            raise AioError(f"{err} {outcome}") from err
        finally:
            # After an error: transfers still in flight read from or write into
            # these buffers, so they go back to the pool only once finished.
            # Their errors are moot: the transaction commits none of this step.
            while held:
                _settle(held.pop(0), raise_errors=False)
            for buffer in param_staging.values():
                buffer.release()

    def restore_memory_shards(self) -> None:
        """After a failed :meth:`step` (its transaction aborted): undo its updates of in-memory shards.

        A device or cpu parameter tier gets each stepped slice at once; the
        masters on disk kept the previous step, and the shard is the master in
        compute dtype, so each updated slice is rebuilt from the kept master.
        With nvme_copies=1 the master may be lost too: the read then raises.
        """
        updated, self._shards_updated = self._shards_updated, []
        for record, group in updated:
            master = self.store.read_swap(record.swap, record.plan.state_key("master", group.index), torch.float32,
                                           group.numel, torch.device("cpu"))
            record.shard[group.start : group.stop].copy_(master)

    def _publish_group(self, pool, record, group: SubGroup, master: torch.Tensor, param_staging: dict) -> None:
        """Hand the updated slice to the parameter tier (nvme: the whole shard at once, to each of its swap keys)."""
        if record.params_in_master:
            return  # the master's write, in this transaction, is the parameter's
        if record.param_tier != "nvme":
            self._shards_updated.append((record, group))
            record.shard[group.start : group.stop].copy_(master)
            return
        if record.uid not in param_staging:
            param_staging[record.uid] = pool.acquire(
                record.shard_bytes, timeout=self.store_wait_seconds)
        if stage_param(param_staging[record.uid], group, master):
            buffer = param_staging.pop(record.uid)
            try:
                wait_all(self.store.write_param(record, buffer), raise_errors=True)
            finally:
                buffer.release()

    def state_bytes_on_disk(self, records) -> int:
        """Bytes of the two moments these records keep in swap files (they appear at the first step).

        The fp32 masters there are the store's, counted by ``memory_report``.
        """
        return sum(2 * record.local_numel * 4 for record in records
                   if record.owns_state and self.steps.get(record.uid, 0) > 0)


def wait_all(requests: list, raise_errors: bool) -> None:
    """Wait for every request (all of them, even after one fails); then raise the first failure if asked."""
    failure = None
    for request in requests:
        try:
            request.wait()
        except Exception as err:  # AioError; anything else is as fatal and as moot here
            failure = failure or err
    if failure is not None and raise_errors:
        raise failure


def _settle(group: SubGroup, raise_errors: bool) -> None:
    """Finish a group's transfers in flight, then give its buffers back to the pool."""
    try:
        wait_all(group.requests, raise_errors)
    finally:
        group.requests = []
        for buffer in group.buffers.values():
            buffer.release()
        group.buffers = {}
