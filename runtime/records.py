"""One adopted parameter's record, the store's constants, and the small helpers its parts share."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from .aio import AioEngine, AioError
from .swap_layout import align
from .comm import MeshComm
from .ledger import Ledger, ZinfStoreError
from .grad_state import Gradient
from .model_group import ModelGroup
from .param_plan import ParamPlan
from .units import ParamLayout


# A transfer waiting this long for pinned memory means the pool is too small
# for what is in flight: an error naming pinned_bytes beats a hang.
POOL_WAIT_SECONDS = 120.0
# While the main thread waits on a transfer with background work in flight (ParamStore._wait_working): how long
# each wait for the transfer lasts before the background work is looked at again.  A read that lands is stepped
# at most this late; the wait ends when its transfer does, or after the background pass under way then.
BACKGROUND_POLL_SECONDS = 0.0005
# Gradient sub-groups being written to swap at once (nvme optimizer tier):
# enough to keep the disk busy while backward goes on, few enough that the
# pinned pool's optimizer share covers them.
GRAD_WRITES_IN_FLIGHT = 2

# Gathered bytes one bucket may hold (option bucket_bytes; see runtime/units.py).
DEFAULT_BUCKET_BYTES = 64 << 20

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(eq=False, kw_only=True)
class ParamRecord(ParamLayout):
    """One adopted parameter: its fixed layout (:class:`ParamLayout`, whose facts are its frozen ``plan``'s) and
    this rank's state of it."""

    # Weak: the store must not keep a dropped model alive (see ParamStore.adopt).
    param_ref: "weakref.ref[torch.nn.Parameter]"
    param_id: int  # id() of the parameter, its key in the store
    # The resting shard in compute dtype: on the device or on the CPU; for the
    # nvme tier an empty tensor (the data is in the swap file ``param.<uid>``,
    # or in the master's files: see ParamPlan.params_in_master).
    shard: torch.Tensor
    # fp32 master of this rank's slice for device/cpu optimizer tiers (the
    # shard itself when they coincide); None for the nvme tier (swap files).
    master: torch.Tensor | None = None
    # This rank's accumulated gradient, in one explicit state; only its own moves change it (grad_state.py).
    gradient: Gradient = dataclasses.field(init=False)
    # nvme optimizer tier within the option nvme_grad_ram_bytes: the gradient
    # stays in memory (``gradient.shard``, host memory) and the step reads it from there.
    grad_in_ram: bool = False
    swap: "AioEngine | None" = None  # the swap engine of its nvme_path, for nvme tiers
    full_storage_bytes: int = 0  # the parameter's own storage, until stage 3 frees it
    group: ModelGroup  # the model it belongs to, for its whole life (see runtime/model_group.py)
    # Stages 1-2: the parameter's version counter when its shard last matched it (see sync_written_params).
    synced_version: int = 0
    # The ranks it is sharded over (and, for HSDP, replicated across); set at adoption.
    mesh: "MeshComm | None" = None
    # A weak reference to what takes those early steps (EarlyAdam), once an optimizer is bound.
    grad_listener: "weakref.ref | None" = None

    def __post_init__(self):
        self.gradient = Gradient(self.name)

    @property
    def ledger(self) -> Ledger:
        """The ledger of its model (``group.ledger``), where the parameter's bytes are counted."""
        return self.group.ledger

    @property
    def param(self) -> torch.nn.Parameter:
        """The parameter; raises if it was garbage-collected."""
        param = self.param_ref()
        if param is None:
            raise ZinfStoreError(f"parameter {self.name} was garbage-collected; its zinf state is gone")
        return param

    @property
    def trainable(self) -> bool:
        """Whether the parameter is alive and requires a gradient."""
        param = self.param_ref()
        return param is not None and param.requires_grad


# The one module that assigns each of ParamRecord's fields after it is made (its constructor aside): the module
# that owns that part of a parameter's life.  tests/unit/test_structure.py fails on an assignment elsewhere.
FIELD_OWNERS = {
    "name": None, "plan": None, "param_ref": None, "param_id": None, "group": None, "mesh": None,  # fixed at adoption
    "gradient": "zinf_compiler.runtime.records",  # made in __post_init__; its own moves in runtime/grad_state.py
    "shard": "zinf_compiler.runtime.store_values",  # a parameter's values on its tiers
    "master": "zinf_compiler.runtime.store_values",
    "grad_in_ram": "zinf_compiler.runtime.store",  # adoption's choices and stage 3's full storage
    "swap": "zinf_compiler.runtime.store",
    "full_storage_bytes": "zinf_compiler.runtime.store",
    "synced_version": "zinf_compiler.runtime.store_publish",  # what a step or a load wrote (stages 1-2)
    "grad_listener": "zinf_compiler.runtime.records",  # listen_to_gradients, by the early steps
}


def listen_to_gradients(record: ParamRecord, listener) -> None:
    """``listener`` (an early step: EarlyAdam, EarlyHostAdam) hears of ``record``'s gradients from now on.  Held
    weakly: the store must not keep an optimizer alive."""
    record.grad_listener = weakref.ref(listener)


def grad_listener_of(record: ParamRecord):
    """What steps ``record`` during backward (an EarlyAdam), if anything does now."""
    return record.grad_listener() if record.grad_listener is not None else None


def tier_memory(tier: str) -> str:
    """The memory a tier's tensors occupy: nvme-tier state is staged in CPU memory."""
    return "device" if tier == "device" else "cpu"


def finish_oldest_write(writes: list) -> None:
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




def finish_copies(works: list, staging) -> None:
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


def nbytes_of(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def move_to_empty_storage(param: torch.nn.Parameter) -> None:
    """Point ``param`` (same object, shape, strides, dtype and device) at a new empty storage of its
    own; its old storage stays, untouched, with the other tensors holding it."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        # (No op makes a tensor of this shape on an empty storage: ``set_`` grows the storage to fit.
        # So this allocates the parameter's bytes for a moment; CPU memory never touched costs nothing.)
        empty = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
        empty.untyped_storage().resize_(0)
        param.data = empty


def padded_view(view, offset: int, nbytes: int):
    """``view`` from ``offset`` for ``nbytes`` rounded up to the O_DIRECT alignment (never past its end)."""
    padded = align(nbytes)
    return view[offset : min(len(view), offset + padded)]


def local_slice(flat: torch.Tensor, plan: ParamPlan) -> torch.Tensor:
    """This rank's shard of a full flat parameter, laid out as ``plan`` says, in its holding dtype (fp32, or an
    integer dtype); padding is zero."""
    local = torch.zeros(plan.local_numel, dtype=plan.holding_dtype, device=flat.device)
    for first, stop, local_start in plan.local_ranges:
        local[local_start : local_start + stop - first].copy_(flat[first:stop])
    return local
