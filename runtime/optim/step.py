"""The parts of a zinf optimizer's step, as functions of what they touch: gradient averaging and norm, the
NVMe step's transaction, stepping the in-memory masters and writing them back to their tier."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch

from ..aio import AioError
from .early_host_adam import EarlyHostAdam
from ..host_memory import available_bytes, pages_kept
from ..store import ParamStore

from .state import Slot
from ..tensor_parallel import holds_own_slice, model_tp_mesh

# With parameters on NVMe, masters are stepped and written back this many bytes at a time.
PUBLISH_CHUNK_BYTES = 32 << 20


def host_memory_bounded(records) -> bool:
    """Whether the step's end should give freed host memory back to the OS (``malloc_trim``).

    Yes where host memory is a staging area beside an accelerator's (a cpu
    or NVMe tier off a CPU device), and where an NVMe tier bounds a CPU
    device's host memory while glibc's heap keeps its defaults (a host_memory
    budget: see zinf_compiler/adoption.py).  Not where the compute device is
    the CPU otherwise: the pages freed by a step are the next step's gathers
    and gradients, and trimming them costs a page fault per page again every
    step (benchmarks/RESULTS.md, 2026-11-25: the cpu tier's GPT step at world
    size 1 went from 0.550 s to 0.402 s; 2026-12-03: the NVMe tier's at world
    2 with runtime/host_memory.py's kept pages, from 4.85 to 4.43 s).
    """
    return any((r.device.type != "cpu" and (r.param_tier != "device" or r.opt_tier != "device"))
               or (r.device.type == "cpu" and "nvme" in (r.param_tier, r.opt_tier) and not pages_kept())
               for r in records)


def average_uncaptured_grads(slots: list[Slot], mesh, timeout) -> None:
    """Average over ranks the gradients of parameters that no compiled graph used, as DDP would.

    A parameter zinf never sharded ran only in eager code (Dynamo runs the
    rest of a loop, and what follows it, eagerly after a graph break inside
    the loop), so no graph averaged its gradient: each rank holds its own.
    A rank without a gradient for one counts as zero, and it gets the
    average too (DDP with ``find_unused_parameters``); a parameter no rank
    has a gradient for keeps None.  Taken again at ``step()`` after
    ``clip_grad_norm_``: averaging equal gradients leaves them as they are,
    and every rank takes part in the same collectives whatever its
    gradients did in between.
    """
    everyone = mesh.everyone
    if everyone.world_size == 1:
        return
    params = [slot.param for slot in slots if slot.record is None and slot.param.requires_grad]
    if not params:
        return
    device = params[0].device
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
    # One all-reduce: every gradient (zeros where a rank has none), then a has-gradient flag per parameter.
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, dtype)
                      for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)])
    everyone.all_reduce_avg(flat, "all_reduce of the gradients of parameters no graph used", timeout).wait()
    offset, present = 0, flat[-len(params):].tolist()
    for param, on_some_rank in zip(params, present):
        numel = param.numel()
        averaged = flat[offset : offset + numel].view_as(param).to(param.device, param.dtype)
        param.grad = averaged if on_some_rank else None
        offset += numel


NORM_CHUNK_ELEMENTS = 1 << 18


def _squared_sum(grad: torch.Tensor) -> torch.Tensor:
    """The float64 sum of ``grad``'s squares, a chunk at a time: a whole float64 copy of a large gradient (and
    its square) would add 16 bytes per element to the process's peak while every gradient is held."""
    flat = grad.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for chunk in flat.split(NORM_CHUNK_ELEMENTS):
        total += chunk.double().pow_(2).sum()
    return total


