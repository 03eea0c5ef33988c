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
(:meth:`ActivationStore.count_saved`, runtime/saved_on_device.py).  Nothing here knows FX.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import weakref

import numpy as np
import torch

from .aio import AioEngine
from .swap_folders import FolderWatch
from .swap_layout import ALIGNMENT
from .copy_engine import CopyEngine
from .pinned import PinnedMemory, PinnedPool
from .ledger import Ledger
from .saved_on_device import count_saved

# The NVMe tier stages through one pinned pool (the "activations" quota of the
# process's pinned memory), sized 4x the largest value
# offloaded so far within these bounds.  A value moves in pieces of at most a
# quarter of the pool, each its own swap key: so a 7 GiB logits tensor needs
# 64 MiB of staging, not 28 GiB, and its writes overlap its own copies.
MIN_POOL_BYTES = 64 << 20
MAX_POOL_BYTES = 256 << 20


class ZinfActivationError(RuntimeError):
    """A saved activation could not be offloaded or fetched back."""


class PieceState(enum.Enum):
    """Where one NVMe piece of an offloaded activation is (as runtime/transfers.py's states for parameters):

        NEW -> STAGING -> WRITING -> ON_DISK -> READING -> FETCHED (-> ON_DISK: fetched again)
    """
    NEW = "not staged"  # its bytes are only in the value
    STAGING = "staging"  # its copy into a pinned buffer is in flight
    WRITING = "writing"  # its write is in flight (the staging is held until it lands)
    ON_DISK = "on disk"  # written, staging released
    READING = "reading"  # a fetch's read into staging is in flight
    FETCHED = "fetched"  # copied into the fetch in flight's device tensor


_P = PieceState
# The moves a piece makes; any other raises (a bug in the store, never a silent pairing).
PIECE_MOVES = frozenset({(_P.NEW, _P.STAGING), (_P.STAGING, _P.WRITING), (_P.WRITING, _P.ON_DISK),
                         (_P.ON_DISK, _P.READING), (_P.READING, _P.FETCHED), (_P.FETCHED, _P.ON_DISK)})


@dataclasses.dataclass(eq=False)
class _Piece:
    """One NVMe swap key of an entry: the bytes [offset, offset + nbytes) of the value, in memory order."""

    entry: "_Entry"
    key: str
    offset: int
    nbytes: int
    staging: object = None  # the pinned buffer holding the piece, during its copy out + write or read + copy in
    copy: object = None  # CopyWork of the copy into staging (offload)
    write: object = None  # AioRequest of the write, until reaped
    read: object = None  # AioRequest of the read (fetch)
    state: PieceState = PieceState.NEW

    def move(self, to: PieceState) -> None:
        """Go to state ``to``, if :data:`PIECE_MOVES` allows it."""
        if (self.state, to) not in PIECE_MOVES:
            raise ZinfActivationError(f"activation {self.entry.name}, piece {self.key}: {self.state.value} -> "
                                      f"{to.value} is not a move of the activation store")
        self.state = to


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
    copy: object = None  # cpu tier: CopyWork of the copy out, until offload_wait
    source: torch.Tensor | None = None  # nvme tier: the value's bytes (1-D, memory order) until every piece is staged
    pieces: list = dataclasses.field(default_factory=list)  # nvme tier
    fetch: tuple | None = None  # (device tensor, its 1-D memory-order view, CopyWork | None) of a fetch in flight
    dropped: bool = False

    @property
    def key(self) -> str:
        return f"act.{self.id}"


