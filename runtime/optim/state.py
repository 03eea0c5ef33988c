"""What a zinf optimizer steps and holds: its slots, and its state where it rests (memory or NVMe swap files).

The one place outside the NVMe step itself (runtime/optim/nvme_adam.py) that names
the swap keys of Adam's moments: :meth:`ShardOptimizer.save_state` and
``load_state`` go through :func:`read_moment` and :func:`write_moment`, so
that a checkpoint handles an NVMe-resident state as it does one in memory.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from ..store import ParamRecord, ParamStore

# What NvmeAdam keeps per slot in swap files besides the master (its step count stays in memory).
NVME_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(eq=False)
class Slot:
    """One parameter as the optimizer steps it: the user's parameter, the store's record and the tensor stepped."""

    param: torch.nn.Parameter  # what the user passed
    record: ParamRecord | None  # the store's record; None for a parameter zinf did not shard
    master: torch.Tensor | None  # what the inner optimizer steps; None when the state rests on NVMe

    @property
    def state_on_nvme(self) -> bool:
        """Whether this slot's master and moments rest in NVMe swap files (stepped by NvmeAdam, not in memory)."""
        return self.master is None

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient the step reads: ``param.grad`` unsharded, else this rank's gradient shard (None: not its own)."""
        if self.record is None or self.record.stage == 0:
            return self.param.grad
        return self.record.gradient.shard if self.record.owns_state else None


@dataclasses.dataclass
class StreamedState:
    """One kind of a slot's state that rests in swap files, read a sub-group at a time as ``chunks`` is consumed."""

    dtype: torch.dtype
    chunks: Iterator[tuple[int, torch.Tensor]]  # (first element in the slot's local tensor, values on the CPU)


def read_moment(store: ParamStore, record: ParamRecord, kind: str) -> StreamedState:
    """An NVMe-tier slot's moment ``kind`` (one of NVME_MOMENTS), streamed from its swap files."""
    chunks = ((start, store.read_swap(record.swap, key, torch.float32, stop - start, torch.device("cpu")))
              for key, start, stop in record.plan.state_swap(kind))
    return StreamedState(torch.float32, chunks)


def write_moment(store: ParamStore, record: ParamRecord, kind: str, local: torch.Tensor) -> None:
    """Write this rank's whole moment ``kind`` of an NVMe-tier slot (``local_numel`` elements) to its swap files."""
    for key, start, stop in record.plan.state_swap(kind):
        store.write_swap(record.swap, key, local[start:stop])


def count_state_bytes(inner: torch.optim.Optimizer | None, memory_slots: list[Slot], nvme, nvme_slots: list[Slot],
                params: set[int] | None) -> dict[str, int]:
    """Bytes of optimizer state per tier for ``params`` (ids), or all (see ``ShardOptimizer.state_bytes``)."""
    per_tier = {"device": 0, "cpu": 0, "nvme": 0}
    if inner is None:
        return per_tier
    for slot in memory_slots:
        if params is not None and id(slot.param) not in params:
            continue
        tier = slot.record.opt_tier if slot.record is not None and slot.record.stage > 0 else "device"
        for value in inner.state.get(slot.master, {}).values():
            if isinstance(value, torch.Tensor):
                per_tier[tier] += value.numel() * value.element_size()
    if nvme is not None:
        records = [slot.record for slot in nvme_slots if params is None or id(slot.param) in params]
        per_tier["nvme"] += nvme.state_bytes_on_disk(records)
    return per_tier


def unaccount_state(store: ParamStore, state_bytes: dict[int, list]) -> None:
    """A dropped optimizer's moments stop counting in their models' ledgers (a ``weakref.finalize`` callback;
    ``state_bytes``: id(group) -> [group, {tier: bytes}], see ``ShardOptimizer._account_state``)."""
    for group, per_tier in state_bytes.values():
        for tier, nbytes in per_tier.items():
            store.add_optimizer_bytes(tier, -nbytes, ledger=group.ledger)
            per_tier[tier] = 0


class CountedState:
    """What an optimizer counted of its moments in its models' ledgers: per model group (``by_group``: id(group)
    -> [group, {tier: bytes}]), and the state's signature (:func:`state_signature`) at that count.

    A count reads every state tensor; after a step that made no new state (every step after the first: a
    moment's size never changes) it would find the same, so :meth:`update` skips it while the signature
    stays; a load, which may replace the state, counts again (``force``)."""

    def __init__(self):
        self.by_group: dict[int, list] = {}
        self.signature: tuple | None = None

    def update(self, store: ParamStore, params, state_bytes, optimizers: tuple, force: bool = False) -> None:
        """Count the change since the last count (see :func:`account_state`), unless nothing can have changed;
        ``optimizers``: (the inner optimizer, the NVMe one), each possibly None."""
        signature = state_signature(*optimizers)
        if force or signature != self.signature:
            self.signature = signature
            account_state(store, params, state_bytes, self.by_group)


def state_signature(inner: torch.optim.Optimizer | None, nvme) -> tuple:
    """What decides the state's bytes: the inner optimizer's state entries and the NVMe slots stepped."""
    return (len(inner.state) if inner is not None else 0,
            sum(1 for steps in nvme.steps.values() if steps) if nvme is not None else 0)


def account_state(store: ParamStore, params, state_bytes, counted_by_group: dict) -> None:
    """Count the optimizer state's bytes of ``params`` in the ledger of each one's model group: the change since
    the last count (``counted_by_group``: id(group) -> [group, {tier: bytes counted}]); ``state_bytes(ids)`` is
    the optimizer's figure for those parameters."""
    for group, members in store.params_by_group(list(params)):
        held = state_bytes({id(param) for param in members})
        counted = counted_by_group.setdefault(id(group), [group, {"device": 0, "cpu": 0}])[1]
        for tier in ("device", "cpu"):
            store.add_optimizer_bytes(tier, held[tier] - counted[tier], ledger=group.ledger)
            counted[tier] = held[tier]
