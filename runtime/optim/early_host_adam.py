"""The host optimizer's step taken during backward: Adam on master and moments in host memory (the cpu tier).

Why: with the optimizer state in host memory beside an accelerator (ZeRO-Offload), the host's cores idle
while the device runs backward, and a step after backward (every parameter, about 28 bytes moved each) adds
to every step.  Here, as the store adds a parameter's whole gradient, a worker thread steps that parameter
from *copies* of its master and moments, with torch's fused kernel as the step after backward runs it.
``opt.step()`` puts each stepped copy in place of the state (:meth:`EarlyHostAdam.commit`) where its
premises still hold, and steps the rest after backward as before:

* this was the arrival to step at (runtime/optim/arrivals.py: no later gradient came);
* no clipping scaled the gradients and no fp16 overflow skipped the step;
* the hyperparameters (lr, betas, eps, weight_decay) and the step count are the ones it stepped with.

A step put in place is bit-equal to the step after backward: the same kernel on the same inputs.  So the
result never depends on the guess; only the speed does.

What it costs: the copies, 12 bytes a parameter of host memory from its step until ``opt.step()``, counted
as transient CPU bytes of the model and bounded by ``budget_bytes`` (a parameter whose copies would pass it
steps after backward), and the copying itself.  It pays where the host idles through backward, beside an
accelerator: option overlap_optimizer ``"auto"`` takes it there and not on a CPU device
(runtime/param_plan.py).  A gradient still copying off the device (runtime/store_grads.py) is waited for
by the worker, not by backward.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import weakref
from typing import Callable

import torch

from .arrivals import Arrivals, EarlyStep
from .early_adam import hyperparameters
from ..records import listen_to_gradients

# What a slot's state is to the early step: (fp32 master, exp_avg, exp_avg_sq, step count tensor), all on the host.
HostState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclasses.dataclass(eq=False)
class _Job:
    """One parameter's early step: the worker's future of (master, exp_avg, exp_avg_sq, step) stepped copies."""

    record: object
    hyper: tuple
    step: torch.Tensor  # the step count it steps with (the state's, plus one)
    nbytes: int  # host bytes its copies hold (counted until the verdict)
    future: concurrent.futures.Future


class EarlyHostAdam(EarlyStep):
    """Early steps of the host-memory slots of one zinf optimizer (see the module docstring)."""

    def __init__(self, store, decoupled_weight_decay: bool, records_and_groups: list[tuple[object, dict]],
                 state_of: Callable[[object], "HostState | None"], budget_bytes: int):
        """``records_and_groups``: each record to step early with the optimizer's live param group of it;
        ``state_of(record)``: its state now, or None before its first step (torch makes the moments then)."""
        self.store = store
        self.decoupled = decoupled_weight_decay
        self.groups_by_uid = {record.uid: group for record, group in records_and_groups}
        self.state_of = state_of
        self.budget_bytes = budget_bytes
        self.jobs: dict[int, _Job] = {}
        self.arrivals = Arrivals()
        self.held_bytes = 0
        self.stats = {"started": 0, "committed": 0, "dropped": 0, "over_budget": 0}
        self._counted: dict[int, list] = {}  # id(ledger) -> [ledger, bytes counted]
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-early-host")
        weakref.finalize(self, _close, self._worker, store, self._counted)
        for record, _ in records_and_groups:
            listen_to_gradients(record, self)  # the store tells of gradients

    # --- the store's side (arrival, gradient_changed, gradients_dropped: arrivals.EarlyStep's) ---------

    def start(self, record, grad: torch.Tensor, owned: bool, ready=None) -> None:
        """Step ``record`` early with its whole local fp32 gradient ``grad`` (on the host; read, never written);
        ``ready``: the copy still bringing ``grad`` off the device (the worker waits for it), or None."""
        state = self.state_of(record)
        group = self.groups_by_uid[record.uid]
        if state is None or group.get("amsgrad") or group.get("maximize"):
            return  # its first step (no moments yet), or a variant the fused kernel's call here does not take
        master, exp_avg, exp_avg_sq, step = state
        nbytes = 3 * master.numel() * master.element_size()
        if self.held_bytes + nbytes > self.budget_bytes:
            self.stats["over_budget"] += 1
            return
        self._count(record.ledger, nbytes, f"early step of {record.name}")
        hyper = hyperparameters(group)
        next_step = step + 1
        future = self._worker.submit(_step_copies, self.decoupled, master, exp_avg, exp_avg_sq, grad, ready,
                                     next_step, hyper)
        self.jobs[record.uid] = _Job(record, hyper, next_step, nbytes, future)
        self.stats["started"] += 1

    def fetched_master(self, record, staging, offset: int, reads) -> None:
        """(An NVMe read's master: never here, whose masters rest in host memory.)"""

    def _cancel(self, uid: int) -> None:
        job = self.jobs.pop(uid, None)
        if job is None:
            return
        job.future.cancel()  # (a step already running finishes into copies nobody takes)
        self._count(job.record.ledger, -job.nbytes, "")
        self.stats["dropped"] += 1

    # --- the verdict -------------------------------------------------------------------

    def commit(self, clipped: bool) -> dict[int, HostState]:
        """At ``opt.step()``: wait for every early step and return, by uid, the stepped state of those that
        count (the caller puts them in place; the others it steps after backward).  ``clipped``: clipping
        scaled the gradients after the early steps read them (none counts)."""
        committed = {}
        for uid, job in self.jobs.items():
            try:
                stepped = job.future.result()
            except Exception:  # a step that failed is taken after backward, where its error shows again
                stepped = None
            self._count(job.record.ledger, -job.nbytes, "")
            current_group = self.groups_by_uid.get(uid)
            state = self.state_of(job.record)
            if (stepped is not None and not clipped and current_group is not None
                    and hyperparameters(current_group) == job.hyper and state is not None
                    and torch.equal(state[3] + 1, job.step)):
                committed[uid] = stepped
        self.stats["committed"] += len(committed)
        self.stats["dropped"] += len(self.jobs) - len(committed)
        self.jobs = {}
        self.arrivals.stepped(clipped)
        return committed

    def _count(self, ledger, delta: int, what: str) -> None:
        self.held_bytes += delta
        self.store.count_transient("cpu", delta, what, ledger)
        entry = self._counted.setdefault(id(ledger), [ledger, 0])
        entry[1] += delta


def _step_copies(decoupled: bool, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor, ready, step: torch.Tensor, hyper: tuple) -> HostState:
    """(The worker.) Copies of the state, stepped with ``grad``: what the step after backward would make."""
    if ready is not None:
        ready.synchronize()
    copies = [_copy_of(tensor) for tensor in (master, exp_avg, exp_avg_sq)]
    lr, beta1, beta2, eps, weight_decay = hyper
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel([copies[0]], [grad], [copies[1]], [copies[2]], [], [step], lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    return copies[0], copies[1], copies[2], step


def _copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in memory of the same kind (pinned where the original is: a shard the device copies from)."""
    if tensor.is_pinned():
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
    return tensor.clone()


def _close(worker: concurrent.futures.ThreadPoolExecutor, store, counted: dict[int, list]) -> None:
    """The optimizer was dropped: stop its worker and the counting of copies its unfinished steps held."""
    worker.shutdown(wait=False, cancel_futures=True)
    for ledger, nbytes in counted.values():
        if nbytes:
            store.count_transient("cpu", -nbytes, "", ledger)
    counted.clear()
