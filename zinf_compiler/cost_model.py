"""The cost model in ``ctx``: how long this machine takes for a node's compute and for each transfer.

At the first compile of a process :func:`profile_machine` runs a short set of
probes (about 0.1-0.3 s) and keeps the result for the rest of the process:

* ``matmul_flops``: a square matmul in the compute dtype (FLOP/s);
* ``memory_bandwidth``: a large copy in device memory (bytes/s), the cost of
  memory-bound ops and, at world size 1, of a gather (a local copy);
* ``host_to_device``: a pinned host buffer copied to the device (on a CPU
  device: the same memcpy, which is what ``cg`` is there);
* ``host_memory_bandwidth``: a large copy in host memory (on a CPU device the
  same as ``memory_bandwidth``), the rate of the CPU optimizer's pass;
* ``disk_read`` / ``disk_write``: 32 MiB written and read back with
  ``O_DIRECT`` in ``nvme_path`` (only when something is offloaded to NVMe);
* ``collective``: an all-gather over the default process group (world > 1),
  as bytes of gathered output per second.

:class:`CostModel` turns those rates into seconds: ``node_seconds(node)`` from
the node's fake tensors (``meta["val"]``: matmuls and attention by FLOPs,
everything else by bytes moved, views free) and ``transfer_seconds(step,
nbytes)`` for the steps ``nc``, ``cg``, ``gg`` and ``rs``.  The schedule pass
uses it only for the estimates it prints (the schedule itself depends on the
graph alone, so it is deterministic); the dumps print the profile.

At world size > 1 every rank ends with the same profile: the rates are
averaged over ranks and the free device memory is the smallest (at the
first compile; later ones re-read their own free memory without a
collective, as a recompile may happen on one rank alone).  Decisions
taken from it (``auto`` checkpointing picks recompute or offload per tensor,
the live-bytes cap) then give every rank the same graphs, so their
collectives pair up.

``ZINF_COST_PROFILE=nominal`` skips the probes and uses fixed nominal rates
(tests that only need a deterministic table use this too).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from .graph_utils import size_hint
from .runtime.host_memory import available_bytes

if TYPE_CHECKING:
    from .runtime.comm import Comm

_cache: dict[tuple, "MachineProfile"] = {}
_cache_lock = threading.Lock()
PROBE_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """Measured rates of this machine (bytes/s and FLOP/s); ``None``: not measured (not needed)."""

    device: str
    dtype: str
    matmul_flops: float
    memory_bandwidth: float
    host_to_device: float
    # A copy in host memory (the CPU optimizer's rate); None: the same as memory_bandwidth (a CPU device).
    host_memory_bandwidth: float | None = None
    disk_read: float | None = None
    disk_write: float | None = None
    collective: float | None = None
    # Device bytes free when profiled (CUDA: cudaMemGetInfo; CPU: MemAvailable).
    free_device_bytes: int | None = None
    probe_seconds: float = 0.0
    source: str = "measured"  # "measured" | "nominal"

    @property
    def host_bandwidth(self) -> float:
        """The host memory's copy rate (bytes/s): on a CPU device, the device's."""
        return self.host_memory_bandwidth or self.memory_bandwidth

    def describe(self) -> list[str]:
        """The rates, the free device memory and the probes' time as one readable line (in a list)."""
        def rate(value: float | None) -> str:
            return "not measured" if value is None else f"{value / 1e9:.2f} GB/s"

        free = "unknown" if self.free_device_bytes is None else f"{self.free_device_bytes / 2**30:.1f} GiB"
        return [
            f"cost model ({self.source}, {self.device}, {self.dtype}, probes took {self.probe_seconds * 1000:.0f} ms): "
            f"matmul {self.matmul_flops / 1e12:.3f} TFLOP/s, memory {rate(self.memory_bandwidth)}, "
            f"host->device {rate(self.host_to_device)}, host memory {rate(self.host_bandwidth)}, "
            f"disk read {rate(self.disk_read)}, disk write {rate(self.disk_write)}, collective {rate(self.collective)}, free device memory {free}",
        ]


def measured_profiles() -> list["MachineProfile"]:
    """Every profile this process has measured so far (for reports: benchmarks/peers.py's limit model)."""
    with _cache_lock:
        return list(_cache.values())


def nominal_profile(device: str = "cpu", dtype: str = "fp32") -> MachineProfile:
    """Fixed rates, deterministic, for tests, ``ZINF_COST_PROFILE=nominal`` and a budget chosen without probes:
    on a CPU roughly this project's 2-core CPU VM, on a GPU roughly the H100 the CUDA path was checked on."""
    if device == "cuda":
        return MachineProfile(device=device, dtype=dtype, matmul_flops=40e12, memory_bandwidth=2.5e12,
                              host_to_device=20e9, host_memory_bandwidth=12e9, disk_read=2e9, disk_write=2e9,
                              collective=100e9, free_device_bytes=None, source="nominal")
    return MachineProfile(device=device, dtype=dtype, matmul_flops=0.3e12, memory_bandwidth=12e9,
                          host_to_device=12e9, disk_read=2e9, disk_write=2e9, collective=0.5e9,
                          free_device_bytes=None, source="nominal")


