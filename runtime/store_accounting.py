"""Bytes held per tier, for the process and per model, and the model groups' (part of ParamStore)."""

from __future__ import annotations

import functools
import weakref
from typing import Iterable

import torch

from .ledger import Ledger
from .model_group import ModelGroup, ModelView
from .records import tier_memory
from .tensor_parallel import local_of


_UNSET = object()  # "not given": None is a value (no limit, no timeout)


def _process_figure(name: str) -> property:
    return property(lambda store: getattr(store.process, name),
                    doc=f"The process's ``{name}`` bytes per tier: every model's and the shared pinned pool's.")


class StoreAccounting:
    """The accounting of :class:`~.store.ParamStore` (uses its ``process`` ledger, records and claims)."""

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
        for group in {id(r.group): r.group for r in self._records.values()}.values():
            group.ledger.reset_peak()

    # --- models ------------------------------------------------------------------

    def claim(self, params: Iterable[torch.Tensor], device_memory_limit=_UNSET,
              collective_timeout=_UNSET) -> ModelGroup:
        """Count ``params`` as one model's: those in no group yet join the group the others already share
        (the first of them, in ``params``' order), else a new one; returns that group.

        Parameters already in a group stay in it (groups never merge; see runtime/model_group.py).  The
        compile that adopts a graph's parameters claims them, and so do an optimizer or a checkpoint load
        that comes before it.  ``device_memory_limit`` / ``collective_timeout``, if given (a compile's
        options), configure every group ``params`` belong to.
        """
        self.collect()
        params = list(params)
        groups = self.groups_of(params)
        home = groups[0] if groups else ModelGroup(self)
        for param in map(local_of, params):  # (a DTensor's record is its local tensor's: so is its claim)
            if self.group_of(param) is None:
                self._claimed[id(param)] = (weakref.ref(param, functools.partial(self._forget_claim, id(param))),
                                            home)
        if device_memory_limit is not _UNSET or collective_timeout is not _UNSET:
            for group in groups or [home]:
                group.configure(
                    device_memory_limit=group.device_memory_limit if device_memory_limit is _UNSET
                    else device_memory_limit,
                    collective_timeout=group.collective_timeout if collective_timeout is _UNSET
                    else collective_timeout)
        return home

    def view_of(self, params: Iterable[torch.Tensor]) -> ModelView:
        """The model of ``params`` as the top layer sees it (``api.store_of``): claimed (those in no group join
        the group the others share, else a new one), with every group they are in."""
        params = list(params)
        home = self.claim(params)
        return ModelView(tuple(self.groups_of(params)) or (home,), self)

    def group_of(self, param: torch.Tensor) -> ModelGroup | None:
        """The model group ``param`` belongs to (adopted, or claimed before adoption), or None: the one
        documented way from a parameter to its model."""
        param = local_of(param)  # (a DTensor's record and claim are its local tensor's)
        record = self.lookup(param)
        if record is not None:
            return record.group
        entry = self._claimed.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return None

    def groups_of(self, params: Iterable[torch.Tensor]) -> list[ModelGroup]:
        """The groups ``params`` belong to, each once, in the order first met; read only (a report on one
        model never changes another's)."""
        return [group for group, _ in self.params_by_group(params)]

    def params_by_group(self, params: Iterable[torch.Tensor]) -> list[tuple[ModelGroup, list[torch.Tensor]]]:
        """``params`` (those in a group) split by their group, groups in the order first met."""
        found: dict[int, tuple[ModelGroup, list]] = {}
        for param in params:
            group = self.group_of(param)
            if group is not None:
                found.setdefault(id(group), (group, []))[1].append(param)
        return list(found.values())

    def _forget_claim(self, param_id: int, _ref) -> None:
        self._dropped_claims.put(param_id)

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
            if record.gradient.shard is not None:
                grads.append(record.gradient.shard)
            if record.master is not None and record.master is not record.shard:
                masters.append(record.master)
        return {"params": params, "grads": grads, "masters": masters}


