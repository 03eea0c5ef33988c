"""The parameter store's offload resources: its swap engines and its pinned pool, made on first need.

One :class:`OffloadResources` per store.  It is handed what it needs, nothing
more: the tracer its engines draw on, the folder watch that removes their
folders on SIGTERM, and the process's pinned memory its pool is a quota of
(``"parameters"``, counted there); the records it sizes from are passed to
the calls that read them.  Synchronous swap reads and writes through the pool
are here too (adoption, checkpoints, the optimizer's first write of a master).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .aio import AioEngine
from .ledger import ZinfStoreError
from .pinned import PinnedMemory, PinnedPool
from .pool_sizes import grad_write_reserve_bytes, parameter_pool_bytes
from .records import POOL_WAIT_SECONDS
from .swap_folders import FolderWatch
from .trace import Tracer


class OffloadResources:
    """One engine per nvme_path and the process's pinned pool, with the settings they are made from.

    ``tracer``: the timeline the engines' transfers are drawn on; ``folder_watch``:
    what removes their folders on SIGTERM (None: each engine its own);
    ``pinned_memory``: the allocator the pool is drawn from (which counts its bytes).
    """

    def __init__(self, tracer: Tracer, folder_watch: FolderWatch | None, pinned_memory: PinnedMemory):
        self.tracer = tracer
        self.folder_watch = folder_watch
        self.pinned_memory = pinned_memory
        self.engines_by_path: dict[str, AioEngine] = {}
        self.pinned: PinnedPool | None = None
        self.settings: dict = {}
        self.planned: list = []  # ParamPlan of every parameter planned before its adoption (sizes the pool)

    def configure(self, nvme_path: str | None, pinned_bytes, aio_block_size: int, aio_queue_depth: int,
                  aio_threads: int, nvme_copies: int = 2) -> None:
        """Settings for the parameters adopted next: their swap folder and the pinned pool."""
        if self.pinned is not None and pinned_bytes not in ("auto", self.pinned.capacity_bytes):
            raise ZinfStoreError(
                f"pinned_bytes={pinned_bytes} asked after the pinned pool was made with "
                f"{self.pinned.capacity_bytes:,} bytes; use one pinned_bytes per process"
            )
        self.settings = dict(nvme_path=nvme_path, pinned_bytes=pinned_bytes, aio_block_size=aio_block_size,
                             aio_queue_depth=aio_queue_depth, aio_threads=aio_threads, nvme_copies=nvme_copies)

    def engine(self) -> AioEngine:
        """The swap engine of the configured nvme_path (one per path: two models may swap to different disks)."""
        settings = self.settings
        nvme_path = settings["nvme_path"]
        engine = self.engines_by_path.get(nvme_path)
        if engine is None:
            engine = self.engines_by_path[nvme_path] = AioEngine(
                nvme_path, block_size=settings["aio_block_size"], queue_depth=settings["aio_queue_depth"],
                threads=settings["aio_threads"], copies=settings.get("nvme_copies", 2), tracer=self.tracer,
                folder_watch=self.folder_watch)
        elif engine.copies != settings.get("nvme_copies", engine.copies):
            raise ZinfStoreError(
                f"nvme_copies={settings['nvme_copies']} asked for {nvme_path}, whose swap engine "
                f"was made with nvme_copies={engine.copies}; use one value per nvme_path")
        return engine

    def plan_shards(self, plans: Iterable, records: Iterable = ()) -> None:
        """Before adoption: the plans of the parameters adopted next (their slices size the pool, which the
        first adopted one may make).  A pool made for an earlier part of the model (a graph compiled before
        the next one was planned) that these do not fit grows now, while no buffer is in use (``pinned_bytes
        ="auto"``; else a transfer too large for it raises, naming pinned_bytes)."""
        self.planned.extend(plans)
        pool = self.pinned
        if pool is None:
            return  # (kept until the pool is made, to size it)
        sizing, self.planned = self.sizing_plans(records), []
        if self.settings.get("pinned_bytes", "auto") != "auto" or pool.in_use_bytes:
            return
        wanted = parameter_pool_bytes(max([plan.local_numel * 4 for plan in sizing] + [0]), sizing)
        if wanted > pool.capacity_bytes:
            pool.close()
            self.pinned = self.pinned_memory.quota("parameters", wanted)

    def sizing_plans(self, records: Iterable) -> list:
        """The plans the pool is sized from: ``records``' (adopted) and those planned since, each once."""
        plans = [record.plan for record in records]
        adopted = {plan.uid for plan in plans}
        return plans + [plan for plan in self.planned if plan.uid not in adopted]

    def pinned_pool(self, at_least: int, records: Iterable) -> PinnedPool:
        """The pinned pool, made on first need (``pinned_bytes``, or sized from ``records``' shards and
        ``at_least``, the bytes the caller is about to take)."""
        if self.pinned is None:
            wanted = self.settings.get("pinned_bytes", "auto")
            if wanted == "auto":
                plans = self.sizing_plans(records)
                wanted = parameter_pool_bytes(max([plan.local_numel * 4 for plan in plans] + [at_least]), plans)
            self.pinned = self.pinned_memory.quota("parameters", int(wanted))
            self.planned = []  # (read only to size it)
        return self.pinned

    def prefetch_pinned_bytes(self, records: list) -> int | None:
        """Pinned bytes the graph's nc reads may hold at once (None: no pool, nothing read from NVMe).

        The pool less what gradient writes to NVMe use during backward and
        one largest shard of slack for first-fit fragmentation; never less
        than one largest shard (a fetch without prefetch needs that much).
        """
        if self.pinned is None:
            return None
        largest = max([r.shard_bytes for r in records if r.param_tier == "nvme"] + [0])
        reserve = grad_write_reserve_bytes([r.plan for r in records])
        return max(self.pinned.capacity_bytes - reserve - largest, largest)

    def write_swap(self, engine: AioEngine, key: str, tensor: torch.Tensor, records: Iterable = ()) -> None:
        """Write a flat tensor to the swap file ``key`` through the pinned pool (synchronous)."""
        nbytes = tensor.numel() * tensor.element_size()
        with self.pinned_pool(nbytes, records).acquire(nbytes, timeout=POOL_WAIT_SECONDS) as staging:
            staging.tensor(tensor.dtype, tensor.numel()).copy_(tensor)
            engine.write(key, staging, nbytes).wait()

    def read_swap(self, engine: AioEngine, key: str, dtype: torch.dtype, numel: int, device: torch.device,
                  records: Iterable = ()) -> torch.Tensor:
        """Read the swap file ``key`` into a new tensor on ``device`` (synchronous)."""
        nbytes = numel * dtype.itemsize
        out = torch.empty(numel, dtype=dtype, device=device)
        with self.pinned_pool(nbytes, records).acquire(nbytes, timeout=POOL_WAIT_SECONDS) as staging:
            engine.read(key, staging, nbytes).wait()
            out.copy_(staging.tensor(dtype, numel))
        return out
