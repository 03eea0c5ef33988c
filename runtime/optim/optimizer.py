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
:meth:`ShardOptimizer.save_state` / :meth:`~ShardOptimizer.load_state` give
and take the state slot by slot, wherever it rests (memory or NVMe swap
files): ``zinf.save`` / ``zinf.load`` use them, and never read a swap key.

The optimizer is the runtime's (runtime/optim/): this module its body, state.py the
slots and where their state rests, step.py the parts of a step, nvme_adam.py the
step streamed from NVMe, early_adam.py / early_host_adam.py the steps taken during
backward.  It is handed the parts it uses (:class:`OptimizerParts`); the public
classes (zinf_compiler/optim.py, the entry layer) hand them on from the process's
runtime, and install the guards that route torch's clipping and ``zero_grad`` to
it (zinf_compiler/torch_patches.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import torch

from ..aio import AioError
from ..host_memory import trim
from ..model_group import agree_on_skip
from ..store import ParamRecord, ParamStore
from ..trace import Tracer
from .early_adam import EarlyAdam
from .early_host_adam import EarlyHostAdam
from .nvme_adam import NvmeAdam
from .state import (NVME_MOMENTS, CountedState, Slot, StreamedState, count_state_bytes, read_moment,
                          unaccount_state, write_moment)
from .step import (average_uncaptured_grads, clip_grad_norm, host_memory_bounded, invalidate_unwritten,
                         make_early_host, make_inner, params_not_written, publish_unwritten,
                         put_early_steps_in_place, step_and_publish, step_nvme)

__all__ = ["OptimizerParts", "ShardOptimizer", "Slot", "StreamedState"]


@dataclasses.dataclass(frozen=True)
class OptimizerParts:
    """What an optimizer is handed: the store of the shards it steps, the tracer its steps are marked in, and
    the set of live optimizers it joins (torch's clipping finds the one holding a model's parameters there)."""

    store: ParamStore
    tracer: Tracer
    optimizers: "weakref.WeakSet"


class ShardOptimizer(torch.optim.Optimizer):
    """A torch optimizer of ``inner_class`` that steps zinf's master shards (see the module docstring).

    Subclasses name the torch optimizer that does the arithmetic (``inner_class``) and take its arguments;
    zinf_compiler/optim.py's ``ZinfOptimizer`` is the public one, which hands the process's parts.
    """

    inner_class: type[torch.optim.Optimizer]

    def __init__(self, params: Iterable, parts: OptimizerParts, **defaults: Any):
        self._store, self._tracer = parts.store, parts.tracer
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
        self._early_host: EarlyHostAdam | None = None  # host-memory slots stepped during backward
        self._pending_state: dict | None = None  # loaded before any parameter was sharded (see load_state_dict)
        # zinf.load's saved state (see attach_state): applied when the optimizer binds, and
        # again if it binds anew before its first step (parameters adopted after the load).
        self._saved_state = None
        self._saved_state_applied = False
        self._counted = CountedState()  # moment bytes counted per model group (see _account_state)
        # clip_grad_norm_ scaled this step's gradients: no step taken during backward counts.
        self._clipped = False
        # One optimizer, one model: its parameters not yet in a model group join the group the others share
        # (else a new one), which the compile that adopts them keeps (see ParamStore.claim).
        self._store.claim(p for group in self.param_groups for p in group["params"])
        parts.optimizers.add(self)
        # Dropped with its model: the moments it held stop counting (the dict, not self, is kept).
        weakref.finalize(self, unaccount_state, self._store, self._counted.by_group)

    # --- binding to the store ----------------------------------------------------

    def bind(self) -> None:
        """Bind to the store's shards now (done by the first step); a state given by ``zinf.load`` is applied."""
        self._bind_slots()
        if self._saved_state is not None and not self._saved_state_applied:
            self._saved_state.apply(self)
            self._saved_state_applied = True

    def attach_state(self, saved) -> None:
        """``zinf.load``: take a saved state at the next bind (kept until the first step).

        ``saved`` has ``apply(optimizer)``, called on the bound optimizer (it
        calls :meth:`load_state`), and ``close()``, called once the binding is
        final (the first step) or another state replaces it.
        """
        if self._saved_state is not None:
            self._saved_state.close()
        self._saved_state = saved
        self._saved_state_applied = False
        self._pending_state = None

    def _drop_saved_state(self) -> None:
        if self._saved_state is not None:
            self._saved_state.close()
            self._saved_state = None

    def _bind_slots(self) -> None:
        if self._inner is not None:
            stale = any(slot.record is None and self._store.lookup(slot.param) is not None
                        for group_slots in self._slots for slot in group_slots)
            if not stale:
                return
            stepped = self._inner.state or self._nvme is not None and self._nvme.steps
            if stepped and self._saved_state is None:
                raise RuntimeError(
                    "zinf optimizer stepped before the model's first compiled forward: parameters "
                    "were adopted afterwards; run a forward/backward before the first opt.step()"
                )
            # Bound early (state_dict() before any forward) with nothing stepped yet: bind again
            # (a loaded checkpoint is applied again, to the new binding).
            self._inner, self._slots, self._nvme_slots, self._nvme = None, [], [], None
            self._early_host = None
            self._saved_state_applied = False
        inner_groups = []
        for group_index, group in enumerate(self.param_groups):
            group_slots = []
            for param in group["params"]:
                record = self._store.lookup(param)
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
        self._inner = make_inner(self.inner_class, self.defaults, inner_groups)
        if self._nvme_slots:
            self._nvme = NvmeAdam(self._store, decoupled_weight_decay=self.inner_class is torch.optim.AdamW,
                                  records=[slot.record for slot, _ in self._nvme_slots])
            early = [(slot.record, self.param_groups[group_index]) for slot, group_index in self._nvme_slots
                     if slot.record.step_in_backward]
            if early:
                self._nvme.early = EarlyAdam(self._nvme, early)
        self._early_host = make_early_host(self._store, self.inner_class, self._inner, self._slots, self.param_groups)
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            self._load_inner(pending)


    def slots(self) -> list[Slot]:
        """Every slot, the nvme-tier ones included (empty until bound)."""
        return [slot for group_slots in self._slots for slot in group_slots] + [s for s, _ in self._nvme_slots]

    def _memory_slots(self) -> list[Slot]:
        """The slots whose master the inner torch optimizer steps."""
        return [slot for group_slots in self._slots for slot in group_slots]

    def _params(self) -> Iterator[torch.Tensor]:
        """This optimizer's parameters, as its param groups hold them."""
        return (param for group in self.param_groups for param in group["params"])

    def _records(self) -> list[ParamRecord]:
        return [slot.record for slot in self.slots() if slot.record is not None]

    def _mesh(self):
        """The ranks this optimizer's parameters are sharded over (one mesh: see _bind_slots)."""
        records = self._records()
        return records[0].mesh if records else self._store.comm.mesh()

    def _collective_timeout(self):
        """This optimizer's model's collective timeout (None: the communicator's)."""
        records = self._records()
        return records[0].group.collective_timeout if records else None

    def _reduce_full_grads(self) -> None:
        """Average the gradients no graph averaged: stage 1's, those of parameters no graph used, and a stage-2
        parameter's ``param.grad`` (its graph ran without the partition pass, or set by hand: never ignored)."""
        self._store.reduce_full_grads([r for r in self._records()
                                       if r.stage == 1 or (r.stage == 2 and r.param.grad is not None)])
        average_uncaptured_grads(self._memory_slots(), self._mesh(), self._collective_timeout())

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
        self._tracer.mark("optimizer step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.bind()
        self._drop_saved_state()  # bound at a step: the binding is final, the loaded state is in it

        if self._params_unwritten:
            # The last step was applied; only its parameters are missing on disk.
            try:
                publish_unwritten(self._store, self._params_unwritten)
            except AioError as err:
                raise params_not_written(err) from err
            self._params_unwritten = ()
            self._store.refresh_full_params(self._records())
            self._account_state()
            trim()
            self._tracer.step_done(self._params())
            return loss
        self._store.sync_written_params(self._records())  # stages 1-2: the user may have loaded new weights
        self._reduce_full_grads()
        fp16_records = [r for r in self._records() if r.compute_dtype == torch.float16]
        if fp16_records:
            # On the compute device: the shard may rest on the CPU, which NCCL cannot reduce.
            # The scales of this optimizer's model groups (one, unless its model was compiled in parts before
            # the optimizer existed): one decision for all of them, which keeps them in step.
            scalers = [group.fp16_scaler for group in self._store.groups_of(r.param for r in fp16_records)]
            if agree_on_skip(scalers, self._mesh().everyone, fp16_records[0].device, self._collective_timeout()):
                # An fp16 gradient overflowed on some rank: no update this step.
                self._store.drop_grads(self._records())
                self._tracer.step_done(self._params())
                return loss
        for slot in self._memory_slots():
            if slot.master is not slot.param:
                slot.master.grad = slot.grad
        self._sync_hyperparameters()
        if self._nvme is not None:
            # First the state on disk, as one transaction: on an I/O error the
            # inner optimizer's state has not been touched yet.
            step_nvme(self._nvme, self._nvme_slots, self.param_groups, self._clipped)
        stepped_early = put_early_steps_in_place(self._early_host, self._inner, self._memory_slots(), self._clipped)
        try:
            step_and_publish(self._store, self._inner, self._memory_slots(), stepped_early)
        except AioError as err:
            # The in-memory step is complete (failed writes inside the transaction
            # only surface at its end); the parameters on disk are the previous
            # step's: make them unreadable until the next step() writes them.
            unwritten = invalidate_unwritten(self._memory_slots())
            if not unwritten:
                raise
            self._params_unwritten = unwritten
            raise params_not_written(err) from err
        self._clipped = False
        self._store.refresh_full_params(self._records())
        self._account_state()
        if host_memory_bounded(self._records()):
            trim()  # hand this step's freed staging back: host memory is what offloading bounds
        self._tracer.step_done(self._params())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` and every gradient shard zinf holds for these parameters (bound or not)."""
        super().zero_grad(set_to_none)  # full gradients in param.grad (unsharded params, stage 1)
        self._clipped = False
        for slot in self._memory_slots():
            if slot.master is not slot.param:
                slot.master.grad = None
        # Not through the slots: before the first step they are not bound yet,
        # and gradient shards from a backward must still go.
        records = (self._store.lookup(p) for group in self.param_groups for p in group["params"])
        self._store.drop_grads([r for r in records if r is not None])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm across all ranks; returns the norm before clipping.  Equals
        ``torch.nn.utils.clip_grad_norm_`` on the whole model's full, averaged gradients, also over tensor-
        parallel parameters and a :class:`ZinfPipelineStage`'s stages (optim_step.clip_grad_norm)."""
        if norm_type != 2.0:
            raise ValueError("zinf clip_grad_norm_ supports norm_type=2.0 only")
        self.bind()
        self._reduce_full_grads()
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        pipeline = next((r.group.pipeline for r in self._records() if r.group.pipeline is not None), None)
        total_norm, clipped = clip_grad_norm(self.slots(), self._mesh(), device, max_norm, self._collective_timeout(),
                                             pipeline)
        self._clipped = self._clipped or clipped
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
        if self._inner is None and not any(self._store.lookup(p) is not None
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
        self._account_state(force=True)

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    # --- the state, slot by slot (zinf.save and zinf.load read and restore it only through these) ----------

    @property
    def bound(self) -> bool:
        """Whether the optimizer has bound its parameters to the store's shards (see :meth:`bind`)."""
        return self._inner is not None

    def save_state(self, slot: Slot) -> Iterator[tuple[str, Any]]:
        """``slot``'s optimizer state on this rank, kind by kind: ``(kind, value)`` (nothing: none yet).

        ``value`` is a scalar (a Python value or a 0-dim tensor, e.g.
        ``step``), a tensor this rank holds in memory (laid out like the
        slot's master: this rank's local shard of a sharded parameter), or a
        :class:`StreamedState`: a moment of an NVMe-tier slot, streamed from
        its swap files a sub-group at a time, never whole in memory.  The
        master itself is the parameter's value: the store streams it from
        wherever it rests (``ParamStore.local_value_chunks``).
        """
        if not slot.state_on_nvme:
            if self._inner is not None:
                yield from self._inner.state.get(slot.master, {}).items()
            return
        steps = self._nvme.steps.get(slot.record.uid, 0) if self._nvme is not None else 0
        if not steps or not slot.record.owns_state:
            return
        yield "step", torch.tensor(float(steps), dtype=torch.float32)
        for kind in NVME_MOMENTS:
            yield kind, read_moment(self._store, slot.record, kind)

    @torch.no_grad()
    def load_state(self, states: Iterable[tuple[Slot, Mapping[str, Any]]]) -> None:
        """Replace the whole state of a bound optimizer with ``states``: ``(slot, state)`` pairs.

        A state maps each kind of :meth:`save_state` to a scalar or to this
        rank's whole local tensor (in this run's layout); a slot left out, or
        given an empty state, starts fresh.  ``states`` is consumed once, slot
        by slot: an NVMe-tier slot's moments are looked up one at a time and
        written to its swap files at once (the mapping may read each from disk
        when looked up), so that no more than one of them is in memory.
        """
        if self._inner is None:
            raise RuntimeError("load_state() of an optimizer that is not bound yet: call bind() first")
        memory_states, nvme_steps = {}, {}
        for slot, state in states:
            if not slot.state_on_nvme:
                if state:
                    memory_states[slot] = dict(state)
                continue
            steps = int(state["step"]) if "step" in state else 0
            if steps and slot.record.owns_state:
                for kind in NVME_MOMENTS:
                    write_moment(self._store, slot.record, kind, state[kind])
                nvme_steps[slot.record.uid] = steps
        inner_state = self._inner.state_dict()
        # The inner optimizer numbers its tensors in the order of its parameter groups: the memory slots'.
        inner_state["state"] = {index: memory_states[slot] for index, slot in enumerate(self._memory_slots())
                                if slot in memory_states}
        self._inner.load_state_dict(inner_state)
        for slot, _ in self._nvme_slots:
            if slot.record.uid in nvme_steps:
                self._nvme.steps[slot.record.uid] = nvme_steps[slot.record.uid]
            else:
                self._nvme.steps.pop(slot.record.uid, None)
        self._account_state(force=True)

    # --- accounting --------------------------------------------------------------

    def state_bytes(self, params: set[int] | None = None) -> dict[str, int]:
        """Bytes of optimizer state per tier for ``params`` (ids), or all: the moments (and step counters) the
        inner optimizer holds, on the device or the CPU, and those in NVMe swap files.  Separate fp32 masters
        are the store's (see ``memory_report``)."""
        return count_state_bytes(self._inner, self._memory_slots(), self._nvme,
                                 [slot for slot, _ in self._nvme_slots], params)

    def _account_state(self, force: bool = False) -> None:
        """Count the moments' bytes in each parameter's model group's ledger (see ``CountedState``)."""
        self._counted.update(self._store, self._params(), self.state_bytes, (self._inner, self._nvme), force)
