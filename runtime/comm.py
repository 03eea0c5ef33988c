"""Collectives over ``torch.distributed`` (the default process group), with traffic counters.

World size 1 needs no process group: every collective degenerates to a local
copy.  Each call adds to ``traffic_bytes[kind]`` the bytes of the full tensor
it moves (an all-gather: its output, a reduce-scatter: its input, an
all-reduce: twice its size, a broadcast or reduce: its size), the unit in
which ZeRO's traffic is usually stated (stage 1/2: 2x params, stage 3: 3x).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from .copy_engine import COPIER
from .trace import TRACER, now


class _DoneWork:
    """The handle of a collective that finished synchronously (world size 1)."""

    def wait(self) -> bool:
        return True


class _TracedWork:
    """A collective's handle whose completion lands on a trace track and whose wait counts as a stall."""

    def __init__(self, work, track: str, nbytes: int):
        self._work = work
        self._track = track
        if TRACER.recording:
            started = now()
            try:
                work.get_future().add_done_callback(
                    lambda _: TRACER.interval(track, track, started, now(), nbytes))
            except (AttributeError, RuntimeError):  # a backend without futures: no interval
                pass

    def wait(self) -> bool:
        with TRACER.stall(f"wait {self._track}"):
            return self._work.wait()


class Comm:
    def __init__(self) -> None:
        self.traffic_bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.initialized else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.initialized else 0

    def _count(self, kind: str, nbytes: int) -> None:
        self.traffic_bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset_traffic(self) -> None:
        self.traffic_bytes.clear()
        self.calls.clear()

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor):
        """Start gathering every rank's equal-size ``shard`` into ``output``; returns a handle."""
        nbytes = output.numel() * output.element_size()
        self._count("all_gather", nbytes)
        if self.world_size == 1:
            return COPIER.copy(output, shard, "gg", "gather (local copy)")
        return _TracedWork(dist.all_gather_into_tensor(output, shard, async_op=True), "gg", nbytes)

    def reduce_scatter_avg(self, output: torch.Tensor, full: torch.Tensor):
        """Start averaging ``full`` over ranks, this rank keeping its slice in ``output``."""
        nbytes = full.numel() * full.element_size()
        self._count("reduce_scatter", nbytes)
        if self.world_size == 1:
            return COPIER.copy(output, full, "rs", "reduce (local copy)")
        return _TracedWork(dist.reduce_scatter_tensor(output, full, op=dist.ReduceOp.AVG, async_op=True), "rs", nbytes)

    def all_reduce_avg(self, tensor: torch.Tensor):
        """Start averaging ``tensor`` in place over ranks."""
        self._count("all_reduce", 2 * tensor.numel() * tensor.element_size())
        if self.world_size == 1:
            return _DoneWork()
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over ranks (small scalars such as norms)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Start sending ``tensor`` from rank ``src`` to every rank, in place."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("broadcast", nbytes)
        if self.world_size == 1:
            return _DoneWork()
        return _TracedWork(dist.broadcast(tensor, src=src, async_op=True), "gg", nbytes)

    def reduce_sum(self, tensor: torch.Tensor, dst: int):
        """Start summing ``tensor`` over ranks into rank ``dst``'s copy."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("reduce", nbytes)
        if self.world_size == 1:
            return _DoneWork()
        return _TracedWork(dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, async_op=True), "rs", nbytes)


COMM = Comm()