def clip_grad_norm(slots: list[Slot], mesh, device: torch.device, max_norm: float, timeout,
                   pipeline=None) -> tuple[torch.Tensor, bool]:
    """Clip the slots' global gradient norm across all ranks: (the norm before clipping, whether it clipped).

    Equals ``torch.nn.utils.clip_grad_norm_`` on the whole model's full, averaged gradients.  The norm spans
    the data-parallel ranks (``mesh``: each sharded element on one rank of its shard group, HSDP replicas
    holding the same ones), the tensor-parallel ranks of DTensor parameters (a Shard placement's local
    gradients add over tp; a Replicate one, or a plain parameter beside them, is the same on every tp rank
    and counts on tp rank 0) and, for a pipeline stage's model, the other stages (``pipeline``, the Comm of
    the pipeline's ranks: their parameters are other parts of the model).
    """
    tp_mesh = model_tp_mesh([slot.param for slot in slots], "clip_grad_norm_")
    tp_first = tp_mesh is None or tp_mesh.get_local_rank() == 0
    # float64 sums; on the parameters' device, where NCCL can reduce them.
    sharded_sq = torch.zeros((), dtype=torch.float64, device=device)
    replicated_sq = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    grads_on_disk = []
    for slot in slots:
        counts_here = tp_first or holds_own_slice(slot.param)  # (each tp-replicated element once)
        if slot.record is not None and slot.record.gradient.on_disk:
            # An nvme-tier gradient: its norm was taken as it was written.
            grads_on_disk.append(slot.record)
            if counts_here:
                sharded_sq += slot.record.gradient.sq_norm
            continue
        grad = slot.grad
        if grad is None:
            continue
        grads.append(grad)
        if not counts_here:
            continue
        squared = _squared_sum(grad.detach()).to(device)
        if slot.record is not None and slot.record.stage > 0:
            sharded_sq += squared  # each element lives on exactly one rank
        else:
            replicated_sq += squared  # every rank holds the same full gradient
    # Over the shard group: each element lives on one rank of it (HSDP replicas hold the same ones).
    mesh.shard.all_reduce_sum(sharded_sq, "all_reduce of the gradient norm (clip_grad_norm_)", timeout)
    total_sq = sharded_sq + replicated_sq
    if tp_mesh is not None:
        mesh.shard.subgroup(tp_mesh.get_group()).all_reduce_sum(
            total_sq, "all_reduce of the gradient norm over the tensor-parallel ranks (clip_grad_norm_)", timeout)
    if pipeline is not None:
        pipeline.all_reduce_sum(total_sq, "all_reduce of the gradient norm over the pipeline's stages "
                                          "(clip_grad_norm_)", timeout)
    total_norm = total_sq.sqrt().to(torch.float32)
    clip_coef = float(max_norm) / (total_norm.item() + 1e-6)
    if clip_coef >= 1.0:
        return total_norm, False
    for grad in grads:
        grad.mul_(clip_coef)
    for record in grads_on_disk:
        record.gradient.scale(clip_coef)  # applied when the step reads the gradient (its norm scaled now)
    return total_norm, True


def step_nvme(nvme, nvme_slots: list[tuple[Slot, int]], param_groups: list[dict], clipped: bool) -> None:
    """The NVMe-tier slots' Adam step, as one swap transaction: all of it lands, or the previous step stays.

    An I/O error leaves every swap file at the last good step
    (``nvme_copies=2``), the step counts and the shards it updated in memory
    are put back, and the error is raised.
    """
    steps_before = dict(nvme.steps)
    try:
        with swap_transaction(slot.record for slot, _ in nvme_slots):
            # The steps taken during backward that count commit with this transaction.
            early = nvme.early.commit(clipped) if nvme.early is not None else set()
            late = [(slot, group_index) for slot, group_index in nvme_slots if slot.record.uid not in early]
            nvme.step([slot for slot, _ in late], [param_groups[group_index] for _, group_index in late])
    except Exception as err:
        nvme.steps = steps_before
        try:
            nvme.restore_memory_shards()
        except AioError as restore_err:  # nvme_copies=1: the previous masters may be lost too
            err.add_note(f"The parameters kept in memory could not be put back to the previous step, "
                         f"so the model's state is unusable: {restore_err}")
        raise


def step_and_publish(store: ParamStore, inner: torch.optim.Optimizer, slots: list[Slot],
                     stepped_early: set[int] = frozenset()) -> None:
    """Step the in-memory masters of ``slots`` and write them back to their parameter tier.

    With parameters on NVMe the inner optimizer steps ~PUBLISH_CHUNK_BYTES
    of masters at a time, and each chunk's writes run while the next
    chunk steps (state is per parameter, so stepping a subset is the same
    arithmetic).  The writes form one transaction: all land or none.
    ``stepped_early``: ids of slots already stepped (during backward): only written back.
    """
    late = [slot for slot in slots if id(slot) not in stepped_early]
    early = [slot for slot in slots if id(slot) in stepped_early]
    if not any(slot.record is not None and slot.record.param_tier == "nvme" for slot in late):
        chunks = [late]
    else:
        chunks, chunk, chunk_bytes = [], [], 0
        for slot in late:
            chunk.append(slot)
            chunk_bytes += slot.master.numel() * slot.master.element_size()
            if chunk_bytes >= PUBLISH_CHUNK_BYTES:
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
        chunks.append(chunk)
    with swap_transaction(slot.record for slot in slots if slot.record is not None):
        try:
            for slot in early:
                if slot.record is not None and slot.record.stage > 0:
                    store.publish(slot.record, slot.master)
            for chunk in chunks:
                with _stepping_only(inner, chunk if len(chunks) > 1 or early else None):
                    inner.step()
                for slot in chunk:
                    if slot.record is not None and slot.record.stage > 0:
                        store.publish(slot.record, slot.master)
        finally:
            store.finish_publish()  # inside the transaction: its writes commit together


def publish_unwritten(store: ParamStore, unwritten: tuple[Slot, ...]) -> None:
    """Write the masters of a step that was applied but whose parameters did not reach their NVMe files."""
    with swap_transaction(slot.record for slot in unwritten):
        try:
            for slot in unwritten:
                store.publish(slot.record, slot.master)
        finally:
            store.finish_publish()


