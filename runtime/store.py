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

import collections
import functools
import queue
import threading
import weakref
from typing import Callable, Iterable

import torch

from .aio import AioEngine
from .comm import Comm, MeshComm
from .host_memory import available_bytes, ranks_on_node
from .swap_folders import FolderWatch
from .pool_sizes import auto_grad_ram_bytes
from .swap_layout import SUB_GROUP_NUMEL
from .pinned import PinnedMemory, PinnedPool
from .tensor_parallel import local_of
from .resting import guard_aliases, rest
from .ledger import Ledger, ZinfStoreError
from .model_group import ModelGroup
from .param_plan import OPTIMIZER_STATES, ParamPlan
from .records import (DTYPES, ParamRecord, local_slice, move_to_empty_storage, nbytes_of,
                      padded_view, tier_memory)
from .store_accounting import StoreAccounting
from .store_background import BackgroundSteps
from .store_fetch import FetchSteps
from .store_grads import GradientSteps
from .store_offload import OffloadResources
from .store_publish import PublishSteps
from .store_values import forget_values, local_value_chunks, place_master, place_shard, write_local
from .transfers import TransferTable

__all__ = ["DTYPES", "ParamRecord", "ParamStore", "ZinfStoreError"]


class _ParamRef(weakref.ref):
    """A weak reference to an adopted parameter that carries its uid."""

    __slots__ = ("uid",)

    def __new__(cls, param, callback, uid):
        return super().__new__(cls, param, callback)

    def __init__(self, param, callback, uid):
        super().__init__(param, callback)
        self.uid = uid


