"""Collectives over ``torch.distributed``, with traffic counters.

A :class:`Comm` runs collectives over one process group (the default one, or a
subgroup from :meth:`Comm.subgroup`); a :class:`MeshComm` is a model's
data-parallel ranks: the group its parameters are sharded over and, for HSDP,
the group of replicas its gradients are averaged across.  World size 1 needs
no process group: every collective degenerates to a local copy.  Each call adds to ``traffic_bytes[kind]`` the bytes of the full tensor
it moves (an all-gather: its output, a reduce-scatter: its input, an
all-reduce: twice its size, a broadcast or reduce: its size), the unit in
which ZeRO's traffic is usually stated (stage 1/2: 2x params, stage 3: 3x).
"""

from __future__ import annotations

import collections
import datetime
import threading

import torch
import torch.distributed as dist

from .copy_engine import CopyEngine
from .trace import Tracer, now

# The one-tensor collectives under their newer names where torch has them (2.13 deprecates the old ones with a
# warning at every call site; 2.11 has only the old ones): the same operations.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DoneWork:
    """The handle of a transfer step with nothing in flight (a collective that finished synchronously at world
    size 1, a reduce with nothing to average): waiting returns at once."""

    def wait(self) -> bool:
        """Nothing to wait for."""
        return True

    def wait_done(self, timeout: float) -> bool:
        """Done already."""
        return True


DONE = DoneWork()


class _AllWork:
    """One handle for several collectives that together make one (see :meth:`Comm.all_gather_into`):
    ``wait()`` waits for each, then runs ``then`` (once)."""

    def __init__(self, works: list, then=None) -> None:
        self._works = works
        self._then = then

    def get_future(self):
        """A future done when every part is (for the trace)."""
        return torch.futures.collect_all([work.get_future() for work in self._works])

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else now() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - now(), 0.001)))
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True


class ZinfCollectiveTimeout(RuntimeError):
    """A collective did not complete within ``collective_timeout``: some rank did not make the same call."""


