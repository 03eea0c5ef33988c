"""Optimizers that step where zinf keeps the state: on this rank's fp32 master shards.

``zinf_compiler.optim.AdamW(model.parameters(), lr=...)`` is a regular
``torch.optim.Optimizer`` (param_groups, LR schedulers, ``state_dict``,
``zero_grad``).  Parameters are adopted by the backend at the first compiled
call, so the optimizer binds lazily at its first ``step``: each parameter the
store sharded is stepped through its flat master shard (the shard itself for
fp32, an fp32 copy for bf16/fp16) with the gradient shard the backward graph
reduced into the store; any other parameter is stepped as usual through
``param.grad``.  The work is done by a plain torch optimizer over those
tensors, with ``fused=True`` where torch supports it.

``state_dict()`` holds this rank's optimizer state for its shards (like ZeRO's
per-rank optimizer checkpoints); load it into the same world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterable

import torch

from zinf_compiler.runtime.aio import AioError
from zinf_compiler.runtime.early_adam import EarlyAdam
from zinf_compiler.runtime.host_memory import trim
from zinf_compiler.runtime.nvme_adam import NvmeAdam
from zinf_compiler.runtime.store import ParamRecord
from zinf_compiler.api import RUNTIME

# With parameters on NVMe, masters are stepped and written back this many bytes at a time.
PUBLISH_CHUNK_BYTES = 32 << 20


def _host_memory_bounded(records) -> bool:
    """Whether the step's end should give freed host memory back to the OS (``malloc_trim``).

    Yes where host memory holds less than the model (a tier on NVMe) or is a
    staging area beside an accelerator's (cpu tiers off a CPU device).  Not
    where the compute device is the CPU and nothing rests on NVMe: the pages
    freed by a step are the next step's gathers and gradients, and trimming
    them costs a page fault per page again every step, for a peak that stays
    the same (benchmarks/RESULTS.md, session 17: with the inline gather copy
    of runtime/copy_engine.py, the cpu tier's GPT step at world size 1 went
    from 0.550 s to 0.402 s, equal to the step without offload).
    """
    return any(r.param_tier == "nvme" or r.opt_tier == "nvme"
               or (r.device.type != "cpu" and (r.param_tier != "device" or r.opt_tier != "device"))
               for r in records)


@dataclasses.dataclass(eq=False)
class Slot:
    """One parameter as the optimizer steps it: the user's parameter, the store's record and the tensor stepped."""

    param: torch.nn.Parameter  # what the user passed
    record: ParamRecord | None  # the store's record; None for a parameter zinf did not shard
    master: torch.Tensor | None  # what the inner optimizer steps; None when the state rests on NVMe

    @property
    def state_on_nvme(self) -> bool:
        """Whether this slot's master and moments rest in NVMe swap files (stepped by NvmeAdam, not in memory)."""
        return self.master is None

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient the step reads: ``param.grad`` unsharded, else this rank's gradient shard (None: not its own)."""
        if self.record is None or self.record.stage == 0:
            return self.param.grad
        return self.record.grad_shard if self.record.owns_state else None