class ParamStore(FetchSteps, GradientSteps, PublishSteps, StoreAccounting, BackgroundSteps):
    """Every adopted parameter of the process: its record, and the resources its transfers use.

    Split by concern: this file holds adoption, lookup and forgetting;
    :class:`~.store_offload.OffloadResources` the swap engines and the pinned
    pool, runtime/store_values.py a record's values on its tiers (placed,
    overwritten, streamed out); :class:`FetchSteps` the
    parameter fetches (nc, cg, gather), :class:`GradientSteps` the gradients'
    reduction and accumulation, :class:`PublishSteps` what follows an
    optimizer step, :class:`StoreAccounting` the bytes held and the models'
    ledgers, :class:`BackgroundSteps` the work moved on at transfer points
    and inside waits.  They share the state made here.
    """

    def __init__(self, comm: Comm, folder_watch: FolderWatch | None = None, pinned_memory: PinnedMemory | None = None):
        self.comm = comm  # the process's default group: parameters adopted without a mesh shard over it
        self.copier = comm.copier  # cg copies (CPU or pinned -> device): the process's
        self._records: dict[int, ParamRecord] = {}
        # id(param) -> a weak reference to it that knows the uid; checked for identity
        # on lookup, so a new tensor at a dead one's address is never taken for it.
        self._by_param: dict[int, _ParamRef] = {}
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()  # uids whose parameter was collected
        self._next_uid = 0  # the next parameter's uid (see reserve_uids)
        self._lock = threading.RLock()
        self._owned_bytes_by_rank: dict[int, int] = {}
        self._grad_ram_reserved = 0  # bytes of nvme-tier gradients adopted to stay in RAM (nvme_grad_ram_bytes)
        self._grad_ram_auto: int | None = None  # nvme_grad_ram_bytes="auto": this process's budget, fixed once
        # NVMe swap and the pinned pool: made on first need (see configure_offload). The folder watch
        # removes the engines' folders on SIGTERM (None: each engine its own); the pool is a quota of
        # the process's pinned memory (None: an allocator of this store's own, counted here).
        self.pinned_memory = pinned_memory if pinned_memory is not None else PinnedMemory(self.count_pinned_pool)
        self.offload = OffloadResources(comm.tracer, folder_watch, self.pinned_memory)
        self._grad_writes: list = []  # in-flight gradient swap writes: (request, pinned buffer, record)
        # Bytes held per tier, for the whole process (every model and the pinned
        # pool); each model has its own too (its ModelGroup's, ParamRecord.ledger).
        self.process = Ledger()
        # id(param) -> (weak ref, model group) for parameters claimed before adoption (see claim).
        self._claimed: dict[int, tuple] = {}
        self._dropped_claims: queue.SimpleQueue = queue.SimpleQueue()
        self._publish_writes: list = []  # (request, pinned staging) of parameter writes in flight
        self._device_publishes: list = []  # copies of updated shards to the device in flight (CopyWork)
        self._grads_to_host: collections.deque = collections.deque()  # gradient copies off the device (CopyWork)
        self._transfers = TransferTable()  # every fetch and reduce in flight, each in its state
        # Groups with a hold open (hold_gathers / hold_grads); each group keeps what it holds.
        self._holding_groups: "weakref.WeakSet" = weakref.WeakSet()
        # Work that moves on at the transfer points of a graph (the optimizer's early steps).
        self._background: "weakref.WeakSet" = weakref.WeakSet()

    # --- offload resources -------------------------------------------------------

    def configure_offload(self, nvme_path: str | None, pinned_bytes, aio_block_size: int, aio_queue_depth: int,
                          aio_threads: int, nvme_copies: int = 2) -> None:
        """Settings for the parameters adopted next: their swap folder and the pinned pool."""
        self.offload.configure(nvme_path, pinned_bytes, aio_block_size, aio_queue_depth, aio_threads, nvme_copies)

    @property
    def pinned(self) -> PinnedPool | None:
        """The process's pinned pool (None until first needed)."""
        return self.offload.pinned

    def engines(self) -> list[AioEngine]:
        """The swap engines, one per nvme_path."""
        return list(self.offload.engines_by_path.values())

    def plan_shards(self, plans) -> None:
        """Before adoption: the plans of the parameters adopted next (they size the pool, growing one made
        for fewer; see :meth:`OffloadResources.plan_shards`)."""
        self.offload.plan_shards(plans, self._records.values())

    def pinned_pool(self, at_least: int) -> PinnedPool:
        """The process's pinned pool, made on first need (see :meth:`OffloadResources.pinned_pool`)."""
        return self.offload.pinned_pool(at_least, self._records.values())

    def write_param(self, record: ParamRecord, staging, hold: bool = False) -> list:
        """Start writing a whole shard staged in ``staging`` to its swap keys.

        ``hold``: as held copies, in the background (an early step's; see AioEngine.write).
        """
        view = staging.memoryview()
        itemsize = record.compute_dtype.itemsize
        return [record.swap.write(key, padded_view(view, start * itemsize, numel * itemsize), numel * itemsize,
                                  hold=hold, background=hold)
                for key, start, numel in record.swap_layout()]

    def count_pinned_pool(self, nbytes: int) -> None:
        """Count (or, negative, stop counting) a quota of the process's pinned memory (its allocator calls this)."""
        self._add_resting("cpu", nbytes)

    def count_transient(self, tier: str, delta: int, what: str, ledger: "Ledger") -> None:
        """Count (or, negative, stop counting) bytes held for a while on ``tier`` for ``ledger``'s model."""
        self._add_transient(tier, delta, what=what if delta > 0 else None, ledger=ledger)

    def prefetch_pinned_bytes(self) -> int | None:
        """Pinned bytes the graph's nc reads may hold at once (see :meth:`OffloadResources.prefetch_pinned_bytes`)."""
        return self.offload.prefetch_pinned_bytes(list(self._records.values()))

    def write_swap(self, engine: AioEngine, key: str, tensor: torch.Tensor) -> None:
        """Write a flat tensor to the swap file ``key`` through the pinned pool (synchronous)."""
        self.offload.write_swap(engine, key, tensor, self._records.values())

    def read_swap(self, engine: AioEngine, key: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """Read the swap file ``key`` into a new tensor on ``device`` (synchronous)."""
        return self.offload.read_swap(engine, key, dtype, numel, device, self._records.values())

    # --- adoption -------------------------------------------------------------

    def reserve_uids(self, count: int) -> int:
        """The first of ``count`` new uids for parameters planned now and adopted next (their swap keys' names)."""
        first = self._next_uid
        self._next_uid += count
        return first

    def owned_numel_by_rank(self) -> dict[int, int]:
        """Elements each rank owns whole so far (``partition="broadcast"``): where a new model's plan puts its
        parameters' owners (a copy)."""
        return dict(self._owned_bytes_by_rank)

    def pool_sizing_plans(self) -> list:
        """The plans the parameters' pinned pool will be sized from when it is made (every adopted record's and
        those planned since): what a new model's plan predicts it by."""
        return self.offload.sizing_plans(self._records.values())

    def adopt(self, param: torch.nn.Parameter, name: str, plan: ParamPlan, *, group: ModelGroup | None = None,
              read_local: "Callable[[ParamRecord], torch.Tensor] | None" = None,
              mesh: MeshComm | None = None) -> ParamRecord:
        """Shard ``param`` (once; a tied parameter is the same tensor) as ``plan`` lays it out, and return its
        record.

        ``plan``: its model's plan of it (zinf_compiler/model_plan.py: tiers, layout, owner, uid from
        :meth:`reserve_uids`, whether its gradient rests in RAM, which the store then reserves of the process's
        nvme_grad_ram_bytes); a parameter adopted before keeps its record.  ``group``: the model it belongs to
        if no :meth:`claim` put it in one before (default: a new group of its own).  ``read_local``: where this
        rank's slice comes from instead of the parameter's own values (``materialize`` from a weights file):
        called with the new record, it returns the local slice (see :meth:`ParamRecord.owned_ranges`) in
        ``record.holding_dtype``; the parameter's memory is never read, and nothing is broadcast.  ``mesh``:
        the ranks to shard over (default: every rank of the default group; see runtime/comm.py), whose size
        and rank the plan was made for.

        The store holds the parameter only weakly: when it is garbage-collected
        (its model and optimizer dropped), its shards, gradients, swap files and
        accounted bytes go with it (:meth:`_forget`).
        """
        mesh = mesh or self.comm.mesh()
        param = local_of(param)
        with self._lock:
            record = self.lookup(param)
            self.collect()
            if record is not None:
                return record
            if not param.is_contiguous() or param.untyped_storage().nbytes() != param.numel() * param.element_size():
                raise ZinfStoreError(
                    f"parameter {name} shares its storage with other tensors (or is not contiguous); "
                    f"zinf can only shard parameters that own their memory"
                )
            if plan.tile_rows is not None and param.is_floating_point() and param.dim() < 2:
                raise ZinfStoreError(f"tile_rows {tuple(plan.tile_rows)} do not split the {tuple(param.shape)} "
                                     f"parameter's rows (a tiled parameter has two dimensions or more)")
            world_size, rank = mesh.shard.world_size, mesh.shard.rank
            if (tuple(plan.shape), plan.dtype, plan.world_size, plan.rank) != (tuple(param.shape), param.dtype,
                                                                                world_size, rank):
                raise ZinfStoreError(
                    f"parameter {name} ({tuple(param.shape)} {param.dtype}, rank {rank} of {world_size}) was "
                    f"planned as {tuple(plan.shape)} {plan.dtype}, rank {plan.rank} of {plan.world_size}")
            if plan.shard_is_param and read_local is not None:
                raise ZinfStoreError(f"parameter {name}: a plan whose shard is the parameter's own storage cannot "
                                     f"read its values from a file (plan it with from_file)")
            group = self.group_of(param) or group or ModelGroup(self)  # a claim made before wins
            group.check_mesh(mesh, name)
            if plan.owner is not None:
                self._owned_bytes_by_rank[plan.owner] = self._owned_bytes_by_rank.get(plan.owner, 0) + plan.numel
            uid = plan.uid
            record = ParamRecord(name=name, plan=plan, param_ref=weakref.ref(param),
                                 shard=torch.empty(0, dtype=plan.compute_dtype), param_id=id(param),
                                 synced_version=param._version, mesh=mesh,
                                 group=group)
            if read_local is not None:
                local = read_local(record)
                if local.numel() != record.local_numel or local.dtype != plan.holding_dtype:
                    raise ZinfStoreError(f"{name}: read_local gave {local.numel()} {local.dtype} elements for a "
                                         f"shard of {record.local_numel} {plan.holding_dtype}")
            else:
                full = param.detach()
                if world_size > 1:
                    # Like DDP: every rank starts from rank 0's values.
                    mesh.everyone.broadcast(full, src=0, what=f"broadcast of {name} from rank 0 (adoption)",
                                        timeout=record.group.collective_timeout).wait()
                local = local_slice(full.reshape(-1), plan)
            if plan.grad_in_ram:
                record.grad_in_ram = True
                self._grad_ram_reserved += record.local_numel * 4
            if "nvme" in (plan.param_tier, plan.opt_tier):
                record.swap = self.offload.engine()
            self._records[uid] = record
            record.group.join(record)
            self._claimed.pop(id(param), None)
            # The callback runs when the parameter is collected; it must not hold the parameter.
            self._by_param[id(param)] = _ParamRef(param, functools.partial(self._forget_param, uid), uid)
            record.full_storage_bytes = nbytes_of(param)
            self._add_resting("device", record.full_storage_bytes,
                              ledger=record.ledger)  # until release_full_storage (stage 3)
            place_shard(record, local, self, self._add_resting)
            place_master(record, local, self, self._add_resting)
            return record

    def grad_ram_left(self, grad_ram_bytes: int | str) -> int:
        """What option nvme_grad_ram_bytes (bytes or "auto") leaves for gradients not adopted yet."""
        limit = self._auto_grad_ram_bytes() if grad_ram_bytes == "auto" else int(grad_ram_bytes)
        return max(0, limit - self._grad_ram_reserved)

    def _auto_grad_ram_bytes(self) -> int:
        """``nvme_grad_ram_bytes="auto"``: an eighth of the memory available when first asked, shared by the
        ranks on this node (``LOCAL_WORLD_SIZE``, set by torchrun); fixed from then on, so that what this
        process allocates afterwards does not shrink it.  0 where the kernel does not say."""
        if self._grad_ram_auto is None:
            self._grad_ram_auto = auto_grad_ram_bytes(available_bytes(), ranks_on_node())
        return self._grad_ram_auto

    def release_full_storage(self, records: Iterable[ParamRecord]) -> None:
        """Stage 3: free the full parameters (once tracing no longer reads them).

        Tensors sharing a parameter's storage (``state_dict()`` values, ``p.detach()``,
        ``p.data``, views) must not be left reading freed memory: :func:`guard_aliases`
        makes the Python ones raise a clear error instead; a storage something else holds
        as well (a view an autograd graph saved) is not freed: the parameter moves to an
        empty storage of its own and leaves the old one, whole, to its holders.
        """
        releasing = {id(r): r for r in records if r.stage == 3 and r.param.untyped_storage().nbytes() > 0}
        kept = guard_aliases([(r.param, r.uid, r.name) for r in releasing.values()], self.lookup)
        for record in releasing.values():
            param = record.param
            self._add_resting("device", -param.untyped_storage().nbytes(), ledger=record.ledger)
            record.full_storage_bytes = 0
            if id(param) in kept:
                move_to_empty_storage(param)
            else:
                param.untyped_storage().resize_(0)
            rest(param, self)  # a RestingParameter, whose guard asks this store for its record

    def hold_full_storage(self, record: ParamRecord) -> bool:
        """Stage 3 (``zinf.gathered``): give a resting parameter its full storage back, holding its
        current value (a collective: every rank must call); :meth:`release_full_storage` frees it.
        False if it was not resting (an enclosing block holds it)."""
        if record.stage != 3 or record.full_storage_bytes:
            return False
        full = self.full_param(record)
        param = record.param
        record.full_storage_bytes = nbytes_of(param)
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
        self.assign_local(record, local_slice(flat, record.plan))

    def assign_local(self, record: ParamRecord, local: torch.Tensor) -> None:
        """Write this rank's new slice (local layout, ``record.holding_dtype``) into its shard and master.

        The shard takes it in compute dtype on the parameter tier; the fp32
        master (memory or swap files) takes it as it is.
        """
        if local.numel() != record.local_numel:
            raise ZinfStoreError(f"{record.name}: a local slice of {local.numel()} elements for a shard of "
                                 f"{record.local_numel}")
        write_local(record, local, self)

    def local_value_chunks(self, record: ParamRecord, chunk_numel: int = SUB_GROUP_NUMEL):
        """This rank's slice of the parameter's value, streamed (see :func:`.store_values.local_value_chunks`)."""
        return local_value_chunks(record, self, chunk_numel)

    def lookup(self, param: torch.Tensor) -> ParamRecord | None:
        """The record of ``param`` (this very tensor object, alive; a DTensor: its local tensor), or None if it
        was never adopted."""
        param = local_of(param)
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
                param_id = self._dropped_claims.get_nowait()
            except queue.Empty:
                break
            entry = self._claimed.get(param_id)
            if entry is not None and entry[0]() is None:
                del self._claimed[param_id]
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
            self._add_resting(tier_memory(record.param_tier), -nbytes_of(record.shard), ledger=record.ledger)
        if record.master is not None and record.master is not record.shard:
            self._add_resting(tier_memory(record.opt_tier), -nbytes_of(record.master), ledger=record.ledger)
        forget_values(record)
        if record.swap is not None:
            for key, _, _ in record.swap_layout():
                record.swap.forget(key)
            for state in OPTIMIZER_STATES:
                for key, _, _ in record.plan.state_swap(state):
                    record.swap.forget(key)
        if record.owner is not None:
            self._owned_bytes_by_rank[record.owner] -= record.numel
        record.group.leave(record)

    def records(self) -> list[ParamRecord]:
        """Every adopted parameter's record (call :meth:`collect` first to drop collected parameters')."""
        return list(self._records.values())

