"""The partition store: every adopted parameter's shard, gradient shard and the bytes held.

A parameter is *adopted* at its first compile: flattened, padded to a multiple
of the world size and split so that each rank keeps one equal slice
(``partition="allgather"``, bandwidth-centric), or kept whole by one owner
rank (``partition="broadcast"``, the paper's baseline).  At stage 3 the
parameter's own storage is then resized to 0: the tensor keeps its shape and
strides (Dynamo's guards still hold) but holds no memory.

The graph reaches the store through the ``zinf`` ops (``gather_start`` /
``gather_wait`` / ``release``, ``reduce_grad_start`` / ``reduce_grad_wait``),
the optimizer through :meth:`ParamStore.lookup`.  Everything here is plain
tensors and ``torch.distributed``; no FX.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
import weakref
import time
from typing import Callable, Iterable

import torch

from .aio import ALIGNMENT, AioEngine, AioError
from .comm import COMM, Comm, MeshComm
from .copy_engine import COPIER
from .nvme_adam import SUB_GROUP_NUMEL, state_key, sub_groups, write_initial_master
from .pinned import PinnedPool
from .grad_hooks import run_grad_hooks
from .resting import RestingParameter, guard_aliases
from .ledger import Ledger, ZinfStoreError, merge_ledgers
from .units import ParamLayout, Segment, Unit, can_share_unit, unit_of

# A transfer waiting this long for pinned memory means the pool is too small
# for what is in flight: an error naming pinned_bytes beats a hang.
POOL_WAIT_SECONDS = 120.0
# Gradient sub-groups being written to swap at once (nvme optimizer tier):
# enough to keep the disk busy while backward goes on, few enough that the
# pinned pool's optimizer share covers them.
GRAD_WRITES_IN_FLIGHT = 2

# Gathered bytes one bucket may hold (option bucket_bytes; see runtime/units.py).
DEFAULT_BUCKET_BYTES = 64 << 20

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(eq=False, kw_only=True)
class ParamRecord(ParamLayout):
    """One adopted parameter: its fixed layout (:class:`ParamLayout`) and this rank's state of it."""

    # Weak: the store must not keep a dropped model alive (see ParamStore.adopt).
    param_ref: "weakref.ref[torch.nn.Parameter]"
    param_id: int  # id() of the parameter, its key in the store
    # The resting shard in compute dtype: on the device or on the CPU; for the
    # nvme tier an empty tensor (the data is in the swap file ``param.<uid>``,
    # or in the master's files: see ParamLayout.params_in_master).
    shard: torch.Tensor
    # fp32 master of this rank's slice for device/cpu optimizer tiers (the
    # shard itself when they coincide); None for the nvme tier (swap files).
    master: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None  # fp32 on the optimizer's device/cpu tier, accumulated
    # nvme optimizer tier: the accumulated fp32 gradient slice is in the swap
    # files ``grad.<uid>.<i>`` (one per optimizer sub-group) instead of memory;
    # its squared norm is kept for clipping, which scales it lazily by
    # ``grad_multiplier`` when the step reads it.
    grad_on_disk: bool = False
    # nvme optimizer tier within the option nvme_grad_ram_bytes: the gradient
    # stays in ``grad_shard`` (CPU memory) and the step reads it from there.
    grad_in_ram: bool = False
    grad_sq_norm: float = 0.0
    grad_multiplier: float = 1.0
    swap: "AioEngine | None" = None  # the swap engine of its nvme_path, for nvme tiers
    # nvme optimizer tier, tiled: reduced gradient tiles collected in CPU memory
    # until every tile of this backward has arrived: (buffer, tiles done).
    grad_pending: "tuple[torch.Tensor, set] | None" = None
    full_storage_bytes: int = 0  # the parameter's own storage, until stage 3 frees it
    # Gathered bytes a bucket of the optimizer's own collectives (stages 1-2) may reach (option bucket_bytes).
    bucket_bytes: int = 0
    _ledger: "Ledger | None" = None  # the model's accounting (see ParamStore.group)
    # Stages 1-2: the parameter's version counter when its shard last matched it (see sync_written_params).
    synced_version: int = 0
    # The ranks it is sharded over (and, for HSDP, replicated across); set at adoption.
    mesh: "MeshComm | None" = None
    # Its optimizer step may run during backward, as its gradient lands (option overlap_optimizer;
    # runtime/early_adam.py): stage 3 with shard and optimizer state on NVMe, nvme_copies=2.
    step_in_backward: bool = False
    # A weak reference to what takes those early steps (EarlyAdam), once an optimizer is bound.
    grad_listener: "weakref.ref | None" = None

    @property
    def ledger(self) -> "Ledger":
        return self._ledger.root()

    @property
    def param(self) -> torch.nn.Parameter:
        param = self.param_ref()
        if param is None:
            raise ZinfStoreError(f"parameter {self.name} was garbage-collected; its zinf state is gone")
        return param

    @property
    def trainable(self) -> bool:
        param = self.param_ref()
        return param is not None and param.requires_grad

    @property
    def has_grad(self) -> bool:
        return self.grad_shard is not None or self.grad_on_disk


_UNSET = object()


class _ParamRef(weakref.ref):
    """A weak reference to an adopted parameter that carries its uid."""

    __slots__ = ("uid",)

    def __new__(cls, param, callback, uid):
        return super().__new__(cls, param, callback)

    def __init__(self, param, callback, uid):
        super().__init__(param, callback)
        self.uid = uid


