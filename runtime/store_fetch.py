"""Fetching a unit's parameters for the graph: nc, cg and the gather (part of ParamStore).

The graph's ``zinf`` ops call these in pairs (start, wait); each started
transfer is a state in :mod:`.transfers`, moved only by these methods.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .aio import AioError
from .collectives import start_gather
from .comm import DONE, Comm
from .ledger import ZinfStoreError
from .transfers import Transfer, TransferState as State
from .tiers import fetch_steps
from .records import POOL_WAIT_SECONDS, ParamRecord, finish_copies, grad_listener_of, nbytes_of, padded_view
from .units import Unit, unit_of


class FetchSteps:
    """The fetch steps of :class:`~.store.ParamStore` (uses its ``_transfers`` and pinned pool; units are their
    model group's).

    One state machine for every unit (a whole parameter, a row tile of one, a
    bucket of parameters): nc (NVMe -> pinned buffer), cg (pinned or CPU shard
    -> device), gather (all-gather or broadcast), then release.  A unit's
    transfers in the same state advance first in first out, as the graph's
    ops pair starts with waits in order (see :mod:`.transfers`).
    """

    def unit(self, records: Iterable[ParamRecord], tile: int | None = None) -> Unit:
        """The unit of ``records`` (a bucket), or of one record's row ``tile``; built once, then cached."""
        records = list(records)
        key = tuple((record.uid, tile) for record in records)
        units = records[0].group.units  # (the model's: uids never repeat, and a freed record's units go with it)
        unit = units.get(key)
        if unit is None:
            if tile is not None and (records[0].tile_rows is None or not 0 <= tile < len(records[0].tile_rows)):
                raise ZinfStoreError(f"tile {tile} of {records[0].name}, which has tile rows {records[0].tile_rows}")
            unit = units[key] = unit_of(records, tile)
        return unit

    @staticmethod
    def _group_of(unit: Unit) -> "ModelGroup":
        """The model of the unit's first parameter, whose ledger counts the unit's bytes and whose timeout
        bounds its collectives."""
        return unit.pieces[0].layout.group

    @staticmethod
    def _shard_comm(unit: Unit) -> Comm:
        """The group the unit's parameters are sharded over (one per unit: see _bucketed)."""
        return unit.pieces[0].layout.mesh.shard

    def nc_start(self, unit: Unit) -> None:
        """Start reading the unit's shards (nvme tier) from their swap keys into one pinned buffer."""
        if self._held_values(unit) is not None:  # gathered already: the steps up to the gather only move on
            self._transfers.move(unit, "nc_start", State.NEW, State.READING)
            return
        staging = self.pinned_pool(unit.sizes.pinned).acquire(unit.sizes.pinned, timeout=POOL_WAIT_SECONDS)
        view = staging.memoryview()
        itemsize = unit.compute_dtype.itemsize
        requests = []
        for piece, at in zip(unit.pieces, unit.staging_offsets):
            record = piece.layout
            for key, start, numel in piece.reads:
                offset = at + start * itemsize
                requests.append(record.swap.read(key, padded_view(view, offset, numel * itemsize), numel * itemsize))
        transfer = self._transfers.move(unit, "nc_start", State.NEW, State.READING)
        transfer.staging, transfer.pending = staging, requests

    def nc_wait(self, unit: Unit, in_graph: bool = True) -> None:
        """Finish the unit's oldest NVMe read: its pinned buffer holds the local shards.

        ``in_graph``: a graph's fetch, whose masters a backward may step next (not one outside any graph).
        """
        self._advance_background()
        transfer = self._transfers.move(unit, "nc_wait", State.READING, State.READ)
        for request in transfer.pending:
            self._wait_working(request)
            request.wait()  # raises AioError for a failed read; abandon_transfers gives the buffer back
        transfer.pending = []
        if in_graph and transfer.staging is not None:
            self._offer_fetched_masters(unit, transfer.staging)

    @staticmethod
    def _offer_fetched_masters(unit: Unit, staging) -> None:
        """The fp32 masters this read brought (``params_in_master``) go to the parameter's early optimizer
        step, which may keep them rather than read them again (runtime/optim/fetched_masters.py)."""
        for piece, at in zip(unit.pieces, unit.staging_offsets):
            record = piece.layout
            listener = grad_listener_of(record) if record.params_in_master else None
            if listener is not None:
                listener.fetched_master(record, staging, at, piece.reads)

    def cg_start(self, unit: Unit) -> None:
        """Start copying the unit's local input (CPU shards, or the nc buffer) to the device."""
        from_nvme = unit.pieces[0].layout.param_tier == "nvme"
        transfer = self._transfers.move(unit, "cg_start", State.READ if from_nvme else State.NEW, State.COPYING)
        staging = transfer.staging
        if self._held_values(unit) is not None:
            if staging is not None:  # read before the unit's values were held: not needed now
                staging.release()
                transfer.staging = None
            return
        self._add_transient("device", unit.sizes.local, what=f"cg_start of {unit.name}", ledger=self._group_of(unit).ledger)
        if unit.values_apart:  # each piece's value a tensor of its own (the gather passes them on)
            on_device = [torch.empty(piece.local_numel, dtype=unit.compute_dtype, device=unit.device)
                         for piece in unit.pieces]
            targets = on_device
        else:
            on_device = torch.empty(unit.local_numel, dtype=unit.compute_dtype, device=unit.device)
            targets, at = [], 0
            for piece in unit.pieces:
                targets.append(on_device[at : at + piece.local_numel])
                at += piece.local_numel
        copies = []
        for index, (piece, target) in enumerate(zip(unit.pieces, targets)):
            numel = piece.local_numel
            if numel == 0:
                continue
            if staging is not None:
                start = unit.staging_offsets[index] // unit.compute_dtype.itemsize + piece.staged_start
                source = staging.tensor(unit.compute_dtype, start + numel)[start:]
            else:
                start, stop = piece.local_range
                source = piece.layout.shard[start:stop]
            copies.append((target, source))
        # One work for the unit's pieces (one launch on CUDA).
        works = [self.copier.copy([t for t, _ in copies], [s for _, s in copies], "cg", f"cg {unit.name}")] if copies else []
        transfer.value, transfer.pending = on_device, works

    def cg_wait(self, unit: Unit) -> None:
        """Finish the unit's oldest device copy: its local input is staged for the gather."""
        transfer = self._transfers.move(unit, "cg_wait", State.COPYING, State.STAGED)
        works, staging, transfer.pending, transfer.staging = transfer.pending, transfer.staging, [], None
        finish_copies(works, staging)

    def _start_gather_from_local_input(self, unit: Unit) -> tuple[Transfer, list[torch.Tensor]]:
        """The unit's transfer, now gathering, and its local input on the device (in one or several parts,
        side by side): staged by cg, cut from shards resting there, or fetched now."""
        if self._transfers.has(unit, State.STAGED):
            transfer = self._transfers.move(unit, "gather_start", State.STAGED, State.GATHERING)
            local, transfer.value = transfer.value, None
            parts = local if unit.values_apart else [local]
            self._add_transient("device", -sum(map(nbytes_of, parts)), ledger=self._group_of(unit).ledger)
            return transfer, parts
        if self._rests_on_device(unit):
            slices = [piece.layout.shard[piece.local_range[0] : piece.local_range[1]] for piece in unit.pieces]
            transfer = self._transfers.move(unit, "gather_start", State.NEW, State.GATHERING)
            return transfer, slices
        # No nc/cg ran for this use (outside a graph, or the offload pass is off): fetch synchronously.
        if unit.pieces[0].layout.param_tier == "nvme":
            self.nc_start(unit)
            self.nc_wait(unit, in_graph=False)
        self.cg_start(unit)
        self.cg_wait(unit)
        return self._start_gather_from_local_input(unit)

    @staticmethod
    def _rests_on_device(unit: Unit) -> bool:
        """Whether the unit's shards rest where its gather runs: the device tier, or the cpu tier on a CPU
        device (the offload pass fetches nothing for those: the same :func:`fetch_steps`)."""
        return not fetch_steps(unit.pieces[0].layout.param_tier, unit.device)

    def gather_start(self, unit: Unit) -> None:
        """Start assembling the unit's parameters (all-gather of slices, or broadcast from the owner)."""
        group = self._group_of(unit)
        if self._held_values(unit) is not None:  # gathered already in this hold: no collective
            source = State.STAGED if self._transfers.has(unit, State.STAGED) else State.NEW
            transfer = self._transfers.move(unit, "gather_start", source, State.GATHERING)
            if transfer.value is not None:  # staged on the device before the values were held
                staged = transfer.value if unit.values_apart else [transfer.value]
                self._add_transient("device", -sum(map(nbytes_of, staged)), ledger=group.ledger)
            transfer.work, transfer.value = DONE, None  # (gather_wait copies the held values)
            self._add_transient("device", unit.sizes.gathered, what=f"gather_start of {unit.name}", ledger=group.ledger)
            return
        transfer, local = self._start_gather_from_local_input(unit)
        self._add_transient("device", unit.sizes.gathered, what=f"gather_start of {unit.name}", ledger=group.ledger)
        if unit.world_size == 1 and unit.partition == "allgather" and not self._rests_on_device(unit):
            # The cg step's fresh device copy already is the whole unit: no collective, no copy.
            transfer.work, transfer.value = DONE, (local if unit.values_apart else local[0])
            return
        transfer.work, transfer.value = start_gather(unit, local, self._shard_comm(unit), group.collective_timeout)

    def gather_wait(self, unit: Unit) -> list[torch.Tensor]:
        """Finish the oldest gather of ``unit``: each piece's full value, in its parameter's dtype."""
        transfer = self._transfers.move(unit, "gather_wait", State.GATHERING, State.DONE)
        matrix = transfer.value
        self._wait_working(transfer.work)
        transfer.work.wait()
        if matrix is None:  # gather_start found the unit held: the graph gets copies it may overwrite
            return [value.clone() for value in self._held_values(unit)]
        group = self._group_of(unit)
        # A bucket's values are copied out of the matrix; both exist until this returns.
        copy_out = unit.sizes.copy_out
        if copy_out:
            self._add_transient("device", copy_out, what=f"gather_wait of {unit.name} (copy-out)", ledger=group.ledger)
        try:
            values = []
            for index, piece in enumerate(unit.pieces):
                if unit.values_apart:  # a list: each piece's own flat value (see Unit.values_apart)
                    value = matrix[index].view(piece.shape)
                else:
                    value = piece.assemble(unit.column_block(matrix, index))
                if value.dtype != piece.layout.dtype:
                    value = value.to(piece.layout.dtype)
                values.append(value)
        finally:
            if copy_out:
                self._add_transient("device", -copy_out, ledger=group.ledger)
        holding = group.held_gathers
        if holding is not None:  # a copy is kept (and counted) until the hold ends, for the next uses
            for piece, value in zip(unit.pieces, values):
                if (piece.layout.uid, piece.tile) not in holding:
                    holding[piece.layout.uid, piece.tile] = value.clone()
                    self._add_transient("device", nbytes_of(value), what=f"hold of {piece.layout.name}",
                                        ledger=group.ledger)
        return values

    def release(self, unit: Unit) -> None:
        """The graph is done with the unit's gathered values: they no longer count as held.

        The memory itself goes when the graph drops its last reference, right
        after this op (the generated code frees values after their last use).
        """
        self._add_transient("device", -unit.sizes.gathered, ledger=self._group_of(unit).ledger)

    # --- holding gathered values across calls (pipeline micro-batches) ---------------------------
    #
    # A pipeline stage runs its graphs once per micro-batch, forward and backward.  While a hold on
    # the stage's model is open, each parameter's first gather keeps a copy of its value (keyed by
    # parameter and tile, not by unit: the forward and backward graphs bucket the same parameters
    # into different units); a later gather of a unit whose every piece is held runs no collective,
    # and the fetch steps before it (nc, cg) only move their transfer's state, so the graph's ops
    # pair as always.  Each use gets a fresh copy of the held values, never the held tensors: the
    # graph owns what gather_wait returns, and Inductor's memory planning reuses an op output's
    # storage after its last use (the backward wrote fc2.weight's gradient into the gathered
    # fc2.weight, same shape: "buf8 = buf3; del buf3  # reuse").  The held values count as device
    # bytes until the hold ends.  Whoever opens a hold must end it before the parameters change (the
    # optimizer step): the values would be stale.

    def hold_gathers(self, groups) -> None:
        """Keep each parameter of the model ``groups`` gathered once from now to :meth:`end_held_gathers`."""
        for group in groups:
            self.end_held_gathers([group])
            group.held_gathers = {}
            self._holding_groups.add(group)

    def end_held_gathers(self, groups) -> None:
        """Drop the values held for ``groups``."""
        for group in groups:
            held, group.held_gathers = group.held_gathers or {}, None
            self._add_transient("device", -sum(map(nbytes_of, held.values())), ledger=group.ledger)
            if group.grad_hold is None:
                self._holding_groups.discard(group)

    def _held_values(self, unit: Unit) -> list[torch.Tensor] | None:
        """The values of the unit's pieces held by an open hold, or None (no hold, or not all held yet)."""
        holding = self._group_of(unit).held_gathers if self._holding_groups else None
        if not holding:
            return None
        values = [holding.get((piece.layout.uid, piece.tile)) for piece in unit.pieces]
        return None if any(value is None for value in values) else values

    def abandon_transfers(self) -> None:
        """Forget every transfer in flight (a graph raised half way): give back pinned buffers and counted bytes.

        Transfers still running finish into buffers nobody reads; without this
        the next call would pair its waits with the stale starts.  Called
        between top-level graph calls, where nothing may be gathered or in flight.
        """
        if not self._transfers and self.process.transient["device"] == 0:
            return
        for transfer in self._transfers:
            if transfer.state in (State.READING, State.READ):
                for request in transfer.pending:
                    try:
                        request.wait()
                    except AioError:
                        pass  # the read's buffer is discarded either way
                transfer.staging.release()
            elif transfer.state is State.COPYING:
                finish_copies(transfer.pending, transfer.staging)
        self._transfers.clear()
        self.process.transient["device"] = 0
        for record in self._records.values():
            record.ledger.transient["device"] = 0
        for group in list(self._holding_groups):
            if group.held_gathers is not None:  # held values stay gathered between calls
                self._add_transient("device", sum(map(nbytes_of, group.held_gathers.values())), ledger=group.ledger)
            if group.grad_hold is not None:  # and held gradients summed
                self._add_transient("device", group.grad_hold.nbytes(), ledger=group.ledger)

