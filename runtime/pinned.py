"""The process's pinned host memory: one allocator, and a bounded pool of aligned buffers per consumer.

Every host-side staging buffer of the runtime (NVMe reads and writes, copies
to and from the device) is a block of a :class:`PinnedPool`; nothing
allocates host memory per tensor.  The pools are drawn from one
:class:`PinnedMemory` (the process's, built by runtime/process.py), as named
quotas: each consumer (the parameters' transfers, the activations' NVMe
staging, the early optimizer step) sizes its own, and the allocator counts
every quota's bytes once and keeps per-consumer figures (quota, in use,
peak, page-locked) for ``zinf.memory_report``.  A quota is a pool of its
own: a consumer that fills it waits (or raises) as it always did, and never
takes another consumer's buffers.

Memory.  The pool is one anonymous ``mmap`` region made once, at creation,
with every page touched then (on these VMs freshly touched memory costs
~5 s/GiB; touched-once memory is reused at full speed).  ``mmap`` memory is
page aligned, which ``O_DIRECT`` needs, and blocks are handed out at
multiples of ``alignment`` (4096 by default), sized in multiples of it.

Page locking.  With a CUDA device the region is registered with
``cudaHostRegister`` (portable: pinned for every device): the pages are locked and CUDA knows them, so
``tensor.to("cuda", non_blocking=True)`` from a block is a real asynchronous
DMA.  This beats ``torch.empty(..., pin_memory=True)``, whose caching host
allocator rounds every size up to a power of two (a 6 GiB pool would pin
8 GiB) and gives no control over alignment.  Without CUDA (CPU-only torch,
where ``pin_memory=True`` raises) the region is ``mlock``-ed when the process
may (RLIMIT_MEMLOCK or CAP_IPC_LOCK), which keeps it out of swap.  Either
step may fail; the pool then works on plain memory and says so:
``pool.pinned`` (registered with CUDA) and ``pool.locked`` (page-locked by
either means).

Allocation.  ``acquire(nbytes)`` takes a block first fit from a free list
that coalesces on release.  When no block fits, it waits (condition
variable) until buffers are released; it never allocates past
``capacity_bytes``.  A request larger than the whole pool raises at once.
Thread safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
import weakref
from typing import Callable

import torch

from .swap_layout import ALIGNMENT
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


class PinnedBuffer:
    """A block of a :class:`PinnedPool`; ``release()`` it (or use ``with``) when done.

    ``nbytes`` is the block's size (the request rounded up to the pool's
    alignment), ``offset`` its place in the pool, ``address`` its pointer.
    Views (``memoryview()``, ``tensor()``) share the block's memory: do not
    use them after ``release()``, the block is handed to the next acquirer.
    A buffer that is dropped without ``release()`` stays in use (a tensor
    view could still be reading it).
    """

    __slots__ = ("pool", "offset", "nbytes", "released")

    def __init__(self, pool: "PinnedPool", offset: int, nbytes: int):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.released = False

    @property
    def address(self) -> int:
        """The memory address of the buffer's first byte."""
        return self.pool.base_address + self.offset

    def memoryview(self) -> memoryview:
        """A writable view of the whole block (``nbytes`` bytes), no copy."""
        if self.released:
            raise ValueError(f"pinned buffer at offset {self.offset} was released; acquire a new one")
        return self.pool._view[self.offset : self.offset + self.nbytes]

    def tensor(self, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """A 1-d CPU tensor over the first ``numel`` elements of the block (no copy).

        ``numel`` defaults to as many elements as fit.  The tensor keeps the
        pool's memory mapped, but not the block reserved: stop using it
        before ``release()``.
        """
        itemsize = dtype.itemsize
        if numel is None:
            numel = self.nbytes // itemsize
        if numel * itemsize > self.nbytes:
            raise ValueError(f"{numel:,} x {dtype} ({numel * itemsize:,} bytes) does not fit a "
                             f"{self.nbytes:,}-byte pinned buffer")
        view = self.memoryview()
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(view, dtype=dtype, count=numel)

    def release(self) -> None:
        """Give the block back (idempotent); waiting acquirers are woken."""
        self.pool._release(self)

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "in use"
        return f"PinnedBuffer(offset={self.offset}, nbytes={self.nbytes}, {state})"


class PinnedPool:
    """A fixed pool of ``capacity_bytes`` (rounded up to ``alignment``) of host memory.

    ``pin``: ``None`` (default) page-locks where possible and records the
    outcome in ``pinned`` / ``locked``; ``True`` raises if the memory cannot
    be page-locked at all; ``False`` leaves it pageable.

    Stats: ``capacity_bytes``, ``in_use_bytes``, ``peak_in_use_bytes``
    (since creation or ``reset_peak()``), ``waits`` (acquires that had to
    wait for a release), ``buffers_in_use``.  ``consumer``: the figures of
    the :class:`PinnedMemory` consumer this pool is a quota of (None: a
    pool on its own, counted nowhere).
    """

    def __init__(self, capacity_bytes: int, alignment: int = ALIGNMENT, pin: bool | None = None,
                 consumer: "_Consumer | None" = None):
        if capacity_bytes <= 0:
            raise ValueError(f"pinned pool capacity must be > 0 bytes, got {capacity_bytes} (option pinned_bytes)")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"pinned pool alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.capacity_bytes = _round_up(capacity_bytes, alignment)
        # mmap is page aligned; a larger alignment needs slack to start at.
        slack = max(0, alignment - mmap.PAGESIZE)
        self._mmap = mmap.mmap(-1, self.capacity_bytes + slack)
        mapped_address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        start = _round_up(mapped_address, alignment) - mapped_address
        self._view = memoryview(self._mmap)[start : start + self.capacity_bytes]
        self.base_address = mapped_address + start
        # Touch every page now, once (memset writes, so each page is really backed).
        ctypes.memset(self.base_address, 0, self.capacity_bytes)

        self.pinned = False
        self.locked = False
        self.lock_error = ""  # why page-locking did not happen, for diagnostics
        unlock = None
        if pin is not False:
            self.pinned, cuda_problem = _cuda_register(self.base_address, self.capacity_bytes)
            if self.pinned:
                self.locked = True
                unlock = _cuda_unregister
            else:
                self.locked, mlock_problem = _mlock(self.base_address, self.capacity_bytes)
                if self.locked:
                    unlock = _munlock
                self.lock_error = "; ".join(p for p in (cuda_problem, mlock_problem) if p)
            if pin and not self.locked:
                raise RuntimeError(f"pinned pool: could not page-lock {self.capacity_bytes:,} bytes "
                                   f"({self.lock_error}); use pin=None to run on pageable memory")
        # Unlock when the pool goes away; the mapping itself lives as long as
        # any view of it (a tensor from tensor() keeps it mapped, so never dangles).
        # The consumer's figures drop the quota at the same moment.
        self._consumer = consumer
        if consumer is not None:
            consumer.opened(self.capacity_bytes, self.locked)
        self._finalizer = weakref.finalize(self, _free, unlock, self.base_address, self.capacity_bytes, consumer,
                                           self.locked)
        self._finalizer.atexit = False  # the process exit unlocks everything; CUDA may be gone by then

        self._cond = threading.Condition()
        self._free_blocks: list[list[int]] = [[0, self.capacity_bytes]]  # [offset, size], sorted by offset
        self._live: dict[int, int] = {}  # offset -> size of the blocks in use
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.waits = 0
        self._closed = False

    @property
    def buffers_in_use(self) -> int:
        """Buffers acquired and not yet released."""
        return len(self._live)

    def acquire(self, nbytes: int, timeout: float | None = None) -> PinnedBuffer:
        """A block of at least ``nbytes`` (rounded up to the alignment).

        Waits while no free block is large enough; ``timeout`` (seconds)
        bounds the wait and raises ``TimeoutError``.  A request larger than
        the pool raises ``ValueError``.
        """
        if nbytes < 0:
            raise ValueError(f"cannot acquire {nbytes} bytes")
        size = _round_up(max(nbytes, 1), self.alignment)
        if size > self.capacity_bytes:
            raise ValueError(
                f"a {nbytes:,}-byte transfer ({_mib(size)} aligned) does not fit the pinned pool of "
                f"{self.capacity_bytes:,} bytes ({_mib(self.capacity_bytes)}); raise the option pinned_bytes "
                f"to at least {size:,}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            waited = False
            while True:
                if self._closed:
                    raise RuntimeError("pinned pool is closed")
                offset = self._take(size)
                if offset is not None:
                    self._live[offset] = size
                    self.in_use_bytes += size
                    self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
                    if self._consumer is not None:
                        self._consumer.used(size)
                    return PinnedBuffer(self, offset, size)
                if not waited:
                    self.waits += 1
                    waited = True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    largest_free = max((block[1] for block in self._free_blocks), default=0)
                    raise TimeoutError(
                        f"pinned pool: no free block of {size:,} bytes ({_mib(size)}) after waiting {timeout} s: "
                        f"{len(self._live)} buffers in use hold {self.in_use_bytes:,} of {self.capacity_bytes:,} "
                        f"bytes ({_mib(self.in_use_bytes)} of {_mib(self.capacity_bytes)}), largest free block "
                        f"{largest_free:,} bytes; release buffers sooner or raise the option pinned_bytes"
                    )
                self._cond.wait(remaining)

    def _take(self, size: int) -> int | None:
        """First fit; called with the lock held."""
        for index, block in enumerate(self._free_blocks):
            offset, free_size = block
            if free_size >= size:
                if free_size == size:
                    del self._free_blocks[index]
                else:
                    block[0], block[1] = offset + size, free_size - size
                return offset
        return None

    def _release(self, buffer: PinnedBuffer) -> None:
        with self._cond:
            if buffer.released:
                return
            buffer.released = True
            size = self._live.pop(buffer.offset)
            self.in_use_bytes -= size
            if self._consumer is not None:
                self._consumer.used(-size)
            # Insert in offset order and merge with the neighbours.
            blocks = self._free_blocks
            index = 0
            while index < len(blocks) and blocks[index][0] < buffer.offset:
                index += 1
            blocks.insert(index, [buffer.offset, size])
            if index + 1 < len(blocks) and blocks[index][0] + blocks[index][1] == blocks[index + 1][0]:
                blocks[index][1] += blocks.pop(index + 1)[1]
            if index > 0 and blocks[index - 1][0] + blocks[index - 1][1] == blocks[index][0]:
                blocks[index - 1][1] += blocks.pop(index)[1]
            self._cond.notify_all()

    def reset_peak(self) -> None:
        """Start a new peak window at the bytes in use now."""
        with self._cond:
            self.peak_in_use_bytes = self.in_use_bytes

    def close(self) -> None:
        """Unlock the memory (and give a quota back); later ``acquire`` calls raise.  Buffers still in use stay
        valid memory."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._finalizer()

    def __repr__(self) -> str:
        return (f"PinnedPool(capacity_bytes={self.capacity_bytes}, in_use_bytes={self.in_use_bytes}, "
                f"pinned={self.pinned}, locked={self.locked})")


class _Consumer:
    """One consumer's figures over its quotas (it may hold several at once: two optimizers' early steps)."""

    def __init__(self, count_bytes: Callable[[int], None]):
        self._count_bytes = count_bytes
        # Taken inside a pool's lock, never the other way round; reentrant, as a dropped pool's finalizer
        # (freed) may run from a garbage collection that starts inside one of these methods.
        self._lock = threading.RLock()
        self.quota_bytes = 0  # of its live quotas
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0  # since its first quota, across quotas made and closed
        self.quotas = 0
        self.locked_quotas = 0

    def opened(self, capacity_bytes: int, locked: bool) -> None:
        with self._lock:
            self.quota_bytes += capacity_bytes
            self.quotas += 1
            self.locked_quotas += locked
        self._count_bytes(capacity_bytes)

    def freed(self, capacity_bytes: int, locked: bool) -> None:
        with self._lock:
            self.quota_bytes -= capacity_bytes
            self.quotas -= 1
            self.locked_quotas -= locked
        self._count_bytes(-capacity_bytes)

    def used(self, delta: int) -> None:
        with self._lock:
            self.in_use_bytes += delta
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)

    def figures(self) -> dict:
        with self._lock:
            return {"quota": self.quota_bytes, "in_use": self.in_use_bytes, "peak": self.peak_in_use_bytes,
                    "pinned": self.quotas > 0 and self.locked_quotas == self.quotas}


class PinnedMemory:
    """The process's pinned host memory: each consumer draws a named quota of it (:meth:`quota`).

    ``count_bytes(delta)``: where every quota's bytes are counted, once, from
    when it is made until it is closed or dropped (the process's cpu figure;
    None: nowhere).  Each consumer keeps its sizing rule where it is decided
    and asks for exactly that many bytes; the allocator only makes, counts and
    reports.
    """

    def __init__(self, count_bytes: Callable[[int], None] | None = None):
        self._count_bytes = count_bytes if count_bytes is not None else (lambda nbytes: None)
        self._consumers: dict[str, _Consumer] = {}
        self._lock = threading.Lock()

    def quota(self, consumer: str, nbytes: int, pin: bool | None = None) -> PinnedPool:
        """A pool of ``nbytes`` (rounded up to the alignment) for ``consumer``, page-locked as ``pin`` says
        (see :class:`PinnedPool`); ``close()`` it, or drop it, to give the bytes back."""
        with self._lock:
            figures = self._consumers.get(consumer)
            if figures is None:
                figures = self._consumers[consumer] = _Consumer(self._count_bytes)
        return PinnedPool(nbytes, pin=pin, consumer=figures)

    def figures(self) -> dict[str, dict]:
        """Per consumer: ``quota`` (bytes of its live quotas), ``in_use``, ``peak`` (in use, since its first
        quota) and ``pinned`` (every live quota page-locked: registered with CUDA or mlock-ed)."""
        with self._lock:
            consumers = dict(self._consumers)
        return {name: consumer.figures() for name, consumer in consumers.items()}


# --- page locking ----------------------------------------------------------------


def _cuda_register(address: int, nbytes: int) -> tuple[bool, str]:
    """Register host memory with CUDA (locks it and enables async DMA); (done, why not)."""
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        cudart = torch.cuda.cudart()
        # Portable: pinned for every device's context, not only the current one.
        result = cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE)
    except Exception as err:  # CPU-only builds, broken drivers: fall back, recorded
        return False, f"cudaHostRegister unavailable: {err}"
    if int(result) != 0:
        return False, f"cudaHostRegister failed: {cudart.cudaGetErrorString(result)}"
    return True, ""


def _cuda_unregister(address: int, nbytes: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mlock(address: int, nbytes: int) -> tuple[bool, str]:
    """Page-lock host memory where the process is allowed to (RLIMIT_MEMLOCK / CAP_IPC_LOCK)."""
    try:
        libc = _libc()
        if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0:
            return True, ""
        return False, f"mlock failed: {os.strerror(ctypes.get_errno())} (see ulimit -l)"
    except (OSError, AttributeError) as err:
        return False, f"mlock unavailable: {err}"


def _munlock(address: int, nbytes: int) -> None:
    _libc().munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _free(unlock, address: int, nbytes: int, consumer: "_Consumer | None", locked: bool) -> None:
    """A pool closed or dropped: unlock its memory and give its quota back."""
    if unlock is not None:
        try:
            unlock(address, nbytes)
        except Exception:  # best effort at teardown
            pass
    if consumer is not None:
        consumer.freed(nbytes, locked)
