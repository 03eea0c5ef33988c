"""Gradients: reduced over ranks, accumulated into this rank's shard, swapped to NVMe (part of ParamStore)."""

from __future__ import annotations

from typing import Iterable

import torch

from .aio import AioError
from .buckets import bucket_runs
from .collectives import finish_reduce, padded_rows, start_reduce
from .comm import DONE
from .grad_hooks import run_grad_hooks
from .grad_state import GradState
from .ledger import ZinfStoreError
from .model_group import GradHold
from .transfers import TransferState as State
from .records import (GRAD_WRITES_IN_FLIGHT, POOL_WAIT_SECONDS, ParamRecord, grad_listener_of, nbytes_of,
                      tier_memory)
from .units import Unit


class GradientSteps:
    """The gradient steps of :class:`~.store.ParamStore` (uses its records, transfers, swap writes and ledgers).

    A gradient reaches its shard by ``reduce_grad_start`` / ``reduce_grad_wait``
    (from the graph) or :meth:`reduce_full_grads` (stages 1-2, after
    backward); nvme optimizer tiers write it to swap per sub-group, or keep
    it in RAM within ``nvme_grad_ram_bytes``, and tell an early-stepping
    optimizer (runtime/optim/early_adam.py) as it lands.
    """

    def reduce_grad_start(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """Start averaging each piece's gradient over ranks into this rank's slices (or to the owner)."""
        group = self._group_of(unit)
        if len(grads) != len(unit.pieces):
            raise ZinfStoreError(f"reduce_grad_start of {unit.name}: {len(grads)} gradients for "
                                 f"{len(unit.pieces)} parameters")
        # The gradients the graph hands over are device memory too, until this op returns.
        grad_bytes = sum(nbytes_of(grad) for grad in grads)
        self._add_transient("device", grad_bytes, what=f"reduce_grad_start of {unit.name}", ledger=group.ledger)
        try:
            flats = []
            for piece, grad in zip(unit.pieces, grads):
                if piece.tile is None:
                    # Hooks see the whole local gradient before it is averaged, as in eager and DDP.
                    grad = run_grad_hooks(piece.layout.param, grad.detach(), piece.layout.name)
                flat = grad.detach().reshape(-1)
                if flat.numel() != piece.numel:
                    raise ZinfStoreError(f"reduce_grad_start of {piece.layout.name}: a gradient of {flat.numel()} "
                                         f"elements for {piece.numel}")
                if unit.compute_dtype == torch.float16:
                    flat = flat * group.fp16_scaler.scale  # keep small gradients representable in fp16
                flats.append(flat)
            hold = group.grad_hold
            if hold is not None and (flats := self._add_held_sum(unit, flats, hold)) is None:
                transfer = self._transfers.move(unit, "reduce_grad_start", State.NEW, State.REDUCING)
                transfer.work = DONE  # summed into the hold: nothing to reduce or add
                return
            if unit.sizes.reduce == 0:
                # World size 1: nothing to average; add each gradient into its shard now, holding nothing.
                for piece, row in zip(unit.pieces, padded_rows(unit, flats)):
                    self._accumulate(piece, row, private=False)
                transfer = self._transfers.move(unit, "reduce_grad_start", State.NEW, State.REDUCING)
                transfer.work = DONE  # and no value: added already
                return
            self._add_transient("device", unit.sizes.reduce, what=f"reduce_grad_start of {unit.name}",
                                ledger=group.ledger)
            work, out = start_reduce(unit, flats, self._shard_comm(unit), group.collective_timeout)
            transfer = self._transfers.move(unit, "reduce_grad_start", State.NEW, State.REDUCING)
            transfer.work, transfer.value = work, out
        finally:
            self._add_transient("device", -grad_bytes, ledger=group.ledger)

    def reduce_grad_wait(self, unit: Unit) -> None:
        """Finish the oldest reduce of ``unit`` and add each piece's slice to its gradient shard.

        The gradient shard lives where the optimizer steps: on the device, or
        in CPU memory for cpu and nvme optimizer tiers (the device-to-CPU copy
        happens here, right after the reduction).
        """
        transfer = self._transfers.move(unit, "reduce_grad_wait", State.REDUCING, State.DONE)
        out = transfer.value
        self._wait_working(transfer.work)
        transfer.work.wait()
        self._advance_background()
        if out is None:
            return  # added at the start (world size 1)
        group = self._group_of(unit)
        self._add_transient("device", -unit.sizes.reduce, ledger=group.ledger)
        out = finish_reduce(unit, out, unit.pieces[0].layout.mesh, group.collective_timeout)
        if out is None:
            return  # a broadcast partition's gradient is the owner's
        if unit.compute_dtype == torch.float16:
            scaler = self._group_of(unit).fp16_scaler  # the model's own (one model's overflow is not another's)
            out = out.to(torch.float32) / scaler.scale
            scaler.check(out)
        whole = len(unit.pieces) == 1  # ``out`` is then the piece's own, fresh tensor
        for index, piece in enumerate(unit.pieces):
            start = unit.offsets[index]
            self._accumulate(piece, out[start : start + piece.width], private=whole)

    def _accumulate(self, piece, reduced: torch.Tensor, private: bool) -> None:
        """Add a piece's reduced slice into its parameter's gradient shard (or its swap files).

        ``private``: ``reduced`` is a fresh tensor nobody else holds (it may become the shard).
        """
        record = piece.layout
        start, stop = piece.local_range
        if stop == start:
            return
        gradient = record.gradient
        if record.opt_tier == "nvme" and not record.grad_in_ram:
            if (start, stop) == (0, record.local_numel):
                self._swap_grad(record, reduced)
                return
            # A tile: the swap files take the whole slice, so tiles collect in CPU memory first.
            whole, buffer_bytes = gradient.collect_tile(piece.tile, start, stop, reduced, record.local_numel,
                                                        len(record.tile_rows))
            if buffer_bytes:
                self._add_transient("cpu", buffer_bytes, ledger=record.ledger)
            if whole is not None:
                self._swap_grad(record, whole)
            return
        grad_device = record.device if record.opt_tier == "device" else torch.device("cpu")
        whole = (start, stop) == (0, record.local_numel)
        if gradient.state is GradState.NONE:
            if private and whole and reduced.dtype == torch.float32 and reduced.device == grad_device:
                gradient.start(reduced)  # already a copy of our own, in fp32 where the optimizer steps
            elif whole and reduced.is_cuda and grad_device.type == "cpu":
                self._grad_off_the_device(record, reduced, private)
            elif whole:  # the whole shard: one copy, no zeroing first
                gradient.start(reduced.to(device=grad_device, dtype=torch.float32, copy=True))
            else:
                gradient.start(torch.zeros(record.local_numel, dtype=torch.float32, device=grad_device))
                gradient.add(start, stop, reduced)
            self._add_resting(tier_memory(record.opt_tier), gradient.shard_bytes, ledger=record.ledger)
        else:
            gradient.add(start, stop, reduced)
        listener = grad_listener_of(record)
        if listener is not None and listener.arrival(record, piece.tile):
            # (The gradient may still be copying off the device: the listener waits for it where it reads it.)
            listener.start(record, gradient.shard_nowait, owned=False, ready=gradient.arriving)

    def _grad_off_the_device(self, record: ParamRecord, reduced: torch.Tensor, private: bool) -> None:
        """A whole gradient shard to host memory without blocking the host (ZeRO-Offload's gradients leaving
        the device as each bucket is reduced): into pinned memory on the copy engine's stream, while backward
        goes on.  The record's ``gradient.shard`` waits for the copy when first read (the optimizer step)."""
        # Memory the graph handed over may be reused by it once this op returns: copied first, on the device.
        # That copy is held until the copy off the device is done: the ones done by now are let go here.
        while self._grads_to_host and self._grads_to_host[0].done():
            self._grads_to_host.popleft()
        source = reduced if private else reduced.clone()
        shard = torch.empty(record.local_numel, dtype=torch.float32, pin_memory=True)
        copy = self.copier.copy(shard, source, "grads", f"gradient of {record.name} to host")
        self._grads_to_host.append(copy)
        record.gradient.start_arriving(shard, copy)

    def _bucketed(self, records: list[ParamRecord]) -> list[Unit]:
        """Units of ``records`` for the optimizer's own collectives: buckets of up to ``bucket_bytes`` gathered."""
        runs = bucket_runs(records, [record.bucket_bytes for record in records],
                           [id(record.mesh) for record in records])  # (one collective runs on one mesh)
        return [self.unit([records[index] for index in run]) for run in runs]

    def reduce_full_grads(self, records: Iterable[ParamRecord]) -> None:
        """Stage 1: reduce the full ``param.grad`` of each record into its gradient shard, bucketed."""
        records = [record for record in records if record.param.grad is not None]
        units = self._bucketed(records)
        for unit in units:
            self.reduce_grad_start(unit, [piece.layout.param.grad for piece in unit.pieces])
        for unit in units:
            self.reduce_grad_wait(unit)
        for record in records:
            record.param.grad = None

    def _swap_grad(self, record: ParamRecord, reduced: torch.Tensor) -> None:
        """nvme optimizer tier: add a reduced gradient slice to its swap files, sub-group by sub-group.

        The optimizer step streams the gradient from there along with the
        master and moments, so no gradient shard stays in memory.  Writes run
        in the background, at most GRAD_WRITES_IN_FLIGHT sub-groups at once;
        :meth:`finish_grad_writes` drains them.

        A swap write or read that fails (ENOSPC, EIO, ...) does not raise here:
        raising would stop the backward graph half way, leaving its other
        transfers in flight.  The record's gradient is marked lost instead,
        and :meth:`finish_grad_writes` refuses the step until
        :meth:`drop_grads` (``opt.zero_grad()``) discards it.
        """
        reduced = reduced.to(device="cpu", dtype=torch.float32)
        gradient = record.gradient
        # From here on its gradient files may exist: drop_grads deletes them whatever happens below.
        accumulating = gradient.state is GradState.LOST or gradient.to_disk()
        if accumulating:
            # A read must see the previous backward's writes.
            self._drain_grad_writes(0)
        listener = grad_listener_of(record)
        step_now = listener is not None and listener.arrival(record, None)
        if gradient.state is GradState.LOST:
            return  # already incomplete: nothing to add to, the step refuses it until zero_grad
        # The whole gradient for an early step (runtime/optim/early_adam.py), a copy of its own: ``reduced`` may be
        # memory the compiled graph reuses once this op returns, and an accumulated one is only in the staging.
        total = torch.empty(record.local_numel, dtype=torch.float32) if step_now else None
        # What the files hold still waits for its multiplier (clipping or scaling since it was written): applied
        # as it is read back here, since the sum is written with none pending.
        held_multiplier = gradient.multiplier
        sq_norm = 0.0
        for key, start, stop in record.plan.state_swap("grad"):
            numel = stop - start
            self._drain_grad_writes(GRAD_WRITES_IN_FLIGHT - 1)
            staging = self.pinned_pool(numel * 4).acquire(numel * 4, timeout=POOL_WAIT_SECONDS)
            try:
                group = staging.tensor(torch.float32, numel)
                if accumulating:
                    record.swap.read(key, staging, numel * 4).wait()
                    if held_multiplier != 1.0:
                        group.mul_(held_multiplier)
                    group.add_(reduced[start:stop])
                else:
                    group.copy_(reduced[start:stop])
                if total is not None:
                    total[start:stop].copy_(group)
                sq_norm += float(torch.linalg.vector_norm(group, dtype=torch.float64)) ** 2
                request = record.swap.write(key, staging, numel * 4)
            except AioError as err:
                staging.release()
                gradient.lose(err)
                return
            except BaseException as err:
                staging.release()
                gradient.lose(err)  # stopped half way: its files hold a mix
                raise
            self._grad_writes.append((request, staging, record))
        gradient.written(sq_norm)
        if total is not None:
            listener.start(record, total, owned=True)

    def _drain_grad_writes(self, keep: int) -> None:
        """Wait for the oldest gradient writes until ``keep`` are in flight; give their buffers back.

        A failed write marks its record's gradient lost (see :meth:`_swap_grad`)
        and is not raised here, so no later call meets it as a stale error.
        """
        while len(self._grad_writes) > keep:
            request, staging, record = self._grad_writes.pop(0)
            try:
                request.wait()
            except AioError as err:
                record.gradient.lose(err)
            finally:
                staging.release()

    def finish_grad_writes(self, records: Iterable[ParamRecord] | None = None) -> None:
        """Wait for every gradient swap write in flight (before the step reads them).

        Raises :class:`AioError` if the gradient of one of ``records`` (default:
        any) is incomplete because a swap write or read of it failed: a step
        would train on a partial gradient.  Nothing is changed then; after
        ``opt.zero_grad()`` the next backward writes the gradients afresh.
        """
        self._drain_grad_writes(0)
        records = self._records.values() if records is None else records
        lost = [record for record in records if record.gradient.state is GradState.LOST]
        if not lost:
            return
        names = [record.name for record in lost]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        first = lost[0].gradient.lost
        raise AioError(
            f"optimizer step refused: the gradient of {len(lost)} parameter(s) ({shown}) could not be written to "
            f"its NVMe swap files during backward, and a step on a partial gradient would mix steps; no parameter "
            f"or optimizer state was changed. Free space under nvme_path (or point nvme_path at a bigger disk), "
            f"then call opt.zero_grad() (it discards the incomplete gradients) and run the backward again. "
            f"The first failure: {first}"
        ) from first

    # --- holding gradients across calls (pipeline micro-batches) ---------------------------------
    #
    # While a model's gradient hold is open, reduce_grad_start sums each unit's gradients on the
    # device (by unit: the backward graph reduces the same units in every micro-batch) and reduces
    # nothing; in the backward that the hold marks last (a pipeline step's last) it reduces its
    # gradients plus the sum: one reduce per unit per step.  Reducing is linear, so the result is the
    # per-micro-batch reduces' sum.  Costs the units' unsharded gradients on the device for the step.

    def hold_grads(self, groups) -> None:
        """Sum the gradients of the model ``groups`` over backwards from now, unreduced (drops a stale hold)."""
        self.end_held_grads(groups, reduced=False)
        for group in groups:
            group.grad_hold = GradHold()
            self._holding_groups.add(group)

    def reduce_held_grads_next(self, groups) -> None:
        """The next backward of ``groups`` reduces each unit's gradients plus its held sum."""
        for group in groups:
            group.grad_hold.last = True

    def end_held_grads(self, groups, reduced: bool = True) -> None:
        """End the hold: after the backward that reduced the sums (``reduced``: one left unreduced raises),
        or dropping them (a step that raised half way)."""
        for group in groups:
            hold, group.grad_hold = group.grad_hold, None
            if group.held_gathers is None:
                self._holding_groups.discard(group)
            if hold is None:
                continue
            self._add_transient("device", -hold.nbytes(), ledger=group.ledger)
            if reduced and hold.sums:
                raise ZinfStoreError(f"{len(hold.sums)} units' gradients were held over the micro-batches and "
                                     f"not reduced by the last backward (its graph reduced other units)")

    def _add_held_sum(self, unit: Unit, flats: list[torch.Tensor], hold: GradHold) -> list[torch.Tensor] | None:
        """``flats`` plus the unit's held sum, to reduce now (the hold's last backward), or None: summed."""
        group = self._group_of(unit)
        held = hold.sums.pop(unit.key, None)
        if held is not None:
            self._add_transient("device", -sum(map(nbytes_of, held)), ledger=group.ledger)
            flats = [flat + total for flat, total in zip(flats, held)]
        if hold.last:
            return flats
        if held is None:  # (a copy: the graph may reuse its gradients' buffers)
            flats = [flat.clone() for flat in flats]
        hold.sums[unit.key] = flats
        self._add_transient("device", sum(map(nbytes_of, flats)), what=f"held gradients of {unit.name}",
                            ledger=group.ledger)
        return None

    def scale_grads(self, records: Iterable[ParamRecord], factor: float) -> None:
        """Multiply the accumulated gradients of ``records`` by ``factor`` (a pipeline schedule's
        1 / micro-batches): shards in memory now; gradients in swap files when the step reads them, as
        clipping does (their norm, kept for clipping, scales with them; an early step taken on the
        unscaled gradient no longer counts, see runtime/optim/early_adam.py)."""
        for record in records:
            listener = grad_listener_of(record)
            if listener is not None:
                listener.gradient_changed(record)
            record.gradient.scale(factor)

    def drop_grads(self, records: Iterable[ParamRecord]) -> None:
        """Discard the gradients of ``records`` (``opt.zero_grad()``), incomplete ones included."""
        for record in records:
            listener = grad_listener_of(record)
            if listener is not None:
                listener.gradients_dropped(record)
            if record.gradient.on_disk:
                self._drain_grad_writes(0)  # settles the writes in flight; a failure no longer matters here
            shard_bytes, had_files, tile_bytes = record.gradient.drop()
            if shard_bytes:
                self._add_resting(tier_memory(record.opt_tier), -shard_bytes, ledger=record.ledger)
            if tile_bytes:
                self._add_transient("cpu", -tile_bytes, ledger=record.ledger)
            if had_files:
                # Delete the files: the disk then holds what memory_report says.
                for key, _, _ in record.plan.state_swap("grad"):
                    record.swap.forget(key)
