"""Bytes held per tier, per model and for the process: the runtime's accounting.

Resting bytes (shards, masters, gradient shards, optimizer state, the pinned
pool), saved activations between forward and backward, and transient bytes (gathered or in flight, counted by the store from
each unit's sizes, see units.py), their peaks, and the device budget
``device_memory_limit`` that transient device bytes may not pass.

A model's ledger is one part of its :class:`~.model_group.ModelGroup`, which
also holds what else belongs to the model rather than to a parameter (its fp16
loss scale, collective timeout and mesh).  Ledgers never merge.
"""

from __future__ import annotations


class ZinfStoreError(RuntimeError):
    """A parameter cannot be adopted or used the way it was asked for."""


class ZinfBudgetError(ZinfStoreError):
    """An op would hold more gathered and in-flight device bytes than ``device_memory_limit`` allows."""


class Ledger:
    """Bytes one model (or the process) holds per tier, resting (shards, gradients, optimizer state) and
    transient (gathered or in flight), their peaks since :meth:`reset_peak`, and the device budget that
    transient bytes may not pass.  A model's ledger belongs to its :class:`~.model_group.ModelGroup`."""

    def __init__(self, device_memory_limit: int | None = None):
        self.resting = {"device": 0, "cpu": 0}
        self.transient = {"device": 0, "cpu": 0}
        self.peak = {"device": 0, "cpu": 0}
        self.peak_transient = {"device": 0, "cpu": 0}
        # Saved activations held between forward and backward (runtime/activations.py).
        self.activations = {"device": 0, "cpu": 0, "nvme": 0}
        # Budget for gathered and in-flight device bytes (option device_memory_limit; None: unlimited).
        self.device_memory_limit = device_memory_limit

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
