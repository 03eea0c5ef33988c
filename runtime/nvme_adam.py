"""Adam / AdamW stepped where the state rests: on NVMe, streamed in sub-groups.

Each nvme-tier parameter slice keeps its fp32 master and its two moments in
swap files, split into sub-groups of at most ``SUB_GROUP_NUMEL`` elements
(keys ``master.<uid>.<i>``, ``exp_avg.<uid>.<i>``, ``exp_avg_sq.<uid>.<i>``);
the reduced gradient waits in ``grad.<uid>.<i>`` (written by the store
during backward).
A step walks the sub-groups in order: the reads of group i+1 are in flight
while group i is updated (torch's fused CPU Adam kernel) and the writes of
group i-1 drain, so disk and compute overlap.  Updated low-precision
parameters go back to the parameter tier through the store.
"""

from __future__ import annotations

import dataclasses

import torch

SUB_GROUP_NUMEL = 16 * 1024 * 1024  # 64 MiB of fp32 per state tensor per group
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def sub_groups(numel: int, group_numel: int = SUB_GROUP_NUMEL) -> list[tuple[int, int]]:
    """(start, stop) element ranges covering ``numel`` in order."""
    return [(start, min(start + group_numel, numel)) for start in range(0, numel, group_numel)] or [(0, 0)]


def state_key(name: str, uid: int, index: int) -> str:
    return f"{name}.{uid}.{index}"


def write_initial_master(store, record, local_fp32: torch.Tensor) -> None:
    """At adoption: the fp32 master slice to its swap files, group by group."""
    for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
        store._write_swap(record.swap, state_key("master", record.uid, index), local_fp32[start:stop])


@dataclasses.dataclass
class _Group:
    record: object
    index: int
    start: int
    stop: int
    buffers: dict = dataclasses.field(default_factory=dict)  # name -> PinnedBuffer
    requests: list = dataclasses.field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.stop - self.start


class NvmeAdam:
    """The streamed step for the nvme-tier parameters of one optimizer."""

    def __init__(self, store, decoupled_weight_decay: bool):
        self.store = store
        self.decoupled = decoupled_weight_decay
        self.steps: dict[int, int] = {}  # uid -> optimizer steps taken
        self.store_wait_seconds = 120.0

    def _start_reads(self, group: _Group, first_step: bool) -> None:
        nbytes = group.numel * 4
        pool, engine = self.store._pool(4 * nbytes), group.record.swap
        for name in STATE_NAMES + ("grad",):
            group.buffers[name] = pool.acquire(nbytes, timeout=self.store_wait_seconds)
            if name in ("exp_avg", "exp_avg_sq") and first_step:
                group.buffers[name].tensor(torch.float32, group.numel).zero_()
            else:
                key = state_key(name, group.record.uid, group.index)
                group.requests.append(engine.read(key, group.buffers[name], nbytes))

    def step(self, slots: list, hyper_by_slot: list[dict]) -> None:
        """Update every slot (record with its gradient shard) with its param group's hyperparameters."""
        plan = []
        for slot, hyper in zip(slots, hyper_by_slot):
            record = slot.record
            if not record.owns_state or not record.has_grad:
                continue
            for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
                plan.append((_Group(record, index, start, stop), hyper))
        if not plan:
            return
        self.store.finish_grad_writes()
        param_staging = {}  # uid -> PinnedBuffer holding the updated shard in compute dtype (nvme param tier)
        pending_writes: list[tuple[_Group, list]] = []
        self._start_reads(plan[0][0], self.steps.get(plan[0][0].record.uid, 0) == 0)
        for position, (group, hyper) in enumerate(plan):
            record = group.record
            if position + 1 < len(plan):
                upcoming = plan[position + 1][0]
                self._start_reads(upcoming, self.steps.get(upcoming.record.uid, 0) == 0)
            for request in group.requests:
                request.wait()
            master, exp_avg, exp_avg_sq, grad = (group.buffers[name].tensor(torch.float32, group.numel)
                                                 for name in STATE_NAMES + ("grad",))
            if record.grad_multiplier != 1.0:
                grad.mul_(record.grad_multiplier)  # clip_grad_norm_ on a gradient resting on disk
            step_count = self.steps.get(record.uid, 0) + 1
            kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            beta1, beta2 = hyper["betas"]
            kernel([master], [grad], [exp_avg], [exp_avg_sq], [],
                   [torch.tensor(float(step_count))], lr=float(hyper["lr"]), beta1=beta1, beta2=beta2,
                   weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=False, maximize=False)
            writes = [record.swap.write(state_key(name, record.uid, group.index), group.buffers[name], group.numel * 4)
                      for name in STATE_NAMES]
            self._publish_group(record, group, master, param_staging)
            # Drain the previous group's writes before its buffers go back to the pool.
            for previous, previous_writes in pending_writes:
                for request in previous_writes:
                    request.wait()
                for buffer in previous.buffers.values():
                    buffer.release()
            pending_writes = [(group, writes)]
            if group.stop == record.local_numel:
                self.steps[record.uid] = step_count
        for previous, previous_writes in pending_writes:
            for request in previous_writes:
                request.wait()
            for buffer in previous.buffers.values():
                buffer.release()

    def _publish_group(self, record, group: _Group, master: torch.Tensor, param_staging: dict) -> None:
        """Hand the updated slice to the parameter tier (nvme: the whole shard at once, to each of its swap keys)."""
        if record.param_tier != "nvme":
            record.shard[group.start : group.stop].copy_(master)
            return
        if record.uid not in param_staging:
            param_staging[record.uid] = self.store._pool(record.shard_bytes).acquire(
                record.shard_bytes, timeout=self.store_wait_seconds)
        staged = param_staging[record.uid].tensor(record.compute_dtype, record.local_numel)
        staged[group.start : group.stop].copy_(master)
        if group.stop == record.local_numel:
            buffer = param_staging.pop(record.uid)
            try:
                for request in self.store._write_param(record, buffer):
                    request.wait()
            finally:
                buffer.release()

    def state_bytes_on_disk(self, records) -> int:
        """Bytes of the two moments these records keep in swap files (they appear at the first step).

        The fp32 masters there are the store's, counted by ``memory_report``.
        """
        return sum(2 * record.local_numel * 4 for record in records
                   if record.owns_state and self.steps.get(record.uid, 0) > 0)
