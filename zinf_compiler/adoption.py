"""Handing parameters to the parameter store under a model's options.

The backend (the parameters of a captured graph, at compile time or at their
first call) and ``zinf.materialize`` (parameters built straight into their
shards) adopt parameters with the same options, so they must derive the same
settings from them: this module is the one place that does.  Both are
handed the store (and with it the communicator); nothing here reaches for a
process-wide runtime.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import ram_cache
from .options import ZinfOptions, budget_bytes
from .runtime.aio import validate_folder
from .runtime.host_memory import available_bytes, ranks_on_node
from .runtime.param_plan import plan_param
from .runtime.store import DTYPES
from .runtime.tiers import store_tier


def model_mesh(options: ZinfOptions, comm):
    """The ranks a model with ``options`` shards over (option ``mesh``; default: every rank of ``comm``)."""
    return options.mesh or comm.mesh()


# (param_tier, opt_tier) that plan_offload's RAM cache (option host_memory) chose for a parameter not yet adopted.
_CACHED_TIERS = WeakIdKeyDictionary()


def planned_as(param: torch.Tensor, planned: torch.Tensor) -> None:
    """``param`` is adopted as ``planned`` was planned by :func:`plan_offload` (``zinf.materialize`` plans the
    meta-device parameters and adopts the real ones built from them)."""
    if planned in _CACHED_TIERS:
        _CACHED_TIERS[param] = _CACHED_TIERS[planned]


def _store_settings(options: ZinfOptions) -> dict:
    """What ``options`` decide of a parameter's plan and adoption, in ``ParamStore.adopt``'s words."""
    return dict(stage=options.stage, partition=options.partition, param_dtype=options.param_dtype,
                param_tier=store_tier(options.offload_param), opt_tier=store_tier(options.offload_optimizer),
                bucket_bytes=options.bucket_bytes, step_in_backward=options.overlap_optimizer)


def plan_for(param: torch.Tensor, tile_rows: tuple[int, ...] | None, options: ZinfOptions, world_size: int,
             rank: int, owner: int | None = None, uid: int = 0, device: torch.device | None = None, **tiers: str):
    """The plan ``param`` (real or on the meta device: only its shape, dtype and device are read) gets under
    ``options`` on ``rank`` of ``world_size`` (see runtime/param_plan.py), as adoption would make it;
    ``device``: the compute device if not ``param``'s (a planned meta-device parameter's);
    ``tiers``: ``param_tier`` / ``opt_tier`` other than the options' (the RAM cache's choice)."""
    settings = {**_store_settings(options), **tiers}
    settings["param_dtype"] = DTYPES[options.param_dtype]
    device = param.device if device is None else device
    return plan_param(uid=uid, shape=param.shape, dtype=param.dtype, device=device, world_size=world_size,
                      rank=rank, owner=owner, tile_rows=tile_rows, requires_grad=param.requires_grad,
                      nvme_copies=options.nvme_copies, **settings)


def adopt(store, param: torch.Tensor, name: str, options: ZinfOptions, mesh, tile_rows: tuple[int, ...] | None,
          group=None, read_local: Callable | None = None):
    """Shard ``param`` into ``store`` with the tiers, dtype and layout ``options`` name; returns its record.

    ``tile_rows``: the tile plan (:func:`zinf_compiler.tile_plan.tile_rows_for`), None for an untiled
    parameter; ``group`` and ``read_local`` as for ``ParamStore.adopt``.  With option host_memory, the tiers
    are the RAM cache's choice (:func:`plan_offload`, which must have planned ``param`` first).
    """
    settings = _store_settings(options)
    if _cache_on(options):
        settings.update(_cached_tiers(store, param, settings))
    return store.adopt(param, name, tile_rows=tile_rows, group=group, read_local=read_local,
                       grad_ram_bytes=options.nvme_grad_ram_bytes, mesh=mesh, **settings)


def _cached_tiers(store, param: torch.Tensor, settings: dict) -> dict:
    """The tiers the RAM cache gave ``param``: chosen by :func:`plan_offload`, or, adopted before (by another
    graph), its record's where the cache moved an nvme tier to the cpu."""
    record = store.lookup(param)
    if record is None:
        param_tier, opt_tier = _CACHED_TIERS.get(param, (settings["param_tier"], settings["opt_tier"]))
    else:
        param_tier, opt_tier = (
            held if (held, asked) == ("cpu", "nvme") else asked
            for held, asked in ((record.param_tier, settings["param_tier"]), (record.opt_tier, settings["opt_tier"])))
    return dict(param_tier=param_tier, opt_tier=opt_tier)


