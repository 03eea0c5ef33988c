"""Transfers in flight, each in one explicit state.

A *fetch* brings one unit's parameters from where they rest to the graph in up
to three steps (nc: NVMe -> pinned buffer, cg: CPU or pinned buffer -> device,
gg: the gather); a *reduce* brings a unit's gradient to this rank's shard.  Each
started transfer is a :class:`Transfer` in one :class:`TransferState`; the
store's ops move it along :data:`LEGAL_TRANSITIONS`, and nothing else does:

    (new) -nc_start-> READING -nc_wait-> READ -cg_start-> COPYING -cg_wait-> STAGED
    (new) -cg_start-> COPYING                    (cpu tier: no NVMe read)
    STAGED or (new) -gather_start-> GATHERING -gather_wait-> (done)
    (new) -reduce_grad_start-> REDUCING -reduce_grad_wait-> (done)

Why states and not one queue per step: an op that finds no transfer of its
unit in the state it starts from is a schedule bug (a wait without its start,
a device copy of a read not yet waited for), and it must raise naming the op,
the unit and what the unit has in flight, never pair with another transfer.
Transfers of one unit in the same state advance first in first out (a unit
used twice in a graph has two fetches in flight).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Hashable, Iterator

from .ledger import ZinfStoreError


class ZinfTransferError(ZinfStoreError):
    """An op asked a transfer to move in a way the state machine does not allow."""


class TransferState(enum.Enum):
    """Where one transfer is: see the module docstring for the moves between states."""
    NEW = "not started"
    READING = "reading"  # nc_start: swap reads into a pinned buffer in flight
    READ = "read"  # nc_wait: the pinned buffer holds the unit's local shards
    COPYING = "copying"  # cg_start: copies to the device in flight
    STAGED = "staged"  # cg_wait: the unit's local input is on the device
    GATHERING = "gathering"  # gather_start: the gather (or nothing, at world size 1) in flight
    REDUCING = "reducing"  # reduce_grad_start: the gradient's reduction in flight
    DONE = "done"  # gather_wait or reduce_grad_wait took its result; no longer held


_S = TransferState
# (from, to) -> the op that makes that move; any other move raises.
LEGAL_TRANSITIONS: dict[tuple[TransferState, TransferState], str] = {
    (_S.NEW, _S.READING): "nc_start",
    (_S.READING, _S.READ): "nc_wait",
    (_S.READ, _S.COPYING): "cg_start",
    (_S.NEW, _S.COPYING): "cg_start",
    (_S.COPYING, _S.STAGED): "cg_wait",
    (_S.STAGED, _S.GATHERING): "gather_start",
    (_S.NEW, _S.GATHERING): "gather_start",
    (_S.GATHERING, _S.DONE): "gather_wait",
    (_S.NEW, _S.REDUCING): "reduce_grad_start",
    (_S.REDUCING, _S.DONE): "reduce_grad_wait",
}


@dataclasses.dataclass(eq=False)
class Transfer:
    """One unit's transfer and what its current step holds (set by the op that moved it there)."""

    unit_name: str
    state: TransferState = TransferState.NEW
    staging: object | None = None  # the pinned buffer of nc (READING, READ) and of cg from it (COPYING)
    pending: list = dataclasses.field(default_factory=list)  # swap requests or copies to wait for
    value: object | None = None  # the device tensor of cg (COPYING, STAGED), the gather's or reduce's output
    work: object | None = None  # the collective in flight (GATHERING, REDUCING)


class TransferTable:
    """Every transfer in flight, by unit key; the only place a transfer changes state."""

    def __init__(self):
        self._by_unit: dict[Hashable, list[Transfer]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_unit)

    def __iter__(self) -> Iterator[Transfer]:
        for transfers in list(self._by_unit.values()):
            yield from transfers

    def has(self, unit, state: TransferState) -> bool:
        """Whether ``unit`` has a transfer in ``state``."""
        return any(transfer.state is state for transfer in self._by_unit.get(unit.key, ()))

    def move(self, unit, op: str, source: TransferState, target: TransferState) -> Transfer:
        """Move ``unit``'s oldest transfer in ``source`` (a new one for NEW) to ``target`` by ``op``."""
        if LEGAL_TRANSITIONS.get((source, target)) != op:
            raise ZinfTransferError(f"{op} cannot move a transfer of {unit.name} from {source.value} to "
                                    f"{target.value}")
        transfers = self._by_unit.get(unit.key, [])
        if source is TransferState.NEW:
            transfer = Transfer(unit.name)
            self._by_unit.setdefault(unit.key, []).append(transfer)
        else:
            transfer = next((t for t in transfers if t.state is source), None)
            if transfer is None:
                in_flight = ", ".join(t.state.value for t in transfers) or "nothing"
                raise ZinfTransferError(f"{op} for {unit.name} without a matching start: it needs a transfer that "
                                        f"is {source.value}, and the unit has {in_flight} in flight")
        transfer.state = target
        if target is TransferState.DONE:
            transfers.remove(transfer)
            if not transfers:
                del self._by_unit[unit.key]
        return transfer

    def clear(self) -> None:
        """Forget every transfer (abandoned: a graph raised half way); each ends DONE."""
        for transfer in self:
            transfer.state = TransferState.DONE
        self._by_unit.clear()
