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
from .runtime.store import DTYPES
from .runtime.tiers import store_tier


def model_mesh(options: ZinfOptions, comm):
    """The ranks a model with ``options`` shards over (option ``mesh``; default: every rank of ``comm``)."""
    return options.mesh or comm.mesh()


def adopt(store, param: torch.Tensor, name: str, options: ZinfOptions, mesh, tile_rows: tuple[int, ...] | None,
          ledger=None, read_local: Callable | None = None):
    """Shard ``param`` into ``store`` with the tiers, dtype and layout ``options`` name; returns its record.

    ``tile_rows``: the tile plan (:func:`zinf_compiler.tile_plan.tile_rows_for`), None for an untiled
    parameter; ``ledger`` and ``read_local`` as for ``ParamStore.adopt``.
    """
    return store.adopt(
        param, name, stage=options.stage, partition=options.partition, param_dtype=options.param_dtype,
        param_tier=store_tier(options.offload_param), opt_tier=store_tier(options.offload_optimizer),
        tile_rows=tile_rows, ledger=ledger, read_local=read_local, bucket_bytes=options.bucket_bytes,
        grad_ram_bytes=options.nvme_grad_ram_bytes, mesh=mesh, step_in_backward=options.overlap_optimizer,
    )


def plan_offload(store, params: list[torch.Tensor], options: ZinfOptions) -> None:
    """Before ``params`` are adopted: configure the swap and pinned pool, check nvme_path has room."""
    store.configure_offload(options.nvme_path, options.pinned_bytes, options.aio_block_size,
                            options.aio_queue_depth, options.aio_threads, options.nvme_copies)
    if "nvme" not in (options.offload_param, options.offload_optimizer):
        return
    world = model_mesh(options, store.comm).shard.world_size
    needed = 0
    for param in params:
        if store.lookup(param) is not None:
            continue
        local_numel = -(-param.numel() // world) if options.partition == "allgather" else param.numel()
        store.plan_shards(local_numel)
        copies = options.nvme_copies
        trained_on_nvme = options.offload_optimizer == "nvme" and param.requires_grad
        # An fp32 parameter trained on nvme is read from its master's files (ParamLayout.params_in_master);
        # a tiled one keeps files of its own, which this check does not foresee (a full disk still fails cleanly).
        if options.offload_param == "nvme" and not (trained_on_nvme and options.param_dtype == "fp32"
                                                    and param.is_floating_point()):
            needed += copies * local_numel * DTYPES[options.param_dtype].itemsize
        if trained_on_nvme:
            needed += copies * 4 * local_numel * 4  # fp32 master, two moments and the gradient
    validate_folder(options.nvme_path, needed)
