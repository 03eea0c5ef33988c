"""The host heap: give freed memory back to the operating system, or keep it for the next step.

glibc serves allocations below its (adaptive, up to 32 MiB) mmap threshold
from its heaps and keeps what is freed there for reuse, so a process that
allocates and frees many mid-sized tensors (a model materialized module by
module, gathered parameters, gradient staging) keeps a resident set far
above what it holds.  ``malloc_trim(0)`` returns the free pages of every
heap.  Elsewhere (musl, macOS) this is a no-op.

The other way round, on a CPU compute device: each training step allocates
and frees the same gathered buckets (64 MiB by default, above glibc's
largest mmap threshold, so each one is a fresh ``mmap``), gradients and
copies, and a page handed back to the kernel costs a fault and a clearing
when the next step touches it again.  :func:`keep_freed_pages` raises the
mmap and trim thresholds once, so those pages stay in the heap from one step
to the next (benchmarks/RESULTS.md, 2026-12-03: NVMe-tier GPT step at world
2 on 2 cores 4.85 -> 4.43 s; 140k faults a rank-step before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_malloc_trim = None
_mallopt = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = getattr(_libc, "malloc_trim", None)
    _mallopt = getattr(_libc, "mallopt", None)
except OSError:
    pass

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap and are reused there: above a gathered bucket (bucket_bytes,
# 64 MiB by default) with room for a larger one; a larger tensor still gets an mmap of its own.
KEEP_MMAP_THRESHOLD_BYTES = 256 * 1024**2
# Free memory at the heap's top that free() leaves mapped (an explicit trim() still returns it).
KEEP_TRIM_THRESHOLD_BYTES = 1024**3
# The user's own malloc settings win: zinf then leaves the heap's thresholds as they are.
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
# glibc's own starting thresholds (malloc.h's DEFAULT_MMAP_THRESHOLD_MIN and DEFAULT_TRIM_THRESHOLD).
_GLIBC_MMAP_THRESHOLD_BYTES = 128 * 1024
_GLIBC_TRIM_THRESHOLD_BYTES = 128 * 1024
_kept = None  # whether keep_freed_pages set the thresholds (None: not asked yet)
_bounded = False  # whether a host_memory budget claimed the heap (bound_heap): it keeps no freed pages from then on


def trim() -> bool:
    """Return the heaps' free pages to the OS; True if anything was released."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


def keep_freed_pages() -> bool:
    """Keep freed heap pages mapped for reuse (a CPU device's steps): raise glibc's mmap and trim thresholds
    once per process; True if they are set.  Not where the environment sets glibc's malloc itself, nor off
    glibc.  Peak RSS is what a step needs, plus what the heap cannot reuse (2026-12-03: 1.24 -> 1.29 GiB for
    the NVMe-tier GPT above, 884 -> 953 MiB for budgets.py's stage3-nvme, which is why a model with a
    host_memory budget does not ask for this); the resting RSS between steps stays at the peak.  The heap may
    still grow in the second step (posix_memalign wants more than a freed bucket's chunk when a small
    allocation sits above it); from there on freed chunks coalesce and serve each step."""
    global _kept
    if _bounded:
        return False
    if _kept is None:
        _kept = (_mallopt is not None and not any(name in os.environ for name in _USER_MALLOC_SETTINGS)
                 and bool(_mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD_BYTES))
                 and bool(_mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD_BYTES)))
    return _kept


def bound_heap() -> None:
    """A model with a host_memory budget in this process: the heap keeps no freed pages from now on, also where an
    unbudgeted model asked for them before (the budget is a bound, the kept pages only speed).  Thresholds that
    :func:`keep_freed_pages` raised go back to glibc's starting values (fixed from then on: glibc no longer
    adapts them), and the free pages go back to the OS now; the budgeted model's steps trim after each step."""
    global _kept, _bounded
    _bounded = True
    if _kept:
        _mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_BYTES)
        _mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD_BYTES)
        trim()
    _kept = False


def pages_kept() -> bool:
    """Whether :func:`keep_freed_pages` set the heap's thresholds in this process."""
    return bool(_kept)


def rss_figures() -> dict[str, int]:
    """Resident set now (``VmRSS``) and its high-water mark (``VmHWM``), in bytes (Linux)."""
    figures = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                figures[line.split(":")[0]] = int(line.split()[1]) * 1024
    return figures


def new_peak_window() -> int:
    """Reset the RSS high-water mark to the current RSS (``/proc/self/clear_refs``); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return rss_figures()["VmRSS"]


def ranks_on_node() -> int:
    """The zinf ranks sharing this machine's memory and cores (``LOCAL_WORLD_SIZE``, set by torchrun; else 1)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def available_bytes() -> int | None:
    """The memory the kernel says a new process could take without swapping (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
