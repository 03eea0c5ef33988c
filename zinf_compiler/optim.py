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

import dataclasses
import weakref
from typing import Any, Callable, Iterable

import torch

from zinf_compiler.runtime.store import STORE, ParamRecord

_LIVE_OPTIMIZERS: "weakref.WeakSet[ZinfOptimizer]" = weakref.WeakSet()


@dataclasses.dataclass(eq=False)
class _Slot:
    param: torch.nn.Parameter  # what the user passed
    record: ParamRecord | None  # the store's record; None for a parameter zinf did not shard
    master: torch.Tensor  # what the inner optimizer steps

    @property
    def grad(self) -> torch.Tensor | None:
        if self.record is None or self.record.stage == 0:
            return self.param.grad
        return self.record.grad_shard if self.record.owns_state else None


class ZinfOptimizer(torch.optim.Optimizer):
    inner_class: type[torch.optim.Optimizer]

    def __init__(self, params: Iterable, **defaults: Any):
        super().__init__(params, defaults)
        self._inner: torch.optim.Optimizer | None = None
        self._slots: list[list[_Slot]] = []
        self._state_bytes = 0
        _LIVE_OPTIMIZERS.add(self)

    # --- binding to the store ----------------------------------------------------

    def _bind(self) -> None:
        if self._inner is not None:
            for group_slots in self._slots:
                for slot in group_slots:
                    if slot.record is None and STORE.lookup(slot.param) is not None:
                        raise RuntimeError(
                            "zinf optimizer stepped before the model's first compiled forward: parameters "
                            "were adopted afterwards; run a forward/backward before the first opt.step()"
                        )
            return
        inner_groups = []
        for group in self.param_groups:
            group_slots = []
            for param in group["params"]:
                record = STORE.lookup(param)
                if record is None or record.stage == 0:
                    master = param
                elif record.compute_dtype == torch.float32:
                    master = record.shard
                else:
                    master = record.shard.to(torch.float32)
                group_slots.append(_Slot(param, record, master))
            self._slots.append(group_slots)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": [slot.master for slot in group_slots]})
        self._inner = self._make_inner(inner_groups)

    def _make_inner(self, inner_groups: list[dict]) -> torch.optim.Optimizer:
        kwargs = {}
        if not any(key in self.defaults for key in ("fused", "foreach")):
            kwargs["fused"] = True
        try:
            return self.inner_class(inner_groups, **kwargs)
        except (RuntimeError, ValueError, TypeError):
            if not kwargs:
                raise
            return self.inner_class(inner_groups)  # fused unsupported for these tensors

    def _all_slots(self) -> list[_Slot]:
        return [slot for group_slots in self._slots for slot in group_slots]

    def _records(self) -> list[ParamRecord]:
        return [slot.record for slot in self._all_slots() if slot.record is not None]

    def _reduce_stage1_grads(self) -> None:
        STORE.reduce_full_grads([r for r in self._records() if r.stage == 1])

    # --- the torch.optim.Optimizer interface -------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._bind()
        self._reduce_stage1_grads()
        fp16_records = [r for r in self._records() if r.compute_dtype == torch.float16]
        if fp16_records:
            if STORE.fp16_scaler.should_skip_step(STORE.comm, fp16_records[0].shard.device):
                # An fp16 gradient overflowed on some rank: no update this step.
                STORE.drop_grads(self._records())
                return loss
        for slot in self._all_slots():
            if slot.master is not slot.param:
                slot.master.grad = slot.grad
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self._inner.step()
        for slot in self._all_slots():
            if slot.record is not None and slot.master is not slot.param and slot.master is not slot.record.shard:
                slot.record.shard.copy_(slot.master)
        STORE.refresh_full_params(self._records())
        self._account_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # full gradients in param.grad (unsharded params, stage 1)
        for slot in self._all_slots():
            if slot.master is not slot.param:
                slot.master.grad = None
        STORE.drop_grads(self._records())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm across all ranks; returns the norm before clipping.

        Equals ``torch.nn.utils.clip_grad_norm_`` on the full, averaged gradients.
        """
        if norm_type != 2.0:
            raise ValueError("zinf clip_grad_norm_ supports norm_type=2.0 only")
        self._bind()
        self._reduce_stage1_grads()
        device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
        # float64 sums; on the parameters' device, where NCCL can reduce them.
        sharded_sq = torch.zeros((), dtype=torch.float64, device=device)
        replicated_sq = torch.zeros((), dtype=torch.float64, device=device)
        grads = []
        for slot in self._all_slots():
            grad = slot.grad
            if grad is None:
                continue
            grads.append(grad)
            squared = grad.detach().double().pow(2).sum().to(device)
            if slot.record is not None and slot.record.stage > 0:
                sharded_sq += squared  # each element lives on exactly one rank
            else:
                replicated_sq += squared  # every rank holds the same full gradient
        STORE.comm.all_reduce_sum(sharded_sq)
        total_norm = (sharded_sq + replicated_sq).sqrt().to(torch.float32)
        clip_coef = float(max_norm) / (total_norm.item() + 1e-6)
        if clip_coef < 1.0:
            for grad in grads:
                grad.mul_(clip_coef)
        return total_norm

    def state_dict(self) -> dict[str, Any]:
        self._bind()
        self._sync_hyperparameters()
        state = self._inner.state_dict()
        state["zinf"] = {"world_size": STORE.comm.world_size, "rank": STORE.comm.rank}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._bind()
        state_dict = dict(state_dict)
        saved = state_dict.pop("zinf", None)
        if saved is not None and saved["world_size"] != STORE.comm.world_size:
            raise ValueError(
                f"optimizer state was saved at world size {saved['world_size']}, this run has "
                f"{STORE.comm.world_size}; per-rank optimizer shards only load into the same world size"
            )
        self._inner.load_state_dict(state_dict)
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        self._account_state()

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    # --- accounting --------------------------------------------------------------

    def state_bytes(self, params: set[int] | None = None) -> int:
        """Bytes of optimizer state (and separate fp32 masters) for ``params`` (ids), or all."""
        if self._inner is None:
            return 0
        total = 0
        for slot in self._all_slots():
            if params is not None and id(slot.param) not in params:
                continue
            for value in self._inner.state.get(slot.master, {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
            if slot.record is not None and slot.master is not slot.record.shard:
                total += slot.master.numel() * slot.master.element_size()
        return total

    def _account_state(self) -> None:
        sharded = self.state_bytes()
        STORE.set_optimizer_bytes(sharded - self._state_bytes)
        self._state_bytes = sharded


def live_optimizers() -> list[ZinfOptimizer]:
    return list(_LIVE_OPTIMIZERS)


class AdamW(ZinfOptimizer):
    inner_class = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class Adam(ZinfOptimizer):
    inner_class = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class SGD(ZinfOptimizer):
    inner_class = torch.optim.SGD

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **kwargs)

