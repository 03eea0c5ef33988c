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
cache is bypassed.  A filesystem that refuses ``O_DIRECT`` (tmpfs before Linux 6.6) gets
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
import hashlib
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
import weakref


from .aio_requests import (ALIGNMENT, AioChecksumError, AioError, AioRequest, KeyCopy, SwapKey, SwapState,
                           SwapTransaction, buffer_address, byte_view, finalize_state, human_bytes, round_up,
                           run_worker, shutdown_state)
from .trace import Tracer
from .swap_folders import FolderWatch, owner_tag, probe_direct, remove_stale_folders, validate_folder

# The engine's public surface, with what it re-exports from its two parts.
__all__ = ["ALIGNMENT", "AioChecksumError", "AioEngine", "AioError", "AioRequest", "human_bytes",
           "remove_stale_folders", "validate_folder"]


class AioEngine:
    """Swap files in a private folder under ``folder``; see the module docstring for the contract.

    ``block_size``: bytes per piece (rounded up to 4096); ``queue_depth``:
    pieces of one request queued or running at once; ``threads``: worker
    threads doing the I/O; ``tracer``: the timeline its transfers and waits
    are drawn on (the process's, ``Runtime.tracer``; default: a tracer of its own, never armed);
    ``folder_watch``: what removes the private folder on SIGTERM (the process's,
    ``Runtime.swap_folders``; default: a watch of its own).  Attributes:
    ``folder`` (the private folder), ``direct``, ``backend``,
    ``bytes_written``, ``bytes_read``, ``busy_seconds``.
    """

    backend = "threads"

    def __init__(self, folder: str, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 4,
                 copies: int = 2, tracer: Tracer | None = None, folder_watch: FolderWatch | None = None):
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
        self.block_size = round_up(block_size, ALIGNMENT)
        self.queue_depth = queue_depth
        self.threads = threads
        remove_stale_folders(folder)
        owner = owner_tag()
        prefix = f"zinf-swap-{os.getpid()}-" + (f"{owner}-" if owner is not None else "")
        self.folder = tempfile.mkdtemp(prefix=prefix, dir=folder)
        try:
            os.chmod(self.folder, 0o700)
            self.direct = probe_direct(self.folder)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        # A standalone engine (tests, benchmarks) gets parts of its own; the runtime's engines are handed its.
        tracer = Tracer() if tracer is None else tracer
        folder_watch = FolderWatch() if folder_watch is None else folder_watch
        self._state = SwapState(self.folder, self.direct, self.block_size, queue_depth, copies, tracer)
        self._state.background_threads = max(1, threads - 1)  # one worker always free for the foreground
        self._state.folder_watch = folder_watch
        folder_watch.watch(self._state, self.folder)  # removed if a SIGTERM ends the process
        # Registered before the threads start, so an error below still removes the folder.
        self._finalizer = weakref.finalize(self, finalize_state, self._state)
        for index in range(threads):
            thread = threading.Thread(target=run_worker, args=(self._state,), name=f"zinf-aio-{index}", daemon=True)
            thread.start()
            self._state.threads.append(thread)

    # --- stats -----------------------------------------------------------------------

    @property
    def bytes_written(self) -> int:
        """Bytes of completed writes."""
        return self._state.bytes_written

    @property
    def bytes_read(self) -> int:
        """Bytes of completed reads."""
        return self._state.bytes_read

    @property
    def busy_seconds(self) -> float:
        """Seconds during which at least one piece was running (the disk's busy time seen from here)."""
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

    def _key(self, key: str) -> SwapKey:
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap keys are non-empty strings, got {key!r}")
        self._check_open()
        state = self._state
        entry = state.keys.get(key)
        if entry is None:
            entry = state.keys[key] = SwapKey(key, self.path(key))
        return entry

    def _check_buffer(self, kind: str, key: str, view: memoryview, nbytes: int) -> None:
        padded = round_up(nbytes, ALIGNMENT)
        if nbytes < 0:
            raise ValueError(f"aio {kind} of {key!r}: negative size {nbytes}")
        if len(view) < padded:
            raise ValueError(f"aio {kind} of {key!r}: the buffer has {len(view):,} bytes, but {nbytes:,} bytes are "
                             f"padded to {padded:,} (a multiple of {ALIGNMENT}) for O_DIRECT; use a PinnedPool block")
        if self.direct and padded and buffer_address(view) % ALIGNMENT:
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
        view = byte_view(buffer, writable=False)
        self._check_buffer("write", key, view, nbytes)
        padded = round_up(nbytes, ALIGNMENT)
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
                copy = KeyCopy(target, nbytes, request._digests)
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
        view = byte_view(into, writable=True)
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
            transaction = state.transaction = SwapTransaction()
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

    def good_copy(self, key: str) -> object | None:
        """A token of ``key``'s good copy (None: none): the same object until that copy changes (a write
        made good, a commit, an invalidation), so bytes read from it can be told current or stale."""
        with self._state.lock:
            entry = self._state.keys.get(key)
            return None if entry is None else entry.committed

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

    def _abort_outcome(self, transaction: SwapTransaction) -> str:
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
            shutdown_state(self._state)

    def __enter__(self) -> "AioEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AioEngine({self.folder!r}, backend={self.backend}, direct={self.direct}, "
                f"block_size={self.block_size}, queue_depth={self.queue_depth}, threads={self.threads})")

