"""One bounded, reused pool of aligned host buffers for every transfer.

The memory is allocated once, as anonymous ``mmap`` regions (page aligned, so
usable with ``O_DIRECT``), and every page is touched at creation: on these VMs
freshly touched memory is slow, reused memory is fast.  Where the platform
allows it the pool is page-locked: registered with CUDA (``cudaHostRegister``)
when a GPU is present, else ``mlock``-ed; ``pool.pinned`` / ``pool.locked``
say what happened.

``acquire(nbytes)`` sub-allocates a block (first fit, coalescing free list);
when the pool is full it waits for a release and never allocates past
``capacity_bytes``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
import time

import torch

ALIGNMENT = 4096


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class PinnedBuffer:
    """A block of the pool: ``memoryview()``, ``tensor(dtype, numel)``, ``release()``."""

    def __init__(self, pool: "PinnedPool", offset: int, nbytes: int):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.released = False

    @property
    def address(self) -> int:
        return self.pool.base_address + self.offset

    def memoryview(self) -> memoryview:
        return self.pool._view[self.offset : self.offset + self.nbytes]

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A tensor over the first ``numel`` elements of the block (no copy)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.nbytes:
            raise ValueError(f"{numel} x {dtype} does not fit a {self.nbytes}-byte pinned buffer")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.memoryview(), dtype=dtype, count=numel)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._free(self)

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PinnedPool:
    def __init__(self, capacity_bytes: int, alignment: int = ALIGNMENT, pin: bool | None = None):
        if capacity_bytes <= 0:
            raise ValueError("pinned pool capacity must be > 0 bytes (option pinned_bytes)")
        self.alignment = alignment
        self.capacity_bytes = _round_up(capacity_bytes, alignment)
        self._mmap = mmap.mmap(-1, self.capacity_bytes)
        self._view = memoryview(self._mmap)
        # Touch every page now, once.
        step = mmap.PAGESIZE
        zeros = bytes(step)
        for offset in range(0, self.capacity_bytes, step):
            self._view[offset : offset + step] = zeros
        self.base_address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self.pinned = False
        self.locked = False
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin and torch.cuda.is_available():
            result = torch.cuda.cudart().cudaHostRegister(self.base_address, self.capacity_bytes, 0)
            self.pinned = int(result) == 0 if not isinstance(result, tuple) else int(result[0]) == 0
        if not self.pinned:
            self.locked = _mlock(self.base_address, self.capacity_bytes)
        self._free_blocks: list[tuple[int, int]] = [(0, self.capacity_bytes)]  # (offset, size), sorted
        self._cond = threading.Condition()
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.waits = 0

    def acquire(self, nbytes: int, timeout: float | None = None) -> PinnedBuffer:
        """A block of at least ``nbytes`` (rounded up to the alignment); waits while the pool is full."""
        size = _round_up(max(nbytes, 1), self.alignment)
        if size > self.capacity_bytes:
            raise ValueError(
                f"a {nbytes:,}-byte transfer does not fit the pinned pool of {self.capacity_bytes:,} bytes; "
                f"raise the option pinned_bytes"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            waited = False
            while True:
                for index, (offset, free_size) in enumerate(self._free_blocks):
                    if free_size >= size:
                        if free_size == size:
                            del self._free_blocks[index]
                        else:
                            self._free_blocks[index] = (offset + size, free_size - size)
                        self.in_use_bytes += size
                        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
                        return PinnedBuffer(self, offset, size)
                if not waited:
                    self.waits += 1
                    waited = True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"pinned pool: no {size:,}-byte block free after {timeout}s "
                        f"({self.in_use_bytes:,} of {self.capacity_bytes:,} bytes in use)"
                    )
                self._cond.wait(remaining)

    def _free(self, buffer: PinnedBuffer) -> None:
        with self._cond:
            self.in_use_bytes -= buffer.nbytes
            blocks = sorted(self._free_blocks + [(buffer.offset, buffer.nbytes)])
            merged: list[tuple[int, int]] = []
            for offset, size in blocks:
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((offset, size))
            self._free_blocks = merged
            self._cond.notify_all()


def _mlock(address: int, nbytes: int) -> bool:
    """Page-lock host memory where the process is allowed to (RLIMIT_MEMLOCK)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0
    except OSError:
        return False
