"""A parameter's values on its tiers: placed at adoption, overwritten by a load, streamed out for a save.

Functions of a record and what they are handed: ``swap_io``, what writes and
reads swap keys through the pinned pool (``write_swap`` / ``read_swap``: the
store's), and ``count_resting(tier, nbytes, ledger)``, the store's count of
resting bytes.  Where a record's bytes live (``params_in_master``,
``shard_is_param``) is its plan's (runtime/param_plan.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .optim.nvme_adam import write_initial_master
from .records import ParamRecord, nbytes_of, tier_memory
from .swap_layout import SUB_GROUP_NUMEL

CountResting = Callable[..., None]  # (tier, delta bytes, ledger=...)


# --- values in ---------------------------------------------------------------------------


def place_shard(record: ParamRecord, local_fp32: torch.Tensor, swap_io, count_resting: CountResting) -> None:
    """Put this rank's slice, in compute dtype, on the parameter tier."""
    if record.shard_is_param:
        record.shard = record.param.detach().view(-1)  # its bytes are the parameter's own
        return
    if record.param_tier == "nvme":
        record.shard = local_fp32.new_empty(0, dtype=record.compute_dtype)  # nothing in memory: the swap files
        if record.owns_state and not record.params_in_master:  # else place_master writes it
            for key, start, numel in record.swap_layout():
                swap_io.write_swap(record.swap, key, local_fp32[start : start + numel].to(record.compute_dtype))
        return
    device = record.device if record.param_tier == "device" else torch.device("cpu")
    shard = local_fp32.to(device=device, dtype=record.compute_dtype, copy=True)
    if record.param_tier == "cpu" and torch.cuda.is_available():
        shard = shard.pin_memory()  # asynchronous host-to-device copies need page-locked memory
    record.shard = shard
    count_resting(tier_memory(record.param_tier), nbytes_of(shard), ledger=record.ledger)


def place_master(record: ParamRecord, local_fp32: torch.Tensor, swap_io, count_resting: CountResting) -> None:
    """The fp32 master on the optimizer tier; the shard itself where they coincide."""
    if record.stage == 0 or not record.dtype.is_floating_point:
        return  # nothing to step (an integer parameter never has a gradient)
    if record.opt_tier == "nvme":
        # A frozen parameter is never stepped (params_in_master: the master is its only copy).
        if record.owns_state and (record.trainable or record.params_in_master):
            write_initial_master(swap_io, record, local_fp32)
        return
    if record.param_tier == record.opt_tier and record.compute_dtype == torch.float32:
        record.master = record.shard
        return
    device = record.device if record.opt_tier == "device" else torch.device("cpu")
    record.master = local_fp32.to(device=device, copy=True)
    count_resting(tier_memory(record.opt_tier), nbytes_of(record.master), ledger=record.ledger)


def forget_values(record: ParamRecord) -> None:
    """The parameter was collected: its record lets go of its shard and master (already uncounted)."""
    record.shard = record.master = None


def write_local(record: ParamRecord, local: torch.Tensor, swap_io) -> None:
    """Write this rank's new slice (local layout, ``record.holding_dtype``) into its shard and master.

    The shard takes it in compute dtype on the parameter tier; the fp32
    master (memory or swap files) takes it as it is.
    """
    if record.param_tier == "nvme":
        if record.owns_state and not record.params_in_master:  # else the master below is the shard
            for key, start, numel in record.swap_layout():
                swap_io.write_swap(record.swap, key, local[start : start + numel].to(record.compute_dtype))
    else:
        record.shard.copy_(local)
    if record.stage == 0 or not record.dtype.is_floating_point:
        return
    if record.opt_tier == "nvme":
        if record.owns_state and (record.trainable or record.params_in_master):
            write_initial_master(swap_io, record, local.to(torch.float32))
    elif record.master is not None and record.master is not record.shard:
        record.master.copy_(local)


# --- values out --------------------------------------------------------------------------


def local_value_chunks(record: ParamRecord, swap_io, chunk_numel: int = SUB_GROUP_NUMEL):
    """This rank's slice of the parameter's value, streamed: ``(local_start, tensor on the CPU)`` in order.

    The most precise copy there is: the fp32 master (in memory or its
    swap files), else the shard (compute dtype on its tier) in
    ``record.holding_dtype``.  Never more than one chunk (or one swap
    key) in memory at a time.
    """
    dtype = record.holding_dtype
    if record.master is not None:
        source = record.master
    elif (record.opt_tier == "nvme" and record.stage > 0 and record.dtype.is_floating_point
          and record.owns_state and record.trainable):
        for key, start, stop in record.plan.state_swap("master"):
            yield start, swap_io.read_swap(record.swap, key, torch.float32, stop - start, torch.device("cpu"))
        return
    elif record.param_tier == "nvme":
        if record.owns_state:
            for key, start, numel in record.swap_layout():
                piece = swap_io.read_swap(record.swap, key, record.compute_dtype, numel, torch.device("cpu"))
                yield start, piece.to(dtype)
        return
    else:
        source = record.shard
    for start in range(0, source.numel(), chunk_numel):
        yield start, source[start : start + chunk_numel].to(device="cpu", dtype=dtype)
