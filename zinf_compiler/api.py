"""Helpers on a model trained with zinf: gathered state, memory accounting, and the model's store.

Part of the entry layer (with backend.py and optim.py): the one place below
which nothing reaches the process's runtime.  Other modules are handed its
parts, or find a model's store through :func:`store_of`.
"""

from __future__ import annotations

import contextlib

import torch

from zinf_compiler.runtime.model_group import ModelView
from zinf_compiler.runtime.process import Runtime
from zinf_compiler.runtime.tensor_parallel import local_of
from zinf_compiler.runtime.tiers import KINDS, TIERS
from zinf_compiler import tensor_parallel
from zinf_compiler.module_paths import unwrap  # noqa: F401  (zinf's callers' name for it)

# The process's runtime (runtime/process.py): the one instance, read only by the entry layer
# (this file, backend.py, optim.py), which hands its parts to everything else.
RUNTIME = Runtime()



def store_of(model: torch.nn.Module) -> ModelView:
    """``model``'s own state (runtime/model_group.py's ModelView): how the top layer (checkpoints, pipeline
    stages) reaches it, its parameters claimed for it now if nothing claimed them yet (a load before the compile).

    Its ``group`` is the model's group (``groups``: every group its parameters are in, one but for a model
    compiled in parts before anything claimed it whole, or a container of models); ``lookup`` finds only this
    model's records.  The machinery every model shares (transfers, swap, the pinned pool, the communicator)
    is its ``store``.
    """
    return RUNTIME.store.view_of(_unique_params(model))


def _unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(unwrap(model).parameters())  # parameters() already drops tied duplicates


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter gathered to its full value.

    A collective at world size > 1: every rank must call it.  Tied parameters
    appear under each of their names, as in ``module.state_dict()``.
    """
    full_by_id: dict[int, torch.Tensor] = {}
    state = {}
    for name, value in unwrap(model).state_dict(keep_vars=True).items():
        if id(value) not in full_by_id:
            record = RUNTIME.store.lookup(value)
            full = RUNTIME.store.full_param(record) if record is not None else value.detach().clone()
            full_by_id[id(value)] = tensor_parallel.full_tensor(value, full)  # (a DTensor: whole over tp too)
        state[name] = full_by_id[id(value)]
    return state


@contextlib.contextmanager
def gathered(model: torch.nn.Module, writeback: bool = False):
    """Full stage-3 parameters inside the block, for eager code: ``model.generate(...)``, an
    eager evaluation, ``print(param)``.

    Every rank must enter it (each parameter is gathered: a collective at
    world size > 1).  The block runs under ``torch.no_grad()``, and each
    parameter holds its full value on the device until the block ends
    (``memory_report`` counts it).  ``writeback=True``: in-place changes made
    to the parameters in the block are written into the shards and masters
    at its end, as ``load_state_dict`` does (every rank must make the same
    changes); otherwise they are dropped.  Stages 0-2 keep full parameters
    already: for them the block only turns off gradients.
    """
    RUNTIME.store.collect()
    records = [r for r in map(RUNTIME.store.lookup, _unique_params(model)) if r is not None and r.stage == 3]
    held = []
    try:
        with torch.no_grad():
            for record in records:
                if RUNTIME.store.hold_full_storage(record):  # (else an enclosing block holds it, and frees it)
                    held.append(record)
            yield model
            if writeback:
                for record in held:
                    RUNTIME.store.assign_full(record, record.param.detach())
    finally:
        RUNTIME.store.release_full_storage(held)


def memory_report(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """This rank's bytes per tier and kind, and the runtime's peak per tier.

    ``{"device"|"cpu"|"nvme": {"params", "grads", "optimizer", "activations"},
    "peak": {"device", "cpu"}, "buffers": {"cpu"}}``.  ``device`` is the
    compute device (the CPU itself when there is no accelerator); ``cpu`` is
    host memory holding offloaded state; ``nvme`` is swap-file bytes.
    Parameters count this rank's shards on their tier plus any full parameter
    storage still held (stages 0-2); gradients count gradient shards (on the
    optimizer's tier) plus ``param.grad``; optimizer counts separate fp32
    master shards and the optimizer's moments.  ``buffers`` is the process's
    pinned staging pools: the parameters' and the activations', allocated once
    and shared by every model, and each NVMe optimizer's own (not in ``peak``).  ``activations`` counts
    the values saved for backward and not yet consumed: on the device (what
    the forward's autograd nodes hold), and copies offloaded to ``cpu`` or
    ``nvme`` (option ``offload_activations``); at stage 0 they are counted
    for the process only.  ``pinned``: per consumer of the process's pinned memory (parameters,
    activations, and each NVMe optimizer's own pool: early_optimizer, or optimizer where it steps only after
    backward), its ``quota``, ``in_use``, ``peak`` bytes and ``pinned`` (page-locked).
    The figures are this model's alone: another model in the same process
    has its own (and its own ``device_memory_limit``).
    """
    RUNTIME.store.collect()
    report = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
    params = _unique_params(model)
    for param in params:
        held = local_of(param)  # (a DTensor's bytes on this rank are its local tensor's)
        report["device"]["params"] += held.untyped_storage().nbytes()
        if param.grad is not None:
            grad = local_of(param.grad)
            report["device"]["grads"] += grad.numel() * grad.element_size()
        record = RUNTIME.store.lookup(param)
        if record is None:
            continue
        if not record.shard_is_param:  # (else the parameter's own storage, counted above)
            report[record.param_tier]["params"] += record.shard_bytes
        if record.master is not None and record.master is not record.shard:
            report[_memory_tier(record.opt_tier)]["optimizer"] += record.master.numel() * record.master.element_size()
        report[_memory_tier(record.opt_tier)]["grads"] += record.gradient.shard_bytes
        if record.gradient.on_disk:
            report["nvme"]["grads"] += record.local_numel * 4
        if (record.stage > 0 and record.opt_tier == "nvme" and record.owns_state and record.trainable
                and not record.params_in_master):  # (then the master's files are the params counted above)
            report["nvme"]["optimizer"] += record.local_numel * 4  # the fp32 master's swap files
    ids = {id(p) for p in params}
    for opt in list(RUNTIME.optimizers):
        for tier, nbytes in opt.state_bytes(ids).items():
            report[tier]["optimizer"] += nbytes
    # Read only: reporting claims nothing.  A model in several groups (parts compiled before any optimizer
    # or load claimed them together) adds its groups' figures up; a sum of peaks is an upper bound.
    ledgers = [group.ledger for group in RUNTIME.store.groups_of(params)]
    for tier in report:
        report[tier]["activations"] = sum(ledger.activations[tier] for ledger in ledgers)
    report["peak"] = {tier: sum(ledger.peak[tier] for ledger in ledgers) for tier in ("device", "cpu")}
    report["pinned"] = RUNTIME.pinned_memory.figures()
    # Every pool is a quota of the process's pinned memory (the store's, the activations', each optimizer's).
    report["buffers"] = {"cpu": sum(figures["quota"] for figures in report["pinned"].values())}
    return report


def _memory_tier(tier: str) -> str:
    return "device" if tier == "device" else "cpu"


def reset_peak_memory(model: torch.nn.Module | None = None) -> None:
    """Start a new peak window for ``memory_report(model)["peak"]`` (None: every model's)."""
    if model is None:
        RUNTIME.store.reset_peak()
    else:
        for group in RUNTIME.store.groups_of(_unique_params(model)):
            group.ledger.reset_peak()
