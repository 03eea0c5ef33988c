"""Bytes held per tier, for the process and per model, and the models' ledgers (part of ParamStore)."""

from __future__ import annotations

import functools
import weakref
from typing import Iterable

import torch

from .ledger import Ledger, merge_ledgers
from .records import tier_memory


_UNSET = object()  # "not given": None is a value (no limit, no timeout)


def _process_figure(name: str) -> property:
    return property(lambda store: getattr(store.process, name),
                    doc=f"The process's ``{name}`` bytes per tier: every model's and the shared pinned pool's.")


class StoreAccounting:
    """The accounting of :class:`~.store.ParamStore` (uses its ``process`` ledger, records and pending ledgers)."""

    def _add_resting(self, tier: str, delta: int, ledger: "Ledger | None" = None) -> None:
        """Count ``delta`` resting bytes on ``tier``: for the process and for ``ledger``'s model (None: shared)."""
        self.process.add_resting(tier, delta)
        if ledger is not None:
            ledger.add_resting(tier, delta)

    def _add_transient(self, tier: str, delta: int, what: str | None = None, ledger: "Ledger | None" = None) -> None:
        """Count ``delta`` bytes gathered or in flight on ``tier``; ``what``: the op, named by a budget error.

        The budget (``device_memory_limit``) is the model's: checked on ``ledger``.
        """
        if ledger is not None:
            ledger.add_transient(tier, delta, what)
        self.process.add_transient(tier, delta, what)

    def add_optimizer_bytes(self, tier: str, delta: int, ledger: "Ledger | None" = None) -> None:
        """Count optimizer state bytes resting on ``tier`` (nvme state is staged in CPU memory)."""
        self._add_resting(tier_memory(tier), delta, ledger=ledger)

    # Process-wide figures (every model and the shared pinned pool), as before per-model ledgers.
    resting = _process_figure("resting")
    transient = _process_figure("transient")
    peak = _process_figure("peak")
    peak_transient = _process_figure("peak_transient")

    def reset_peak(self) -> None:
        """A new peak window for the process and every model."""
        self.process.reset_peak()
        for ledger in {id(r.ledger): r.ledger for r in self._records.values()}.values():
            ledger.reset_peak()

    # --- models ------------------------------------------------------------------

    def group(self, params: Iterable[torch.Tensor], device_memory_limit=_UNSET, collective_timeout=_UNSET) -> "Ledger":
        """Account ``params`` as one model: one ledger for those adopted, and for the rest when they are.

        The optimizer and ``memory_report`` call this with a model's
        parameters; graphs adopt theirs as a group too.  Ledgers that meet
        merge (their figures add up; a merged peak is the sum of peaks, an
        upper bound).
        """
        self.collect()
        ledgers, pending = [], []
        for param in params:
            record = self.lookup(param)
            if record is not None:
                ledgers.append(record.ledger)
            else:
                pending.append(param)
        ledger = merge_ledgers(ledgers) if ledgers else None
        for param in pending:
            entry = self._pending_ledgers.get(id(param))
            if entry is not None and entry[0]() is param:
                ledger = merge_ledgers([ledger, entry[1]]) if ledger is not None else entry[1].root()
        if ledger is None:
            ledger = Ledger()
        for param in pending:
            self._pending_ledgers[id(param)] = (weakref.ref(param, functools.partial(self._forget_pending, id(param))),
                                                ledger)
        if device_memory_limit is not _UNSET:
            ledger.device_memory_limit = device_memory_limit
        if collective_timeout is not _UNSET:
            ledger.collective_timeout = collective_timeout
        return ledger

    def ledgers_of(self, params: Iterable[torch.Tensor]) -> list["Ledger"]:
        """The ledgers ``params`` are counted in (each once), read only: unlike :meth:`group`, nothing merges
        and nothing is registered, so a report on one model never changes another's figures."""
        self.collect()
        found: dict[int, Ledger] = {}
        for param in params:
            record = self.lookup(param)
            ledger = record.ledger.root() if record is not None else self._ledger_for(param)
            if ledger is not None:
                found.setdefault(id(ledger), ledger)
        return list(found.values())

    def _forget_pending(self, param_id: int, _ref) -> None:
        self._dropped_pending.put(param_id)

    def _ledger_for(self, param: torch.Tensor) -> "Ledger | None":
        """The ledger a not-yet-adopted parameter was grouped into (see :meth:`group`), if any."""
        entry = self._pending_ledgers.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1].root()
        return None

    def held_tensors(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
        """The tensors the store holds in memory for ``params`` (default: all), by kind.

        For cross-checking the accounting against real storage.
        """
        if params is None:
            records = list(self._records.values())
        else:
            records = [r for r in (self.lookup(p) for p in params) if r is not None]
        params, grads, masters = [], [], []
        for record in records:
            if not record.shard_is_param:
                params.append(record.shard)
            if record.stage != 3:
                params.append(record.param.data)
            if record.grad_shard is not None:
                grads.append(record.grad_shard)
            if record.master is not None and record.master is not record.shard:
                masters.append(record.master)
        return {"params": params, "grads": grads, "masters": masters}