class _TracedWork:
    """A collective's handle whose completion lands on a trace track and whose wait counts as a stall.

    ``wait()`` gives up after ``timeout`` seconds (None: the process group's
    own) with :class:`ZinfCollectiveTimeout` naming ``what``.
    """

    def __init__(self, tracer: Tracer, work, track: str, nbytes: int, what: str = "", timeout: float | None = None,
                 world_size: int = 0, waits_on_host: bool = True):
        self._tracer = tracer
        self._work = work
        self._waits_on_host = waits_on_host  # wait() blocks this thread (gloo), not a device stream (NCCL)
        self._done: threading.Event | None = None  # set when the collective completes (see wait_done)
        self._world_size = world_size
        self._track = track
        self._what = what or track
        self._timeout = timeout
        if tracer.recording:
            started = now()
            try:
                work.get_future().add_done_callback(
                    lambda _: tracer.interval(track, track, started, now(), nbytes))
            except (AttributeError, RuntimeError):  # a backend without futures: no interval
                pass

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the collective; whether it completed.  Never raises: ``wait()``
        still follows (it raises the collective's error).  True at once where ``wait()`` does not block this
        thread (NCCL orders a stream) or the backend gives no future: nothing to fill the wait with."""
        if not self._waits_on_host:
            return True
        if self._done is None:
            done = threading.Event()
            try:
                self._work.get_future().add_done_callback(lambda _: done.set())
            except (AttributeError, RuntimeError):
                self._waits_on_host = False
                return True
            self._done = done
        return self._done.wait(timeout)

    def wait(self) -> bool:
        with self._tracer.stall(f"wait {self._track}"):
            if self._timeout is None:
                return self._work.wait()
            try:
                return self._work.wait(timeout=datetime.timedelta(seconds=self._timeout))
            except RuntimeError as err:
                if "timed out" not in str(err).lower():
                    raise
                raise ZinfCollectiveTimeout(
                    f"{self._what} did not complete on all {self._world_size} ranks of its group within "
                    f"collective_timeout={self._timeout:g} s (rank {dist.get_rank()} waited): a rank did not make "
                    f"the same call. Every rank must run the same compiled graphs and call zinf's collective "
                    f"helpers (full_state_dict, clip_grad_norm_, optimizer steps) together; raise the option "
                    f"collective_timeout if a rank is just slow") from err


class Comm:
    """Collectives over one process group: ``group`` (None: the default group).

    Subgroups (:meth:`subgroup`) share the process's traffic counters,
    default timeout, copy engine and tracer with the default group's Comm
    (the ``Runtime``'s ``comm``): the counters say what this process sent, whatever the
    group.  World size 1 copies with ``copier``; waits are stalls on ``tracer``.  Ranks (``rank``, ``src``, ``dst``) are
    ranks within the group.
    """

    def __init__(self, group=None, parent: "Comm | None" = None, *, copier: CopyEngine | None = None,
                 tracer: Tracer | None = None) -> None:
        self.group = group
        self._parent = parent
        self.copier = parent.copier if parent else copier
        self.tracer = parent.tracer if parent else tracer
        if self.copier is None or self.tracer is None:
            raise TypeError("a Comm of the default group needs its process's copier and tracer")
        self.traffic_bytes: collections.Counter = parent.traffic_bytes if parent else collections.Counter()
        self.calls: collections.Counter = parent.calls if parent else collections.Counter()
        # Seconds a collective may wait for the other ranks when its caller names no timeout (option
        # collective_timeout of the last compile).  A model's collectives pass the model's own (its ledger's).
        self._timeout: float | None = 600.0
        self._subgroups: dict[int, tuple] = {}  # id(group) -> (group, its Comm)
        self._meshes: dict[tuple, MeshComm] = {}

    @property
    def timeout(self) -> float | None:
        """Seconds a collective waits for the other ranks when its caller names none (the process's)."""
        return self._parent.timeout if self._parent else self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        """Seconds a collective waits for the other ranks when its caller names none (the process's)."""
        if self._parent:
            raise AttributeError("a subgroup's default timeout is its process's (set it on the default group's Comm)")
        self._timeout = seconds

    def subgroup(self, group) -> "Comm":
        """The Comm of process group ``group`` (one per group, made on first use)."""
        root = self._parent or self
        if group is None or group is dist.GroupMember.WORLD:
            return root
        if group is self.group:
            return self
        entry = root._subgroups.get(id(group))
        if entry is None or entry[0] is not group:
            entry = root._subgroups[id(group)] = (group, Comm(group, parent=root))
        return entry[1]

    def _work(self, work, track: str, nbytes: int, what: str, timeout: float | None = None) -> _TracedWork:
        # NCCL waits are stream orderings with the process group's own watchdog timeout; a
        # host-side timeout would block the host, so only gloo waits are bounded here.
        if dist.get_backend(self.group) == "nccl":
            return _TracedWork(self.tracer, work, track, nbytes, what, None, self.world_size, waits_on_host=False)
        return _TracedWork(self.tracer, work, track, nbytes, what, self.timeout if timeout is None else timeout,
                           self.world_size)

    @property
    def initialized(self) -> bool:
        """Whether torch.distributed has a default process group."""
        return dist.is_available() and dist.is_initialized()

    @property
    def rooted_collectives(self) -> bool:
        """Whether all-gathers and reduce-scatters run as one broadcast or reduce per rank (gloo, at
        world size > 1: see :meth:`all_gather_into`); NCCL's own all-gather and reduce-scatter are the
        fast ones there."""
        return self.initialized and dist.get_backend(self.group) == "gloo"

    @property
    def world_size(self) -> int:
        """Ranks in this group (1 without a process group)."""
        return dist.get_world_size(self.group) if self.initialized else 1

    @property
    def rank(self) -> int:
        """This process's rank within the group (0 without a process group)."""
        return dist.get_rank(self.group) if self.initialized else 0

    def _global(self, rank: int) -> int:
        """The default group's number of this group's rank ``rank`` (what torch.distributed's src/dst take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _count(self, kind: str, moved: "torch.Tensor | int") -> int:
        """Count one call of ``kind`` moving ``moved`` (a tensor's bytes, or a byte count); returns the bytes."""
        nbytes = moved if isinstance(moved, int) else moved.numel() * moved.element_size()
        self.traffic_bytes[kind] += nbytes
        self.calls[kind] += 1
        return nbytes

    def reset_traffic(self) -> None:
        """Zero the traffic counters (bytes and calls per kind)."""
        self.traffic_bytes.clear()
        self.calls.clear()

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, what: str = "all_gather",
                        timeout: float | None = None):
        """Start gathering every rank's equal-size ``shard`` into ``output``; returns a handle."""
        nbytes = self._count("all_gather", output)
        if self.world_size == 1:
            if output.data_ptr() == shard.data_ptr():
                return DONE  # already in place
            return self.copier.copy(output, shard, "gg", "gather (local copy)", busy_cores_inline=True)
        return self._work(self.start_all_gather_uncounted(output, shard), "gg", nbytes, what, timeout)

    def copy_apart(self, values: list[torch.Tensor], parts: list[torch.Tensor], what: str = "all_gather"):
        """World size 1: the all-gather of a bucket whose values stay apart (``Unit.values_apart``): each
        ``values[i]`` copied from ``parts[i]``, one work for all; counted as one all-gather."""
        if self.world_size != 1:
            raise ValueError(f"{what}: copy_apart is the all-gather of world size 1, this group has "
                             f"{self.world_size} ranks")
        self._count("all_gather", sum(value.numel() * value.element_size() for value in values))
        return self.copier.copy(values, parts, "gg", "gather (local copy)", busy_cores_inline=True)

    def start_all_gather_uncounted(self, output: torch.Tensor, shard: torch.Tensor):
        """The torch.distributed work of :meth:`all_gather_into` (world size > 1), neither counted nor
        traced: what the cost model's probe times."""
        if self.rooted_collectives:
            # gloo: one broadcast from each rank into its row runs ~2-4x faster than gloo's
            # all-gather here (benchmarks/RESULTS.md, "Collectives on gloo"); same bytes received.
            return self._broadcast_slices(output, shard)
        return _all_gather_single(output, shard, group=self.group, async_op=True)

    def _broadcast_slices(self, flat: torch.Tensor, local: torch.Tensor) -> "_AllWork":
        """Rank r's slice of ``flat`` (elements ``r * n : min((r + 1) * n, len(flat))``, ``n = len(local)``)
        broadcast from rank r, this rank's own copied in from ``local`` first (unless already there)."""
        slice_numel = local.numel()
        ranges = [(src * slice_numel, min((src + 1) * slice_numel, flat.numel())) for src in range(self.world_size)]
        start, stop = ranges[self.rank]
        if stop > start and flat[start:stop].data_ptr() != local.data_ptr():
            flat[start:stop].copy_(local[: stop - start])
        return _AllWork([dist.broadcast(flat[start:stop], src=self._global(src), group=self.group, async_op=True)
                         for src, (start, stop) in enumerate(ranges) if stop > start])

    def reduce_scatter_avg(self, output: torch.Tensor, full: torch.Tensor, what: str = "reduce_scatter",
                           timeout: float | None = None):
        """Start averaging ``full`` over ranks, this rank keeping its slice in ``output``.

        ``full`` is scratch until the handle's ``wait()`` returns (gloo may
        write other ranks' slices of it).
        """
        nbytes = self._count("reduce_scatter", full)
        if self.world_size == 1:
            return self.copier.copy(output, full, "rs", "reduce (local copy)")
        if self.rooted_collectives:
            # gloo: one reduce onto each rank's slice runs ~1.6-2x faster than gloo's reduce-scatter
            # here (benchmarks/RESULTS.md, "Collectives on gloo"); the sum is averaged once it lands.
            rows = full.view(self.world_size, -1)
            works = [dist.reduce(rows[dst], dst=self._global(dst), op=dist.ReduceOp.SUM, group=self.group,
                                 async_op=True) for dst in range(self.world_size)]
            world, own_row = self.world_size, rows[self.rank]
            return self._work(_AllWork(works, then=lambda: torch.div(own_row, world, out=output)), "rs", nbytes,
                              what, timeout)
        return self._work(_reduce_scatter_single(output, full, op=dist.ReduceOp.AVG, group=self.group,
                                                                  async_op=True), "rs", nbytes,
                          what, timeout)

    def fill_slices(self, flat: torch.Tensor, local: torch.Tensor, what: str = "all_gather",
                    timeout: float | None = None):
        """Start filling each rank's slice of ``flat`` from that rank's ``local``, in place: rank r's slice
        is elements ``r * n : min((r + 1) * n, len(flat))`` with ``n = len(local)`` (``local`` may be padded).

        An all-gather straight into a parameter's storage, no gathered copy:
        one broadcast per rank (see :meth:`all_gather_into`, and
        :attr:`rooted_collectives` for where that is the cheap way).
        """
        nbytes = self._count("all_gather", flat)
        if self.world_size == 1:
            flat.copy_(local[: flat.numel()])
            return DONE
        return self._work(self._broadcast_slices(flat, local), "gg", nbytes, what, timeout)

    def all_reduce_avg(self, tensor: torch.Tensor, what: str = "all_reduce of a gradient (stage 0)",
                       timeout: float | None = None):
        """Start averaging ``tensor`` in place over ranks."""
        nbytes = 2 * tensor.numel() * tensor.element_size()
        self._count("all_reduce", nbytes)
        if self.world_size == 1:
            return DONE
        return self._work(dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=True), "rs",
                          nbytes, what, timeout)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str = "all_reduce", timeout: float | None = None) -> None:
        """Sum ``tensor`` in place over ranks (small scalars such as norms)."""
        if self.world_size > 1:
            self._work(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), "rs", 0, what,
                       timeout).wait()

    @property
    def agreement_device(self) -> torch.device:
        """Where small control tensors go: the process group's device (NCCL: this process's GPU)."""
        if self.initialized and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather_rows(self, row: torch.Tensor, what: str = "all_gather", timeout: float | None = None) -> torch.Tensor:
        """Every rank's small 1-D ``row`` stacked in rank order (bounded by ``collective_timeout``, gloo)."""
        if self.world_size == 1:
            return row[None].clone()
        rows = row.new_empty(self.world_size * row.numel())  # (gloo takes a flat output only)
        self._count("agreement", rows.numel() * rows.element_size())  # control traffic, not ZeRO's
        self._work(_all_gather_single(rows, row, group=self.group, async_op=True), "gg", 0, what,
                   timeout).wait()
        return rows.view(self.world_size, row.numel())

    def all_gather_object(self, obj, what: str = "all_gather_object") -> list:
        """Every rank's ``obj`` (small, picklable), in rank order; ``[obj]`` at world size 1.

        Used to agree on outcomes (a checkpoint written or verified on every
        rank) so that all ranks raise the same error, not one rank alone.
        """
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "broadcast", timeout: float | None = None):
        """Start sending ``tensor`` from rank ``src`` to every rank, in place."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("broadcast", nbytes)
        if self.world_size == 1:
            return DONE
        return self._work(dist.broadcast(tensor, src=self._global(src), group=self.group, async_op=True), "gg", nbytes,
                          what, timeout)

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int, what: str = "broadcast",
                            timeout: float | None = None) -> None:
        """Make every rank's ``tensors`` equal rank ``src``'s: one broadcast per dtype and device.

        A tensor already equal to ``src``'s is left untouched: a copy in place would bump its version, and
        autograd refuses a backward whose saved tensor changed version (a buffer saved by one micro-batch's
        forward while the next one's forward agrees on the buffers, under 1F1B).  The comparison reads one
        value per dtype and device on the host.  Counted under "buffers" (model buffers, not ZeRO traffic).
        """
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for group in groups.values():
            local = torch.cat([tensor.detach().reshape(-1) for tensor in group])
            flat = local.clone()
            nbytes = flat.numel() * flat.element_size()
            self._count("buffers", nbytes)
            self._work(dist.broadcast(flat, src=self._global(src), group=self.group, async_op=True), "gg", nbytes,
                       what, timeout).wait()
            if torch.equal(flat, local):
                continue
            at = 0
            with torch.no_grad():
                for tensor in group:
                    value = flat[at : at + tensor.numel()].view_as(tensor)
                    if not torch.equal(tensor, value):
                        tensor.copy_(value)
                    at += tensor.numel()

    def reduce_sum(self, tensor: torch.Tensor, dst: int, what: str = "reduce", timeout: float | None = None):
        """Start summing ``tensor`` over ranks into rank ``dst``'s copy."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("reduce", nbytes)
        if self.world_size == 1:
            return DONE
        return self._work(dist.reduce(tensor, dst=self._global(dst), op=dist.ReduceOp.SUM, group=self.group,
                                      async_op=True), "rs", nbytes, what, timeout)


    def mesh(self, shard_group=None, replicate_group=None) -> "MeshComm":
        """The :class:`MeshComm` sharding over ``shard_group`` and replicating over ``replicate_group``
        (None: the default group; no replicas).  One per pair of groups, so models compiled with the
        same groups share it (and their parameters may share buckets)."""
        root = self._parent or self
        if shard_group is dist.GroupMember.WORLD:
            shard_group = None
        key = (id(shard_group), id(replicate_group))
        mesh = root._meshes.get(key)
        if mesh is None or mesh.groups != (shard_group, replicate_group):
            replicate = root.subgroup(replicate_group) if replicate_group is not None else None
            mesh = root._meshes[key] = MeshComm(root.subgroup(shard_group), replicate,
                                                (shard_group, replicate_group))
        return mesh


class MeshComm:
    """A model's data-parallel ranks: ``shard``, the group its parameters, gradients and optimizer
    state are split over, and ``replicate`` (HSDP; None without), the group of ranks holding the same
    shard, across which reduced gradients are averaged.

    ``everyone`` is the group of all the model's ranks, for what every rank of the model must do
    together (agreement, rank 0's initial values and buffers, the fp16 overflow flag): the shard
    group, or with replicas the default group (a 2-D mesh must span it, see zinf_compiler/options.py).
    """

    def __init__(self, shard: Comm, replicate: Comm | None = None, groups: tuple = (None, None)):
        self.shard = shard
        self.replicate = replicate
        self.groups = groups
        self.everyone = shard if replicate is None else (shard._parent or shard)

    @property
    def world_size(self) -> int:
        """All of the model's ranks (shards times replicas)."""
        return self.shard.world_size * (self.replicate.world_size if self.replicate is not None else 1)

    @property
    def is_default(self) -> bool:
        """Sharded over the default group, no replicas (what zinf does without a ``mesh`` option)."""
        return self.shard.group is None and self.replicate is None

    def average_replicas(self, tensor: torch.Tensor, what: str, timeout: float | None = None) -> None:
        """Average ``tensor`` (a reduced gradient slice) in place across the replicas, if any."""
        if self.replicate is not None and self.replicate.world_size > 1:
            self.replicate.all_reduce_avg(tensor, what, timeout).wait()

    def describe(self) -> str:
        """Words for the mesh's shape, equal on every rank (in errors and the agreement's fingerprint)."""
        if self.replicate is None:
            return "the default group" if self.shard.group is None else f"a group of {self.shard.world_size} ranks"
        return f"a mesh of {self.replicate.world_size} replicas x {self.shard.world_size} shards"

    def __repr__(self) -> str:
        return f"MeshComm({self.describe()})"

    def __deepcopy__(self, memo) -> "MeshComm":
        return self  # process groups are not copied (dataclasses.asdict deep-copies option values)

