"""After an optimizer step: updated masters back to the parameters' tier and the full parameters (part of ParamStore)."""

from __future__ import annotations

from typing import Iterable

import torch

from .records import POOL_WAIT_SECONDS, ParamRecord, finish_oldest_write

# A parameter at least this big is refreshed in place on gloo (one broadcast per rank, ~0.3 ms each
# here); smaller ones share a bucket's gather and its copy-out (~1 MiB of copying costs that much).
REFRESH_IN_PLACE_BYTES = 1 << 20


class PublishSteps:
    """The publish steps of :class:`~.store.ParamStore` (uses its pinned pool, swap writes and transfers)."""

    def publish(self, record: ParamRecord, master: torch.Tensor) -> None:
        """Write an updated fp32 master slice back to the parameter tier, in compute dtype.

        nvme tier: the write runs in the background (up to half the pinned
        pool in flight); :meth:`finish_publish` waits for them.
        """
        if record.param_tier == "nvme":
            if record.owns_state:
                nbytes = record.shard_bytes
                # Up to half the pinned pool in flight (at least one write): the
                # optimizer steps the next chunk of masters meanwhile.
                self._drain_publish_writes(max(self.pinned_pool(nbytes).capacity_bytes // 2 - nbytes, 0))
                staging = self.pinned_pool(nbytes).acquire(nbytes, timeout=POOL_WAIT_SECONDS)
                try:
                    staging.tensor(record.compute_dtype, record.local_numel).copy_(master)
                    requests = self.write_param(record, staging)
                except BaseException:
                    staging.release()
                    raise
                self._publish_writes.append((requests, staging))
        elif master is not record.shard and record.shard.is_cuda and not master.is_cuda:
            # A host master (cpu optimizer tier) back to a shard resting on the device: cast on the host into
            # pinned memory and copied on the copy engine's stream, without blocking the host; finish_publish
            # orders the device's later work after it (torch's pinned allocator keeps the staging until the
            # copy is done).
            staging = torch.empty(record.local_numel, dtype=record.compute_dtype, pin_memory=True)
            staging.copy_(master)
            self._device_publishes.append(self.copier.copy(record.shard, staging, "publish",
                                                           f"{record.name} to the device"))
        elif master is not record.shard:
            record.shard.copy_(master)

    def _drain_publish_writes(self, keep_bytes: int) -> None:
        """Wait for the oldest parameter writes until at most ``keep_bytes`` are in flight."""
        while self._publish_writes and sum(staging.nbytes for _, staging in self._publish_writes) > keep_bytes:
            finish_oldest_write(self._publish_writes)

    def finish_publish(self) -> None:
        """Wait for the parameter writes :meth:`publish` started (before their transaction ends), and order the
        device's later work after its copies to the device (a stream wait: the host goes on)."""
        self._drain_publish_writes(0)
        copies, self._device_publishes = self._device_publishes, []
        for copy in copies:
            copy.wait()

    def refresh_full_params(self, records: Iterable[ParamRecord]) -> None:
        """Stages 1 and 2 keep full parameters: rebuild them from the updated shards."""
        # Frozen parameters never change: nothing to rebuild, no collective to pay.
        records = [r for r in records if r.stage in (1, 2) and r.trainable]
        for record in records:
            if self._shard_is_param(record):
                record.synced_version = record.param._version  # the step's own in-place update
        in_place, bucketed = [], []
        for record in records:
            if not self._shard_is_param(record):
                (in_place if self._refreshed_in_place(record) else bucketed).append(record)
        works = [r.mesh.shard.fill_slices(r.param.data.view(-1), r.shard, f"all_gather of {r.name} (refresh)",
                                          r.group.collective_timeout) for r in in_place]
        units = self._bucketed(bucketed)
        for unit in units:
            self.gather_start(unit)
        for work in works:
            work.wait()
        for unit in units:
            for piece, full in zip(unit.pieces, self.gather_wait(unit)):
                piece.layout.param.data.copy_(full)
            self.release(unit)

    @staticmethod
    def _refreshed_in_place(record: ParamRecord) -> bool:
        """Whether a stage 1-2 parameter is refreshed by filling its own storage from every rank's slice
        (:meth:`Comm.fill_slices`) rather than gathered in a bucket and copied out of it: where the
        group's collectives are rooted ones (gloo), for a parameter of at least ``REFRESH_IN_PLACE_BYTES``
        (below it one collective per parameter costs more than the bucket's copy) laid out as one
        contiguous slice per rank."""
        param = record.param
        return (record.mesh.shard.rooted_collectives and record.partition == "allgather"
                and record.tile_rows is None and record.param_tier != "nvme" and param.dtype == record.compute_dtype
                and param.device == record.shard.device and param.is_contiguous()
                and record.numel * param.element_size() >= REFRESH_IN_PLACE_BYTES)

    @staticmethod
    def _shard_is_param(record: ParamRecord) -> bool:
        """Whether the shard still is the parameter's storage (``param.data = other`` separates them:
        from then on the parameter is rebuilt from the shard after each step, as at world size > 1)."""
        return record.shard_is_param and record.shard.data_ptr() == record.param.data_ptr()

    def sync_written_params(self, records: Iterable[ParamRecord]) -> None:
        """Stages 1-2: carry in-place writes to a full parameter (``load_state_dict``, ``nn.init``,
        ``p.mul_()`` under no_grad) into its shard and master, before the optimizer steps them.

        Such writes bump the parameter's version counter; zinf's own refresh
        writes through ``.data``, which does not.  (Writes through ``.data``
        by the user are not seen.)
        """
        for record in records:
            if record.stage not in (1, 2):
                continue
            param = record.param
            if param._version != record.synced_version:
                self.assign_full(record, param.detach())
                record.synced_version = param._version

    def mark_synced(self, record: ParamRecord) -> None:
        """Stages 1-2: the parameter's current value is what its shard holds (a load wrote both), so that
        :meth:`sync_written_params` finds nothing to write back."""
        record.synced_version = record.param._version

    def full_param(self, record: ParamRecord) -> torch.Tensor:
        """A full copy of the parameter's current value (collective: every rank must call)."""
        if record.stage != 3:
            return record.param.detach().clone()
        unit = self.unit([record])
        self.gather_start(unit)
        full = self.gather_wait(unit)[0].clone()
        self.release(unit)
        return full

