"""Async bulk tensor I/O to swap files under ``nvme_path``.

``AioEngine.write(key, buffer, nbytes)`` / ``read(key, into, nbytes)``
return an :class:`AioRequest` at once; ``wait()`` blocks until the transfer
is done and raises on error, ``done()`` polls.  Many requests may be in
flight at once, from any thread.

Backend.  This is the "threads" backend (``engine.backend``): a transfer is
split into ``block_size`` pieces executed by ``threads`` worker threads
with ``os.pwritev`` / ``os.preadv`` (they release the GIL).  Each request
keeps at most ``queue_depth`` pieces queued or running: when one finishes,
the worker queues the request's next piece at the tail of the shared FIFO.
So requests interleave piece by piece, and a small read issued behind a
256 MiB write waits for at most ``queue_depth`` of its pieces, not all of
them.  An io_uring backend (kernel queue, no threads) would be a second
class with the same interface, chosen at runtime where the kernel and
liburing allow it.

Files.  ``AioEngine(folder)`` makes a private folder (mode 0700)
``zinf-swap-<pid>-<owner>-<random>`` under ``folder`` (the user's
``nvme_path``), where ``<owner>`` identifies the process beyond its pid (its
start time, pid namespace, boot and host; see :func:`remove_stale_folders`);
each key is one file in it (mode 0600), opened with ``O_DIRECT`` so the page
cache is bypassed.  A filesystem that refuses ``O_DIRECT`` (tmpfs) gets
buffered I/O with ``posix_fadvise(DONTNEED)`` instead; ``engine.direct``
says which.  The folder is removed by ``close()``, when the engine is
garbage collected, at interpreter exit (SIGINT included) and on a SIGTERM
that would end the process (never by a forked child).  A
killed process removes nothing, so each new engine first removes the
folders under ``folder`` left by processes that no longer exist.
Swap files are scratch for this process: nothing is fsync-ed.

Alignment.  ``O_DIRECT`` needs 4096-aligned memory, offsets and sizes, so
``nbytes`` is padded up to a multiple of 4096 internally: the buffer must
hold ``ceil(nbytes / 4096) * 4096`` bytes and start at an aligned address.
:class:`~zinf_compiler.runtime.pinned.PinnedPool` blocks satisfy both.
A read fills the padding too.

No partial state is taken as good.  With ``copies=2`` (the option
``nvme_copies``, default) each key's file holds two slots; a write goes to
the slot that does not hold the key's last good copy, and the key's metadata
(slot, size, checksums) switches to it only when every piece has been
written.  A failed write (ENOSPC, EIO, ...) therefore leaves the previous
copy readable.  Inside ``with engine.transaction():`` the switches happen
together at the end of the block, and only if it ends without an error and
every write in it succeeded: an optimizer step that fails half way leaves
every key at the previous step.  With ``copies=1`` a write overwrites the
only copy in place, so a failed write (or an aborted transaction) leaves the
key *lost*: reading it raises, naming why, until a later write completes.
Writes of one key are serialized (a second write waits for the first); reads
see the newest completed write (inside a transaction: including its own
writes).  A full disk often takes part of a write before it refuses the
rest: the rest is retried, so the error is the disk's ENOSPC, not a short
write.

Checksums.  Every write records, per piece, a 64-bit checksum of the bytes
written: the 4096-byte sectors' sums of 64-bit words, weighted by the
sector's position (numpy, ~12 GB/s on one core, computed by the worker
threads so it overlaps the I/O; zlib.crc32 runs at ~2 GB/s here, as slow as
the disk).  Every read verifies them and raises :class:`AioChecksumError`
naming the key, the file and the damaged byte range; bad data is never
returned as good.

Stats: ``bytes_written``, ``bytes_read`` (completed transfers),
``busy_seconds`` (wall time with at least one piece in flight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict, deque

import numpy as np

from .trace import TRACER
from .trace import now as trace_now

log = logging.getLogger("zinf")

ALIGNMENT = 4096
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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def validate_folder(folder: str | None, needed_bytes: int) -> None:
    """Fail early, naming the option ``nvme_path``, if ``folder`` cannot hold ``needed_bytes`` of swap.

    Raises :class:`AioError` if the folder is missing, not a folder, not
    writable, or on a filesystem with less than ``needed_bytes`` free.
    """
    if not folder:
        raise AioError("NVMe offload needs the option nvme_path: a folder on a fast local disk")
    if not os.path.exists(folder):
        raise AioError(f"nvme_path {folder!r} does not exist; create it first (mkdir -p {folder}) "
                       f"or point nvme_path at an existing folder on a fast local disk")
    if not os.path.isdir(folder):
        raise AioError(f"nvme_path {folder!r} is not a folder; point nvme_path at a folder on a fast local disk")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AioError(f"nvme_path {folder!r} is not writable by this process (uid {os.geteuid()}); "
                       f"fix its permissions or point nvme_path elsewhere")
    stats = os.statvfs(folder)
    available = stats.f_bavail * stats.f_frsize
    if available < needed_bytes:
        raise AioError(
            f"nvme_path {folder!r} is too small for the swap files: needs {human_bytes(needed_bytes)} "
            f"({needed_bytes:,} bytes), {human_bytes(available)} free ({available:,} bytes); "
            f"free space there or point nvme_path at a bigger disk"
        )


# --- checksums -------------------------------------------------------------------

_WEIGHTS = np.arange(1, (64 << 20) // ALIGNMENT + 1, dtype=np.uint64)  # sector weights, up to 64 MiB pieces


def _digest(piece: memoryview, first_sector: int) -> int:
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
class _Copy:
    """One complete, checksummed copy of a key: which slot, how many bytes, per-piece checksums."""

    slot: int
    nbytes: int
    digests: np.ndarray


class _Key:
    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        self.fd: int | None = None
        self.fd_users = 0  # requests using fd; it is only closed at 0
        self.regions: list[tuple[int, int] | None] = [None, None]  # per slot: (file offset, capacity)
        self.file_end = 0
        self.committed: _Copy | None = None  # the last good copy
        self.lost: str | None = None  # copies=1: why the only copy is gone (a failed or aborted write)
        self.writing = False  # a write of this key is in flight
        self.reads = [0, 0]  # reads in flight per slot
        # A complete copy written with hold=True, not yet the good one (see AioEngine.commit_held);
        # ``hold_token`` names the held write in flight, so a later write supersedes it.
        self.held: _Copy | None = None
        self.hold_token: object | None = None


class _Transaction:
    def __init__(self):
        self.pending: dict[str, _Copy] = {}
        self.written: set[str] = set()  # every key a write was started for
        self.open_writes = 0
        self.failure: AioError | None = None
        self.state = "open"  # open | committed | aborted


class _State:
    def __init__(self, folder: str, direct: bool, block_size: int, queue_depth: int, copies: int):
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
        self.background_running = 0
        self.stopping = False
        self.closed = False
        self.threads: list[threading.Thread] = []
        self.keys: dict[str, _Key] = {}
        self.open_files: OrderedDict[str, _Key] = OrderedDict()  # LRU of keys with an open fd
        self.transaction: _Transaction | None = None
        self.bytes_written = 0
        self.bytes_read = 0
        self.pieces_running = 0
        self.busy_since = 0.0
        self.busy_seconds = 0.0

    # Called with the lock held.
    def acquire_fd(self, key: _Key) -> int:
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

    def release_fd(self, key: _Key) -> None:
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

    def __init__(self, state: _State, kind: str, key: _Key, view: memoryview, nbytes: int, file_offset: int,
                 expected: np.ndarray | None, on_finish):
        self.kind = kind  # "read" | "write"
        self.key = key.name
        self.nbytes = nbytes
        self._state = state
        self._key = key
        self._view = view
        self._file_offset = file_offset
        padded = _round_up(nbytes, ALIGNMENT)
        self._pieces = [(start, min(state.block_size, padded - start)) for start in range(0, padded, state.block_size)]
        self._digests = np.zeros(len(self._pieces), dtype=np.uint64) if expected is None else expected
        self._on_finish = on_finish  # called once, lock held, in the thread that finishes the last piece
        self._next_piece = 0
        self._outstanding = 0
        self.error: AioError | None = None
        # A write inside engine.transaction(): its failure also fails the transaction when it ends.
        self.in_transaction = False
        self.background = False  # yields to every other request (see _State.background)
        self._event = threading.Event()
        self._submitted = trace_now()

    def done(self) -> bool:
        """True when every piece has finished (successfully or not); ``wait()`` then returns or raises at once."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer is complete; raise its :class:`AioError` if it failed."""
        if not self._event.is_set():
            with TRACER.stall(f"wait {self.kind} {self.key}"):
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
            TRACER.interval(_trace_track(self.kind, self.key), f"{self.kind} {self.key}", self._submitted,
                            trace_now(), self.nbytes)
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
                self._digests[index] = _digest(piece, start // ALIGNMENT)
                _write_all(fd, piece, file_offset, self._state)
            else:
                done = os.preadv(fd, [piece], file_offset)
                if done != size:
                    raise OSError(errno.EIO, f"short read: {done} of {size} bytes (file truncated?)")
            if not self._state.direct:
                os.posix_fadvise(fd, file_offset, size, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            return _io_error(self.kind, self._key, self._state, self.nbytes, file_offset, err)
        if self.kind == "read" and _digest(piece, start // ALIGNMENT) != int(self._digests[index]):
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


def _write_all(fd: int, piece: memoryview, file_offset: int, state: _State) -> None:
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


def _outcome(kind: str, key: _Key, state: _State) -> str:
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


def _io_error(kind: str, key: _Key, state: _State, nbytes: int, file_offset: int, err: OSError) -> AioError:
    name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else type(err).__name__
    padded = _round_up(nbytes, ALIGNMENT)
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


def _worker(state: _State) -> None:
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


def _finalize(state: _State) -> None:
    """The engine was garbage collected, or the interpreter exits: shut down (owner process only)."""
    if os.getpid() != state.owner_pid:
        return  # a forked child must not remove its parent's swap files
    # A collection can run inside one of our own critical sections (any
    # allocation may trigger it) or in a worker: never block on the lock or
    # join ourselves there, hand the shutdown to a fresh thread instead.
    if threading.current_thread() not in state.threads and state.lock.acquire(timeout=1.0):
        state.lock.release()
        _shutdown(state)
    else:
        threading.Thread(target=_shutdown, args=(state,), name="zinf-aio-shutdown").start()


def _shutdown(state: _State) -> None:
    """Finish queued work, stop the workers, close and remove the swap files."""
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
    _LIVE_FOLDERS.pop(id(state), None)


# --- SIGTERM: remove the swap folders before dying -------------------------------------
# SIGINT raises KeyboardInterrupt, so the interpreter exits and the finalizers
# run; SIGTERM's default action (torchrun's way of stopping the other ranks
# when one fails, and a scheduler's) ends the process at once, leaving every
# swap folder behind until the next start.  While a swap folder exists, a
# SIGTERM that would kill the process first removes them.

_LIVE_FOLDERS: dict[int, str] = {}  # id(state) -> swap folder of this process's open engines
_SIGTERM_INSTALLED = False


def _remove_folders_then_die(signum, frame) -> None:
    # No locks, no joins: the signal may arrive inside any critical section.  Open
    # files of unlinked swap keys just vanish when the process ends right after.
    for folder in list(_LIVE_FOLDERS.values()):
        shutil.rmtree(folder, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watch_sigterm() -> None:
    """Install the SIGTERM cleanup once, only over the default action (a user's own handler is kept)."""
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _remove_folders_then_die)
    _SIGTERM_INSTALLED = True


# --- swap folders left by killed runs ---------------------------------------------------
# A process killed by SIGKILL or the OOM killer (or a crashed node) never runs
# its finalizer, so its swap folder, possibly hundreds of GiB, would stay under
# nvme_path forever.  Each folder's name says whose it is, so a later engine can
# tell a dead owner's folder from a live one's without any lock file.

_FOLDER_NAME = re.compile(
    r"zinf-swap-(?P<pid>\d+)-"
    r"(?:(?P<start>\d+)\.(?P<pidns>\d+)\.(?P<boot>[0-9a-f]{8})\.(?P<host>[0-9a-f]{8})-)?"
    r"[a-z0-9_]{8}"  # tempfile.mkdtemp's random part
)


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22).

    None: no such process (or no /proc).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # Field 2 (the command name, in parentheses) may itself hold spaces and parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])


def _start_seconds(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (None: no such process, or no /proc)."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _owner_tag() -> str | None:
    """``<start ticks>.<pid namespace>.<boot id>.<host>`` of this process, for its folder's name (None: no /proc).

    The pid alone does not identify a process: pids are reused, mean nothing
    in another pid namespace (a container) and nothing after a reboot or on
    another machine sharing the disk.  With the start time, namespace, boot id
    and host hash, :func:`remove_stale_folders` can tell all of these apart.
    """
    try:
        with open("/proc/self/stat", "rb") as handle:
            own_pid = int(handle.read().split(b" ", 1)[0])
        # A /proc of another pid namespace (a container seeing the host's) would
        # describe other processes under our pids: then nothing can be judged.
        start = _start_ticks(os.getpid()) if own_pid == os.getpid() else None
        namespace = re.fullmatch(r"pid:\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip().replace("-", "")[:8]
    except (OSError, ValueError, IndexError):
        return None
    if start is None or namespace is None or not re.fullmatch(r"[0-9a-f]{8}", boot):
        return None
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"{start}.{namespace.group(1)}.{boot}.{host}"


def _stale_reason(match: re.Match, info: os.stat_result, mine: list[str]) -> str | None:
    """Why the folder named by ``match`` belongs to no live process (None: it may, so it stays)."""
    pid = int(match["pid"])
    _, my_namespace, my_boot, my_host = mine
    if match["start"] is not None:
        if match["host"] != my_host:
            return None  # another machine sharing this disk: its processes cannot be seen from here
        if match["boot"] != my_boot:
            return "made before this machine last booted"
        if match["pidns"] != my_namespace:
            return None  # another pid namespace (a container): its pids mean other processes here
        started = _start_ticks(pid)
        if started is None:
            return f"process {pid} has exited"
        if started != int(match["start"]):
            return f"process {pid} has exited and its pid was reused"
        return None
    # Made before folder names carried the owner: judged by the pid and times alone.
    started = _start_seconds(pid)
    if started is None:
        return f"process {pid} has exited"
    # The owner started before it made the folder, and the folder's mtime is
    # no earlier than that; a process that started later reuses the pid.  2 s
    # of slack: the boot time in /proc/stat has whole seconds.
    if started > info.st_mtime + 2.0:
        return f"process {pid} has exited and its pid was reused by a process that started after the folder was made"
    return None


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def remove_stale_folders(root: str) -> list[str]:
    """Remove the swap folders under ``root`` whose process no longer exists; return what was removed.

    Only folders named ``zinf-swap-<pid>-...``, owned by this user, are
    considered.  One whose name carries its owner (start time, pid namespace,
    boot, host; see :func:`_owner_tag`) is stale when it was made before the
    last boot, or when ``<pid>`` is gone or is now a different process (its
    start time differs).  One of another host or pid namespace is never
    removed: whether its process lives cannot be seen from here.  One without
    the owner (made by an older zinf) is stale when ``<pid>`` is gone or
    started after the folder last changed.  A live process's folder is never
    removed.  Logs a warning naming each folder removed.
    """
    mine = _owner_tag()
    if mine is None:
        return []  # no /proc: nothing can be judged, nothing is removed
    mine_fields = mine.split(".")
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        reason = _stale_reason(match, info, mine_fields)
        if reason is None:
            continue
        size = _tree_bytes(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)  # another engine may be removing it at the same time
        if os.path.lexists(entry.path):
            log.warning("zinf: could not remove the stale swap folder %s (%s) under nvme_path; remove it by hand",
                        entry.path, reason)
            continue
        removed.append(f"{entry.path} ({reason}; {human_bytes(size)})")
    if removed:
        log.warning("zinf: removed %d swap folder(s) under nvme_path %s left by runs that did not exit cleanly: %s",
                    len(removed), root, "; ".join(removed))
    return removed


def _probe_direct(folder: str) -> bool:
    """Whether the filesystem under ``folder`` accepts O_DIRECT (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(folder, "probe-o-direct")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise AioError(f"cannot create a swap file in {folder} (under nvme_path): "
                       f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})") from err
    try:
        block = mmap.mmap(-1, ALIGNMENT)  # page aligned
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise AioError(f"cannot write a swap file in {folder} (under nvme_path): "
                           f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})") from err
        finally:
            block.close()
        return True
    finally:
        os.close(fd)
        os.unlink(path)


def _byte_view(buffer, writable: bool) -> memoryview:
    view = buffer.memoryview() if hasattr(buffer, "memoryview") else memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ValueError("aio buffers must be contiguous")
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("aio read needs a writable buffer")
    return view


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class AioEngine:
    """Swap files in a private folder under ``folder``; see the module docstring for the contract.

    ``block_size``: bytes per piece (rounded up to 4096); ``queue_depth``:
    pieces of one request queued or running at once; ``threads``: worker
    threads doing the I/O.  Attributes: ``folder`` (the private folder),
    ``direct``, ``backend``, ``bytes_written``, ``bytes_read``,
    ``busy_seconds``.
    """

    backend = "threads"

    def __init__(self, folder: str, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 4,
                 copies: int = 2):
        if block_size <= 0 or queue_depth < 1 or threads < 1 or copies not in (1, 2):
            raise ValueError(f"aio settings out of range: block_size={block_size} (> 0), "
                             f"queue_depth={queue_depth} (>= 1), threads={threads} (>= 1), copies={copies} "
                             f"(1 or 2); see the options aio_block_size, aio_queue_depth, aio_threads, nvme_copies")
        # copies=2: a write goes to the slot not holding the last good copy
        # (the contract above).  copies=1 halves the disk: writes overwrite the
        # only copy in place, so a failed write (or an aborted transaction)
        # leaves that key *lost*: reading it raises, it is never taken as good.
        self.copies = copies
        validate_folder(folder, 0)
        self.root = folder
        self.block_size = _round_up(block_size, ALIGNMENT)
        self.queue_depth = queue_depth
        self.threads = threads
        remove_stale_folders(folder)
        owner = _owner_tag()
        prefix = f"zinf-swap-{os.getpid()}-" + (f"{owner}-" if owner is not None else "")
        self.folder = tempfile.mkdtemp(prefix=prefix, dir=folder)
        try:
            os.chmod(self.folder, 0o700)
            self.direct = _probe_direct(self.folder)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._state = _State(self.folder, self.direct, self.block_size, queue_depth, copies)
        self._state.background_threads = max(1, threads - 1)  # one worker always free for the foreground
        _LIVE_FOLDERS[id(self._state)] = self.folder
        _watch_sigterm()
        # Registered before the threads start, so an error below still removes the folder.
        self._finalizer = weakref.finalize(self, _finalize, self._state)
        for index in range(threads):
            thread = threading.Thread(target=_worker, args=(self._state,), name=f"zinf-aio-{index}", daemon=True)
            thread.start()
            self._state.threads.append(thread)

    # --- stats -----------------------------------------------------------------------

    @property
    def bytes_written(self) -> int:
        return self._state.bytes_written

    @property
    def bytes_read(self) -> int:
        return self._state.bytes_read

    @property
    def busy_seconds(self) -> float:
        state = self._state
        with state.lock:
            running = time.perf_counter() - state.busy_since if state.pieces_running else 0.0
            return state.busy_seconds + running

    def bytes_on_disk(self) -> int:
        """Bytes the swap files occupy (both slots of every key)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.folder):
                with contextlib.suppress(OSError):
                    total += entry.stat().st_blocks * 512
        return total

    # --- keys ------------------------------------------------------------------------

    def path(self, key: str) -> str:
        """The swap file of ``key`` (one file per key, both slots in it)."""
        name = urllib.parse.quote(key, safe="")
        if len(name) > 200:  # file names are limited to 255 bytes
            name = name[:150] + "-" + hashlib.sha1(key.encode()).hexdigest()
        return os.path.join(self.folder, name + ".swap")

    def _check_open(self) -> None:
        if self._state.closed:
            raise AioError(f"NVMe swap engine for {self.folder} is closed")

    def _key(self, key: str) -> _Key:
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap keys are non-empty strings, got {key!r}")
        self._check_open()
        state = self._state
        entry = state.keys.get(key)
        if entry is None:
            entry = state.keys[key] = _Key(key, self.path(key))
        return entry

    def _check_buffer(self, kind: str, key: str, view: memoryview, nbytes: int) -> None:
        padded = _round_up(nbytes, ALIGNMENT)
        if nbytes < 0:
            raise ValueError(f"aio {kind} of {key!r}: negative size {nbytes}")
        if len(view) < padded:
            raise ValueError(f"aio {kind} of {key!r}: the buffer has {len(view):,} bytes, but {nbytes:,} bytes are "
                             f"padded to {padded:,} (a multiple of {ALIGNMENT}) for O_DIRECT; use a PinnedPool block")
        if self.direct and padded and _address(view) % ALIGNMENT:
            raise ValueError(f"aio {kind} of {key!r}: O_DIRECT needs a buffer aligned to {ALIGNMENT} bytes; "
                             f"use a PinnedPool block")

    # --- transfers ---------------------------------------------------------------------

    def write(self, key: str, buffer, nbytes: int, hold: bool = False, background: bool = False) -> AioRequest:
        """Start writing the first ``nbytes`` of ``buffer`` (a PinnedBuffer or memoryview) as ``key``.

        The buffer must hold ``nbytes`` rounded up to 4096 (those bytes are
        written and checksummed) and stay untouched until ``wait()``.  Waits
        first while an earlier write of the same key is in flight.

        ``hold=True`` (copies=2 only): the written copy is *held*, not made
        good: reads keep seeing the last good copy until :meth:`commit_held`
        makes it the good one, and :meth:`drop_held` (or any later write of
        the key) discards it.  Outside any transaction.  This is how a step
        computed ahead of time (the optimizer during backward) waits for the
        verdict on whether it counts.  ``background=True``: the transfer
        yields to every other (see :meth:`read`).
        """
        self._check_open()
        if hold and self.copies != 2:
            raise ValueError(f"aio write of {key!r} with hold=True needs copies=2 (the held copy goes to the slot "
                             f"that does not hold the good one); this engine has copies={self.copies}")
        view = _byte_view(buffer, writable=False)
        self._check_buffer("write", key, view, nbytes)
        padded = _round_up(nbytes, ALIGNMENT)
        state = self._state
        with state.lock:
            entry = self._key(key)
            while True:
                if self.copies == 1:
                    target = 0
                else:
                    target = 0 if entry.committed is None else 1 - entry.committed.slot
                if not entry.writing and entry.reads[target] == 0:
                    break
                state.changed.wait()
                entry = self._key(key)  # raises if closed meanwhile
            if self.copies == 1:
                # The only copy is overwritten from here on: until this write
                # (and its transaction) completes, the key has no good copy.
                if entry.committed is not None:
                    entry.committed = None
                    entry.lost = ("its only copy was being overwritten in place (nvme_copies=1) when the write "
                                  "failed or its transaction was aborted, so the state it belongs to is unusable "
                                  "(nvme_copies=2 keeps the last good copy through a failed write)")
            region = entry.regions[target]
            if region is None or region[1] < padded:
                # First write, or the key grew: a new region at the end of the file.
                region = entry.regions[target] = (entry.file_end, padded)
                entry.file_end += padded
            state.acquire_fd(entry)
            entry.writing = True
            # Either write goes to the held copy's slot: a held copy from before is gone.
            entry.held = None
            entry.hold_token = token = object() if hold else None
            transaction = None if hold else state.transaction
            if transaction is not None:
                transaction.pending.pop(key, None)  # that copy's slot is being overwritten
                transaction.written.add(key)
                transaction.open_writes += 1

            def on_finish(request: AioRequest) -> None:
                entry.writing = False
                state.release_fd(entry)
                if transaction is not None:
                    transaction.open_writes -= 1
                if request.error is not None:
                    if transaction is not None and transaction.failure is None:
                        transaction.failure = request.error
                    return
                copy = _Copy(target, nbytes, request._digests)
                if hold:
                    if entry.hold_token is token:  # not superseded or dropped meanwhile
                        entry.held = copy
                elif transaction is None:
                    entry.committed = copy
                    entry.lost = None
                elif transaction.state == "open":
                    transaction.pending[key] = copy
                state.bytes_written += nbytes

            request = AioRequest(state, "write", entry, view, nbytes, region[0], None, on_finish)
            request.in_transaction = transaction is not None
            request.background = background
            request._submit()
        return request

    def read(self, key: str, into, nbytes: int | None = None, background: bool = False) -> AioRequest:
        """Start reading ``key`` into ``into`` (a PinnedBuffer or writable memoryview).

        ``nbytes`` (default: the size written) must equal the size of the
        key's last good write; ``into`` must hold it rounded up to 4096.
        The checksums recorded at write time are verified.  ``background``:
        its pieces run only while no other transfer waits, on one worker at a
        time, so work that can wait (the optimizer stepping during backward)
        does not delay the graph's fetches by more than a piece.
        """
        self._check_open()
        view = _byte_view(into, writable=True)
        state = self._state
        with state.lock:
            self._check_open()
            entry = state.keys.get(key)
            transaction = state.transaction
            copy = transaction.pending.get(key) if transaction is not None else None
            copy = copy or (entry.committed if entry is not None else None)
            if copy is None:
                if entry is not None and entry.lost is not None:
                    raise AioError(f"NVMe swap read of {key!r} (in {self.folder}): the key has no good copy: "
                                   f"{entry.lost}")
                raise AioError(f"NVMe swap read of {key!r}: no write of this key has completed")
            if nbytes is None:
                nbytes = copy.nbytes
            if nbytes != copy.nbytes:
                raise AioError(f"NVMe swap read of {key!r}: asked for {nbytes:,} bytes, {copy.nbytes:,} were written")
            self._check_buffer("read", key, view, nbytes)
            state.acquire_fd(entry)
            entry.reads[copy.slot] += 1

            def on_finish(request: AioRequest) -> None:
                entry.reads[copy.slot] -= 1
                state.release_fd(entry)
                if request.error is None:
                    state.bytes_read += nbytes

            request = AioRequest(state, "read", entry, view, nbytes, entry.regions[copy.slot][0], copy.digests,
                                 on_finish)
            request.background = background
            request._submit()
        return request

    @contextlib.contextmanager
    def transaction(self):
        """Writes inside become the keys' good copies together, when the block ends without an error.

        An optimizer step writes many keys; if one write fails (ENOSPC), every
        key keeps its copy from before the step (copies=2), so the state on disk
        is the last good step, never a mix; with copies=1 the keys the block
        overwrote are lost instead (reads raise), never taken as good.  Leaving
        the block waits for the writes started in it; if any failed (even one
        whose error the block caught), nothing is committed and
        :class:`AioError` is raised, saying which of the two happened.  Inside,
        reads see the block's completed writes.  One transaction per engine at
        a time.
        """
        state = self._state
        with state.lock:
            if state.transaction is not None:
                raise AioError("nested swap transactions are not supported")
            transaction = state.transaction = _Transaction()
        ok = False
        try:
            yield transaction
            ok = True
        finally:
            with state.lock:
                state.transaction = None
                if not ok:
                    transaction.state = "aborted"
                else:
                    while transaction.open_writes:
                        state.changed.wait()
                    if transaction.failure is not None:
                        transaction.state = "aborted"
                        raise AioError(f"swap transaction not committed, {self._abort_outcome(transaction)}: "
                                       f"{transaction.failure}") from transaction.failure
                    for key, copy in transaction.pending.items():
                        state.keys[key].committed = copy
                        state.keys[key].lost = None
                    transaction.state = "committed"

    def holds(self, keys) -> bool:
        """Whether every key has a complete held copy (its ``hold=True`` write finished without an error)."""
        with self._state.lock:
            return all(key in self._state.keys and self._state.keys[key].held is not None for key in keys)

    def commit_held(self, keys) -> None:
        """Make each key's held copy its good one; inside a transaction, when that commits.

        Raises :class:`AioError`, changing nothing, when a key has no held copy
        (its held write failed, is still in flight, or was dropped or superseded).
        """
        state = self._state
        with state.lock:
            missing = [key for key in keys if key not in state.keys or state.keys[key].held is None]
            if missing:
                raise AioError(f"NVMe swap: no held copy of {missing[0]!r} to commit"
                               + (f" (and {len(missing) - 1} more keys)" if len(missing) > 1 else ""))
            for key in keys:
                entry = state.keys[key]
                if state.transaction is not None:
                    state.transaction.pending[key] = entry.held
                else:
                    entry.committed = entry.held
                    entry.lost = None
                entry.held, entry.hold_token = None, None

    def drop_held(self, keys) -> None:
        """Discard the keys' held copies, and the copies of held writes still in flight (they land unheld)."""
        with self._state.lock:
            for key in keys:
                entry = self._state.keys.get(key)
                if entry is not None:
                    entry.held, entry.hold_token = None, None

    def _abort_outcome(self, transaction: _Transaction) -> str:
        """What an aborted transaction left, true for nvme_copies 1 and 2 (lock held)."""
        if self.copies == 2:
            return "every key keeps its copy from before it (nvme_copies=2; a key first written in it stays unwritten)"
        lost = sorted(key for key in transaction.written
                      if key in self._state.keys and self._state.keys[key].lost is not None)
        if not lost:
            return "no key lost a copy (the keys it wrote had none yet)"
        shown = ", ".join(repr(key) for key in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        return (f"{len(lost)} key(s) it overwrote in place lost their only copy (nvme_copies=1): {shown}; the state "
                f"they belong to is unusable (nvme_copies=2 keeps the last good copy through a failed write)")

    def invalidate(self, key: str, reason: str) -> None:
        """Make ``key`` unreadable until its next complete write; reads raise :class:`AioError` giving ``reason``.

        For a key whose good copy is out of date, e.g. a parameter whose
        optimizer step was applied but whose rewrite failed: reading the old
        copy would mix states.  Waits for a write of the key in flight.
        """
        state = self._state
        with state.lock:
            entry = self._key(key)
            while entry.writing:
                state.changed.wait()
                entry = self._key(key)
            entry.committed = None
            entry.held, entry.hold_token = None, None
            entry.lost = reason
            if state.transaction is not None:
                state.transaction.pending.pop(key, None)

    def forget(self, key: str) -> None:
        """Drop ``key`` and delete its file (after its in-flight transfers finish)."""
        state = self._state
        with state.lock:
            entry = state.keys.get(key)
            if entry is None:
                return
            while entry.writing or any(entry.reads):
                state.changed.wait()
            del state.keys[key]
            if state.transaction is not None:
                state.transaction.pending.pop(key, None)
            if entry.fd is not None:
                os.close(entry.fd)
                state.open_files.pop(key, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)

    # --- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Finish the transfers in flight, then remove the swap folder (idempotent)."""
        if self._finalizer.detach() is not None:
            _shutdown(self._state)

    def __enter__(self) -> "AioEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AioEngine({self.folder!r}, backend={self.backend}, direct={self.direct}, "
                f"block_size={self.block_size}, queue_depth={self.queue_depth}, threads={self.threads})")
