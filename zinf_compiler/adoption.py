"""Handing parameters to the parameter store under a model's options.

The backend (the parameters of a captured graph, at compile time or at their
first call) and ``zinf.materialize`` (parameters built straight into their
shards) adopt parameters with the same options, so they must derive the same
settings from them: this module is the one place that does.  Both are
handed the store (and with it the communicator); nothing here reaches for a
process-wide runtime.
"""

from __future__ import annotations

from typing import Callable

import torch

from .options import ZinfOptions
from .runtime.aio import validate_folder
from .runtime.param_plan import OPTIMIZER_STATES, plan_param
from .runtime.store import DTYPES
from .runtime.tiers import store_tier


def model_mesh(options: ZinfOptions, comm):
    """The ranks a model with ``options`` shards over (option ``mesh``; default: every rank of ``comm``)."""
    return options.mesh or comm.mesh()


def _store_settings(options: ZinfOptions) -> dict:
    """What ``options`` decide of a parameter's plan and adoption, in ``ParamStore.adopt``'s words."""
    return dict(stage=options.stage, partition=options.partition, param_dtype=options.param_dtype,
                param_tier=store_tier(options.offload_param), opt_tier=store_tier(options.offload_optimizer),
                bucket_bytes=options.bucket_bytes, step_in_backward=options.overlap_optimizer)


def adopt(store, param: torch.Tensor, name: str, options: ZinfOptions, mesh, tile_rows: tuple[int, ...] | None,
          group=None, read_local: Callable | None = None):
    """Shard ``param`` into ``store`` with the tiers, dtype and layout ``options`` name; returns its record.

    ``tile_rows``: the tile plan (:func:`zinf_compiler.tile_plan.tile_rows_for`), None for an untiled
    parameter; ``group`` and ``read_local`` as for ``ParamStore.adopt``.
    """
    return store.adopt(param, name, tile_rows=tile_rows, group=group, read_local=read_local,
                       grad_ram_bytes=options.nvme_grad_ram_bytes, mesh=mesh, **_store_settings(options))


def plan_offload(store, params: list[tuple[torch.Tensor, tuple[int, ...] | None]], options: ZinfOptions) -> None:
    """Before ``params`` (each with its tile rows) are adopted: configure the swap and pinned pool, check
    nvme_path has room for their swap files (sized from their plans, as the store will lay them out)."""
    store.configure_offload(options.nvme_path, options.pinned_bytes, options.aio_block_size,
                            options.aio_queue_depth, options.aio_threads, options.nvme_copies)
    if "nvme" not in (options.offload_param, options.offload_optimizer):
        return
    shard = model_mesh(options, store.comm).shard
    settings = _store_settings(options)
    settings["param_dtype"] = DTYPES[options.param_dtype]
    needed = 0
    for param, tile_rows in params:
        if store.lookup(param) is not None:
            continue
        # A broadcast parameter's owner is chosen at adoption: count it as this rank's, the most it can hold.
        plan = plan_param(uid=0, shape=param.shape, dtype=param.dtype, device=param.device, world_size=shard.world_size,
                          rank=shard.rank, owner=shard.rank, tile_rows=tile_rows, requires_grad=param.requires_grad,
                          nvme_copies=options.nvme_copies, **settings)
        store.plan_shards(plan.local_numel)
        if plan.param_tier == "nvme" and not plan.params_in_master:  # (else its reads go to the master's files)
            needed += options.nvme_copies * sum(numel for _, _, numel in plan.shard_swap) * plan.compute_dtype.itemsize
        if plan.opt_tier == "nvme" and param.requires_grad:
            needed += options.nvme_copies * len(OPTIMIZER_STATES) * plan.local_numel * 4  # fp32 master, moments, grad
    validate_folder(options.nvme_path, needed)