class ZinfOptimizer(torch.optim.Optimizer):
    """A torch optimizer of ``inner_class`` that steps zinf's master shards (see the module docstring).

    Subclasses (:class:`AdamW`, :class:`Adam`, :class:`SGD`) name the torch
    optimizer that does the arithmetic and take its arguments.
    """

    inner_class: type[torch.optim.Optimizer]

    def __init__(self, params: Iterable, **defaults: Any):
        from . import torch_patches

        torch_patches.install()  # clipping, zero_grad and foreign optimizers see zinf's shards
        super().__init__(params, defaults)
        meta = [p for group in self.param_groups for p in group["params"] if p.is_meta]
        if meta:
            # Usually made before the first forward: the place to say it, before Dynamo
            # stops at a generic device mismatch between meta weights and real inputs.
            raise ValueError(
                f"{len(meta)} parameter(s) given to {type(self).__name__} are on the meta device (the model was built "
                f"under `with torch.device('meta')`): call zinf_compiler.materialize(model, options, init_fn=...) "
                f"before torch.compile, to build them straight into their shards")
        self._inner: torch.optim.Optimizer | None = None
        self._slots: list[list[Slot]] = []
        self._nvme_slots: list[tuple[Slot, int]] = []  # (slot, param group index): state in swap files
        self._nvme: NvmeAdam | None = None
        self._pending_state: dict | None = None  # loaded before any parameter was sharded (see load_state_dict)
        # zinf.load's checkpoint (and parameter names): applied when the optimizer binds, and
        # again if it binds anew before its first step (parameters adopted after the load).
        self._checkpoint = None
        self._checkpoint_applied = False
        self._state_bytes = {"device": 0, "cpu": 0}
        # clip_grad_norm_ scaled this step's gradients: no step taken during backward counts.
        self._clipped = False
        # One optimizer, one model: its parameters share a ledger (memory_report, device_memory_limit).
        self._ledger = RUNTIME.store.group(p for group in self.param_groups for p in group["params"])
        RUNTIME.optimizers.add(self)
        # Dropped with its model: the moments it held stop counting (the dict, not self, is kept).
        weakref.finalize(self, _unaccount_state, self._state_bytes, self._ledger)

    # --- binding to the store ----------------------------------------------------

    def bind(self) -> None:
        """Bind to the store's shards now (done by the first step); a checkpoint given by ``zinf.load`` is applied."""
        self._bind_slots()
        if self._checkpoint is not None and not self._checkpoint_applied:
            from zinf_compiler.checkpoint import apply_optimizer_state

            apply_optimizer_state(self, *self._checkpoint)
            self._checkpoint_applied = True

    def attach_checkpoint(self, checkpoint, names: dict[int, str]) -> None:
        """``zinf.load``: take ``checkpoint``'s state at the next bind (kept until the first step).

        ``names``: each parameter's name in the checkpoint, by ``id(param)``.
        """
        if self._checkpoint is not None:
            self._checkpoint[0].close()
        self._checkpoint = (checkpoint, names)
        self._checkpoint_applied = False
        self._pending_state = None

    def _drop_checkpoint(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint[0].close()
            self._checkpoint = None

    def _bind_slots(self) -> None:
        if self._inner is not None:
            stale = any(slot.record is None and RUNTIME.store.lookup(slot.param) is not None
                        for group_slots in self._slots for slot in group_slots)
            if not stale:
                return
            stepped = self._inner.state or self._nvme is not None and self._nvme.steps
            if stepped and self._checkpoint is None:
                raise RuntimeError(
                    "zinf optimizer stepped before the model's first compiled forward: parameters "
                    "were adopted afterwards; run a forward/backward before the first opt.step()"
                )
            # Bound early (state_dict() before any forward) with nothing stepped yet: bind again
            # (a loaded checkpoint is applied again, to the new binding).
            self._inner, self._slots, self._nvme_slots, self._nvme = None, [], [], None
            self._checkpoint_applied = False
        inner_groups = []
        for group_index, group in enumerate(self.param_groups):
            group_slots = []
            for param in group["params"]:
                record = RUNTIME.store.lookup(param)
                if record is not None and record.stage > 0 and record.opt_tier == "nvme":
                    if self.inner_class not in (torch.optim.Adam, torch.optim.AdamW):
                        raise ValueError(
                            f"offload_optimizer='nvme' streams Adam/AdamW state from disk; "
                            f"{type(self).__name__} is not supported there (use offload_optimizer='cpu')"
                        )
                    self._nvme_slots.append((Slot(param, record, None), group_index))
                    continue
                if not param.is_floating_point():
                    continue  # integer and bool parameters have no gradient: nothing to step
                master = param if record is None or record.stage == 0 else record.master
                group_slots.append(Slot(param, record, master))
            self._slots.append(group_slots)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": [slot.master for slot in group_slots]})
        meshes = {id(record.mesh): record.mesh for record in self._records()}
        if len(meshes) > 1:
            raise ValueError(
                "zinf optimizer over parameters sharded over different ranks (models compiled with different "
                f"mesh options: {', '.join(mesh.describe() for mesh in meshes.values())}); its gradient norm and "
                "fp16 overflow checks span one group of ranks: use one optimizer per mesh")
        self._inner = self._make_inner(inner_groups)
        if self._nvme_slots:
            self._nvme = NvmeAdam(RUNTIME.store, decoupled_weight_decay=self.inner_class is torch.optim.AdamW)
            early = [(slot.record, self.param_groups[group_index]) for slot, group_index in self._nvme_slots
                     if slot.record.step_in_backward]
            if early:
                self._nvme.early = EarlyAdam(self._nvme, early)
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            self._load_inner(pending)

    def _make_inner(self, inner_groups: list[dict]) -> torch.optim.Optimizer:
        kwargs = {}
        if not any(key in self.defaults for key in ("fused", "foreach")):
            kwargs["fused"] = True
        try:
            inner = self.inner_class(inner_groups, **kwargs)
        except (RuntimeError, ValueError, TypeError):
            if not kwargs:
                raise
            inner = self.inner_class(inner_groups)  # fused unsupported for these tensors
        inner._zinf_inner = True  # steps zinf's masters: not refused by refuse_foreign_optimizers
        return inner

    def slots(self) -> list[Slot]:
        """Every slot, the nvme-tier ones included (empty until bound)."""
        return [slot for group_slots in self._slots for slot in group_slots] + [s for s, _ in self._nvme_slots]

    def _memory_slots(self) -> list[Slot]:
        """The slots whose master the inner torch optimizer steps."""
        return [slot for group_slots in self._slots for slot in group_slots]

    def _records(self) -> list[ParamRecord]:
        return [slot.record for slot in self.slots() if slot.record is not None]

    def _mesh(self):
        """The ranks this optimizer's parameters are sharded over (one mesh: see _bind_slots)."""
        records = self._records()
        return records[0].mesh if records else RUNTIME.store.comm.mesh()

    def _reduce_full_grads(self) -> None:
        """Average the gradients no graph averaged: stage 1's, and those of parameters no graph used."""
        RUNTIME.store.reduce_full_grads([r for r in self._records() if r.stage == 1])
        self._average_uncaptured_grads()

    def _average_uncaptured_grads(self) -> None:
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
        everyone = self._mesh().everyone
        if everyone.world_size == 1:
            return
        params = [slot.param for slot in self._memory_slots() if slot.record is None and slot.param.requires_grad]
        if not params:
            return
        device = params[0].device
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
        # One all-reduce: every gradient (zeros where a rank has none), then a has-gradient flag per parameter.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, dtype)
                          for p in params]
                         + [torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)])
        records = self._records()
        everyone.all_reduce_avg(flat, "all_reduce of the gradients of parameters no graph used",
                                records[0].ledger.collective_timeout if records else None).wait()
        offset, present = 0, flat[-len(params):].tolist()
        for param, on_some_rank in zip(params, present):
            numel = param.numel()
            averaged = flat[offset : offset + numel].view_as(param).to(param.device, param.dtype)
            param.grad = averaged if on_some_rank else None
            offset += numel

    # --- the torch.optim.Optimizer interface -------------------------------------

    # Slots whose last step was applied in memory but whose parameters could
    # not be written to their NVMe swap files; the next step() writes them.
    _params_unwritten: tuple = ()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimizer step.  A failed NVMe swap write never leaves a mix of two steps:

        * A gradient the backward could not write (disk full): the step is
          refused (:class:`AioError`) before anything changes.  Free space,
          call ``zero_grad()`` and run the backward again.
        * A failed write of the optimizer state on NVMe
          (``offload_optimizer="nvme"``): the step is **not applied**.  Every
          swap file keeps the previous step (``nvme_copies=2``), and the
          shards it had updated in memory and its step counts are put back.
          Free space, then call ``step()`` again (it steps from the same
          gradients) or ``zero_grad()`` to skip the step.  With
          ``nvme_copies=1`` the keys it overwrote are lost: the next step
          refuses with an error saying so.
        * A failed write of the updated parameters only (``offload_param=
          "nvme"`` with the optimizer state in memory): the step **is
          applied** (masters and moments in memory are updated), and the
          parameters cannot be read until written.  Free space, then call
          ``step()`` again: it writes them from the masters and does not
          step again.
        """
        RUNTIME.tracer.mark("optimizer step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.bind()
        self._drop_checkpoint()  # bound at a step: the binding is final, the loaded state is in it

        def params_not_written(err: Exception) -> AioError:
            return AioError(
                f"opt.step() was applied to the optimizer state in memory, but writing the updated parameters to "
                f"their NVMe swap files failed, so those parameters cannot be read until they are written: {err} "
                f"Free space under nvme_path (or point nvme_path at a bigger disk), then call opt.step() again: it "
                f"writes the parameters from the updated masters and does not step again.")

        if self._params_unwritten:
            # The last step was applied; only its parameters are missing on disk.
            unwritten = self._params_unwritten
            try:
                with _swap_transaction(slot.record for slot in unwritten):
                    try:
                        for slot in unwritten:
                            RUNTIME.store.publish(slot.record, slot.master)
                    finally:
                        RUNTIME.store.finish_publish()
            except AioError as err:
                raise params_not_written(err) from err
            self._params_unwritten = ()
            RUNTIME.store.refresh_full_params(self._records())
            self._account_state()
            trim()
            RUNTIME.tracer.step_done()
            return loss
        RUNTIME.store.sync_written_params(self._records())  # stages 1-2: the user may have loaded new weights
        self._reduce_full_grads()
        fp16_records = [r for r in self._records() if r.compute_dtype == torch.float16]
        if fp16_records:
            # On the compute device: the shard may rest on the CPU, which NCCL cannot reduce.
            # The scale of this optimizer's model (its parameters share one ledger: ParamStore.group).
            ledger = fp16_records[0].ledger
            if ledger.fp16_scaler.should_skip_step(self._mesh().everyone, fp16_records[0].device, ledger.collective_timeout):
                # An fp16 gradient overflowed on some rank: no update this step.
                RUNTIME.store.drop_grads(self._records())
                RUNTIME.tracer.step_done()
                return loss
        for slot in self._memory_slots():
            if slot.master is not slot.param:
                slot.master.grad = slot.grad
        self._sync_hyperparameters()
        if self._nvme is not None:
            # First the state on disk, as one transaction: an I/O error here
            # leaves every swap file at the last good step (nvme_copies=2), the
            # inner optimizer's state has not been touched yet, and the shards
            # it updated in memory are put back below.
            steps_before = dict(self._nvme.steps)
            try:
                with _swap_transaction(slot.record for slot, _ in self._nvme_slots):
                    # The steps taken during backward that count commit with this transaction.
                    early = self._nvme.early.commit(self._clipped) if self._nvme.early is not None else set()
                    late = [(slot, group_index) for slot, group_index in self._nvme_slots
                            if slot.record.uid not in early]
                    self._nvme.step([slot for slot, _ in late],
                                    [self.param_groups[group_index] for _, group_index in late])
            except Exception as err:
                self._nvme.steps = steps_before
                try:
                    self._nvme.restore_memory_shards()
                except AioError as restore_err:  # nvme_copies=1: the previous masters may be lost too
                    err.add_note(f"The parameters kept in memory could not be put back to the previous step, "
                                 f"so the model's state is unusable: {restore_err}")
                raise
        try:
            self._step_and_publish()
        except AioError as err:
            # The in-memory step is complete (failed writes inside the transaction
            # only surface at its end); the parameters on disk are the previous
            # step's: make them unreadable until the next step() writes them.
            unwritten = tuple(slot for slot in self._memory_slots() if slot.record is not None
                              and slot.record.stage > 0 and slot.record.param_tier == "nvme"
                              and slot.record.owns_state)
            if not unwritten:
                raise
            reason = ("opt.step() updated it in memory but could not write it (see the error that step raised); "
                      "call opt.step() again once nvme_path has space: it writes the parameters, without stepping")
            for slot in unwritten:
                for key, _, _ in slot.record.swap_layout():
                    slot.record.swap.invalidate(key, reason)
            self._params_unwritten = unwritten
            raise params_not_written(err) from err
        self._clipped = False
        RUNTIME.store.refresh_full_params(self._records())
        self._account_state()
        if _host_memory_bounded(self._records()):
            trim()  # hand this step's freed staging back: host memory is what offloading bounds
        RUNTIME.tracer.step_done()
        return loss

    def _step_and_publish(self) -> None:
        """Step the in-memory masters and write them back to their parameter tier.

        With parameters on NVMe the inner optimizer steps ~PUBLISH_CHUNK_BYTES
        of masters at a time, and each chunk's writes run while the next
        chunk steps (state is per parameter, so stepping a subset is the same
        arithmetic).  The writes form one transaction: all land or none.
        """
        slots = self._memory_slots()
        if not any(slot.record is not None and slot.record.param_tier == "nvme" for slot in slots):
            chunks = [slots]
        else:
            chunks, chunk, chunk_bytes = [], [], 0
            for slot in slots:
                chunk.append(slot)
                chunk_bytes += slot.master.numel() * slot.master.element_size()
                if chunk_bytes >= PUBLISH_CHUNK_BYTES:
                    chunks.append(chunk)
                    chunk, chunk_bytes = [], 0
            chunks.append(chunk)
        with _swap_transaction(slot.record for slot in slots if slot.record is not None):
            try:
                for chunk in chunks:
                    with _stepping_only(self._inner, chunk if len(chunks) > 1 else None):
                        self._inner.step()
                    for slot in chunk:
                        if slot.record is not None and slot.record.stage > 0:
                            RUNTIME.store.publish(slot.record, slot.master)
            finally:
                RUNTIME.store.finish_publish()  # inside the transaction: its writes commit together

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` and every gradient shard zinf holds for these parameters (bound or not)."""
        super().zero_grad(set_to_none)  # full gradients in param.grad (unsharded params, stage 1)
        self._clipped = False
        for slot in self._memory_slots():
            if slot.master is not slot.param:
                slot.master.grad = None
        # Not through the slots: before the first step they are not bound yet,
        # and gradient shards from a backward must still go.
        records = (RUNTIME.store.lookup(p) for group in self.param_groups for p in group["params"])
        RUNTIME.store.drop_grads([r for r in records if r is not None])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm across all ranks; returns the norm before clipping.

        Equals ``torch.nn.utils.clip_grad_norm_`` on the full, averaged gradients.
        """
        if norm_type != 2.0:
            raise ValueError("zinf clip_grad_norm_ supports norm_type=2.0 only")
        self.bind()
        self._reduce_full_grads()
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        # float64 sums; on the parameters' device, where NCCL can reduce them.
        sharded_sq = torch.zeros((), dtype=torch.float64, device=device)
        replicated_sq = torch.zeros((), dtype=torch.float64, device=device)
        grads = []
        grads_on_disk = []
        for slot in self.slots():
            if slot.record is not None and slot.record.grad_on_disk:
                # An nvme-tier gradient: its norm was taken as it was written.
                grads_on_disk.append(slot.record)
                sharded_sq += slot.record.grad_sq_norm
                continue
            grad = slot.grad
            if grad is None:
                continue
            grads.append(grad)
            squared = grad.detach().double().pow(2).sum().to(device)
            if slot.record is not None and slot.record.stage > 0:
                sharded_sq += squared  # each element lives on exactly one rank
            else:
                replicated_sq += squared  # every rank holds the same full gradient
        records = self._records()
        # Over the shard group: each element lives on one rank of it (HSDP replicas hold the same ones).
        self._mesh().shard.all_reduce_sum(sharded_sq, "all_reduce of the gradient norm (clip_grad_norm_)",
                                  records[0].ledger.collective_timeout if records else None)
        total_norm = (sharded_sq + replicated_sq).sqrt().to(torch.float32)
        clip_coef = float(max_norm) / (total_norm.item() + 1e-6)
        if clip_coef < 1.0:
            self._clipped = True
            for grad in grads:
                grad.mul_(clip_coef)
            for record in grads_on_disk:
                record.grad_multiplier *= clip_coef  # applied when the step reads the gradient
        return total_norm

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for its shards, with the world size and rank it belongs to (``"zinf"``).

        Loads only into the same world size; ``zinf.save`` writes a checkpoint
        that reshards, and is the one that holds NVMe-tier state.
        """
        self.bind()
        if self._nvme_slots:
            raise NotImplementedError(
                "state_dict() of an optimizer whose state rests on NVMe (offload_optimizer='nvme') is not "
                "built yet; use offload_optimizer='cpu' or 'none' to checkpoint optimizer state"
            )
        self._sync_hyperparameters()
        state = self._inner.state_dict()
        shard = self._mesh().shard
        state["zinf"] = {"world_size": shard.world_size, "rank": shard.rank}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of the same world size (kept until binding if nothing is sharded yet)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("zinf", None)
        if saved is not None and saved["world_size"] != self._mesh().shard.world_size:
            raise ValueError(
                f"optimizer state was saved at world size {saved['world_size']}, this run has "
                f"{self._mesh().shard.world_size}; per-rank optimizer shards only load into the same world size"
            )
        if self._inner is None and not any(RUNTIME.store.lookup(p) is not None
                                           for group in self.param_groups for p in group["params"]):
            # Before the model's first compiled call nothing is sharded yet: the state
            # belongs to shards that do not exist.  Load it when the optimizer binds.
            self._pending_state = state_dict
            return
        self.bind()
        self._load_inner(state_dict)

    def _load_inner(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        self._account_state()

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    # --- the state, for zinf_compiler.checkpoint (it reads and restores only through these) ----------

    @property
    def bound(self) -> bool:
        """Whether the optimizer has bound its parameters to the store's shards (see :meth:`bind`)."""
        return self._inner is not None

    def memory_state(self, slot: Slot) -> dict[str, Any]:
        """The state the in-memory optimizer holds for ``slot``'s master (``{}``: none yet, or on NVMe)."""
        if self._inner is None or slot.state_on_nvme:
            return {}
        return self._inner.state.get(slot.master, {})

    def nvme_steps(self, slot: Slot) -> int:
        """Adam steps an NVMe-tier ``slot`` has taken (0: none); its moments are in its record's swap files."""
        if self._nvme is None or not slot.state_on_nvme:
            return 0
        return self._nvme.steps.get(slot.record.uid, 0)

    def restore_state(self, memory_states: dict[Slot, dict[str, Any]], nvme_steps: dict[Slot, int]) -> None:
        """Replace the whole state of a bound optimizer.

        ``memory_states``: the in-memory state of each slot stepped in memory
        (a slot left out starts fresh).  ``nvme_steps``: the step count of each
        NVMe-tier slot whose moments the caller has written to its swap files
        (left out, or 0: starts fresh).
        """
        if self._inner is None:
            raise RuntimeError("restore_state() of an optimizer that is not bound yet: call bind() first")
        inner_state = self._inner.state_dict()
        # The inner optimizer numbers its tensors in the order of its parameter groups: the memory slots'.
        inner_state["state"] = {index: memory_states[slot] for index, slot in enumerate(self._memory_slots())
                                if memory_states.get(slot)}
        self._inner.load_state_dict(inner_state)
        for slot, _ in self._nvme_slots:
            steps = nvme_steps.get(slot, 0)
            if steps:
                self._nvme.steps[slot.record.uid] = steps
            else:
                self._nvme.steps.pop(slot.record.uid, None)
        self._account_state()

    # --- accounting --------------------------------------------------------------

    def state_bytes(self, params: set[int] | None = None) -> dict[str, int]:
        """Bytes of optimizer state per tier for ``params`` (ids), or all.

        Counts the moments (and step counters) the inner optimizer holds, on
        the device or the CPU, and the moments in NVMe swap files.
        Separate fp32 masters are the store's (see ``memory_report``).
        """
        per_tier = {"device": 0, "cpu": 0, "nvme": 0}
        if self._inner is None:
            return per_tier
        for slot in self._memory_slots():
            if params is not None and id(slot.param) not in params:
                continue
            tier = slot.record.opt_tier if slot.record is not None and slot.record.stage > 0 else "device"
            for value in self._inner.state.get(slot.master, {}).values():
                if isinstance(value, torch.Tensor):
                    per_tier[tier] += value.numel() * value.element_size()
        if self._nvme is not None:
            records = [s.record for s, _ in self._nvme_slots if params is None or id(s.param) in params]
            per_tier["nvme"] += self._nvme.state_bytes_on_disk(records)
        return per_tier

    def _account_state(self) -> None:
        held = self.state_bytes()
        for tier in ("device", "cpu"):
            RUNTIME.store.add_optimizer_bytes(tier, held[tier] - self._state_bytes[tier], ledger=self._ledger.root())
            self._state_bytes[tier] = held[tier]


def _unaccount_state(state_bytes: dict[str, int], ledger) -> None:
    for tier, nbytes in state_bytes.items():
        RUNTIME.store.add_optimizer_bytes(tier, -nbytes, ledger=ledger.root())
        state_bytes[tier] = 0


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


def _swap_transaction(records) -> contextlib.ExitStack:
    """One all-or-nothing swap transaction over the engines these records write to."""
    stack = contextlib.ExitStack()
    for engine in {id(r.swap): r.swap for r in records if r.swap is not None}.values():
        stack.enter_context(engine.transaction())
    return stack


def _grad_outside_param(record: ParamRecord | None) -> bool:
    """Whether ``param.grad`` misses this parameter's (averaged) gradient: it lives in zinf's shards
    (stages 2-3), or stage 1 with several ranks has not averaged it yet."""
    return record is not None and (record.stage >= 2 or (record.stage == 1 and record.world_size > 1))


def refuse_foreign_optimizers(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before any ``torch.optim`` step: refuse one that would silently miss zinf's gradients.

    At stages 2-3 a sharded parameter's gradient lives in zinf's store
    (``param.grad`` stays None), so a plain torch optimizer would step nothing;
    at stage 1 with several ranks it would step un-averaged gradients.  Its
    step raises instead, naming the zinf optimizer to use.
    """
    if isinstance(optimizer, ZinfOptimizer) or getattr(optimizer, "_zinf_inner", False):
        return
    RUNTIME.store.collect()
    for group in optimizer.param_groups:
        for param in group["params"]:
            record = RUNTIME.store.lookup(param)
            if not _grad_outside_param(record):
                continue
            name = type(optimizer).__name__
            suggestion = name if name in ("AdamW", "Adam", "SGD") else "AdamW"
            raise RuntimeError(
                f"{type(optimizer).__module__}.{name} cannot train parameter {record.name}: at zinf stage "
                f"{record.stage} its gradient and optimizer state live in zinf's shards (param.grad stays None), "
                f"so this optimizer would update nothing. Use zinf_compiler.optim.{suggestion}(model.parameters(), "
                f"...) (AdamW, Adam or SGD), which steps the shards and takes the same arguments"
            )


# ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` reads ``param.grad``; at
# stages 2-3 that is None, so it would return 0 and clip nothing, silently.  zinf
# puts a guard in front of torch's two clipping functions: it hands zinf's
# parameters to the zinf optimizer holding them and passes every other call to
# torch's own code (zinf_compiler/torch_patches.py installs them).
TORCH_CLIP: dict[str, Callable] = {}  # name -> torch's function body, which the guards call


def _zinf_params_in(parameters) -> tuple[list[torch.Tensor], list[ParamRecord]]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not RUNTIME.store.records():
        return params, []
    return params, [r for r in map(RUNTIME.store.lookup, params) if _grad_outside_param(r)]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also sees zinf's gradient shards (same arguments)."""
    params, records = _zinf_params_in(parameters)
    if not records:
        return TORCH_CLIP["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    trainable = {id(p) for p in params if p.requires_grad}
    for optimizer in live_optimizers():
        held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        if held == trainable:
            total_norm = optimizer.clip_grad_norm_(max_norm, norm_type)
            if error_if_nonfinite and not torch.isfinite(total_norm):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                                   f"non-finite, so it cannot be clipped (error_if_nonfinite=True)")
            return total_norm
    raise RuntimeError(
        f"torch.nn.utils.clip_grad_norm_ cannot see the gradient of parameter {records[0].name}: at zinf stage "
        f"{records[0].stage} it lives in zinf's shards (param.grad is not the averaged gradient), and no zinf "
        f"optimizer holds exactly the trainable parameters given. Pass the same parameters as to your "
        f"zinf_compiler.optim optimizer (e.g. model.parameters()), or call optimizer.clip_grad_norm_(max_norm)")


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, refused for zinf-sharded gradients (it would clip nothing)."""
    params, records = _zinf_params_in(parameters)
    if records:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_value_ cannot clip the gradient of parameter {records[0].name}: at zinf "
            f"stage {records[0].stage} it lives in zinf's shards, so it would clip nothing. zinf clips by norm: "
            f"call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or optimizer.clip_grad_norm_")
    return TORCH_CLIP["clip_grad_value_"](params, clip_value, foreach)


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, refused for zinf-sharded gradients: the norm the
    caller took with ``get_total_norm`` over ``param.grad`` missed them, and the scaling would too."""
    params, records = _zinf_params_in(parameters)
    if records:
        raise RuntimeError(
            f"torch.nn.utils.clip_grads_with_norm_ cannot scale the gradient of parameter {records[0].name}: at "
            f"zinf stage {records[0].stage} it lives in zinf's shards (param.grad is not it, so a norm taken with "
            f"get_total_norm over param.grad misses it too). Call torch.nn.utils.clip_grad_norm_(model.parameters(), "
            f"max_norm) or optimizer.clip_grad_norm_(max_norm): both return the global norm")
    return TORCH_CLIP["_clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


def live_optimizers() -> list[ZinfOptimizer]:
    """Every zinf optimizer still alive in this process (the clipping guard finds the one holding the parameters)."""
    return list(RUNTIME.optimizers)


class AdamW(ZinfOptimizer):
    """``torch.optim.AdamW`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class Adam(ZinfOptimizer):
    """``torch.optim.Adam`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class SGD(ZinfOptimizer):
    """``torch.optim.SGD`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.SGD

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **kwargs)



# ``model.zero_grad()`` (the HF Trainer's call, and many loops') clears ``param.grad``;
# at stages 2-3 zinf keeps gradients in sharded buffers instead, which it would
# leave alone: the next step would add two backwards' gradients up, silently.
TORCH_MODULE_ZERO_GRAD = torch.nn.Module.zero_grad  # torch's own (torch_patches.install sets it)


def module_zero_grad_with_shards(self: torch.nn.Module, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad`` that also discards the zinf gradient shards of the module's parameters."""
    TORCH_MODULE_ZERO_GRAD(self, set_to_none)
    if RUNTIME.store.records():
        records = [record for record in map(RUNTIME.store.lookup, self.parameters()) if record is not None]
        if records:
            RUNTIME.store.drop_grads(records)
