"""Saved activations off the device: copies to host memory or NVMe between forward and backward.

The ``activations`` pass replaces each offloaded value a forward graph saves
for backward with a *handle* (16 bytes of CPU memory with the value's shape
and dtype and zero strides, naming an entry) and brackets it with start/wait
ops:

* forward: :meth:`ActivationStore.offload_start` right after the value is
  computed begins its copy off the device (the copy engine: a side stream on
  CUDA, a worker thread on CPU); :meth:`offload_wait` after its last forward
  use finishes that copy and, for ``nvme``, submits the write of the staged
  bytes to the swap folder (the write then overlaps the rest of forward;
  staging buffers of finished writes are reclaimed at the next op).  Past the
  wait the graph holds no reference, so the device memory is freed.
* backward: :meth:`fetch_start` (placed ahead of use by the schedule pass)
  begins reading the value back into a fresh device tensor with the saved
  shape and strides; :meth:`fetch_wait` returns it.

An entry lives as long as its handle: autograd frees saved tensors after
backward (or with the graph, when backward never runs), and the handle's
storage owns a numpy array whose finalizer drops the entry, its host copy
and its swap file.  So ``retain_graph=True`` and a second backward work, and
a forward whose graph is dropped leaks nothing.

Bytes are counted per tier on the model's ledger (``Ledger.activations``)
and the process's: ``cpu`` (host copies), ``nvme`` (bytes in swap files);
the device tier counts saved values that stay on the device
(:func:`count_saved`).  Nothing here knows FX.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref

import numpy as np
import torch

from .aio import AioEngine
from .copy_engine import COPIER
from .pinned import PinnedPool
from .store import STORE

MIN_POOL_BYTES = 64 << 20


class ZinfActivationError(RuntimeError):
    """A saved activation could not be offloaded or fetched back."""


@dataclasses.dataclass(eq=False)
class _Entry:
    id: int
    name: str
    tier: str  # "cpu" | "nvme"
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    ledger: object  # the model's Ledger, or None (stage 0: no parameters bound)
    engine: AioEngine | None = None
    host: torch.Tensor | None = None  # cpu tier: the copy
    staging: object = None  # nvme tier: the pinned buffer of the copy out, until its write finished
    copy: object = None  # CopyWork of the copy out, until offload_wait
    write: object = None  # AioRequest of the NVMe write, until reaped
    fetch: tuple | None = None  # (device tensor, CopyWork | AioRequest, staging) of a fetch in flight
    dropped: bool = False

    @property
    def key(self) -> str:
        return f"act.{self.id}"


class ActivationStore:
    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._by_address: dict[int, int] = {}  # a live handle's storage address -> its entry id
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._engines: dict[str, AioEngine] = {}
        self._engine_settings: dict[str, dict] = {}
        self._pool: PinnedPool | None = None
        self._writes: list[_Entry] = []  # NVMe writes in flight, oldest first
        self.held = {"cpu": 0, "nvme": 0}  # process-wide bytes of live entries
        self.peak_held = {"cpu": 0, "nvme": 0}

    # --- configuration (at compile time) -----------------------------------------------

    def configure(self, nvme_path: str, block_size: int, queue_depth: int, threads: int) -> None:
        """Swap settings for activations under ``nvme_path`` (their own engine: one copy, no transactions)."""
        self._engine_settings[nvme_path] = dict(block_size=block_size, queue_depth=queue_depth, threads=threads)

    def _engine(self, nvme_path: str) -> AioEngine:
        engine = self._engines.get(nvme_path)
        if engine is None:
            settings = self._engine_settings.get(nvme_path, {})
            engine = self._engines[nvme_path] = AioEngine(nvme_path, copies=1, **settings)
        return engine

    def engines(self) -> list[AioEngine]:
        return list(self._engines.values())

    def _staging(self, nbytes: int):
        """A pinned buffer for an NVMe transfer, reclaiming finished writes first (waits on the oldest)."""
        if self._pool is None or nbytes > self._pool.capacity_bytes:
            self._drain_writes(keep=0)
            if self._pool is not None and self._pool.buffers_in_use:
                raise ZinfActivationError(
                    f"a {nbytes:,}-byte activation does not fit the activation staging pool "
                    f"({self._pool.capacity_bytes:,} bytes) while it is in use")
            if self._pool is not None:
                STORE.process.add_resting("cpu", -self._pool.capacity_bytes)
                self._pool.close()
            self._pool = PinnedPool(max(MIN_POOL_BYTES, 4 * nbytes))
            STORE.process.add_resting("cpu", self._pool.capacity_bytes)
        while True:
            self._reap()
            try:
                return self._pool.acquire(nbytes, timeout=0)
            except TimeoutError:
                if not self._writes:
                    # Fetches prefetched ahead hold the pool, and only this thread's later
                    # waits free them: waiting would deadlock.  A one-off buffer instead.
                    return PinnedPool(nbytes, pin=False).acquire(nbytes)
                self._drain_writes(keep=len(self._writes) - 1)

    @property
    def pool_bytes(self) -> int:
        return self._pool.capacity_bytes if self._pool is not None else 0

    # --- forward ------------------------------------------------------------------------

    def offload_start(self, tensor: torch.Tensor, tier: str, nvme_path: str, name: str, ledger) -> torch.Tensor:
        """Begin copying ``tensor`` off the device; returns its handle (saved for backward instead of it)."""
        if tier not in ("cpu", "nvme"):
            raise ZinfActivationError(f"activation tier must be 'cpu' or 'nvme', got {tier!r}")
        with self._lock:
            self._reap()
            entry = _Entry(id=next(self._ids), name=name, tier=tier, shape=tuple(tensor.shape),
                           stride=tuple(tensor.stride()), dtype=tensor.dtype, device=tensor.device,
                           nbytes=tensor.numel() * tensor.element_size(), ledger=ledger)
            if tier == "cpu":
                entry.host = torch.empty(entry.shape, dtype=entry.dtype, pin_memory=tensor.is_cuda)
                target = entry.host
            else:
                entry.engine = self._engine(nvme_path)
                entry.staging = self._staging(entry.nbytes)
                target = entry.staging.tensor(entry.dtype, tensor.numel()).view(entry.shape)
            entry.copy = COPIER.copy(target, tensor, "activations", f"offload {name}")
            self._entries[entry.id] = entry
            self._count(entry, +1)
        return self._handle(entry, tensor)

    def _handle(self, entry: _Entry, like: torch.Tensor) -> torch.Tensor:
        """16 bytes of CPU memory viewed with ``like``'s shape and dtype, every stride 0.

        The value's own shape and dtype keep AOTAutograd's bookkeeping of saved
        values (Inductor restrides backward inputs after the forward's outputs)
        consistent.  Its storage owns a numpy array whose finalizer drops the
        entry when autograd frees the handle.
        """
        array = np.zeros(2, dtype=np.int64)
        array[0] = entry.id
        weakref.finalize(array, self.drop, entry.id)
        flat = torch.from_numpy(array).view(torch.uint8)[: like.element_size()].view(like.dtype)
        handle = flat.reshape([1] * like.dim()).expand(like.shape)
        self._by_address[handle.untyped_storage().data_ptr()] = entry.id
        return handle

    def is_handle(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._by_address

    def offload_wait(self, handle: torch.Tensor) -> None:
        """Finish the copy off the device (the graph then frees the device value); nvme: submit its write."""
        entry = self._entry(handle, "offload_wait")
        if entry.copy is None:
            return
        entry.copy.wait()
        entry.copy = None
        if entry.tier == "nvme":
            with self._lock:
                entry.write = entry.engine.write(entry.key, entry.staging, entry.nbytes)
                self._writes.append(entry)

    # --- backward -----------------------------------------------------------------------

    def fetch_start(self, handle: torch.Tensor) -> None:
        """Begin bringing the value of ``handle`` back to its device, in a fresh tensor."""
        entry = self._entry(handle, "fetch_start")
        if entry.copy is not None:  # no offload_wait ran (a graph without the pass's wait): finish it now
            self.offload_wait(handle)
        out = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=entry.device)
        if entry.tier == "cpu":
            entry.fetch = (out, COPIER.copy(out, entry.host, "activations", f"fetch {entry.name}"), None)
            return
        with self._lock:
            if entry.write is not None:
                self._finish_write(entry)
            staging = self._staging(entry.nbytes)
        entry.fetch = (out, entry.engine.read(entry.key, staging, entry.nbytes), staging)

    def fetch_wait(self, handle: torch.Tensor) -> torch.Tensor:
        entry = self._entry(handle, "fetch_wait")
        if entry.fetch is None:
            self.fetch_start(handle)
        out, work, staging = entry.fetch
        entry.fetch = None
        work.wait()
        if staging is not None:
            source = staging.tensor(entry.dtype, out.numel()).view(entry.shape)
            COPIER.copy(out, source, "activations", f"fetch {entry.name}").wait()
            staging.release()
        return out

    # --- lifetime -----------------------------------------------------------------------

    def drop(self, entry_id: int) -> None:
        """The handle is gone: free the host copy and the swap file (a write in flight finishes first)."""
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                return
            for address in [address for address, held in self._by_address.items() if held == entry_id]:
                del self._by_address[address]
            entry.dropped = True
            self._count(entry, -1)
            if entry.copy is not None:
                entry.copy.wait()
                entry.copy = None
            if entry.fetch is not None:
                entry.fetch[1].wait()
                if entry.fetch[2] is not None:
                    entry.fetch[2].release()
                entry.fetch = None
            entry.host = None
            if entry.write is not None:
                return  # _reap forgets the key once the write finished
            if entry.staging is not None:
                entry.staging.release()
                entry.staging = None
            if entry.engine is not None:
                entry.engine.forget(entry.key)

    def _entry(self, handle: torch.Tensor, op: str) -> _Entry:
        entry = self._entries.get(self._by_address.get(handle.untyped_storage().data_ptr(), -1))
        if entry is None:
            raise ZinfActivationError(f"{op}: the handle names no saved activation (freed, or not a handle)")
        return entry

    def _finish_write(self, entry: _Entry) -> None:
        try:
            entry.write.wait()
        finally:
            entry.write = None
            if entry in self._writes:
                self._writes.remove(entry)
            entry.staging.release()
            entry.staging = None
            if entry.dropped:
                entry.engine.forget(entry.key)

    def _reap(self) -> None:
        """Reclaim the staging buffers of finished NVMe writes."""
        with self._lock:
            for entry in [entry for entry in self._writes if entry.write.done()]:
                self._finish_write(entry)

    def _drain_writes(self, keep: int) -> None:
        with self._lock:
            while len(self._writes) > keep:
                self._finish_write(self._writes[0])

    def finish(self) -> None:
        """Wait for every NVMe write in flight (tests and shutdown)."""
        self._drain_writes(keep=0)

    def _count(self, entry: _Entry, sign: int) -> None:
        delta = sign * entry.nbytes
        self.held[entry.tier] += delta
        self.peak_held[entry.tier] = max(self.peak_held[entry.tier], self.held[entry.tier])
        STORE.process.add_activations(entry.tier, delta)
        if entry.ledger is not None:
            entry.ledger.root().add_activations(entry.tier, delta)

    def live_entries(self) -> int:
        return len(self._entries)


ACTIVATIONS = ActivationStore()


class _SavedOnDevice:
    """Device bytes one call's autograd node saves, counted until its backward ran or the node died."""

    __slots__ = ("ledger", "nbytes", "__weakref__")

    def __init__(self, ledger, nbytes: int):
        self.ledger = ledger
        self.nbytes = nbytes
        STORE.process.add_activations("device", nbytes)
        if ledger is not None:
            ledger.root().add_activations("device", nbytes)

    def release(self, *_ignored) -> None:
        if self.nbytes:
            STORE.process.add_activations("device", -self.nbytes)
            if self.ledger is not None:
                self.ledger.root().add_activations("device", -self.nbytes)
            self.nbytes = 0

    def __del__(self) -> None:
        self.release()


_SAVED_KEY = "zinf_saved_activations"


def count_saved(nodes: list, inputs: list, ledger) -> int:
    """Count on ``ledger`` the device bytes the autograd ``nodes`` of one call saved (inputs and handles aside).

    Returns the bytes counted.  The count ends when the node's backward has
    run (its saved tensors are freed then) or when the node is freed.
    """
    skip = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    total = 0
    for node in nodes:
        if _SAVED_KEY in node.metadata:
            continue
        try:
            saved = node.saved_tensors
        except RuntimeError:
            continue  # already freed, or not unpackable here
        storages = {}
        for tensor in saved:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in skip or storage.data_ptr() == 0 or ACTIVATIONS.is_handle(tensor):
                continue  # parameters, user inputs, storage-less parameters, handles of offloaded values
            storages[storage.data_ptr()] = storage.nbytes()
        nbytes = sum(storages.values())
        counter = _SavedOnDevice(ledger, nbytes)
        node.metadata[_SAVED_KEY] = counter
        node.register_hook(counter.release)
        total += nbytes
    return total