def _memory_order(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s elements as a 1-D view in memory order, or None when they are not one dense span."""
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


class ActivationStore:
    """The process's offloaded activations (one per process: the ``Runtime``'s ``activations``, runtime/process.py).

    ``process``: the process-wide ledger its held bytes are counted in;
    ``copier``: the copy engine its device <-> host copies run on (its tracer
    draws the swap engines' transfers too); ``pinned_memory``: the allocator
    its NVMe staging pool is a quota of (which counts the pool's bytes);
    ``folder_watch``: what removes the swap engines' folders on SIGTERM (None:
    each engine its own).
    """

    def __init__(self, process: Ledger, copier: CopyEngine, pinned_memory: PinnedMemory,
                 folder_watch: FolderWatch | None = None) -> None:
        self.process = process
        self.copier = copier
        self._pinned_memory = pinned_memory
        self._folder_watch = folder_watch
        self._entries: dict[int, _Entry] = {}
        self._by_address: dict[int, int] = {}  # a live handle's storage address -> its entry id
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._engines: dict[str, AioEngine] = {}
        self._engine_settings: dict[str, dict] = {}
        self._pool: PinnedPool | None = None
        self.min_pool_bytes = MIN_POOL_BYTES
        self.max_pool_bytes = MAX_POOL_BYTES
        self._copies: list[_Piece] = []  # copies into staging whose write is not submitted yet
        self._writes: list[_Piece] = []  # NVMe writes in flight, oldest first
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
            engine = self._engines[nvme_path] = AioEngine(nvme_path, copies=1, tracer=self.copier.tracer,
                                                          folder_watch=self._folder_watch, **settings)
        return engine

    def engines(self) -> list[AioEngine]:
        """The swap engines activations were offloaded through (one per nvme_path)."""
        return list(self._engines.values())

    # --- staging ------------------------------------------------------------------------

    def set_staging_bounds(self, min_bytes: int, max_bytes: int) -> None:
        """Bound the NVMe staging pool (default 64-256 MiB); the idle pool is rebuilt at the next offload."""
        if not 0 < min_bytes <= max_bytes:
            raise ValueError(f"staging bounds must satisfy 0 < min <= max, got {min_bytes:,} and {max_bytes:,}")
        with self._lock:
            self.finish()
            if self._pool is not None and self._pool.buffers_in_use:
                raise ZinfActivationError("the activation staging pool is in use (a fetch or copy in flight)")
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            self.min_pool_bytes, self.max_pool_bytes = min_bytes, max_bytes

    def _grow_pool(self, nbytes: int) -> None:
        """Size the pool for values of ``nbytes`` (4x, within the bounds) while none of it is in use."""
        wanted = max(self.min_pool_bytes, min(4 * nbytes, self.max_pool_bytes))
        if self._pool is not None and (self._pool.capacity_bytes >= wanted or self._pool.buffers_in_use):
            return  # big enough, or busy: pieces fit any pool
        if self._pool is not None:
            self._pool.close()
        self._pool = self._pinned_memory.quota("activations", wanted)

    def _piece_bytes(self) -> int:
        return max(ALIGNMENT, self._pool.capacity_bytes // 4 // ALIGNMENT * ALIGNMENT)

    def _try_staging(self, nbytes: int):
        """A pinned buffer if one is free now (finished writes reclaimed first), else None."""
        self._reap()
        try:
            return self._pool.acquire(nbytes, timeout=0)
        except TimeoutError:
            return None

    def _staging(self, nbytes: int):
        """A pinned buffer, waiting for the oldest NVMe write to finish while none is free."""
        while True:
            buffer = self._try_staging(nbytes)
            if buffer is not None:
                return buffer
            if not self._writes:
                # Fetches prefetched ahead hold the pool, and only this thread's later
                # waits free them: waiting would deadlock.  A one-off piece-sized buffer instead
                # (pageable memory of its own, outside the activations quota, freed with the buffer).
                return PinnedPool(nbytes, pin=False).acquire(nbytes)
            self._finish_write(self._writes[0])

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pinned staging pool for activation offload (0 before any)."""
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
            # A view with gaps (q of a fused qkv) has no memory-order span of its own: its
            # elements leave in logical order, and the fetch writes them back with the
            # value's own strides (into a fresh tensor spanning them).
            flat = _memory_order(tensor)
            if tier == "cpu":
                entry.host = torch.empty(entry.shape, dtype=entry.dtype, pin_memory=tensor.is_cuda)
                entry.copy = self.copier.copy(entry.host, tensor, "activations", f"offload {name}")
            else:
                entry.engine = self._engine(nvme_path)
                if flat is None:
                    flat = tensor.contiguous().reshape(-1)
                entry.source = flat.view(torch.uint8) if flat.numel() else flat
                self._grow_pool(entry.nbytes)
                step = self._piece_bytes()
                entry.pieces = [_Piece(entry, f"{entry.key}.{index}", offset, min(step, entry.nbytes - offset))
                                for index, offset in enumerate(range(0, entry.nbytes, step))]
                self._stage_out(entry, block=False)
            self._entries[entry.id] = entry
            self._count(entry, +1)
        return self._handle(entry, tensor)

    def _stage_out(self, entry: _Entry, block: bool) -> None:
        """Start copying pieces into staging: as far as buffers are free, or (``block``) the next one."""
        for piece in entry.pieces:
            if piece.state is not PieceState.NEW or entry.source is None:
                continue
            piece.staging = self._staging(piece.nbytes) if block else self._try_staging(piece.nbytes)
            if piece.staging is None:
                return
            piece.move(PieceState.STAGING)
            target = piece.staging.tensor(torch.uint8, piece.nbytes)
            source = entry.source[piece.offset: piece.offset + piece.nbytes]
            piece.copy = self.copier.copy(target, source, "activations", f"offload {entry.name}")
            self._copies.append(piece)
            if block:
                return

    def _submit_write(self, piece: _Piece) -> None:
        # The disk reads the staging buffer next: the host waits for the copy itself (on CUDA, its event).
        piece.copy.synchronize()
        piece.copy = None
        self._copies.remove(piece)
        piece.move(PieceState.WRITING)
        piece.write = piece.entry.engine.write(piece.key, piece.staging, piece.nbytes)
        self._writes.append(piece)

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
        """Whether ``tensor`` is the CPU handle an offloaded activation left in the graph."""
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._by_address

    def offload_wait(self, handle: torch.Tensor) -> None:
        """Finish the copy off the device (the graph then frees the device value); nvme: submit its writes.

        A value larger than the free staging is streamed here: each piece's
        write is submitted as soon as its copy landed, and later pieces wait
        for earlier writes to free staging.
        """
        entry = self._entry(handle, "offload_wait")
        if entry.tier == "cpu":
            if entry.copy is not None:
                entry.copy.wait()
                entry.copy = None
            return
        with self._lock:
            if entry.source is None:
                return
            for piece in entry.pieces:
                if piece.state not in (PieceState.NEW, PieceState.STAGING):
                    continue  # its write was submitted
                if piece.staging is None:
                    self._stage_out(entry, block=True)
                if piece.copy is not None:
                    self._submit_write(piece)
                self._stage_out(entry, block=False)  # later pieces into whatever staging the reap freed
            entry.source = None

    # --- backward -----------------------------------------------------------------------

    def fetch_start(self, handle: torch.Tensor) -> None:
        """Begin bringing the value of ``handle`` back to its device, in a fresh tensor."""
        entry = self._entry(handle, "fetch_start")
        if entry.fetch is not None:
            return
        if entry.tier == "cpu" and entry.copy is not None:  # no offload_wait ran: finish the copy first
            self.offload_wait(handle)
        if entry.tier == "nvme" and entry.source is not None:
            self.offload_wait(handle)
        out = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=entry.device)
        if entry.tier == "cpu":
            entry.fetch = (out, None, self.copier.copy(out, entry.host, "activations", f"fetch {entry.name}"))
            return
        flat = _memory_order(out)
        if flat is None:  # a view with gaps: assembled contiguous, then copied into ``out``
            flat = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        entry.fetch = (out, flat.view(torch.uint8) if flat.numel() else flat, None)
        with self._lock:
            for piece in entry.pieces:
                if piece.state is PieceState.FETCHED:
                    piece.move(PieceState.ON_DISK)  # fetched before (a second backward): read again
            self._read_pieces(entry, block=False)

    def _read_pieces(self, entry: _Entry, block: bool) -> None:
        """Start reading pieces into staging (as far as buffers are free, or the next one when ``block``)."""
        for piece in entry.pieces:
            if piece.state in (PieceState.READING, PieceState.FETCHED):
                continue
            if piece.write is not None:
                self._finish_write(piece)
            piece.staging = self._staging(piece.nbytes) if block else self._try_staging(piece.nbytes)
            if piece.staging is None:
                return
            piece.move(PieceState.READING)
            piece.read = entry.engine.read(piece.key, piece.staging, piece.nbytes)
            if block:
                return

    def fetch_wait(self, handle: torch.Tensor) -> torch.Tensor:
        """Finish the fetch of ``handle``'s activation: its value back on the device, as saved."""
        entry = self._entry(handle, "fetch_wait")
        if entry.fetch is None:
            self.fetch_start(handle)
        out, flat, copy = entry.fetch
        entry.fetch = None
        if entry.tier == "cpu":
            copy.wait()
            return out
        for piece in entry.pieces:
            with self._lock:
                if piece.read is None:
                    self._read_pieces(entry, block=True)
            piece.read.wait()
            piece.read = None
            piece.move(PieceState.FETCHED)
            source = piece.staging.tensor(torch.uint8, piece.nbytes)
            # The staging buffer is reused once released: wait for the copy on the host.
            self.copier.copy(flat[piece.offset: piece.offset + piece.nbytes], source, "activations",
                        f"fetch {entry.name}").synchronize()
            piece.staging.release()
            piece.staging = None
            with self._lock:
                self._read_pieces(entry, block=False)  # the freed buffer takes the next piece
        if flat.numel() and flat.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            out.copy_(flat.view(entry.dtype).view(entry.shape))  # a view with gaps, assembled apart
        return out

    # --- lifetime -----------------------------------------------------------------------

    def drop(self, entry_id: int) -> None:
        """The handle is gone: free the host copy and the swap files (writes in flight finish first)."""
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                return
            for address in [address for address, held in self._by_address.items() if held == entry_id]:
                del self._by_address[address]
            entry.dropped = True
            self._count(entry, -1)
            if entry.copy is not None:
                entry.copy.synchronize()
                entry.copy = None
            entry.host = None
            entry.source = None
            entry.fetch = None
            for piece in entry.pieces:
                if piece.copy is not None:
                    piece.copy.synchronize()
                    piece.copy = None
                    self._copies.remove(piece)
                if piece.read is not None:
                    piece.read.wait()
                    piece.read = None
                if piece.write is not None:
                    continue  # _reap forgets the key once the write finished
                if piece.staging is not None:
                    piece.staging.release()
                    piece.staging = None
                entry.engine.forget(piece.key)

    def _entry(self, handle: torch.Tensor, op: str) -> _Entry:
        entry = self._entries.get(self._by_address.get(handle.untyped_storage().data_ptr(), -1))
        if entry is None:
            raise ZinfActivationError(f"{op}: the handle names no saved activation (freed, or not a handle)")
        return entry

    def _finish_write(self, piece: _Piece) -> None:
        try:
            piece.write.wait()
        finally:
            piece.write = None
            piece.move(PieceState.ON_DISK)
            if piece in self._writes:
                self._writes.remove(piece)
            piece.staging.release()
            piece.staging = None
            if piece.entry.dropped:
                piece.entry.engine.forget(piece.key)

    def _reap(self) -> None:
        """Submit the writes of pieces whose copy landed; reclaim the staging of finished writes."""
        with self._lock:
            for piece in [piece for piece in self._copies if piece.copy.done()]:
                self._submit_write(piece)
            for piece in [piece for piece in self._writes if piece.write.done()]:
                self._finish_write(piece)

    def finish(self) -> None:
        """Wait for every NVMe write in flight (tests and shutdown)."""
        with self._lock:
            while self._writes:
                self._finish_write(self._writes[0])

    def _count(self, entry: _Entry, sign: int) -> None:
        delta = sign * entry.nbytes
        self.held[entry.tier] += delta
        self.peak_held[entry.tier] = max(self.peak_held[entry.tier], self.held[entry.tier])
        self.process.add_activations(entry.tier, delta)
        if entry.ledger is not None:
            entry.ledger.add_activations(entry.tier, delta)

    def live_entries(self) -> int:
        """Offloaded activations not yet fetched and freed (0 between steps: none leaked)."""
        return len(self._entries)

    def count_saved(self, nodes: list, inputs: list, ledger) -> int:
        """Count on ``ledger`` (and the process's) the device bytes the autograd ``nodes`` of one call saved,
        inputs and this store's handles aside; returns the bytes counted (see runtime/saved_on_device.py)."""
        return count_saved(nodes, inputs, ledger, self.process, self.is_handle)
