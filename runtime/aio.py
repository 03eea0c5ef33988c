"""Async bulk tensor I/O to swap files under ``nvme_path``.

``AioEngine.write(key, buffer, nbytes)`` / ``read(key, buffer, nbytes)``
split a transfer into ``block_size`` pieces and hand them to a pool of worker
threads doing ``os.pwritev`` / ``os.preadv`` on files opened with
``O_DIRECT`` (the page cache is bypassed; buffers come from the aligned
pinned pool).  Calls return an :class:`AioRequest` at once; ``wait()`` blocks
until every piece is done and raises on error.  Many requests can be in
flight.  This is the "threads" backend; an io_uring backend would be a second
class chosen at runtime where the kernel allows it.

Swap files live in a private folder (mode 0700) made under ``nvme_path``,
each file mode 0600, and are removed at ``close()`` and at exit.  Every key
is written to a fresh region (double buffering: two slots per key) and its
metadata (slot, size, checksum) switches only after the write completed, so
a failed write leaves the last good contents readable; every read verifies
the checksum and raises :class:`AioChecksumError` on a mismatch.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import errno
import os
import shutil
import tempfile
import threading
import time
import weakref

import numpy as np

ALIGNMENT = 4096


class AioError(RuntimeError):
    """An NVMe swap operation failed; the message names the key, file and cause."""


class AioChecksumError(AioError):
    """The bytes read back differ from the bytes written."""


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError


def validate_folder(folder: str | None, needed_bytes: int) -> None:
    """Fail early, naming ``nvme_path``, if ``folder`` cannot hold ``needed_bytes`` of swap."""
    if not folder:
        raise AioError("NVMe offload needs the option nvme_path: a folder on a fast local disk")
    if not os.path.exists(folder):
        raise AioError(f"nvme_path {folder!r} does not exist; create it (mkdir -p {folder}) or point nvme_path elsewhere")
    if not os.path.isdir(folder):
        raise AioError(f"nvme_path {folder!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AioError(f"nvme_path {folder!r} is not writable by this process")
    stats = os.statvfs(folder)
    available = stats.f_bavail * stats.f_frsize
    if available < needed_bytes:
        raise AioError(
            f"nvme_path {folder!r} has {human_bytes(available)} free ({available:,} bytes) but the planned swap needs "
            f"{human_bytes(needed_bytes)} ({needed_bytes:,} bytes); free space or choose another nvme_path"
        )


def checksum(view: memoryview, nbytes: int) -> int:
    """Sum of the 64-bit words of the (alignment-padded) transfer, modulo 2**64.

    Any corruption confined to one word changes it; it runs at memory speed
    (a CRC would cost more than the disk read it protects).
    """
    words = np.frombuffer(view, dtype=np.uint64, count=_round_up(nbytes, ALIGNMENT) // 8)
    return int(words.sum(dtype=np.uint64))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass
class _KeyMeta:
    capacity: int  # bytes reserved per slot, fixed by the key's first write
    slot: int = -1  # which slot holds the last good write (-1: none yet)
    nbytes: int = 0
    checksum: int = 0


class AioRequest:
    """An in-flight read or write: ``wait()`` to finish it (raises on failure), ``done()`` to poll."""

    def __init__(self, futures: list, on_done=None):
        self._futures = futures
        self._on_done = on_done
        self._finished = False

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def wait(self) -> None:
        if self._finished:
            return
        self._finished = True
        errors = []
        for future in self._futures:
            try:
                future.result()
            except Exception as err:  # collect, then raise the first with context
                errors.append(err)
        if self._on_done is not None:
            self._on_done(errors)
        elif errors:
            raise errors[0]


class AioEngine:
    backend = "threads"

    def __init__(self, folder: str, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 4):
        validate_folder(folder, 0)
        self.block_size = _round_up(block_size, ALIGNMENT)
        self.queue_depth = queue_depth
        self.folder = tempfile.mkdtemp(prefix=f"zinf-swap-{os.getpid()}-", dir=folder)
        os.chmod(self.folder, 0o700)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zinf-aio")
        self._meta: dict[str, _KeyMeta] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.direct = True
        self.bytes_written = 0
        self.bytes_read = 0
        self.busy_seconds = 0.0
        self._closed = False
        self._pending: dict | None = None  # key -> new metadata, inside a transaction
        self._finalizer = weakref.finalize(self, _remove_folder, self.folder, self._fds)
        atexit.register(self._finalizer)

    # --- files -------------------------------------------------------------------

    def path(self, key: str) -> str:
        return os.path.join(self.folder, key.replace("/", "__") + ".swap")

    def _fd(self, key: str) -> int:
        with self._lock:
            fd = self._fds.get(key)
            if fd is not None:
                return fd
            flags = os.O_RDWR | os.O_CREAT
            try:
                fd = os.open(self.path(key), flags | getattr(os, "O_DIRECT", 0), 0o600)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise self._error("open", key, 0, err) from err
                # The filesystem refuses O_DIRECT (tmpfs): buffered I/O, cache dropped after each write.
                self.direct = False
                fd = os.open(self.path(key), flags, 0o600)
            self._fds[key] = fd
            return fd

    def _error(self, what: str, key: str, nbytes: int, err: OSError) -> AioError:
        name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else type(err).__name__
        if err.errno == errno.ENOSPC:
            return AioError(
                f"NVMe swap {what} of {key!r} ({human_bytes(nbytes)}) failed: the disk under nvme_path "
                f"({self.folder}) is full (ENOSPC); the last good copy of {key!r} is kept"
            )
        return AioError(f"NVMe swap {what} of {key!r} to {self.path(key)} ({human_bytes(nbytes)}) failed: {name}: {err}")

    # --- transactions ------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self):
        """Writes inside become visible together, when the block ends without an error.

        An optimizer step writes many keys; if one write fails (ENOSPC), every
        key keeps its copy from before the step, so the state on disk is the
        last good step, never a mix.  (Writes go to the other slot, so the old
        copies are untouched until the commit switches to the new ones.)
        """
        if self._pending is not None:
            raise AioError("nested swap transactions are not supported")
        self._pending = {}
        try:
            yield
        except BaseException:
            self._pending = None
            raise
        pending, self._pending = self._pending, None
        for meta, slot, nbytes, digest in pending.values():
            meta.slot, meta.nbytes, meta.checksum = slot, nbytes, digest

    # --- transfers ---------------------------------------------------------------

    def _pieces(self, nbytes: int):
        padded = _round_up(nbytes, ALIGNMENT)
        for start in range(0, padded, self.block_size):
            yield start, min(self.block_size, padded - start)

    def write(self, key: str, buffer, nbytes: int) -> AioRequest:
        """Write the first ``nbytes`` of ``buffer`` (a PinnedBuffer or memoryview, aligned) as ``key``."""
        view = buffer.memoryview() if hasattr(buffer, "memoryview") else memoryview(buffer)
        padded = _round_up(nbytes, ALIGNMENT)
        if len(view) < padded:
            raise ValueError(f"aio write of {key!r}: buffer of {len(view)} bytes, needs {padded} (aligned)")
        with self._lock:
            meta = self._meta.setdefault(key, _KeyMeta(capacity=padded))
        if padded > meta.capacity:
            raise AioError(f"NVMe swap write of {key!r}: {nbytes} bytes, but the key was created for {meta.capacity}")
        # Write into the slot that does not hold the last good copy.
        target_slot = 0 if meta.slot != 0 else 1
        base = target_slot * meta.capacity
        fd = self._fd(key)
        digest = checksum(view, nbytes)
        futures = [self._executor.submit(self._write_piece, fd, view[start : start + size], base + start, key, nbytes)
                   for start, size in self._pieces(nbytes)]

        def finish(errors):
            if errors:
                first = errors[0]
                raise first if isinstance(first, AioError) else self._error("write", key, nbytes, first)
            if self._pending is not None:
                self._pending[key] = (meta, target_slot, nbytes, digest)  # applied at commit
            else:
                meta.slot, meta.nbytes, meta.checksum = target_slot, nbytes, digest
            self.bytes_written += nbytes

        return AioRequest(futures, finish)

    def read(self, key: str, buffer, nbytes: int | None = None) -> AioRequest:
        """Read ``key`` into ``buffer``; verifies the checksum recorded by its last good write."""
        meta = self._meta.get(key)
        if meta is None or meta.slot < 0:
            raise AioError(f"NVMe swap read of {key!r}: nothing was written under this key")
        nbytes = meta.nbytes if nbytes is None else nbytes
        if nbytes != meta.nbytes:
            raise AioError(f"NVMe swap read of {key!r}: asked for {nbytes} bytes, {meta.nbytes} were written")
        view = buffer.memoryview() if hasattr(buffer, "memoryview") else memoryview(buffer)
        if len(view) < _round_up(nbytes, ALIGNMENT):
            raise ValueError(f"aio read of {key!r}: buffer of {len(view)} bytes is too small for {nbytes} (aligned)")
        fd = self._fd(key)
        base = meta.slot * meta.capacity
        expected = meta.checksum
        futures = [self._executor.submit(self._read_piece, fd, view[start : start + size], base + start, key, nbytes)
                   for start, size in self._pieces(nbytes)]

        def finish(errors):
            if errors:
                first = errors[0]
                raise first if isinstance(first, AioError) else self._error("read", key, nbytes, first)
            if checksum(view, nbytes) != expected:
                raise AioChecksumError(
                    f"NVMe swap file {self.path(key)} for {key!r} is corrupt: its checksum differs from the one "
                    f"recorded when it was written; the data was not used"
                )
            self.bytes_read += nbytes

        return AioRequest(futures, finish)

    def _write_piece(self, fd: int, piece: memoryview, offset: int, key: str, nbytes: int) -> None:
        started = time.perf_counter()
        try:
            written = os.pwritev(fd, [piece], offset)
            if written != len(piece):
                raise OSError(errno.EIO, f"short write ({written} of {len(piece)} bytes)")
            if not self.direct:
                os.posix_fadvise(fd, offset, len(piece), os.POSIX_FADV_DONTNEED)
        except OSError as err:
            raise self._error("write", key, nbytes, err) from err
        finally:
            self.busy_seconds += time.perf_counter() - started

    def _read_piece(self, fd: int, piece: memoryview, offset: int, key: str, nbytes: int) -> None:
        started = time.perf_counter()
        try:
            got = os.preadv(fd, [piece], offset)
            if got != len(piece):
                raise OSError(errno.EIO, f"short read ({got} of {len(piece)} bytes)")
        except OSError as err:
            raise self._error("read", key, nbytes, err) from err
        finally:
            self.busy_seconds += time.perf_counter() - started

    # --- accounting and lifetime -------------------------------------------------

    def bytes_on_disk(self) -> int:
        """Bytes the swap files occupy (both slots of every key)."""
        total = 0
        for key in list(self._fds):
            try:
                total += os.fstat(self._fds[key]).st_blocks * 512
            except OSError:
                pass
        return total

    def forget(self, key: str) -> None:
        with self._lock:
            self._meta.pop(key, None)
            fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)
            os.unlink(self.path(key))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._finalizer()


def _remove_folder(folder: str, fds: dict) -> None:
    for fd in list(fds.values()):
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
