"""Bytes held per tier, per model and for the process: the runtime's accounting.

Resting bytes (shards, masters, gradient shards, optimizer state, the pinned
pool), saved activations between forward and backward, and transient bytes (gathered or in flight, counted by the store from
each unit's sizes, see units.py), their peaks, and the device budget
``device_memory_limit`` that transient device bytes may not pass.

A model's ledger also holds the one piece of training state that belongs to
the model rather than to a parameter: its fp16 loss scale
(:class:`Fp16GradScaler`), so one model's overflow never skips another's
step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .comm import Comm


class ZinfStoreError(RuntimeError):
    """A parameter cannot be adopted or used the way it was asked for."""


class ZinfBudgetError(ZinfStoreError):
    """An op would hold more gathered and in-flight device bytes than ``device_memory_limit`` allows."""


class Fp16GradScaler:
    """Dynamic scaling of gradients on their way through fp16 (``param_dtype="fp16"``).

    The graph computes in the model's own dtype; gradients become fp16 only
    to be reduced.  They are multiplied by ``scale`` before that cast and
    divided after it, so that small values survive.  An inf or nan seen on
    any rank skips the optimizer step and halves the scale; ``growth_interval``
    good steps in a row double it (the policy of ``torch.amp.GradScaler``).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.found_inf = False
        self.good_steps = 0
        self.skipped_steps = 0

    def absorb(self, other: "Fp16GradScaler") -> None:
        """Become the scaler of a model that joined ``other``'s (ledgers merged)."""
        self.scale = min(self.scale, other.scale)
        self.found_inf = self.found_inf or other.found_inf
        self.good_steps = min(self.good_steps, other.good_steps)
        self.skipped_steps += other.skipped_steps

    def state(self) -> dict:
        """What a checkpoint keeps (see :meth:`load_state`)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict) -> None:
        """Restore the scale and its counters from :meth:`state`'s dict."""
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]

    def check(self, reduced_grad: torch.Tensor) -> None:
        """Note an overflow if ``reduced_grad`` has an inf or NaN (the step will be skipped)."""
        if not self.found_inf and not bool(torch.isfinite(reduced_grad).all()):
            self.found_inf = True

    def should_skip_step(self, comm: "Comm", device: torch.device, timeout: float | None = None) -> bool:
        """Agree over ranks whether any saw an overflow, update the scale, reset the flag.

        ``device``: where the flag is reduced (NCCL reduces device tensors only).
        """
        flag = torch.tensor(1.0 if self.found_inf else 0.0, device=device)
        comm.all_reduce_sum(flag, "all_reduce of the fp16 overflow flag (optimizer step)", timeout)
        self.found_inf = False
        if flag.item() > 0:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False


class Ledger:
    """Bytes one model holds per tier, resting (shards, gradients, optimizer state) and transient
    (gathered or in flight), their peaks since :meth:`reset_peak`, its device budget, and its fp16
    loss scale (``fp16_scaler``) and collective timeout (``collective_timeout``)."""

    def __init__(self, device_memory_limit: int | None = None):
        self.resting = {"device": 0, "cpu": 0}
        self.transient = {"device": 0, "cpu": 0}
        self.peak = {"device": 0, "cpu": 0}
        self.peak_transient = {"device": 0, "cpu": 0}
        # Saved activations held between forward and backward (runtime/activations.py).
        self.activations = {"device": 0, "cpu": 0, "nvme": 0}
        # Budget for gathered and in-flight device bytes (option device_memory_limit; None: unlimited).
        self.device_memory_limit = device_memory_limit
        self.fp16_scaler = Fp16GradScaler()
        # Seconds this model's collectives wait for the other ranks (option collective_timeout; None: the
        # process's default, runtime/comm.py).
        self.collective_timeout: float | None = None
        self.merged_into: Ledger | None = None

    def root(self) -> "Ledger":
        """The ledger this one was merged into (itself if none): where its figures are counted."""
        ledger = self
        while ledger.merged_into is not None:
            ledger = ledger.merged_into
        return ledger

    def add_resting(self, tier: str, delta: int) -> None:
        """Count ``delta`` resting bytes on ``tier``."""
        self.resting[tier] += delta
        self._note_peak(tier)

    def add_transient(self, tier: str, delta: int, what: str | None = None) -> None:
        """Count ``delta`` transient bytes on ``tier``; over the model's device budget raises naming ``what``."""
        limit = self.device_memory_limit
        if tier == "device" and delta > 0 and limit is not None and self.transient[tier] + delta > limit:
            raise ZinfBudgetError(
                f"device_memory_limit exceeded: {what or 'a transfer'} needs {delta:,} bytes on the device while "
                f"{self.transient[tier]:,} bytes are already gathered or in flight ({self.transient[tier] + delta:,} "
                f"> device_memory_limit={limit:,}); raise device_memory_limit, let the tile pass split the op "
                f"(a lower tile_threshold, a larger tile_factor or tile_factor='auto'), or lower max_live_bytes"
            )
        self.transient[tier] += delta
        self.peak_transient[tier] = max(self.peak_transient[tier], self.transient[tier])
        self._note_peak(tier)

    def add_activations(self, tier: str, delta: int) -> None:
        """Count ``delta`` bytes of saved or offloaded activations on ``tier``."""
        self.activations[tier] += delta
        if tier in self.peak:
            self._note_peak(tier)

    def _held(self, tier: str) -> int:
        return self.resting[tier] + self.transient[tier] + self.activations[tier]

    def _note_peak(self, tier: str) -> None:
        self.peak[tier] = max(self.peak[tier], self._held(tier))

    def reset_peak(self) -> None:
        """Start a new peak window at the current figures."""
        for tier in self.peak:
            self.peak[tier] = self._held(tier)
            self.peak_transient[tier] = self.transient[tier]


def merge_ledgers(ledgers: list) -> Ledger:
    """One ledger for all of ``ledgers`` (their roots): the first absorbs the others' figures."""
    roots = []
    for ledger in ledgers:
        root = ledger.root()
        if all(root is not seen for seen in roots):
            roots.append(root)
    target = roots[0]
    for other in roots[1:]:
        for figures in ("resting", "transient", "peak", "peak_transient", "activations"):
            mine, theirs = getattr(target, figures), getattr(other, figures)
            for tier in mine:
                mine[tier] += theirs[tier]
        limits = [limit for limit in (target.device_memory_limit, other.device_memory_limit) if limit is not None]
        target.device_memory_limit = min(limits) if limits else None
        timeouts = [t for t in (target.collective_timeout, other.collective_timeout) if t is not None]
        target.collective_timeout = min(timeouts) if timeouts else None
        # Two models joined (one optimizer over both): the more cautious scale, the counts of both.
        target.fp16_scaler.absorb(other.fp16_scaler)
        other.merged_into = target
    return target
