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

from . import ram_cache
from .model_plan import PlanBudgets, PlannedParam, plan_model
from .options import ZinfOptions, budget_bytes
from .runtime.aio import validate_folder
from .runtime.host_memory import available_bytes, bound_heap, keep_freed_pages, ranks_on_node
from .runtime.param_plan import ParamPlan
from .runtime.store import DTYPES, ZinfStoreError
from .runtime.tiers import store_tier


def model_mesh(options: ZinfOptions, comm):
    """The ranks a model with ``options`` shards over (option ``mesh``; default: every rank of ``comm``)."""
    return options.mesh or comm.mesh()


def plan_offload(store, params: list[tuple[str, torch.Tensor, tuple[int, ...] | None]], options: ZinfOptions,
                 device: torch.device | None = None, from_file=frozenset()) -> dict[int, ParamPlan]:
    """Before ``params`` (each ``(name, parameter, tile rows)``) are adopted: their model's plan
    (:func:`~.model_plan.plan_model`, after what ``store`` already holds), the swap and pinned pool configured
    for it, and nvme_path checked to have room for its swap files.  Returns ``id(parameter) -> its plan`` for
    those not adopted yet (a tied parameter once), to adopt them by (:func:`adopt`).

    ``device``: the compute device if not the parameters' own (``zinf.materialize`` plans meta-device
    parameters); ``from_file``: ids of those whose values a weights file gives.  With option host_memory the
    plans hold the RAM cache's choice of tiers (:mod:`.ram_cache`)."""
    store.configure_offload(options.nvme_path, options.pinned_bytes, options.aio_block_size,
                            options.aio_queue_depth, options.aio_threads, options.nvme_copies)
    new = {id(param): (name, param, tile_rows) for name, param, tile_rows in params if store.lookup(param) is None}
    if not new:
        return {}
    shard = model_mesh(options, store.comm).shard
    planned = [PlannedParam.of(name, param, tile_rows, id(param) in from_file) for name, param, tile_rows in new.values()]
    device = next(iter(new.values()))[1].device if device is None else torch.device(device)
    model_plan = plan_model(planned, options, world_size=shard.world_size, rank=shard.rank, device=device,
                            budgets=_budgets(store, options), first_uid=store.reserve_uids(len(planned)))
    if "nvme" in (options.offload_param, options.offload_optimizer):
        store.plan_shards(model_plan.sizing_plans)  # (they size the pinned pool when it is made, or grow it)
        validate_folder(options.nvme_path, model_plan.swap_space)
    return dict(zip(new, model_plan.plans))


def _budgets(store, options: ZinfOptions) -> PlanBudgets:
    """What ``store``'s process has spent that a new model's plan spends from."""
    cache = options.host_memory is not None or options.ram_cache_bytes is not None
    if cache:
        # A dropped model's parameters may wait in reference cycles: collected first, so that its records neither
        # hold budget they no longer use nor leave ranks with different garbage choosing differently.
        gc.collect()
        store.collect()
    records = store.records()
    host_memory = (None if options.host_memory is None else
                   budget_bytes(options.host_memory, available_bytes(), ranks_on_node()))
    # (The gradient RAM budget is read only where gradients may rest on NVMe: "auto" is fixed at its first reading.)
    grad_ram_left = store.grad_ram_left(options.nvme_grad_ram_bytes) if options.offload_optimizer == "nvme" else 0
    return PlanBudgets(grad_ram_left=grad_ram_left,
                       owned_numel_by_rank=store.owned_numel_by_rank(), host_memory=host_memory,
                       cache_held_bytes=ram_cache.held_by_records(records) if cache else 0,
                       cache_states_bytes=ram_cache.states_held_by_records(records) if cache else 0,
                       pinned_capacity=store.pinned.capacity_bytes if store.pinned is not None else None,
                       pool_sizing_plans=tuple(store.pool_sizing_plans()))


def adopt(store, param: torch.Tensor, name: str, options: ZinfOptions, mesh, plan: ParamPlan | None,
          group=None, read_local: Callable | None = None):
    """Shard ``param`` into ``store`` by ``plan`` (its model's, :func:`plan_offload`); returns its record.

    A parameter adopted before (by another graph of its model) keeps its record, once its options are
    checked to be the ones it was adopted with.  ``group`` and ``read_local`` as for ``ParamStore.adopt``.
    """
    record = store.lookup(param)
    if record is not None:
        _check_adopted_alike(record, name, options, mesh)
        return record
    if plan is None:
        raise ZinfStoreError(f"parameter {name} was not planned before its adoption (adoption.plan_offload)")
    if options.host_memory is not None:
        # A budget bounds the process's peak: the kept heap's fragmentation (about 5%, benchmarks/RESULTS.md,
        # 2026-12-03) would raise it, so no model of this process keeps freed pages from now on.
        bound_heap()
    elif plan.device.type == "cpu":
        # Each step reallocates its gathers and gradients in host memory: the heap keeps their pages
        # (runtime/host_memory.py).
        keep_freed_pages()
    return store.adopt(param, name, plan, group=group, read_local=read_local, mesh=mesh)


def _check_adopted_alike(record, name: str, options: ZinfOptions, mesh) -> None:
    """Refuse a graph whose options differ from those ``record``'s parameter was adopted with (the RAM cache
    moving an nvme tier to the cpu tier is not a difference: it was this model's plan)."""
    asked_tiers = [held if (held, asked) == ("cpu", "nvme") else asked
                   for held, asked in ((record.param_tier, store_tier(options.offload_param)),
                                       (record.opt_tier, store_tier(options.offload_optimizer)))]
    asked = (options.stage, options.partition, DTYPES[options.param_dtype], *asked_tiers, mesh.describe())
    adopted = (record.stage, record.partition, record.compute_dtype, record.param_tier, record.opt_tier,
               record.mesh.describe())
    if adopted != asked or record.mesh is not mesh:
        raise ZinfStoreError(
            f"parameter {name} was adopted with (stage, partition, param_dtype, param tier, optimizer "
            f"tier, mesh) = {adopted}, now asked for {asked}; every compiled graph of a model must "
            f"use the same stage, partition, param_dtype, offload options and mesh")
