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
import itertools
import threading
from typing import Iterable

import torch

from .comm import COMM, Comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZinfStoreError(RuntimeError):
    """A parameter cannot be adopted or used the way it was asked for."""


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """One adopted parameter and this rank's part of it."""

    uid: int
    name: str
    param: torch.nn.Parameter
    stage: int
    partition: str
    compute_dtype: torch.dtype  # dtype of the shard, of gathers and of reduce-scatters
    world_size: int
    rank: int
    owner: int | None  # partition="broadcast": the rank holding the whole parameter
    shard: torch.Tensor  # this rank's flat slice (empty where it owns nothing)
    grad_shard: torch.Tensor | None = None  # fp32, accumulated over backward passes
    _gathers: list = dataclasses.field(default_factory=list)  # in-flight (work, buffer)
    _reduces: list = dataclasses.field(default_factory=list)  # in-flight (work, out, staging)

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def shard_numel(self) -> int:
        """Elements per rank's slice (allgather mode), padding included."""
        return -(-self.numel // self.world_size)

    @property
    def gathered_numel(self) -> int:
        return self.shard_numel * self.world_size if self.partition == "allgather" else self.numel

    @property
    def owns_state(self) -> bool:
        """Whether this rank holds a slice that the optimizer must step."""
        return self.shard.numel() > 0


class ParamStore:
    def __init__(self, comm: Comm = COMM):
        self.comm = comm
        self._records: dict[int, ParamRecord] = {}
        self._uid_by_param: dict[int, int] = {}
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self._owned_bytes_by_rank: dict[int, int] = {}
        # Bytes held on the compute device by kind; transient = gathered
        # parameters and in-flight reduce buffers.
        self.held = {"params": 0, "grads": 0, "optimizer": 0, "transient": 0}
        self.peak_bytes = 0
        self.peak_transient_bytes = 0
        self.fp16_scaler = Fp16GradScaler()

    # --- adoption -------------------------------------------------------------

    def adopt(self, param: torch.nn.Parameter, name: str, stage: int, partition: str, param_dtype: str) -> int:
        """Shard ``param`` (once; a tied parameter is the same tensor) and return its uid."""
        with self._lock:
            uid = self._uid_by_param.get(id(param))
            if uid is not None:
                record = self._records[uid]
                if (record.stage, record.partition, record.compute_dtype) != (stage, partition, DTYPES[param_dtype]):
                    raise ZinfStoreError(
                        f"parameter {name} was adopted with stage={record.stage}, partition={record.partition!r}, "
                        f"param_dtype={record.compute_dtype}; every compiled graph of a model must use the same "
                        f"stage, partition and param_dtype options"
                    )
                return uid
            if not param.is_contiguous() or param.untyped_storage().nbytes() != param.numel() * param.element_size():
                raise ZinfStoreError(
                    f"parameter {name} shares its storage with other tensors (or is not contiguous); "
                    f"zinf can only shard parameters that own their memory"
                )
            world_size, rank = self.comm.world_size, self.comm.rank
            compute_dtype = DTYPES[param_dtype]
            full = param.detach()
            if world_size > 1:
                # Like DDP: every rank starts from rank 0's values.
                self.comm.broadcast(full, src=0).wait()
            flat = full.reshape(-1)
            owner = None
            if partition == "broadcast":
                owner = min(range(world_size), key=lambda r: (self._owned_bytes_by_rank.get(r, 0), r))
                self._owned_bytes_by_rank[owner] = self._owned_bytes_by_rank.get(owner, 0) + flat.numel()
                shard = flat.to(compute_dtype, copy=True) if rank == owner else flat.new_empty(0, dtype=compute_dtype)
            else:
                shard_numel = -(-flat.numel() // world_size)
                shard = torch.zeros(shard_numel, dtype=compute_dtype, device=flat.device)
                start = rank * shard_numel
                stop = min(start + shard_numel, flat.numel())
                if stop > start:
                    shard[: stop - start].copy_(flat[start:stop])
            uid = next(self._uids)
            record = ParamRecord(uid=uid, name=name, param=param, stage=stage, partition=partition,
                                 compute_dtype=compute_dtype, world_size=world_size, rank=rank, owner=owner, shard=shard)
            self._records[uid] = record
            self._uid_by_param[id(param)] = uid
            self.held["params"] += _nbytes(shard) + _nbytes(param)
            self._note_peak()
            return uid

    def release_full_storage(self, uids: Iterable[int]) -> None:
        """Stage 3: free the full parameters (once tracing no longer reads them)."""
        for uid in uids:
            record = self._records[uid]
            storage = record.param.untyped_storage()
            if record.stage == 3 and storage.nbytes() > 0:
                self.held["params"] -= storage.nbytes()
                storage.resize_(0)

    def lookup(self, param: torch.Tensor) -> ParamRecord | None:
        uid = self._uid_by_param.get(id(param))
        return None if uid is None else self._records[uid]

    def record(self, uid: int) -> ParamRecord:
        return self._records[uid]

    def records(self) -> list[ParamRecord]:
        return list(self._records.values())

    # --- gather / release -------------------------------------------------------

    def gather_start(self, uid: int) -> None:
        """Start assembling the full parameter (all-gather of slices, or broadcast from its owner)."""
        record = self._records[uid]
        buffer = torch.empty(record.gathered_numel, dtype=record.compute_dtype, device=record.shard.device)
        if record.partition == "allgather":
            work = self.comm.all_gather_into(buffer, record.shard)
        else:
            if record.rank == record.owner:
                buffer.copy_(record.shard)
            work = self.comm.broadcast(buffer, src=record.owner)
        record._gathers.append((work, buffer))
        self._add_transient(_nbytes(buffer))

    def gather_wait(self, uid: int) -> torch.Tensor:
        """Finish the oldest in-flight gather of ``uid``; the full parameter in its own dtype."""
        record = self._records[uid]
        if not record._gathers:
            raise ZinfStoreError(f"gather_wait for {record.name} without a gather_start")
        work, buffer = record._gathers.pop(0)
        work.wait()
        full = buffer[: record.numel].view(record.shape)
        if full.dtype != record.param.dtype:
            full = full.to(record.param.dtype)
        return full

    def release(self, uid: int) -> None:
        """The graph is done with a gathered copy of ``uid``: it no longer counts as held.

        The memory itself goes when the graph drops its last reference, right
        after this op (the generated code frees values after their last use).
        """
        record = self._records[uid]
        self._add_transient(-record.gathered_numel * record.shard.element_size())

    # --- gradients ---------------------------------------------------------------

    def reduce_grad_start(self, uid: int, grad: torch.Tensor) -> None:
        """Start averaging ``grad`` over ranks into this rank's slice (or to the owner)."""
        record = self._records[uid]
        flat_grad = grad.detach().reshape(-1)
        if record.compute_dtype == torch.float16:
            flat_grad = flat_grad * self.fp16_scaler.scale  # keep small gradients representable in fp16
        if record.partition == "allgather":
            staging = torch.zeros(record.gathered_numel, dtype=record.compute_dtype, device=grad.device)
            staging[: record.numel].copy_(flat_grad)
            out = torch.empty(record.shard_numel, dtype=record.compute_dtype, device=grad.device)
            work = self.comm.reduce_scatter_avg(out, staging)
        else:
            staging = flat_grad.to(record.compute_dtype, copy=True)
            out = staging
            work = self.comm.reduce_sum(staging, dst=record.owner)
        record._reduces.append((work, out, staging))
        self._add_transient(_nbytes(staging) + (_nbytes(out) if out is not staging else 0))

    def reduce_grad_wait(self, uid: int) -> None:
        """Finish the oldest in-flight reduce of ``uid`` and add it to the gradient shard."""
        record = self._records[uid]
        if not record._reduces:
            raise ZinfStoreError(f"reduce_grad_wait for {record.name} without a reduce_grad_start")
        work, out, staging = record._reduces.pop(0)
        work.wait()
        self._add_transient(-(_nbytes(staging) + (_nbytes(out) if out is not staging else 0)))
        if record.partition == "broadcast":
            if record.rank != record.owner:
                return
            out = out / record.world_size
        if record.compute_dtype == torch.float16:
            out = out.to(torch.float32) / self.fp16_scaler.scale
            self.fp16_scaler.check(out)
        if record.grad_shard is None:
            record.grad_shard = out.to(torch.float32, copy=True)
            self.held["grads"] += _nbytes(record.grad_shard)
            self._note_peak()
        else:
            record.grad_shard.add_(out)

    def reduce_full_grads(self, records: Iterable[ParamRecord]) -> None:
        """Stage 1: reduce the full ``param.grad`` of each record into its gradient shard."""
        started = []
        for record in records:
            if record.param.grad is not None:
                self.reduce_grad_start(record.uid, record.param.grad)
                started.append(record)
        for record in started:
            self.reduce_grad_wait(record.uid)
            record.param.grad = None

    def drop_grads(self, records: Iterable[ParamRecord]) -> None:
        for record in records:
            if record.grad_shard is not None:
                self.held["grads"] -= _nbytes(record.grad_shard)
                record.grad_shard = None

    # --- after the optimizer step -----------------------------------------------

    def refresh_full_params(self, records: Iterable[ParamRecord]) -> None:
        """Stages 1 and 2 keep full parameters: rebuild them from the updated shards."""
        records = [r for r in records if r.stage in (1, 2)]
        for record in records:
            self.gather_start(record.uid)
        for record in records:
            full = self.gather_wait(record.uid)
            record.param.data.copy_(full)
            self.release(record.uid)

    def full_param(self, record: ParamRecord) -> torch.Tensor:
        """A full copy of the parameter's current value (collective: every rank must call)."""
        if record.stage != 3:
            return record.param.detach().clone()
        self.gather_start(record.uid)
        full = self.gather_wait(record.uid).clone()
        self.release(record.uid)
        return full

    # --- accounting --------------------------------------------------------------

    def set_optimizer_bytes(self, delta: int) -> None:
        self.held["optimizer"] += delta
        self._note_peak()

    def _add_transient(self, delta: int) -> None:
        self.held["transient"] += delta
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.held["transient"])
        self._note_peak()

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def reset_peak(self) -> None:
        self.peak_bytes = sum(self.held.values())
        self.peak_transient_bytes = self.held["transient"]

    def held_tensors(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
        """The tensors the store holds for ``params`` (default: all), by kind.

        For cross-checking the accounting against real storage.
        """
        if params is None:
            records = list(self._records.values())
        else:
            records = [r for r in (self.lookup(p) for p in params) if r is not None]
        params, grads = [], []
        for record in records:
            params.append(record.shard)
            if record.stage != 3:
                params.append(record.param.data)
            if record.grad_shard is not None:
                grads.append(record.grad_shard)
        return {"params": params, "grads": grads}


class Fp16GradScaler:
    """Dynamic scaling of gradients on their way through fp16 (``param_dtype="fp16"``).

    The graph computes in the model's own dtype; gradients become fp16 only
    to be reduced.  They are multiplied by ``scale`` before that cast and
    divided after it, so that small values survive.  An inf or nan seen on
    any rank skips the optimizer step and halves the scale; ``growth_interval``
    good steps in a row double it (the policy of ``torch.amp.GradScaler``).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.found_inf = False
        self.good_steps = 0
        self.skipped_steps = 0

    def check(self, reduced_grad: torch.Tensor) -> None:
        if not self.found_inf and not bool(torch.isfinite(reduced_grad).all()):
            self.found_inf = True

    def should_skip_step(self, comm: Comm, device: torch.device) -> bool:
        """Agree over ranks whether any saw an overflow, update the scale, reset the flag.

        ``device``: where the flag is reduced (NCCL reduces device tensors only).
        """
        flag = torch.tensor(1.0 if self.found_inf else 0.0, device=device)
        comm.all_reduce_sum(flag)
        self.found_inf = False
        if flag.item() > 0:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


STORE = ParamStore()
