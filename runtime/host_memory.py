"""Give freed host memory back to the operating system.

glibc serves allocations below its (adaptive, up to 32 MiB) mmap threshold
from its heaps and keeps what is freed there for reuse, so a process that
allocates and frees many mid-sized tensors (a model materialized module by
module, gathered parameters, gradient staging) keeps a resident set far
above what it holds.  ``malloc_trim(0)`` returns the free pages of every
heap.  Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_malloc_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = getattr(_libc, "malloc_trim", None)
except OSError:
    pass


def trim() -> bool:
    """Return the heaps' free pages to the OS; True if anything was released."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


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