def is_profiled(device: torch.device, dtype: torch.dtype, nvme_path: str | None, comm: "Comm") -> bool:
    """Whether :func:`profile_machine` has these rates already (then it runs no collective)."""
    if os.environ.get("ZINF_COST_PROFILE", "").lower() == "nominal":
        return True
    with _cache_lock:
        return _key(device, dtype, nvme_path, comm) in _cache


def _key(device: torch.device, dtype: torch.dtype, nvme_path: str | None, comm: "Comm") -> tuple:
    # (A Comm lives as long as the process.)  The CPU's rates are those of the threads this process computes with.
    return (str(device), dtype, nvme_path, comm.world_size, id(comm), torch.get_num_threads())


def profile_machine(device: torch.device, dtype: torch.dtype, nvme_path: str | None, comm: "Comm") -> MachineProfile:
    """The rates of ``device`` (measured once per process and key; see the module docstring).

    Collective over ``comm`` (the ranks of the model, runtime/comm.py): each of
    them must call this at the same point (compiles are; the all-gather probe
    and the averaging of rates are collectives).
    """
    dtype_name = str(dtype).replace("torch.", "")
    if os.environ.get("ZINF_COST_PROFILE", "").lower() == "nominal":
        return nominal_profile(device.type, dtype_name)
    key = _key(device, dtype, nvme_path, comm)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        # No collective here: a later compile may happen on one rank alone (a guard that failed there).
        return dataclasses.replace(cached, free_device_bytes=_free_device_bytes(device))
    started = time.perf_counter()
    disk_read = disk_write = None
    if nvme_path:
        disk_write, disk_read = _probe_disk(nvme_path)
    profile = MachineProfile(
        device=str(device),
        dtype=dtype_name,
        matmul_flops=_probe_matmul(device, dtype),
        memory_bandwidth=_probe_copy(device, device),
        host_to_device=_probe_copy(torch.device("cpu"), device) if device.type == "cuda" else _probe_copy(device, device),
        host_memory_bandwidth=_probe_copy(torch.device("cpu"), torch.device("cpu")) if device.type == "cuda" else None,
        disk_read=disk_read,
        disk_write=disk_write,
        collective=_probe_collective(device, comm) if comm.world_size > 1 else None,
        free_device_bytes=agreed_free_bytes(device, comm),
        probe_seconds=time.perf_counter() - started,
    )
    profile = _agreed_rates(profile, device, comm)
    with _cache_lock:
        _cache[key] = profile
    return profile


def best_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds of ``fn()`` (after one warm-up call), ``device`` synchronized around each."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def _probe_matmul(device: torch.device, dtype: torch.dtype) -> float:
    size = 4096 if device.type == "cuda" else 512
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    if device.type == "cuda":
        return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), device)
    # On a CPU the median of 7 small ones (about 20 ms, paid once per process and profile key): the best of
    # three scattered by 30% from probe to probe; the median still varies by up to a quarter (RESULTS.md).
    torch.mm(a, b)
    seconds = []
    for _ in range(7):
        started = time.perf_counter()
        torch.mm(a, b)
        seconds.append(time.perf_counter() - started)
    return 2 * size**3 / max(sorted(seconds)[3], 1e-9)


def _probe_copy(source_device: torch.device, target_device: torch.device) -> float:
    numel = PROBE_BYTES // 4
    source = torch.ones(numel, device=source_device)
    if source_device.type == "cpu" and target_device.type == "cuda":
        source = source.pin_memory()  # what the pinned pool gives cg
    target = torch.empty(numel, device=target_device)
    return PROBE_BYTES / best_seconds(lambda: target.copy_(source, non_blocking=True), target_device)