def swap_transaction(records) -> contextlib.ExitStack:
    """One all-or-nothing swap transaction over the engines these records write to."""
    stack = contextlib.ExitStack()
    for engine in {id(r.swap): r.swap for r in records if r.swap is not None}.values():
        stack.enter_context(engine.transaction())
    return stack


@contextlib.contextmanager
def _stepping_only(inner: torch.optim.Optimizer, slots: list[Slot] | None):
    """Within the block, ``inner.step()`` updates only these slots' masters (None: all)."""
    if slots is None:
        yield
        return
    wanted = {id(slot.master) for slot in slots}
    groups = inner.param_groups
    subset = [{**group, "params": [p for p in group["params"] if id(p) in wanted]} for group in groups]
    inner.param_groups = [group for group in subset if group["params"]]
    try:
        yield
    finally:
        inner.param_groups = groups


def make_inner(inner_class: type[torch.optim.Optimizer], defaults: dict, inner_groups: list[dict]):
    """The plain torch optimizer that does the arithmetic over the masters (``fused=True`` where torch can)."""
    kwargs = {}
    if not any(key in defaults for key in ("fused", "foreach")):
        kwargs["fused"] = True
    try:
        inner = inner_class(inner_groups, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        if not kwargs:
            raise
        inner = inner_class(inner_groups)  # fused unsupported for these tensors
    inner._zinf_inner = True  # steps zinf's masters: not refused by torch_patches.refuse_foreign_optimizers
    return inner


def make_early_host(store: ParamStore, inner_class: type, inner: torch.optim.Optimizer, slots: list[list[Slot]],
                    param_groups: list[dict]) -> EarlyHostAdam | None:
    """The early step of the slots whose state rests in host memory and may step during backward (option
    overlap_optimizer; ``slots``: per param group), or None.  Only over torch's fused Adam/AdamW: the early
    step runs that kernel, and is bit-equal to the step after backward only if that step runs it too."""
    early = [(slot.record, param_groups[index]) for index, group_slots in enumerate(slots) for slot in group_slots
             if slot.record is not None and slot.record.opt_tier == "cpu" and slot.record.step_in_backward]
    if not early or inner_class not in (torch.optim.Adam, torch.optim.AdamW) or not inner.defaults.get("fused"):
        return None
    masters = {slot.record.uid: slot.master for group_slots in slots for slot in group_slots if slot.record is not None}
    inner_ref = weakref.ref(inner)  # (the early step keeps no optimizer alive)

    def state_of(record):
        optimizer = inner_ref()
        state = optimizer.state.get(masters[record.uid]) if optimizer is not None else None
        if not state or "exp_avg" not in state:
            return None  # before its first step: torch makes the moments there
        return masters[record.uid], state["exp_avg"], state["exp_avg_sq"], state["step"]

    # The stepped copies take 12 bytes a parameter until opt.step(): at most a quarter of the memory free now.
    return EarlyHostAdam(store, inner_class is torch.optim.AdamW, early, state_of, (available_bytes() or 0) // 4)


def put_early_steps_in_place(early_host: EarlyHostAdam | None, inner: torch.optim.Optimizer, slots: list[Slot],
                             clipped: bool) -> set[int]:
    """At ``opt.step()``: the host-memory slots stepped during backward whose steps count get their stepped
    master and moments as their state; returns the ids of those slots (the others step after backward)."""
    if early_host is None:
        return set()
    stepped = early_host.commit(clipped)
    done = set()
    for slot in slots:
        taken = stepped.get(slot.record.uid) if slot.record is not None else None
        if taken is None:
            continue
        master, exp_avg, exp_avg_sq, step = taken
        slot.master.data = master  # (the same tensor object: the inner optimizer's key and the record's)
        state = inner.state[slot.master]
        state["exp_avg"], state["exp_avg_sq"], state["step"] = exp_avg, exp_avg_sq, step
        done.add(id(slot))
    return done


def invalidate_unwritten(slots: list[Slot]) -> tuple[Slot, ...]:
    """After a step whose parameter writes failed: make the NVMe-tier parameters of ``slots`` unreadable until
    the next step writes them (their files hold the previous step); returns those slots."""
    unwritten = tuple(slot for slot in slots if slot.record is not None and slot.record.stage > 0
                      and slot.record.param_tier == "nvme" and slot.record.owns_state)
    reason = ("opt.step() updated it in memory but could not write it (see the error that step raised); "
              "call opt.step() again once nvme_path has space: it writes the parameters, without stepping")
    for slot in unwritten:
        for key, _, _ in slot.record.swap_layout():
            slot.record.swap.invalidate(key, reason)
    return unwritten


def params_not_written(err: Exception) -> AioError:
    """The error of a step applied in memory whose parameters could not be written to their swap files."""
    return AioError(
        f"opt.step() was applied to the optimizer state in memory, but writing the updated parameters to "
        f"their NVMe swap files failed, so those parameters cannot be read until they are written: {err} "
        f"Free space under nvme_path (or point nvme_path at a bigger disk), then call opt.step() again: it "
        f"writes the parameters from the updated masters and does not step again.")