class ParamStore:
    def __init__(self, comm: Comm = COMM):
        self.comm = comm  # the process's default group: parameters adopted without a mesh shard over it
        self._records: dict[int, ParamRecord] = {}
        # id(param) -> a weak reference to it that knows the uid; checked for identity
        # on lookup, so a new tensor at a dead one's address is never taken for it.
        self._by_param: dict[int, _ParamRef] = {}
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()  # uids whose parameter was collected
        self._uids = itertools.count()
        self._lock = threading.RLock()
        self._owned_bytes_by_rank: dict[int, int] = {}
        self._grad_ram_reserved = 0  # bytes of nvme-tier gradients adopted to stay in RAM (nvme_grad_ram_bytes)
        # NVMe swap and the pinned pool: made on first need (see configure_offload).
        self._engines: dict[str, AioEngine] = {}
        self.pinned: PinnedPool | None = None
        self._offload_settings: dict = {}
        self._largest_shard_numel = 0  # of every parameter planned for offload (sizes the pinned pool)
        self._grad_writes: list = []  # in-flight gradient swap writes: (request, pinned buffer, record)
        # uid -> why its gradient in the swap files is incomplete (a failed write or
        # read); the step refuses it until drop_grads (opt.zero_grad()) discards it.
        self._lost_grads: dict[int, BaseException] = {}
        # Bytes held per tier, for the whole process (every model and the pinned
        # pool); each model has its own Ledger too (ParamRecord.ledger).
        self.process = Ledger()
        # id(param) -> (weak ref, ledger) for parameters grouped before adoption (see group).
        self._pending_ledgers: dict[int, tuple] = {}
        self._dropped_pending: queue.SimpleQueue = queue.SimpleQueue()
        self._nvme_sampled = (0.0, 0)  # (when, bytes) of the trace's last swap-folder scan
        self._publish_writes: list = []  # (request, pinned staging) of parameter writes in flight
        self._units: dict[tuple, Unit] = {}  # unit key -> unit (see unit())
        # (step, unit key) -> transfers in flight, oldest first; step: nc, cg, staged, gather, reduce.
        self._transfers: dict[tuple, list] = {}
        # Work that moves on at the transfer points of a graph (the optimizer's early steps).
        self._background: "weakref.WeakSet" = weakref.WeakSet()

    # --- offload resources -------------------------------------------------------

    def configure_offload(self, nvme_path: str | None, pinned_bytes, aio_block_size: int, aio_queue_depth: int,
                          aio_threads: int, nvme_copies: int = 2) -> None:
        """Settings for the parameters adopted next: their swap folder and the pinned pool."""
        if self.pinned is not None and pinned_bytes not in ("auto", self.pinned.capacity_bytes):
            raise ZinfStoreError(
                f"pinned_bytes={pinned_bytes} asked after the pinned pool was made with "
                f"{self.pinned.capacity_bytes:,} bytes; use one pinned_bytes per process"
            )
        self._offload_settings = dict(nvme_path=nvme_path, pinned_bytes=pinned_bytes, aio_block_size=aio_block_size,
                                      aio_queue_depth=aio_queue_depth, aio_threads=aio_threads,
                                      nvme_copies=nvme_copies)

    def _engine_for(self, nvme_path: str) -> AioEngine:
        """One swap engine per nvme_path (two models may swap to different disks)."""
        engine = self._engines.get(nvme_path)
        if engine is None:
            settings = self._offload_settings
            engine = self._engines[nvme_path] = AioEngine(
                nvme_path, block_size=settings["aio_block_size"], queue_depth=settings["aio_queue_depth"],
                threads=settings["aio_threads"], copies=settings.get("nvme_copies", 2))
        elif engine.copies != self._offload_settings.get("nvme_copies", engine.copies):
            raise ZinfStoreError(
                f"nvme_copies={self._offload_settings['nvme_copies']} asked for {nvme_path}, whose swap engine "
                f"was made with nvme_copies={engine.copies}; use one value per nvme_path")
        return engine

    def engines(self) -> list[AioEngine]:
        return list(self._engines.values())

    def plan_shards(self, largest_shard_numel: int) -> None:
        """Before adoption: the largest slice any offloaded parameter will have (sizes the pool)."""
        self._largest_shard_numel = max(self._largest_shard_numel, largest_shard_numel)

    def _pool(self, at_least: int) -> PinnedPool:
        if self.pinned is None:
            wanted = self._offload_settings.get("pinned_bytes", "auto")
            if wanted == "auto":
                # Two of the largest fp32 slices (a fetch in flight while the
                # optimizer stages one) plus the optimizer's twelve sub-group
                # buffers (three groups of master, two moments and gradient in flight).
                largest = max([r.local_numel * 4 for r in self._records.values()]
                              + [at_least, self._largest_shard_numel * 4])
                group = min(largest, SUB_GROUP_NUMEL * 4)
                wanted = max(64 << 20, 2 * largest + 12 * group)
            self.pinned = PinnedPool(int(wanted))
            self._add_resting("cpu", self.pinned.capacity_bytes)
        return self.pinned

    def write_param(self, record: ParamRecord, staging, hold: bool = False) -> list:
        """Start writing a whole shard staged in ``staging`` to its swap keys.

        ``hold``: as held copies, in the background (an early step's; see AioEngine.write).
        """
        view = staging.memoryview()
        itemsize = record.compute_dtype.itemsize
        return [record.swap.write(key, _padded_view(view, start * itemsize, numel * itemsize), numel * itemsize,
                                  hold=hold, background=hold)
                for key, start, numel in record.swap_layout()]

    def count_pinned_pool(self, nbytes: int) -> None:
        """Count (or, negative, stop counting) a pinned pool of the process's other than ``pinned``."""
        self._add_resting("cpu", nbytes)

    def count_transient(self, tier: str, delta: int, what: str, ledger: "Ledger") -> None:
        """Count (or, negative, stop counting) bytes held for a while on ``tier`` for ``ledger``'s model."""
        self._add_transient(tier, delta, what=what if delta > 0 else None, ledger=ledger)

    def add_background_work(self, work) -> None:
        """``work.advance()`` (which must never wait) runs at each transfer point of every graph; held weakly."""
        self._background.add(work)

    def _advance_background(self) -> None:
        for work in list(self._background):
            work.advance()

    def prefetch_pinned_bytes(self) -> int | None:
        """Pinned bytes the graph's nc reads may hold at once (None: no pool, nothing read from NVMe).

        The pool less what gradient writes to NVMe use during backward and
        one largest shard of slack for first-fit fragmentation; never less
        than one largest shard (a fetch without prefetch needs that much).
        """
        if self.pinned is None:
            return None
        records = list(self._records.values())
        largest = max([r.shard_bytes for r in records if r.param_tier == "nvme"] + [0])
        group = min(max([r.local_numel * 4 for r in records] + [0]), SUB_GROUP_NUMEL * 4)
        reserve = (GRAD_WRITES_IN_FLIGHT + 1) * group if any(r.opt_tier == "nvme" for r in records) else 0
        return max(self.pinned.capacity_bytes - reserve - largest, largest)

    def trace_sample(self) -> dict[str, int]:
        """Bytes per tier now, for the step trace's memory picture."""
        activations = self.process.activations
        sample = {"device": self.resting["device"] + self.transient["device"] + activations["device"],
                  "cpu": self.resting["cpu"] + self.transient["cpu"] + activations["cpu"],
                  "pinned in use": self.pinned.in_use_bytes if self.pinned is not None else 0}
        if self._engines or activations["nvme"]:
            at = time.perf_counter()
            if at - self._nvme_sampled[0] > 0.05:  # a directory scan: not every 2 ms
                from .activations import ACTIVATIONS  # (it imports this module)

                engines = list(self._engines.values()) + ACTIVATIONS.engines()
                self._nvme_sampled = (at, sum(engine.bytes_on_disk() for engine in engines))
            sample["nvme"] = self._nvme_sampled[1]
        return sample

    def _write_swap(self, engine: AioEngine, key: str, tensor: torch.Tensor) -> None:
        """Write a flat tensor to the swap file ``key`` through the pinned pool (synchronous)."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._pool(nbytes).acquire(nbytes, timeout=POOL_WAIT_SECONDS) as staging:
            staging.tensor(tensor.dtype, tensor.numel()).copy_(tensor)
            engine.write(key, staging, nbytes).wait()

    def _read_swap(self, engine: AioEngine, key: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """Read the swap file ``key`` into a new tensor on ``device`` (synchronous)."""
        nbytes = numel * dtype.itemsize
        out = torch.empty(numel, dtype=dtype, device=device)
        with self._pool(nbytes).acquire(nbytes, timeout=POOL_WAIT_SECONDS) as staging:
            engine.read(key, staging, nbytes).wait()
            out.copy_(staging.tensor(dtype, numel))
        return out

    # --- adoption -------------------------------------------------------------

    def adopt(self, param: torch.nn.Parameter, name: str, *, stage: int, partition: str, param_dtype: str,
              param_tier: str = "device", opt_tier: str = "device",
              tile_rows: tuple[int, ...] | None = None, ledger: "Ledger | None" = None,
              read_local: "Callable[[ParamRecord], torch.Tensor] | None" = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_ram_bytes: int = 0,
              mesh: MeshComm | None = None, step_in_backward: bool | str = False) -> ParamRecord:
        """Shard ``param`` (once; a tied parameter is the same tensor) and return its record.

        ``param_tier`` / ``opt_tier``: where the shard, and the fp32 master with
        the optimizer state, rest: "device", "cpu" or "nvme".  ``tile_rows``:
        rows per tile of a parameter the ``tile`` pass splits (laid out
        tile-major, see :class:`ParamRecord`); a parameter adopted before keeps
        its first layout (read it back from the record's ``tile_rows``).
        ``ledger``: the model whose bytes it counts in (default: the group it
        was put in by :meth:`group`, else a ledger of its own).
        ``read_local``: where this rank's slice comes from instead of the
        parameter's own values (``materialize`` from a weights file): called
        with the new record, it returns the local slice (see
        :meth:`ParamRecord.owned_ranges`) in ``record.holding_dtype``; the
        parameter's memory is never read, and nothing is broadcast.
        ``grad_ram_bytes`` (nvme optimizer tier): the process's budget of
        gradient bytes kept in CPU memory instead of swap files; parameters
        take it in adoption order while it lasts.  ``mesh``: the ranks to shard
        over (default: every rank of the default group; see runtime/comm.py).
        ``step_in_backward``: the option overlap_optimizer, True, False or
        "auto" (it applies where :attr:`ParamRecord.step_in_backward` says).

        The store holds the parameter only weakly: when it is garbage-collected
        (its model and optimizer dropped), its shards, gradients, swap files and
        accounted bytes go with it (:meth:`_forget`).
        """
        mesh = mesh or self.comm.mesh()
        settings = (stage, partition, DTYPES[param_dtype], param_tier, opt_tier, mesh.describe())
        with self._lock:
            record = self.lookup(param)
            self.collect()
            if record is not None:
                adopted = (record.stage, record.partition, record.compute_dtype, record.param_tier, record.opt_tier,
                           record.mesh.describe())
                if adopted != settings or record.mesh is not mesh:
                    raise ZinfStoreError(
                        f"parameter {name} was adopted with (stage, partition, param_dtype, param tier, optimizer "
                        f"tier, mesh) = {adopted}, now asked for {settings}; every compiled graph of a model must "
                        f"use the same stage, partition, param_dtype, offload options and mesh"
                    )
                return record
            if not param.is_contiguous() or param.untyped_storage().nbytes() != param.numel() * param.element_size():
                raise ZinfStoreError(
                    f"parameter {name} shares its storage with other tensors (or is not contiguous); "
                    f"zinf can only shard parameters that own their memory"
                )
            world_size, rank = mesh.shard.world_size, mesh.shard.rank
            # Integer and bool parameters (counters, masks) are never trained: kept
            # exact in their own dtype, never passed through a float dtype.
            exact = not param.is_floating_point()
            compute_dtype = param.dtype if exact else DTYPES[param_dtype]
            holding_dtype = param.dtype if exact else torch.float32
            tile_rows = None if exact else _tile_rows(tile_rows, param)
            tile_align = (4096 // compute_dtype.itemsize
                          if tile_rows is not None and param_tier == "nvme" and partition == "allgather" else 1)
            owner = None
            if partition == "broadcast":
                owner = min(range(world_size), key=lambda r: (self._owned_bytes_by_rank.get(r, 0), r))
                self._owned_bytes_by_rank[owner] = self._owned_bytes_by_rank.get(owner, 0) + param.numel()
            uid = next(self._uids)
            record = ParamRecord(uid=uid, name=name, param_ref=weakref.ref(param), stage=stage,
                                 partition=partition, compute_dtype=compute_dtype, world_size=world_size, rank=rank,
                                 owner=owner, param_tier=param_tier, opt_tier=opt_tier,
                                 shard=torch.empty(0, dtype=compute_dtype), tile_rows=tile_rows,
                                 tile_align=tile_align, shape=param.shape, dtype=param.dtype, device=param.device,
                                 bucket_bytes=bucket_bytes,
                                 param_id=id(param), synced_version=param._version, mesh=mesh,
                                 _ledger=ledger or self._ledger_for(param) or Ledger())
            if read_local is not None:
                local = read_local(record)
                if local.numel() != record.local_numel or local.dtype != holding_dtype:
                    raise ZinfStoreError(f"{name}: read_local gave {local.numel()} {local.dtype} elements for a "
                                         f"shard of {record.local_numel} {holding_dtype}")
            else:
                full = param.detach()
                if world_size > 1:
                    # Like DDP: every rank starts from rank 0's values.
                    mesh.everyone.broadcast(full, src=0, what=f"broadcast of {name} from rank 0 (adoption)",
                                        timeout=record.ledger.collective_timeout).wait()
                local = _local_slice(full.reshape(-1), holding_dtype, partition, owner, tile_rows, world_size, rank,
                                     tile_align)
            record.shard = local.new_empty(0, dtype=compute_dtype)
            # Each master key must start on a block boundary to be read straight into the staging.
            record.params_in_master = (param_tier == "nvme" and opt_tier == "nvme" and stage > 0
                                       and compute_dtype == torch.float32 and tile_align == 1 and param.requires_grad
                                       and all(start * 4 % ALIGNMENT == 0
                                               for start, _ in sub_groups(record.local_numel)))
            grad_bytes = record.local_numel * 4
            if opt_tier == "nvme" and not exact and self._grad_ram_reserved + grad_bytes <= grad_ram_bytes:
                record.grad_in_ram = True
                self._grad_ram_reserved += grad_bytes
            if "nvme" in (param_tier, opt_tier):
                record.swap = self._engine_for(self._offload_settings["nvme_path"])
            if step_in_backward == "auto":
                # On a CPU device the early step's CPU work (the Adam kernel, the swap checksums) shares
                # the cores with the graph's compute, and measured no gain there beyond noise (-12% to
                # +10%, benchmarks/RESULTS.md, issue 26); with the compute on an accelerator the CPU idles
                # through backward.
                step_in_backward = param.device.type != "cpu"
            record.step_in_backward = (step_in_backward and stage == 3 and param_tier == "nvme"
                                       and opt_tier == "nvme" and not exact and param.requires_grad
                                       and record.swap.copies == 2)
            self._records[uid] = record
            self._pending_ledgers.pop(id(param), None)
            # The callback runs when the parameter is collected; it must not hold the parameter.
            self._by_param[id(param)] = _ParamRef(param, functools.partial(self._forget_param, uid), uid)
            record.full_storage_bytes = _nbytes(param)
            self._add_resting("device", record.full_storage_bytes,
                              ledger=record.ledger)  # until release_full_storage (stage 3)
            record.shard_is_param = (stage in (1, 2) and world_size == 1 and partition == "allgather"
                                     and tile_rows is None and param_tier == "device" and not exact
                                     and compute_dtype == param.dtype and read_local is None)
            self._place_shard(record, local)
            self._place_master(record, local)
            return record

    def _place_shard(self, record: ParamRecord, local_fp32: torch.Tensor) -> None:
        """Put this rank's slice, in compute dtype, on the parameter tier."""
        if record.shard_is_param:
            record.shard = record.param.detach().view(-1)  # its bytes are the parameter's own
            return
        if record.param_tier == "nvme":
            if record.owns_state and not record.params_in_master:  # else _place_master writes it
                for key, start, numel in record.swap_layout():
                    self._write_swap(record.swap, key, local_fp32[start : start + numel].to(record.compute_dtype))
            return
        device = record.device if record.param_tier == "device" else torch.device("cpu")
        shard = local_fp32.to(device=device, dtype=record.compute_dtype, copy=True)
        if record.param_tier == "cpu" and torch.cuda.is_available():
            shard = shard.pin_memory()  # asynchronous host-to-device copies need page-locked memory
        record.shard = shard
        self._add_resting(_tier_memory(record.param_tier), _nbytes(shard), ledger=record.ledger)

    def _place_master(self, record: ParamRecord, local_fp32: torch.Tensor) -> None:
        """The fp32 master on the optimizer tier; the shard itself where they coincide."""
        if record.stage == 0 or not record.dtype.is_floating_point:
            return  # nothing to step (an integer parameter never has a gradient)
        if record.opt_tier == "nvme":
            # A frozen parameter is never stepped (params_in_master: the master is its only copy).
            if record.owns_state and (record.trainable or record.params_in_master):
                write_initial_master(self, record, local_fp32)
            return
        if record.param_tier == record.opt_tier and record.compute_dtype == torch.float32:
            record.master = record.shard
            return
        device = record.device if record.opt_tier == "device" else torch.device("cpu")
        record.master = local_fp32.to(device=device, copy=True)
        self._add_resting(_tier_memory(record.opt_tier), _nbytes(record.master), ledger=record.ledger)

    def release_full_storage(self, records: Iterable[ParamRecord]) -> None:
        """Stage 3: free the full parameters (once tracing no longer reads them).

        Tensors sharing a parameter's storage (``state_dict()`` values, ``p.detach()``,
        ``p.data``, views) must not be left reading freed memory: :func:`guard_aliases`
        makes the Python ones raise a clear error instead; a storage something else holds
        as well (a view an autograd graph saved) is not freed: the parameter moves to an
        empty storage of its own and leaves the old one, whole, to its holders.
        """
        releasing = {id(r): r for r in records if r.stage == 3 and r.param.untyped_storage().nbytes() > 0}
        kept = guard_aliases([(r.param, r.uid, r.name) for r in releasing.values()])
        for record in releasing.values():
            param = record.param
            self._add_resting("device", -param.untyped_storage().nbytes(), ledger=record.ledger)
            record.full_storage_bytes = 0
            if id(param) in kept:
                _move_to_empty_storage(param)
            else:
                param.untyped_storage().resize_(0)
            if type(param) is torch.nn.Parameter:
                param.__class__ = RestingParameter  # touched outside zinf: an error, not a segfault

    def hold_full_storage(self, record: ParamRecord) -> bool:
        """Stage 3 (``zinf.gathered``): give a resting parameter its full storage back, holding its
        current value (a collective: every rank must call); :meth:`release_full_storage` frees it.
        False if it was not resting (an enclosing block holds it)."""
        if record.stage != 3 or record.full_storage_bytes:
            return False
        full = self.full_param(record)
        param = record.param
        record.full_storage_bytes = _nbytes(param)
        param.untyped_storage().resize_(record.full_storage_bytes)
        self._add_resting("device", record.full_storage_bytes, ledger=record.ledger)
        with torch.no_grad():
            param.detach().copy_(full)  # (no longer resting: the guard lets it through)
        return True

    def assign_full(self, record: ParamRecord, value: torch.Tensor) -> None:
        """Write a full new value of a parameter into this rank's shard and master, on their tiers.

        What ``param.copy_(value)`` (``model.load_state_dict``) does on a
        resting parameter.  No collective: each rank takes its own slice of
        ``value``.  Optimizer moments are kept, as ``load_state_dict`` of a
        model keeps them in eager PyTorch.
        """
        if tuple(value.shape) != tuple(record.shape):
            raise ZinfStoreError(f"cannot copy a {tuple(value.shape)} tensor into parameter {record.name} "
                                 f"of shape {tuple(record.shape)}")
        flat = value.detach().to(device=record.device, dtype=record.dtype).reshape(-1)
        self.assign_local(record, _local_slice(flat, record.holding_dtype, record.partition, record.owner,
                                               record.tile_rows, record.world_size, record.rank, record.tile_align))

    def assign_local(self, record: ParamRecord, local: torch.Tensor) -> None:
        """Write this rank's new slice (local layout, ``record.holding_dtype``) into its shard and master.

        The shard takes it in compute dtype on the parameter tier; the fp32
        master (memory or swap files) takes it as it is.
        """
        if local.numel() != record.local_numel:
            raise ZinfStoreError(f"{record.name}: a local slice of {local.numel()} elements for a shard of "
                                 f"{record.local_numel}")
        if record.param_tier == "nvme":
            if record.owns_state and not record.params_in_master:  # else the master below is the shard
                for key, start, numel in record.swap_layout():
                    self._write_swap(record.swap, key, local[start : start + numel].to(record.compute_dtype))
        else:
            record.shard.copy_(local)
        if record.stage == 0 or not record.dtype.is_floating_point:
            return
        if record.opt_tier == "nvme":
            if record.owns_state and (record.trainable or record.params_in_master):
                write_initial_master(self, record, local.to(torch.float32))
        elif record.master is not None and record.master is not record.shard:
            record.master.copy_(local)

    def local_value_chunks(self, record: ParamRecord, chunk_numel: int = SUB_GROUP_NUMEL):
        """This rank's slice of the parameter's value, streamed: ``(local_start, tensor on the CPU)`` in order.

        The most precise copy there is: the fp32 master (in memory or its
        swap files), else the shard (compute dtype on its tier) in
        ``record.holding_dtype``.  Never more than one chunk (or one swap
        key) in memory at a time.
        """
        dtype = record.holding_dtype
        if record.master is not None:
            source = record.master
        elif (record.opt_tier == "nvme" and record.stage > 0 and record.dtype.is_floating_point
              and record.owns_state and record.trainable):
            for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
                yield start, self._read_swap(record.swap, state_key("master", record.uid, index), torch.float32,
                                             stop - start, torch.device("cpu"))
            return
        elif record.param_tier == "nvme":
            if record.owns_state:
                for key, start, numel in record.swap_layout():
                    piece = self._read_swap(record.swap, key, record.compute_dtype, numel, torch.device("cpu"))
                    yield start, piece.to(dtype)
            return
        else:
            source = record.shard
        for start in range(0, source.numel(), chunk_numel):
            yield start, source[start : start + chunk_numel].to(device="cpu", dtype=dtype)

    def lookup(self, param: torch.Tensor) -> ParamRecord | None:
        """The record of ``param`` (this very tensor object, alive), or None if it was never adopted."""
        ref = self._by_param.get(id(param))
        if ref is None or ref() is not param:
            return None
        return self._records.get(ref.uid)

    def _forget_param(self, uid: int, _ref: weakref.ref) -> None:
        """Weakref callback: the parameter of ``uid`` was collected.

        It may run inside any allocation (the garbage collector), with any lock
        held, so it only queues the uid (``SimpleQueue.put`` is reentrant);
        :meth:`collect` frees the record's state at the next safe point.
        """
        self._dropped.put(uid)

    def collect(self) -> None:
        """Free the state of every parameter collected since the last call (see :meth:`_forget_param`).

        Called at the runtime's entry points (adoption, each compiled call,
        the optimizer, ``memory_report``), on the thread that uses the store.
        """
        while True:
            try:
                param_id = self._dropped_pending.get_nowait()
            except queue.Empty:
                break
            entry = self._pending_ledgers.get(param_id)
            if entry is not None and entry[0]() is None:
                del self._pending_ledgers[param_id]
        while True:
            try:
                uid = self._dropped.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                record = self._records.pop(uid, None)
                if record is None:
                    continue
                entry = self._by_param.get(record.param_id)
                if entry is not None and entry.uid == uid:
                    del self._by_param[record.param_id]
                self._free(record)

    def _free(self, record: ParamRecord) -> None:
        """Give back everything ``record`` holds: memory (and its accounting), swap files, ownership."""
        self.drop_grads([record])
        if record.grad_in_ram:
            self._grad_ram_reserved -= record.local_numel * 4
        if record.full_storage_bytes:
            self._add_resting("device", -record.full_storage_bytes, ledger=record.ledger)
        if record.param_tier != "nvme" and not record.shard_is_param:
            self._add_resting(_tier_memory(record.param_tier), -_nbytes(record.shard), ledger=record.ledger)
        if record.master is not None and record.master is not record.shard:
            self._add_resting(_tier_memory(record.opt_tier), -_nbytes(record.master), ledger=record.ledger)
        record.shard = record.master = None
        if record.swap is not None:
            for key, _, _ in record.swap_layout():
                record.swap.forget(key)
            for index in range(len(sub_groups(record.local_numel))):
                for name in ("master", "exp_avg", "exp_avg_sq", "grad"):
                    record.swap.forget(state_key(name, record.uid, index))
        if record.owner is not None:
            self._owned_bytes_by_rank[record.owner] -= record.numel
        for key in [key for key in self._units if any(uid == record.uid for uid, _ in key)]:
            del self._units[key]

    def records(self) -> list[ParamRecord]:
        return list(self._records.values())

    # --- units: what one op moves (see runtime/units.py) --------------------------------
    #
    # One state machine for every unit (a whole parameter, a row tile of one, a
    # bucket of parameters): nc (NVMe -> pinned buffer), cg (pinned or CPU shard
    # -> device), gather (all-gather or broadcast), release, reduce.  Each step's
    # transfers in flight wait in a FIFO per (step, unit), as the graph's ops
    # pair starts with waits in order.

    def unit(self, records: Iterable[ParamRecord], tile: int | None = None) -> Unit:
        """The unit of ``records`` (a bucket), or of one record's row ``tile``; built once, then cached."""
        records = list(records)
        key = tuple((record.uid, tile) for record in records)
        unit = self._units.get(key)  # uids never repeat, and _free drops a freed record's units
        if unit is None:
            if tile is not None and (records[0].tile_rows is None or not 0 <= tile < len(records[0].tile_rows)):
                raise ZinfStoreError(f"tile {tile} of {records[0].name}, which has tile rows {records[0].tile_rows}")
            unit = self._units[key] = unit_of(records, tile)
        return unit

    def _in_flight(self, step: str, unit: Unit) -> list:
        return self._transfers.setdefault((step, unit.key), [])

    def _pop(self, step: str, unit: Unit, op: str):
        queue = self._transfers.get((step, unit.key))
        if not queue:
            raise ZinfStoreError(f"{op} for {unit.name} without a matching start")
        entry = queue.pop(0)
        if not queue:
            del self._transfers[(step, unit.key)]
        return entry

    def _ledger_of(self, unit: Unit) -> "Ledger":
        return unit.pieces[0].layout.ledger

    @staticmethod
    def _shard_comm(unit: Unit) -> Comm:
        """The group the unit's parameters are sharded over (one per unit: see _bucketed)."""
        return unit.pieces[0].layout.mesh.shard

    def nc_start(self, unit: Unit) -> None:
        """Start reading the unit's shards (nvme tier) from their swap keys into one pinned buffer."""
        staging = self._pool(unit.sizes.pinned).acquire(unit.sizes.pinned, timeout=POOL_WAIT_SECONDS)
        view = staging.memoryview()
        itemsize = unit.compute_dtype.itemsize
        requests = []
        for piece, at in zip(unit.pieces, unit.staging_offsets):
            record = piece.layout
            for key, start, numel in piece.reads:
                offset = at + start * itemsize
                requests.append(record.swap.read(key, _padded_view(view, offset, numel * itemsize), numel * itemsize))
        self._in_flight("nc", unit).append((requests, staging))

    def nc_wait(self, unit: Unit) -> None:
        self._advance_background()
        queue = self._transfers.get(("nc", unit.key))
        if not queue:
            raise ZinfStoreError(f"nc_wait for {unit.name} without an nc_start")
        for request in queue[0][0]:
            request.wait()

    def cg_start(self, unit: Unit) -> None:
        """Start copying the unit's local input (CPU shards, or the nc buffer) to the device."""
        staging = None
        if unit.pieces[0].layout.param_tier == "nvme":
            _, staging = self._pop("nc", unit, "cg_start (after a finished nc)")
        self._add_transient("device", unit.sizes.local, what=f"cg_start of {unit.name}", ledger=self._ledger_of(unit))
        on_device = torch.empty(unit.local_numel, dtype=unit.compute_dtype, device=unit.device)
        works, at = [], 0
        for index, piece in enumerate(unit.pieces):
            numel = piece.local_numel
            if numel == 0:
                continue
            if staging is not None:
                start = unit.staging_offsets[index] // unit.compute_dtype.itemsize + piece.staged_start
                source = staging.tensor(unit.compute_dtype, start + numel)[start:]
            else:
                start, stop = piece.local_range
                source = piece.layout.shard[start:stop]
            works.append(COPIER.copy(on_device[at : at + numel], source, "cg", f"cg {piece.layout.name}"))
            at += numel
        self._in_flight("cg", unit).append((on_device, staging, works))

    def cg_wait(self, unit: Unit) -> None:
        on_device, staging, works = self._pop("cg", unit, "cg_wait")
        _finish_copies(works, staging)
        self._in_flight("staged", unit).append(on_device)

    def _local_input(self, unit: Unit) -> torch.Tensor:
        """The unit's local input on the device: staged by cg, cut from shards resting there, or fetched now."""
        if self._transfers.get(("staged", unit.key)):
            local = self._pop("staged", unit, "gather_start")
            self._add_transient("device", -_nbytes(local), ledger=self._ledger_of(unit))
            return local
        if unit.pieces[0].layout.param_tier == "device":
            slices = [piece.layout.shard[piece.local_range[0] : piece.local_range[1]] for piece in unit.pieces]
            return slices[0] if len(slices) == 1 else torch.cat(slices)
        # No nc/cg ran for this use (outside a graph, or the offload pass is off): fetch synchronously.
        if unit.pieces[0].layout.param_tier == "nvme":
            self.nc_start(unit)
            self.nc_wait(unit)
        self.cg_start(unit)
        self.cg_wait(unit)
        return self._local_input(unit)

    def gather_start(self, unit: Unit) -> None:
        """Start assembling the unit's parameters (all-gather of slices, or broadcast from the owner)."""
        local = self._local_input(unit)
        ledger = self._ledger_of(unit)
        self._add_transient("device", unit.sizes.gathered, what=f"gather_start of {unit.name}", ledger=ledger)
        if unit.world_size == 1 and unit.partition == "allgather" and unit.pieces[0].layout.param_tier != "device":
            # The cg step's fresh device copy already is the whole unit: no collective, no copy.
            self._in_flight("gather", unit).append((_DONE, local))
            return
        matrix = torch.empty(unit.rows * unit.columns, dtype=unit.compute_dtype, device=unit.device)
        if unit.partition == "allgather":
            work = self._shard_comm(unit).all_gather_into(matrix, local, f"all_gather of {unit.name}",
                                                          timeout=ledger.collective_timeout)
        else:
            owner = unit.pieces[0].layout.owner
            if local.numel():
                matrix.copy_(local)
            work = self._shard_comm(unit).broadcast(matrix, src=owner, what=f"broadcast of {unit.name}",
                                                    timeout=ledger.collective_timeout)
        self._in_flight("gather", unit).append((work, matrix))

    def gather_wait(self, unit: Unit) -> list[torch.Tensor]:
        """Finish the oldest gather of ``unit``: each piece's full value, in its parameter's dtype."""
        work, matrix = self._pop("gather", unit, "gather_wait")
        work.wait()
        ledger = self._ledger_of(unit)
        # A bucket's values are copied out of the matrix; both exist until this returns.
        copy_out = unit.sizes.copy_out
        if copy_out:
            self._add_transient("device", copy_out, what=f"gather_wait of {unit.name} (copy-out)", ledger=ledger)
        try:
            values = []
            for index, piece in enumerate(unit.pieces):
                value = piece.assemble(unit.column_block(matrix, index))
                if value.dtype != piece.layout.dtype:
                    value = value.to(piece.layout.dtype)
                values.append(value)
        finally:
            if copy_out:
                self._add_transient("device", -copy_out, ledger=ledger)
        return values

    def release(self, unit: Unit) -> None:
        """The graph is done with the unit's gathered values: they no longer count as held.

        The memory itself goes when the graph drops its last reference, right
        after this op (the generated code frees values after their last use).
        """
        self._add_transient("device", -unit.sizes.gathered, ledger=self._ledger_of(unit))

    # --- gradients ---------------------------------------------------------------

    def reduce_grad_start(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """Start averaging each piece's gradient over ranks into this rank's slices (or to the owner)."""
        ledger = self._ledger_of(unit)
        if len(grads) != len(unit.pieces):
            raise ZinfStoreError(f"reduce_grad_start of {unit.name}: {len(grads)} gradients for "
                                 f"{len(unit.pieces)} parameters")
        # The gradients the graph hands over are device memory too, until this op returns.
        grad_bytes = sum(_nbytes(grad) for grad in grads)
        self._add_transient("device", grad_bytes, what=f"reduce_grad_start of {unit.name}", ledger=ledger)
        try:
            flats = []
            for piece, grad in zip(unit.pieces, grads):
                if piece.tile is None:
                    # Hooks see the whole local gradient before it is averaged, as in eager and DDP.
                    grad = run_grad_hooks(piece.layout.param, grad.detach(), piece.layout.name)
                flat = grad.detach().reshape(-1)
                if flat.numel() != piece.numel:
                    raise ZinfStoreError(f"reduce_grad_start of {piece.layout.name}: a gradient of {flat.numel()} "
                                         f"elements for {piece.numel}")
                if unit.compute_dtype == torch.float16:
                    flat = flat * ledger.fp16_scaler.scale  # keep small gradients representable in fp16
                flats.append(flat)
            if unit.sizes.reduce == 0:
                # World size 1: nothing to average; add each gradient into its shard now, holding nothing.
                for index, (piece, flat) in enumerate(zip(unit.pieces, flats)):
                    if piece.segments != (Segment(0, piece.numel, 0, piece.width),):
                        padded = torch.zeros(piece.width, dtype=torch.float32, device=unit.device)
                        piece.scatter(flat, padded.view(1, -1))
                        flat = padded
                    self._accumulate(piece, flat, private=False)
                self._in_flight("reduce", unit).append((_DONE, None))
                return
            self._add_transient("device", unit.sizes.reduce, what=f"reduce_grad_start of {unit.name}",
                                ledger=ledger)
            matrix = torch.zeros(unit.rows * unit.columns, dtype=unit.compute_dtype, device=unit.device)
            for index, (piece, flat) in enumerate(zip(unit.pieces, flats)):
                piece.scatter(flat, unit.column_block(matrix, index))
            if unit.rows > 1:
                out = torch.empty(unit.columns, dtype=unit.compute_dtype, device=unit.device)
                work = self._shard_comm(unit).reduce_scatter_avg(
                    out, matrix, f"reduce_scatter of the gradient of {unit.name}", timeout=ledger.collective_timeout)
            elif unit.world_size > 1:  # broadcast partition: summed on the owner
                out = matrix
                work = self._shard_comm(unit).reduce_sum(matrix, dst=unit.pieces[0].layout.owner,
                                                         what=f"reduce of the gradient of {unit.name}",
                                                         timeout=ledger.collective_timeout)
            else:
                out, work = matrix, _DONE  # world size 1, fp16 or broadcast: nothing to average
            self._in_flight("reduce", unit).append((work, out))
        finally:
            self._add_transient("device", -grad_bytes, ledger=ledger)

    def reduce_grad_wait(self, unit: Unit) -> None:
        """Finish the oldest reduce of ``unit`` and add each piece's slice to its gradient shard.

        The gradient shard lives where the optimizer steps: on the device, or
        in CPU memory for cpu and nvme optimizer tiers (the device-to-CPU copy
        happens here, right after the reduction).
        """
        work, out = self._pop("reduce", unit, "reduce_grad_wait")
        work.wait()
        self._advance_background()
        if out is None:
            return  # added at the start (world size 1)
        ledger = self._ledger_of(unit)
        self._add_transient("device", -unit.sizes.reduce, ledger=ledger)
        if unit.partition == "broadcast":
            if unit.pieces[0].layout.rank != unit.pieces[0].layout.owner:
                return
            if unit.world_size > 1:
                out = out / unit.world_size
        # HSDP: the shard group's average, averaged across the replicas holding the same slice.
        unit.pieces[0].layout.mesh.average_replicas(out, f"all_reduce of the gradient of {unit.name} across replicas",
                                                    ledger.collective_timeout)
        if unit.compute_dtype == torch.float16:
            scaler = self._ledger_of(unit).fp16_scaler  # the model's own (one model's overflow is not another's)
            out = out.to(torch.float32) / scaler.scale
            scaler.check(out)
        whole = len(unit.pieces) == 1  # ``out`` is then the piece's own, fresh tensor
        for index, piece in enumerate(unit.pieces):
            start = unit.offsets[index]
            self._accumulate(piece, out[start : start + piece.width], private=whole)

    def _accumulate(self, piece, reduced: torch.Tensor, private: bool) -> None:
        """Add a piece's reduced slice into its parameter's gradient shard (or its swap files).

        ``private``: ``reduced`` is a fresh tensor nobody else holds (it may become the shard).
        """
        record = piece.layout
        start, stop = piece.local_range
        if stop == start:
            return
        if record.opt_tier == "nvme" and not record.grad_in_ram:
            if (start, stop) == (0, record.local_numel):
                self._swap_grad(record, reduced)
                return
            # A tile: the swap files take the whole slice, so tiles collect in CPU memory first.
            if record.grad_pending is None:
                record.grad_pending = (torch.zeros(record.local_numel, dtype=torch.float32), set())
                self._add_transient("cpu", _nbytes(record.grad_pending[0]), ledger=record.ledger)
            collected, done = record.grad_pending
            collected[start:stop].copy_(reduced)
            done.add(piece.tile)
            if len(done) == len(record.tile_rows):
                record.grad_pending = None
                self._add_transient("cpu", -_nbytes(collected), ledger=record.ledger)
                self._swap_grad(record, collected)
            return
        grad_device = record.device if record.opt_tier == "device" else torch.device("cpu")
        if record.grad_shard is None:
            if (private and (start, stop) == (0, record.local_numel) and reduced.dtype == torch.float32
                    and reduced.device == grad_device):
                record.grad_shard = reduced  # already a copy of our own, in fp32 where the optimizer steps
            else:
                record.grad_shard = torch.zeros(record.local_numel, dtype=torch.float32, device=grad_device)
                record.grad_shard[start:stop].copy_(reduced)
            self._add_resting(_tier_memory(record.opt_tier), _nbytes(record.grad_shard), ledger=record.ledger)
        else:
            record.grad_shard[start:stop].add_(reduced.to(grad_device))
        listener = _grad_listener(record)
        if listener is not None and listener.arrival(record, piece.tile):
            listener.start(record, record.grad_shard, owned=False)

    def abandon_transfers(self) -> None:
        """Forget every transfer in flight (a graph raised half way): give back pinned buffers and counted bytes.

        Transfers still running finish into buffers nobody reads; without this
        the next call would pair its waits with the stale starts.  Called
        between top-level graph calls, where nothing may be gathered or in flight.
        """
        if not self._transfers and self.process.transient["device"] == 0:
            return
        for (step, _), entries in list(self._transfers.items()):
            for entry in entries:
                if step == "nc":
                    requests, staging = entry
                    for request in requests:
                        try:
                            request.wait()
                        except AioError:
                            pass  # the read's buffer is discarded either way
                    staging.release()
                elif step == "cg":
                    _, staging, works = entry
                    _finish_copies(works, staging)
        self._transfers.clear()
        self.process.transient["device"] = 0
        for record in self._records.values():
            record.ledger.transient["device"] = 0

    def _bucketed(self, records: list[ParamRecord]) -> list[Unit]:
        """Units of ``records`` for the optimizer's own collectives: buckets of up to ``bucket_bytes`` gathered."""
        units, bucket, held = [], [], 0
        for record in records:
            nbytes = record.gathered_numel * record.compute_dtype.itemsize
            if bucket and (held + nbytes > record.bucket_bytes or not can_share_unit(bucket[0], record)
                           or record.mesh is not bucket[0].mesh):
                units.append(self.unit(bucket))
                bucket, held = [], 0
            bucket.append(record)
            held += nbytes
        if bucket:
            units.append(self.unit(bucket))
        return units

    def reduce_full_grads(self, records: Iterable[ParamRecord]) -> None:
        """Stage 1: reduce the full ``param.grad`` of each record into its gradient shard, bucketed."""
        records = [record for record in records if record.param.grad is not None]
        units = self._bucketed(records)
        for unit in units:
            self.reduce_grad_start(unit, [piece.layout.param.grad for piece in unit.pieces])
        for unit in units:
            self.reduce_grad_wait(unit)
        for record in records:
            record.param.grad = None

    def _swap_grad(self, record: ParamRecord, reduced: torch.Tensor) -> None:
        """nvme optimizer tier: add a reduced gradient slice to its swap files, sub-group by sub-group.

        The optimizer step streams the gradient from there along with the
        master and moments, so no gradient shard stays in memory.  Writes run
        in the background, at most GRAD_WRITES_IN_FLIGHT sub-groups at once;
        :meth:`finish_grad_writes` drains them.

        A swap write or read that fails (ENOSPC, EIO, ...) does not raise here:
        raising would stop the backward graph half way, leaving its other
        transfers in flight.  The record's gradient is marked lost instead,
        and :meth:`finish_grad_writes` refuses the step until
        :meth:`drop_grads` (``opt.zero_grad()``) discards it.
        """
        reduced = reduced.to(device="cpu", dtype=torch.float32)
        accumulating = record.grad_on_disk
        # From here on its gradient files may exist: drop_grads deletes them whatever happens below.
        record.grad_on_disk = True
        if accumulating:
            # A read must see the previous backward's writes.
            self._drain_grad_writes(0)
        listener = _grad_listener(record)
        step_now = listener is not None and listener.arrival(record, None)
        if record.uid in self._lost_grads:
            return  # already incomplete: nothing to add to, the step refuses it until zero_grad
        # The whole gradient for an early step (runtime/early_adam.py), a copy of its own: ``reduced`` may be
        # memory the compiled graph reuses once this op returns, and an accumulated one is only in the staging.
        total = torch.empty(record.local_numel, dtype=torch.float32) if step_now else None
        sq_norm = 0.0
        for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
            numel, key = stop - start, state_key("grad", record.uid, index)
            self._drain_grad_writes(GRAD_WRITES_IN_FLIGHT - 1)
            staging = self._pool(numel * 4).acquire(numel * 4, timeout=POOL_WAIT_SECONDS)
            try:
                group = staging.tensor(torch.float32, numel)
                if accumulating:
                    record.swap.read(key, staging, numel * 4).wait()
                    group.add_(reduced[start:stop])
                else:
                    group.copy_(reduced[start:stop])
                if total is not None:
                    total[start:stop].copy_(group)
                sq_norm += float(torch.linalg.vector_norm(group, dtype=torch.float64)) ** 2
                request = record.swap.write(key, staging, numel * 4)
            except AioError as err:
                staging.release()
                self._lost_grads.setdefault(record.uid, err)
                return
            except BaseException as err:
                staging.release()
                self._lost_grads.setdefault(record.uid, err)  # stopped half way: its files hold a mix
                raise
            self._grad_writes.append((request, staging, record))
        record.grad_sq_norm = sq_norm
        record.grad_multiplier = 1.0
        if total is not None:
            listener.start(record, total, owned=True)

    def _drain_grad_writes(self, keep: int) -> None:
        """Wait for the oldest gradient writes until ``keep`` are in flight; give their buffers back.

        A failed write marks its record's gradient lost (see :meth:`_swap_grad`)
        and is not raised here, so no later call meets it as a stale error.
        """
        while len(self._grad_writes) > keep:
            request, staging, record = self._grad_writes.pop(0)
            try:
                request.wait()
            except AioError as err:
                self._lost_grads.setdefault(record.uid, err)
            finally:
                staging.release()

    def finish_grad_writes(self, records: Iterable[ParamRecord] | None = None) -> None:
        """Wait for every gradient swap write in flight (before the step reads them).

        Raises :class:`AioError` if the gradient of one of ``records`` (default:
        any) is incomplete because a swap write or read of it failed: a step
        would train on a partial gradient.  Nothing is changed then; after
        ``opt.zero_grad()`` the next backward writes the gradients afresh.
        """
        self._drain_grad_writes(0)
        uids = None if records is None else {record.uid for record in records}
        lost = [(uid, err) for uid, err in self._lost_grads.items() if uids is None or uid in uids]
        if not lost:
            return
        names = [self._records[uid].name if uid in self._records else f"#{uid}" for uid, _ in lost]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        first = lost[0][1]
        raise AioError(
            f"optimizer step refused: the gradient of {len(lost)} parameter(s) ({shown}) could not be written to "
            f"its NVMe swap files during backward, and a step on a partial gradient would mix steps; no parameter "
            f"or optimizer state was changed. Free space under nvme_path (or point nvme_path at a bigger disk), "
            f"then call opt.zero_grad() (it discards the incomplete gradients) and run the backward again. "
            f"The first failure: {first}"
        ) from first

    def drop_grads(self, records: Iterable[ParamRecord]) -> None:
        """Discard the gradients of ``records`` (``opt.zero_grad()``), incomplete ones included."""
        for record in records:
            listener = _grad_listener(record)
            if listener is not None:
                listener.gradients_dropped(record)
            if record.grad_shard is not None:
                self._add_resting(_tier_memory(record.opt_tier), -_nbytes(record.grad_shard), ledger=record.ledger)
                record.grad_shard = None
            if record.grad_on_disk:
                # Settles the writes in flight; a failure among them no longer matters to this record.
                self._drain_grad_writes(0)
                # Delete the files: the disk then holds what memory_report says.
                for index in range(len(sub_groups(record.local_numel))):
                    record.swap.forget(state_key("grad", record.uid, index))
                record.grad_on_disk = False
                record.grad_sq_norm = 0.0
                record.grad_multiplier = 1.0
            self._lost_grads.pop(record.uid, None)

    # --- after the optimizer step -----------------------------------------------

    def publish(self, record: ParamRecord, master: torch.Tensor) -> None:
        """Write an updated fp32 master slice back to the parameter tier, in compute dtype.

        nvme tier: the write runs in the background (up to half the pinned
        pool in flight); :meth:`finish_publish` waits for them.
        """
        if record.param_tier == "nvme":
            if record.owns_state:
                nbytes = record.shard_bytes
                # Up to half the pinned pool in flight (at least one write): the
                # optimizer steps the next chunk of masters meanwhile.
                self._drain_publish_writes(max(self._pool(nbytes).capacity_bytes // 2 - nbytes, 0))
                staging = self._pool(nbytes).acquire(nbytes, timeout=POOL_WAIT_SECONDS)
                try:
                    staging.tensor(record.compute_dtype, record.local_numel).copy_(master)
                    requests = self.write_param(record, staging)
                except BaseException:
                    staging.release()
                    raise
                self._publish_writes.append((requests, staging))
        elif master is not record.shard:
            record.shard.copy_(master)

    def _drain_publish_writes(self, keep_bytes: int) -> None:
        """Wait for the oldest parameter writes until at most ``keep_bytes`` are in flight."""
        while self._publish_writes and sum(staging.nbytes for _, staging in self._publish_writes) > keep_bytes:
            _finish_oldest_write(self._publish_writes)

    def finish_publish(self) -> None:
        """Wait for the parameter writes :meth:`publish` started (before their transaction ends)."""
        self._drain_publish_writes(0)

    def refresh_full_params(self, records: Iterable[ParamRecord]) -> None:
        """Stages 1 and 2 keep full parameters: rebuild them from the updated shards."""
        # Frozen parameters never change: nothing to rebuild, no collective to pay.
        records = [r for r in records if r.stage in (1, 2) and r.trainable]
        for record in records:
            if self._shard_is_param(record):
                record.synced_version = record.param._version  # the step's own in-place update
        units = self._bucketed([r for r in records if not self._shard_is_param(r)])
        for unit in units:
            self.gather_start(unit)
        for unit in units:
            for piece, full in zip(unit.pieces, self.gather_wait(unit)):
                piece.layout.param.data.copy_(full)
            self.release(unit)

    @staticmethod
    def _shard_is_param(record: ParamRecord) -> bool:
        """Whether the shard still is the parameter's storage (``param.data = other`` separates them:
        from then on the parameter is rebuilt from the shard after each step, as at world size > 1)."""
        return record.shard_is_param and record.shard.data_ptr() == record.param.data_ptr()

    def sync_written_params(self, records: Iterable[ParamRecord]) -> None:
        """Stages 1-2: carry in-place writes to a full parameter (``load_state_dict``, ``nn.init``,
        ``p.mul_()`` under no_grad) into its shard and master, before the optimizer steps them.

        Such writes bump the parameter's version counter; zinf's own refresh
        writes through ``.data``, which does not.  (Writes through ``.data``
        by the user are not seen.)
        """
        for record in records:
            if record.stage not in (1, 2):
                continue
            param = record.param
            if param._version != record.synced_version:
                self.assign_full(record, param.detach())
                record.synced_version = param._version

    def full_param(self, record: ParamRecord) -> torch.Tensor:
        """A full copy of the parameter's current value (collective: every rank must call)."""
        if record.stage != 3:
            return record.param.detach().clone()
        unit = self.unit([record])
        self.gather_start(unit)
        full = self.gather_wait(unit)[0].clone()
        self.release(unit)
        return full

    # --- accounting --------------------------------------------------------------

    def _add_resting(self, tier: str, delta: int, ledger: "Ledger | None" = None) -> None:
        """Count ``delta`` resting bytes on ``tier``: for the process and for ``ledger``'s model (None: shared)."""
        self.process.add_resting(tier, delta)
        if ledger is not None:
            ledger.add_resting(tier, delta)

    def _add_transient(self, tier: str, delta: int, what: str | None = None, ledger: "Ledger | None" = None) -> None:
        """Count ``delta`` bytes gathered or in flight on ``tier``; ``what``: the op, named by a budget error.

        The budget (``device_memory_limit``) is the model's: checked on ``ledger``.
        """
        if ledger is not None:
            ledger.add_transient(tier, delta, what)
        self.process.add_transient(tier, delta, what)

    def add_optimizer_bytes(self, tier: str, delta: int, ledger: "Ledger | None" = None) -> None:
        self._add_resting(_tier_memory(tier), delta, ledger=ledger)

    # Process-wide figures (every model and the shared pinned pool), as before per-model ledgers.
    @property
    def resting(self) -> dict[str, int]:
        return self.process.resting

    @property
    def transient(self) -> dict[str, int]:
        return self.process.transient

    @property
    def peak(self) -> dict[str, int]:
        return self.process.peak

    @property
    def peak_transient(self) -> dict[str, int]:
        return self.process.peak_transient

    def reset_peak(self) -> None:
        """A new peak window for the process and every model."""
        self.process.reset_peak()
        for ledger in {id(r.ledger): r.ledger for r in self._records.values()}.values():
            ledger.reset_peak()

    # --- models ------------------------------------------------------------------

    def group(self, params: Iterable[torch.Tensor], device_memory_limit=_UNSET, collective_timeout=_UNSET) -> "Ledger":
        """Account ``params`` as one model: one ledger for those adopted, and for the rest when they are.

        The optimizer and ``memory_report`` call this with a model's
        parameters; graphs adopt theirs as a group too.  Ledgers that meet
        merge (their figures add up; a merged peak is the sum of peaks, an
        upper bound).
        """
        self.collect()
        ledgers, pending = [], []
        for param in params:
            record = self.lookup(param)
            if record is not None:
                ledgers.append(record.ledger)
            else:
                pending.append(param)
        ledger = merge_ledgers(ledgers) if ledgers else None
        for param in pending:
            entry = self._pending_ledgers.get(id(param))
            if entry is not None and entry[0]() is param:
                ledger = merge_ledgers([ledger, entry[1]]) if ledger is not None else entry[1].root()
        if ledger is None:
            ledger = Ledger()
        for param in pending:
            self._pending_ledgers[id(param)] = (weakref.ref(param, functools.partial(self._forget_pending, id(param))),
                                                ledger)
        if device_memory_limit is not _UNSET:
            ledger.device_memory_limit = device_memory_limit
        if collective_timeout is not _UNSET:
            ledger.collective_timeout = collective_timeout
        return ledger

    def _forget_pending(self, param_id: int, _ref) -> None:
        self._dropped_pending.put(param_id)

    def _ledger_for(self, param: torch.Tensor) -> "Ledger | None":
        """The ledger a not-yet-adopted parameter was grouped into (see :meth:`group`), if any."""
        entry = self._pending_ledgers.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1].root()
        return None

    def held_tensors(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
        """The tensors the store holds in memory for ``params`` (default: all), by kind.

        For cross-checking the accounting against real storage.
        """
        if params is None:
            records = list(self._records.values())
        else:
            records = [r for r in (self.lookup(p) for p in params) if r is not None]
        params, grads, masters = [], [], []
        for record in records:
            if not record.shard_is_param:
                params.append(record.shard)
            if record.stage != 3:
                params.append(record.param.data)
            if record.grad_shard is not None:
                grads.append(record.grad_shard)
            if record.master is not None and record.master is not record.shard:
                masters.append(record.master)
        return {"params": params, "grads": grads, "masters": masters}


def _grad_listener(record: ParamRecord):
    """What steps ``record`` during backward (an EarlyAdam), if anything does now."""
    return record.grad_listener() if record.grad_listener is not None else None


def _tier_memory(tier: str) -> str:
    """The memory a tier's tensors occupy: nvme-tier state is staged in CPU memory."""
    return "device" if tier == "device" else "cpu"


def _finish_oldest_write(writes: list) -> None:
    """Wait for the oldest (request or requests, pinned staging) of ``writes`` and give its buffer back.

    Every request of the entry finishes before its buffer goes back (the pool
    may hand it out again at once).  A failed write inside a swap transaction
    is not raised here: the transaction raises it when it ends and commits
    nothing, while raising here would stop the optimizer step with some
    masters stepped and others not.  A failed write outside one raises, once
    the rest of ``writes`` has finished too, so none of them surfaces later
    as a stale error.
    """
    requests, staging = writes.pop(0)
    failure = None
    try:
        for request in requests if isinstance(requests, list) else [requests]:
            try:
                request.wait()
            except AioError as err:
                if not request.in_transaction and failure is None:
                    failure = err
    finally:
        staging.release()
    if failure is not None:
        while writes:
            rest, rest_staging = writes.pop(0)
            for request in rest if isinstance(rest, list) else [rest]:
                try:
                    request.wait()
                except AioError:
                    pass  # the first failure is the one reported
            rest_staging.release()
        raise failure


class _DoneWork:
    def wait(self) -> None:
        pass


_DONE = _DoneWork()


def _finish_copies(works: list, staging) -> None:
    """cg copies are done for the graph; their pinned staging buffer (nc) goes back once the host sees them done."""
    if staging is None:
        for work in works:
            work.wait()
        return
    try:
        for work in works:
            work.synchronize()
    finally:
        staging.release()
    for work in works:
        work.wait()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _move_to_empty_storage(param: torch.nn.Parameter) -> None:
    """Point ``param`` (same object, shape, strides, dtype and device) at a new empty storage of its
    own; its old storage stays, untouched, with the other tensors holding it."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        # (No op makes a tensor of this shape on an empty storage: ``set_`` grows the storage to fit.
        # So this allocates the parameter's bytes for a moment; CPU memory never touched costs nothing.)
        empty = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
        empty.untyped_storage().resize_(0)
        param.data = empty


def _tile_rows(tile_rows, param: torch.Tensor) -> tuple[int, ...] | None:
    if tile_rows is None:
        return None
    tile_rows = tuple(int(rows) for rows in tile_rows)
    if param.dim() < 2 or sum(tile_rows) != param.shape[0] or min(tile_rows) < 1:
        raise ZinfStoreError(f"tile_rows {tile_rows} do not split the {tuple(param.shape)} parameter's rows")
    return tile_rows


def _padded_view(view, offset: int, nbytes: int):
    """``view`` from ``offset`` for ``nbytes`` rounded up to the O_DIRECT alignment (never past its end)."""
    padded = -(-nbytes // ALIGNMENT) * ALIGNMENT
    return view[offset : min(len(view), offset + padded)]


def _local_slice(flat: torch.Tensor, holding_dtype: torch.dtype, partition: str, owner: int | None, tile_rows,
                 world_size: int, rank: int, tile_align: int) -> torch.Tensor:
    """This rank's slice of a full flat parameter, in ``holding_dtype`` (fp32, or an integer dtype)."""
    if partition == "broadcast":
        return flat.to(holding_dtype, copy=True) if rank == owner else flat.new_empty(0, dtype=holding_dtype)
    if tile_rows is not None:
        return _tile_major_slice(flat, tile_rows, world_size, rank, tile_align)
    shard_numel = -(-flat.numel() // world_size)
    local = torch.zeros(shard_numel, dtype=holding_dtype, device=flat.device)
    start = rank * shard_numel
    stop = min(start + shard_numel, flat.numel())
    if stop > start:
        local[: stop - start].copy_(flat[start:stop])
    return local


def _tile_major_slice(flat: torch.Tensor, tile_rows, world_size: int, rank: int, align: int = 1) -> torch.Tensor:
    """This rank's fp32 shard of a tiled parameter: its padded slice of every row tile, in tile order.

    Each slice takes a multiple of ``align`` elements (see ParamRecord.tile_align).
    """
    row_numel = flat.numel() // sum(tile_rows)
    pieces, start = [], 0
    for rows in tile_rows:
        tile = flat[start : start + rows * row_numel]
        start += rows * row_numel
        tile_shard_numel = -(-tile.numel() // world_size)
        piece = torch.zeros(-(-tile_shard_numel // align) * align, dtype=torch.float32, device=flat.device)
        lo, hi = rank * tile_shard_numel, min((rank + 1) * tile_shard_numel, tile.numel())
        if hi > lo:
            piece[: hi - lo].copy_(tile[lo:hi])
        pieces.append(piece)
    return torch.cat(pieces)


STORE = ParamStore()