def _probe_disk(folder: str) -> tuple[float | None, float | None]:
    """Write then read back ``PROBE_BYTES`` with O_DIRECT (buffered if the filesystem refuses it)."""
    buffer = mmap.mmap(-1, PROBE_BYTES)  # page aligned, as O_DIRECT needs
    buffer.write(b"\x5a" * PROBE_BYTES)
    try:
        handle, path = tempfile.mkstemp(prefix="zinf-cost-probe-", dir=folder)
        os.close(handle)
    except OSError:
        return None, None
    try:
        flags = os.O_RDWR | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDWR)
        try:
            started = time.perf_counter()
            os.pwrite(fd, buffer, 0)
            os.fsync(fd)
            write_rate = PROBE_BYTES / max(time.perf_counter() - started, 1e-9)
            started = time.perf_counter()
            os.preadv(fd, [buffer], 0)
            read_rate = PROBE_BYTES / max(time.perf_counter() - started, 1e-9)
        finally:
            os.close(fd)
        return write_rate, read_rate
    except OSError:
        return None, None
    finally:
        buffer.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _probe_collective(device: torch.device, comm: "Comm") -> float | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = comm.world_size
    shard = torch.ones((4 << 20) // 4 // world, device=device)
    gathered = torch.empty(shard.numel() * world, device=device)
    seconds = best_seconds(lambda: comm.start_all_gather_uncounted(gathered, shard).wait(), device, repeats=2)
    return gathered.numel() * 4 / seconds


_RATES = ("matmul_flops", "memory_bandwidth", "host_to_device", "host_memory_bandwidth", "disk_read", "disk_write",
          "collective")


def _distributed(comm: "Comm"):
    """torch.distributed when ``comm``'s ranks must agree (more than one of them), else None."""
    import torch.distributed as dist

    return dist if comm.world_size > 1 and dist.is_available() and dist.is_initialized() else None


def _agreed_rates(profile: "MachineProfile", device: torch.device, comm: "Comm") -> "MachineProfile":
    """Every rank's rates averaged over ``comm``'s ranks (a collective), so every rank decides alike."""
    dist = _distributed(comm)
    if dist is None:
        return profile
    rates = [getattr(profile, name) for name in _RATES]
    packed = torch.tensor([-1.0 if rate is None else float(rate) for rate in rates], dtype=torch.float64,
                          device=device)
    dist.all_reduce(packed, group=comm.group)
    averaged = (packed / comm.world_size).tolist()
    return dataclasses.replace(profile, **{name: None if rate is None else averaged[index]
                                           for index, (name, rate) in enumerate(zip(_RATES, rates))})


def agreed_free_bytes(device: torch.device, comm: "Comm") -> int | None:
    """The free device memory of the rank of ``comm`` with the least (a collective when it has several)."""
    free = _free_device_bytes(device)
    dist = _distributed(comm)
    if dist is None or free is None:
        return free
    smallest = torch.tensor([free], dtype=torch.int64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=comm.group)
    return int(smallest.item())


def _free_device_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    return available_bytes()


# --- per-node estimates ---------------------------------------------------------------

_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def _numel(value: Any) -> int:
    return size_hint(value.numel()) if isinstance(value, torch.Tensor) else 0


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _numel(value) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(item) for item in value)
    return 0


class CostModel:
    """Seconds for graph nodes and transfers, from a :class:`MachineProfile`."""

    def __init__(self, profile: MachineProfile, world_size: int = 1, host_staging_bytes: int | None = None):
        self.profile = profile
        self.world_size = world_size
        # Pinned host bytes the fetch pipeline may hold at once (nc buffers), or None: unbounded.
        self.host_staging_bytes = host_staging_bytes

    def node_seconds(self, node: torch.fx.Node) -> float:
        """Estimated compute seconds of one ATen node (0 for placeholders, views and zinf ops)."""
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0
        target = node.target
        if target.namespace == "zinf" or target.is_view:
            return 0.0
        value = node.meta.get("val")
        inputs = [arg.meta.get("val") for arg in node.all_input_nodes]
        name = target._opname
        if name in _MATMULS and isinstance(value, torch.Tensor):
            first = inputs[1] if name in ("addmm", "baddbmm") else inputs[0]
            inner = size_hint(first.shape[-1]) if isinstance(first, torch.Tensor) and first.dim() else 1
            return 2 * _numel(value) * inner / self.profile.matmul_flops
        if "scaled_dot_product" in name and inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 4:
            query, key = inputs[0], inputs[1]
            batch, heads, q_len, head_dim = (size_hint(size) for size in query.shape)
            flops = 4 * batch * heads * q_len * size_hint(key.shape[-2]) * head_dim
            return (2.5 if "backward" in name else 1.0) * flops / self.profile.matmul_flops
        moved = _bytes(value) + sum(_bytes(item) for item in inputs)
        return moved / self.profile.memory_bandwidth

    def transfer_seconds(self, step: str, nbytes: int) -> float:
        """Seconds for ``step`` ("nc", "cg", "gg", "rs", "write": to NVMe) to move ``nbytes`` (gg/rs: the gathered size)."""
        profile = self.profile
        if step == "nc":
            rate = profile.disk_read or nominal_profile().disk_read
        elif step == "write":
            rate = profile.disk_write or nominal_profile().disk_write
        elif step == "cg":
            rate = profile.host_to_device
        elif step in ("gg", "rs"):
            rate = profile.collective if self.world_size > 1 and profile.collective else profile.memory_bandwidth
        else:
            raise ValueError(f"unknown transfer step {step!r}")
        return nbytes / rate

    def describe(self) -> list[str]:
        """The profile's line, plus the pinned staging bytes where capped: the schedule table's ``cost_model``."""
        lines = self.profile.describe()
        if self.host_staging_bytes is not None:
            lines.append(f"pinned staging for nc prefetch: {self.host_staging_bytes:,} bytes")
        return lines