def plan_offload(store, params: list[tuple[torch.Tensor, tuple[int, ...] | None]], options: ZinfOptions) -> None:
    """Before ``params`` (each with its tile rows) are adopted: configure the swap and pinned pool, check
    nvme_path has room for their swap files (sized from their plans, as the store will lay them out); with
    option host_memory, choose whose states the RAM cache keeps on the cpu tier (:mod:`.ram_cache`)."""
    store.configure_offload(options.nvme_path, options.pinned_bytes, options.aio_block_size,
                            options.aio_queue_depth, options.aio_threads, options.nvme_copies)
    if "nvme" not in (options.offload_param, options.offload_optimizer):
        return
    shard = model_mesh(options, store.comm).shard
    new = [(param, tile_rows) for param, tile_rows in params if store.lookup(param) is None]
    new = list({id(param): (param, tile_rows) for param, tile_rows in new}.values())  # (a tied one once)

    def plan_of(param, tile_rows, **tiers):
        # A broadcast parameter's owner is chosen at adoption: count it as this rank's, the most it can hold.
        return plan_for(param, tile_rows, options, shard.world_size, shard.rank, owner=shard.rank, **tiers)

    plans = [plan_of(param, tile_rows) for param, tile_rows in new]
    store.plan_shards(plans)
    if _cache_on(options):
        plans = _choose_cached(store, new, plans, options, plan_of)
    needed = sum(options.nvme_copies * plan.swap_bytes(trained=param.requires_grad)
                 for (param, _), plan in zip(new, plans))
    validate_folder(options.nvme_path, needed)


def _cache_on(options: ZinfOptions) -> bool:
    """Whether the RAM cache chooses tiers (options host_memory or ram_cache_bytes; parse_options checks that
    an offload is 'nvme')."""
    return options.host_memory is not None or options.ram_cache_bytes is not None


def _choose_cached(store, params: list, plans: list, options: ZinfOptions, plan_of) -> list:
    """Option host_memory: pick whose states of ``params`` (with their all-NVMe ``plans``) rest on the cpu tier
    (:func:`.ram_cache.choose_cached`, the budget as :mod:`.ram_cache` says), note the tiers for :func:`adopt`,
    and return the plans with them."""
    requires_grad = [param.requires_grad for param, _ in params]
    # A dropped model's parameters may wait in reference cycles: collected first, so that its records neither
    # hold budget they no longer use nor leave ranks with different garbage choosing differently.
    gc.collect()
    store.collect()
    pinned = store.pinned.capacity_bytes if store.pinned is not None else 0
    # No pinned pool while nothing rests on NVMe; else it is made now (sized from every plan so far, as it
    # would be at the first swap) and its bytes come out of the budget.
    records = list(store.records())
    states_bytes = (None if options.ram_cache_bytes is None else
                    options.ram_cache_bytes - ram_cache.states_held_by_records(records))
    host_memory = (None if options.host_memory is None else
                   budget_bytes(options.host_memory, available_bytes(), ranks_on_node()))
    tiers_of = ram_cache.choose_tiers(plans, requires_grad, host_memory, ram_cache.held_by_records(records), pinned,
                                      lambda: store.pinned_pool(0).capacity_bytes, states_bytes=states_bytes,
                                      grad_ram_bytes=store.grad_ram_left(options.nvme_grad_ram_bytes))
    cached_plans = []
    for (param, tile_rows), plan, (param_tier, opt_tier) in zip(params, plans, tiers_of):
        _CACHED_TIERS[param] = (param_tier, opt_tier)
        unchanged = (param_tier, opt_tier) == (plan.param_tier, plan.opt_tier)
        cached_plans.append(plan if unchanged else plan_of(param, tile_rows, param_tier=param_tier, opt_tier=opt_tier))
    return cached_plans
