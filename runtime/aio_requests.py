"""The swap engine's requests, their pieces and checksums, and its worker threads (see :mod:`.aio`).

A request is split into ``block_size`` pieces that the workers run with
``os.pwritev`` / ``os.preadv``; :class:`SwapState` is what the engine, its
requests and its workers share (keys, open files, the FIFO of pieces, the
open transaction), guarded by its one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import threading
import time
from collections import OrderedDict, deque

import numpy as np

from .swap_layout import ALIGNMENT
from .trace import Tracer
from .trace import now as trace_now

_SECTOR_WORDS = ALIGNMENT // 8
MAX_OPEN_FILES = 256  # swap files kept open at once; idle ones beyond this are closed (reopened on use)


class AioError(RuntimeError):
    """An NVMe swap operation failed; the message names the key, file and cause."""


class AioChecksumError(AioError):
    """The bytes read back differ from the bytes written."""


def human_bytes(count: float) -> str:
    """``12.0 GiB`` style."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{int(count)} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


# --- checksums -------------------------------------------------------------------

_WEIGHTS = np.arange(1, (64 << 20) // ALIGNMENT + 1, dtype=np.uint64)  # sector weights, up to 64 MiB pieces


def sector_digest(piece: memoryview, first_sector: int) -> int:
    """Checksum of an aligned piece: sector word-sums weighted by the sectors' positions (mod 2**64).

    Position weights make a sector written to the wrong place (or read from
    one) change the checksum, which a plain sum would not notice.
    """
    sums = np.frombuffer(piece, dtype=np.uint64).reshape(-1, _SECTOR_WORDS).sum(axis=1, dtype=np.uint64)
    count = len(sums)
    if count <= len(_WEIGHTS):
        weights = _WEIGHTS[:count] + np.uint64(first_sector)
    else:
        weights = np.arange(first_sector + 1, first_sector + count + 1, dtype=np.uint64)
    return int(np.dot(sums, weights))


# --- state shared by the engine, its requests and its worker threads -----------------
# Nothing below references the AioEngine object, so the engine can be garbage
# collected (and its folder removed) while worker threads sit idle.


@dataclasses.dataclass
class KeyCopy:
    """One complete, checksummed copy of a key: which slot, how many bytes, per-piece checksums."""

    slot: int
    nbytes: int
    digests: np.ndarray


class SwapKey:
    """One swap key: its file, open descriptor, and the metadata (slot, size, checksums) of its good copy."""
    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        self.fd: int | None = None
        self.fd_users = 0  # requests using fd; it is only closed at 0
        self.regions: list[tuple[int, int] | None] = [None, None]  # per slot: (file offset, capacity)
        self.file_end = 0
        self.committed: KeyCopy | None = None  # the last good copy
        self.lost: str | None = None  # copies=1: why the only copy is gone (a failed or aborted write)
        self.writing = False  # a write of this key is in flight
        self.reads = [0, 0]  # reads in flight per slot
        # A complete copy written with hold=True, not yet the good one (see AioEngine.commit_held);
        # ``hold_token`` names the held write in flight, so a later write supersedes it.
        self.held: KeyCopy | None = None
        self.hold_token: object | None = None


class SwapTransaction:
    """The writes of one ``with engine.transaction():`` block, committed together at its end."""
    def __init__(self):
        self.pending: dict[str, KeyCopy] = {}
        self.written: set[str] = set()  # every key a write was started for
        self.open_writes = 0
        self.failure: AioError | None = None
        self.state = "open"  # open | committed | aborted


class SwapState:
    """What an engine, its requests and its worker threads share, guarded by ``lock``."""
    def __init__(self, folder: str, direct: bool, block_size: int, queue_depth: int, copies: int, tracer: Tracer):
        self.tracer = tracer
        self.folder = folder
        self.direct = direct
        self.copies = copies
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.owner_pid = os.getpid()
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # workers wait here for pieces
        self.changed = threading.Condition(self.lock)  # submitters wait here for key state changes
        self.queue: deque = deque()  # (request, piece index)
        # Pieces of background requests: taken only when ``queue`` is empty, by at most
        # ``background_threads`` workers at once (all but one), so a foreground request never waits
        # for more than a piece (the optimizer's steps during backward vs the graph's reads).
        self.background: deque = deque()
        self.background_threads = 1
        self.folder_watch = None  # the process's FolderWatch (runtime/swap_folders.py), set by the engine
        self.background_running = 0
        self.stopping = False
        self.closed = False
        self.threads: list[threading.Thread] = []
        self.keys: dict[str, SwapKey] = {}
        self.open_files: OrderedDict[str, SwapKey] = OrderedDict()  # LRU of keys with an open fd
        self.transaction: SwapTransaction | None = None
        self.bytes_written = 0
        self.bytes_read = 0
        self.pieces_running = 0
        self.busy_since = 0.0
        self.busy_seconds = 0.0

    # Called with the lock held.
    def acquire_fd(self, key: SwapKey) -> int:
        """The key's open file descriptor (opened, evicting the least recently used idle one, if needed)."""
        if key.fd is None:
            while len(self.open_files) >= MAX_OPEN_FILES:
                idle = next((k for k in self.open_files.values() if k.fd_users == 0), None)
                if idle is None:
                    break
                os.close(idle.fd)
                idle.fd = None
                del self.open_files[idle.name]
            flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
            try:
                fd = os.open(key.path, flags, 0o600)
                os.fchmod(fd, 0o600)  # whatever the umask
            except OSError as err:
                raise _io_error("open", key, self, 0, 0, err) from err
            key.fd = fd
            self.open_files[key.name] = key
        self.open_files.move_to_end(key.name)
        key.fd_users += 1
        return key.fd

    def release_fd(self, key: SwapKey) -> None:
        """A user of the key's descriptor is done with it (idle descriptors may be closed)."""
        key.fd_users -= 1


def _trace_track(kind: str, key: str) -> str:
    """The trace track of a swap transfer: parameter fetches are nc, writes of params and gradients offload."""
    if kind == "read" and key.startswith("param."):
        return "nc"
    if kind == "write" and key.startswith(("param.", "grad.")):
        return "offload"
    if key.startswith("act."):
        return "activations"
    return "optimizer io"


class AioRequest:
    """An in-flight read or write: ``wait()`` to finish it (raises on failure), ``done()`` to poll.

    ``in_transaction``: a write started inside ``engine.transaction()``, whose
    failure the transaction raises again when it ends (and commits nothing).
    """

    def __init__(self, state: SwapState, kind: str, key: SwapKey, view: memoryview, nbytes: int, file_offset: int,
                 expected: np.ndarray | None, on_finish):
        self.kind = kind  # "read" | "write"
        self.key = key.name
        self.nbytes = nbytes
        self._state = state
        self._key = key
        self._view = view
        self._file_offset = file_offset
        padded = round_up(nbytes, ALIGNMENT)
        self._pieces = [(start, min(state.block_size, padded - start)) for start in range(0, padded, state.block_size)]
        self._digests = np.zeros(len(self._pieces), dtype=np.uint64) if expected is None else expected
        self._on_finish = on_finish  # called once, lock held, in the thread that finishes the last piece
        self._next_piece = 0
        self._outstanding = 0
        self.error: AioError | None = None
        # A write inside engine.transaction(): its failure also fails the transaction when it ends.
        self.in_transaction = False
        self.background = False  # yields to every other request (see SwapState.background)
        self._event = threading.Event()
        self._submitted = trace_now()

    def done(self) -> bool:
        """True when every piece has finished (successfully or not); ``wait()`` then returns or raises at once."""
        return self._event.is_set()

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; whether every piece has finished (never raises: see :meth:`wait`)."""
        return self._event.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer is complete; raise its :class:`AioError` if it failed."""
        if not self._event.is_set():
            with self._state.tracer.stall(f"wait {self.kind} {self.key}"):
                self._event.wait(timeout)
        if not self._event.is_set():
            raise TimeoutError(f"NVMe swap {self.kind} of {self.key!r} ({human_bytes(self.nbytes)}) "
                               f"still in flight after {timeout} s")
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        status = "failed" if self.error else "done" if self.done() else "in flight"
        return f"AioRequest({self.kind} {self.key!r}, {self.nbytes} bytes, {status})"

    # --- scheduling (lock held) ----------------------------------------------------

    def _submit(self) -> None:
        state = self._state
        if not self._pieces:
            self._finish()
            return
        for _ in range(min(state.queue_depth, len(self._pieces))):
            self._queue().append((self, self._next_piece))
            self._next_piece += 1
            self._outstanding += 1
        state.work.notify(self._outstanding)

    def _queue(self) -> deque:
        return self._state.background if self.background else self._state.queue

    def _piece_finished(self, error: AioError | None) -> bool:
        """Book a finished piece, queue the next one; True when the request is complete."""
        state = self._state
        self._outstanding -= 1
        if error is not None and self.error is None:
            self.error = error
        if self.error is None and self._next_piece < len(self._pieces):
            self._queue().append((self, self._next_piece))
            self._next_piece += 1
            self._outstanding += 1
            state.work.notify()
        if self._outstanding == 0:
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        try:
            self._on_finish(self)
        finally:
            self._view = None  # drop the reference to the caller's buffer
            self._state.tracer.interval(_trace_track(self.kind, self.key), f"{self.kind} {self.key}",
                                        self._submitted, trace_now(), self.nbytes)
            self._state.changed.notify_all()
            self._event.set()

    # --- the I/O itself (worker thread, no lock) ---------------------------------------

    def _run_piece(self, index: int) -> AioError | None:
        if self.error is not None:
            return None  # an earlier piece failed: skip the rest
        start, size = self._pieces[index]
        piece = self._view[start : start + size]
        file_offset = self._file_offset + start
        fd = self._key.fd
        try:
            if self.kind == "write":
                self._digests[index] = sector_digest(piece, start // ALIGNMENT)
                _write_all(fd, piece, file_offset, self._state)
            else:
                done = os.preadv(fd, [piece], file_offset)
                if done != size:
                    raise OSError(errno.EIO, f"short read: {done} of {size} bytes (file truncated?)")
            if not self._state.direct:
                os.posix_fadvise(fd, file_offset, size, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            return _io_error(self.kind, self._key, self._state, self.nbytes, file_offset, err)
        if self.kind == "read" and sector_digest(piece, start // ALIGNMENT) != int(self._digests[index]):
            return AioChecksumError(
                f"NVMe swap file {self._key.path} for {self.key!r} is corrupt: bytes {start:,}-{start + size - 1:,} "
                f"of its {self.nbytes:,} (file offset {file_offset:,}) read back with a different checksum than "
                f"was recorded when they were written; the data was not used. The disk or filesystem under "
                f"nvme_path returned bad data, or something else modified the file."
            )
        return None


def _free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``folder`` (None: unknown)."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _write_all(fd: int, piece: memoryview, file_offset: int, state: SwapState) -> None:
    """Write all of ``piece`` at ``file_offset``, raising ``OSError`` if the disk takes only part of it.

    A filesystem running out of space typically accepts part of a write
    (``pwritev`` returns a short count) and refuses the next one with ENOSPC;
    retrying the rest turns the short count into that error.  Under
    ``O_DIRECT`` the retry starts at the last 4096-aligned byte written (an
    unaligned offset would be refused with EINVAL), rewriting a few bytes.
    """
    size = len(piece)
    done = 0
    while done < size:
        written = os.pwritev(fd, [piece[done:]], file_offset + done)
        progress = done + max(written, 0)
        if state.direct:
            progress -= progress % ALIGNMENT
        if progress <= done:
            # No progress and no error from the kernel: judge by the free space.
            free = _free_bytes(state.folder)
            if free is not None and free < size - done:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise OSError(errno.EIO, f"short write: {done + max(written, 0)} of {size} bytes, and retrying the "
                                     f"rest made no progress")
        done = progress


def _outcome(kind: str, key: SwapKey, state: SwapState) -> str:
    """What a failed ``kind`` transfer of ``key`` left behind, true for nvme_copies 1 and 2."""
    if kind == "read":
        return "the data was not used."
    if state.copies == 2:
        if key.committed is not None:
            return (f"The last good copy of {key.name!r} is kept (nvme_copies=2 keeps two copies of each key), "
                    f"so the state from before this write is still readable.")
        return f"{key.name!r} had no earlier copy: it stays unwritten, nothing older is lost."
    if key.lost is not None:
        return (f"{key.name!r} had one copy (nvme_copies=1) and it is lost: it was being overwritten in place, so "
                f"the state it belongs to is unusable until {key.name!r} is written again in full (nvme_copies=2 "
                f"keeps the last good copy through a failed write).")
    return f"{key.name!r} had no earlier copy (nvme_copies=1): it stays unwritten."


def _io_error(kind: str, key: SwapKey, state: SwapState, nbytes: int, file_offset: int, err: OSError) -> AioError:
    name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else type(err).__name__
    padded = round_up(nbytes, ALIGNMENT)
    root = os.path.dirname(state.folder)
    outcome = _outcome(kind, key, state)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"the write needed {padded:,} bytes" if kind == "write" else f"creating {key.path} needed space"
        if err.errno == errno.ENOSPC:
            cause = f"no space left on device (ENOSPC): the disk under nvme_path ({root}) is full"
            free = _free_bytes(state.folder)
            if free is not None:
                what += f", {free:,} bytes are free there now"
                if free >= padded:
                    what += " (its inodes may be used up, or its last blocks reserved for root)"
        else:
            cause = f"disk quota exceeded (EDQUOT): this user's quota on the disk under nvme_path ({root}) is used up"
        return AioError(
            f"NVMe swap {kind} of {key.name!r} ({human_bytes(nbytes)}, {padded:,} bytes on disk) to {key.path} "
            f"failed: {cause}; {what}. {outcome} Free space there or point nvme_path at a bigger disk."
        )
    where = "to" if kind == "write" else "from" if kind == "read" else "of"
    return AioError(
        f"NVMe swap {kind} of {key.name!r} ({human_bytes(nbytes)}) {where} {key.path} at file offset "
        f"{file_offset:,} failed: {name} ({err.strerror or err}); {outcome}"
    )


def run_worker(state: SwapState) -> None:
    """A worker thread's loop: run queued pieces (foreground first) until the engine stops."""
    while True:
        with state.lock:
            while not (state.queue or state.background and state.background_running < state.background_threads):
                if state.stopping and not state.background:
                    return
                state.work.wait()
            request, index = state.queue.popleft() if state.queue else state.background.popleft()
            if request.background:
                state.background_running += 1
            if state.pieces_running == 0:
                state.busy_since = time.perf_counter()
            state.pieces_running += 1
        try:
            error = request._run_piece(index)
        except Exception as err:  # a bug, not an I/O error: still finish the request
            error = AioError(f"NVMe swap {request.kind} of {request.key!r} failed: {type(err).__name__}: {err}")
        with state.lock:
            state.pieces_running -= 1
            if request.background:
                state.background_running -= 1
                state.work.notify()  # a worker may be waiting for a background slot
            if state.pieces_running == 0:
                state.busy_seconds += time.perf_counter() - state.busy_since
            request._piece_finished(error)


# --- an engine's end: the workers stop, the files and the folder go ---------------------

def finalize_state(state: SwapState) -> None:
    """An engine was garbage collected, or the interpreter exits: shut its state down (owner process only)."""
    if os.getpid() != state.owner_pid:
        return  # a forked child must not remove its parent's swap files
    # A collection can run inside one of our own critical sections (any
    # allocation may trigger it) or in a worker: never block on the lock or
    # join ourselves there, hand the shutdown to a fresh thread instead.
    if threading.current_thread() not in state.threads and state.lock.acquire(timeout=1.0):
        state.lock.release()
        shutdown_state(state)
    else:
        threading.Thread(target=shutdown_state, args=(state,), name="zinf-aio-shutdown").start()


def shutdown_state(state: SwapState) -> None:
    """Finish queued work, stop the workers, close and remove the swap files (an engine's ``close``)."""
    if os.getpid() != state.owner_pid:
        return  # a forked child must not remove its parent's swap files
    with state.lock:
        state.stopping = True
        state.closed = True
        state.work.notify_all()
    for thread in state.threads:
        if thread is not threading.current_thread():
            thread.join()
    with state.lock:
        for key in state.keys.values():
            if key.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(key.fd)
                key.fd = None
        state.open_files.clear()
    shutil.rmtree(state.folder, ignore_errors=True)
    state.folder_watch.unwatch(state)


def byte_view(buffer, writable: bool) -> memoryview:
    """A flat byte view of ``buffer`` (a pinned buffer, a tensor's memory or a bytes-like object)."""
    view = buffer.memoryview() if hasattr(buffer, "memoryview") else memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ValueError("aio buffers must be contiguous")
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("aio read needs a writable buffer")
    return view


def buffer_address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte (0 when empty), for the O_DIRECT alignment check."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


