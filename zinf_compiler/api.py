"""Helpers on a model trained with zinf: gathered state, memory accounting."""

from __future__ import annotations

import torch

from zinf_compiler.optim import live_optimizers
from zinf_compiler.runtime.store import STORE

TIERS = ("device", "cpu", "nvme")
KINDS = ("params", "grads", "optimizer", "activations")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Accept the module or its ``torch.compile`` wrapper."""
    return getattr(model, "_orig_mod", model)


def _unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(_unwrap(model).parameters())  # parameters() already drops tied duplicates


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter gathered to its full value.

    A collective at world size > 1: every rank must call it.  Tied parameters
    appear under each of their names, as in ``module.state_dict()``.
    """
    full_by_id: dict[int, torch.Tensor] = {}
    state = {}
    for name, value in _unwrap(model).state_dict(keep_vars=True).items():
        if id(value) not in full_by_id:
            record = STORE.lookup(value)
            full_by_id[id(value)] = STORE.full_param(record) if record is not None else value.detach().clone()
        state[name] = full_by_id[id(value)]
    return state


def memory_report(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """This rank's bytes per tier and kind, and the runtime's peak per tier.

    ``{"device"|"cpu"|"nvme": {"params", "grads", "optimizer", "activations"},
    "peak": {"device", "cpu"}}``.  ``device`` is the compute device (the CPU
    itself when there is no accelerator).  Parameters count this rank's shards
    plus any full parameter storage still held (stages 0-2); gradients count
    gradient shards plus ``param.grad``; optimizer counts state tensors and
    separate fp32 master shards of the optimizers stepping this model.
    """
    report = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
    params = _unique_params(model)
    device = report["device"]
    for param in params:
        device["params"] += param.untyped_storage().nbytes()
        if param.grad is not None:
            device["grads"] += param.grad.numel() * param.grad.element_size()
        record = STORE.lookup(param)
        if record is not None:
            device["params"] += record.shard.numel() * record.shard.element_size()
            if record.grad_shard is not None:
                device["grads"] += record.grad_shard.numel() * record.grad_shard.element_size()
    ids = {id(p) for p in params}
    device["optimizer"] = sum(opt.state_bytes(ids) for opt in live_optimizers())
    report["peak"] = {"device": STORE.peak_bytes, "cpu": 0}
    return report


def reset_peak_memory(model: torch.nn.Module | None = None) -> None:
    """Start a new peak window for ``memory_report(...)["peak"]``."""
    STORE.reset_peak()
