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
from .runtime.param_plan import plan_param
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


def plan_for(param: torch.Tensor, tile_rows: tuple[int, ...] | None, options: ZinfOptions, world_size: int,
             rank: int, owner: int | None = None, uid: int = 0):
    """The plan ``param`` (real or on the meta device: only its shape, dtype and device are read) gets under
    ``options`` on ``rank`` of ``world_size`` (see runtime/param_plan.py), as adoption would make it."""
    settings = _store_settings(options)
    settings["param_dtype"] = DTYPES[options.param_dtype]
    return plan_param(uid=uid, shape=param.shape, dtype=param.dtype, device=param.device, world_size=world_size,
                      rank=rank, owner=owner, tile_rows=tile_rows, requires_grad=param.requires_grad,
                      nvme_copies=options.nvme_copies, **settings)


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
    needed = 0
    for param, tile_rows in params:
        if store.lookup(param) is not None:
            continue
        # A broadcast parameter's owner is chosen at adoption: count it as this rank's, the most it can hold.
        plan = plan_for(param, tile_rows, options, shard.world_size, shard.rank, owner=shard.rank)
        store.plan_shards(plan.local_numel)
        needed += options.nvme_copies * plan.swap_bytes(trained=param.requires_grad)
    validate_folder(options.nvme_path, needed)
