"""A parameter's plan: every layout fact of one parameter, built by one pure function.

:func:`plan_param` takes what decides a parameter's layout (its shape and
dtype, the options that matter, the mesh's size and this rank as plain ints)
and returns a frozen :class:`ParamPlan`: tiers, shard size and padding, the
elements this rank owns, tile rows and their local slots, the swap keys of
the shard and of the optimizer state, and the adoption's decisions about
where the bytes live (the master doubling as the parameter, the shard being
the parameter's own storage, the step taken in backward).  The store adopts
a parameter by building its plan (``ParamRecord.plan``); the compile side
plans a whole model ahead of adoption (zinf_compiler/model_plan.py) and the
store adopts each parameter by its plan.  Bucket membership is a fact of a
model's list of layouts (runtime/buckets.py).

Layout, tile-major for a tiled parameter: each row tile is flattened, padded
to a multiple of the world size and split evenly over ranks; this rank's
shard is its slices of every tile in tile order, each slice taking a slot of
a multiple of ``tile_align`` elements (nvme tier: one O_DIRECT block, so each
tile is a swap key of its own).  Untiled: the flat parameter padded to a
multiple of the world size, one equal slice per rank.  ``partition=
"broadcast"``: the owner rank holds it whole, the others nothing.

Pure: no process group, no store, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .ledger import ZinfStoreError
from .swap_layout import ALIGNMENT, param_key, state_key, sub_groups, tile_key
from .tiers import KINDS, TIERS

OPTIMIZER_STATES = ("master", "exp_avg", "exp_avg_sq", "grad")  # the fp32 state of a slice, one key each per sub-group


def _in_memory(tier: str) -> str:
    """The memory a tier's tensors occupy: nvme-tier state is staged in CPU memory."""
    return "device" if tier == "device" else "cpu"


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """The fixed layout of one adopted parameter on this rank (see the module docstring)."""

    uid: int  # the store's id of the parameter: names its swap keys
    shape: torch.Size
    dtype: torch.dtype  # the parameter's own dtype (what the graph computes in)
    device: torch.device  # the compute device (where gathered parameters live)
    compute_dtype: torch.dtype  # of the shard, of gathers and of reduce-scatters
    stage: int
    partition: str  # "allgather" (every rank an equal slice) | "broadcast" (one owner holds it whole)
    world_size: int
    rank: int
    owner: int | None  # partition="broadcast": the rank holding the whole parameter
    param_tier: str  # "device" | "cpu" | "nvme": where the shard rests between uses
    opt_tier: str  # "device" | "cpu" | "nvme": where the fp32 master and optimizer state rest
    tile_rows: tuple[int, ...] | None  # rows per row tile (the tile pass's plan), or None
    tile_align: int  # elements each tile's slot in the shard is padded to a multiple of
    bucket_bytes: int  # gathered bytes a bucket of the optimizer's own collectives may reach (stages 1-2)
    shard_numel: int  # elements of one rank's slice (allgather), padding included
    local_numel: int  # elements of this rank's shard (0 where it owns nothing)
    tile_shard_numels: tuple[int, ...]  # per tile: one rank's slice of it (allgather: padded to the world size)
    tile_local_ranges: tuple[tuple[int, int], ...]  # per tile: where this rank's slice sits in its shard
    # (first, stop, local_start): elements first:stop of the flat parameter sit at local_start in the shard,
    # master and moments; padding belongs to no range.
    local_ranges: tuple[tuple[int, int, int], ...]
    # (swap key, first element, elements) of the nvme-tier shard: one key, one per tile, or the master's.
    shard_swap: tuple[tuple[str, int, int], ...]
    state_groups: tuple[tuple[int, int], ...]  # (start, stop) of each optimizer sub-group of the local slice
    # nvme parameter and optimizer tiers, fp32 shard, untiled, trained: the shard is the fp32 master (no swap
    # file of its own; one copy on disk, no write-back after each step).
    params_in_master: bool
    # Stages 1-2 at world size 1, untiled, on the device in the parameter's own dtype, not read from a file:
    # the shard is the parameter's storage itself (the step updates it in place).
    shard_is_param: bool
    # The optimizer steps it during backward as its gradient lands (option overlap_optimizer): state on NVMe
    # (early_adam.py) or in host memory (early_host_adam.py).
    step_in_backward: bool
    requires_grad: bool = True  # the parameter's, when planned (a frozen one gets no gradient nor moments)
    # nvme optimizer tier: its fp32 gradient rests in RAM, within option nvme_grad_ram_bytes (the model's plan
    # decides, zinf_compiler/model_plan.py; the store reserves it), instead of in swap files.
    grad_in_ram: bool = False

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return self.shape.numel()

    @property
    def holding_dtype(self) -> torch.dtype:
        """The dtype of the master and of a checkpoint's values: fp32, or an integer parameter's own."""
        return self.dtype if not self.dtype.is_floating_point else torch.float32

    @property
    def gathered_numel(self) -> int:
        """Elements a gather of the whole parameter produces (padded to the world size)."""
        return self.shard_numel * self.world_size if self.partition == "allgather" else self.numel

    @property
    def row_numel(self) -> int:
        """Elements per row (first dimension) of the parameter."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else 0

    def tile_row_range(self, tile: int) -> tuple[int, int]:
        """The rows [start, stop) of row tile ``tile``."""
        start = sum(self.tile_rows[:tile])
        return start, start + self.tile_rows[tile]

    def tile_numel(self, tile: int) -> int:
        """Elements of row tile ``tile``."""
        return self.tile_rows[tile] * self.row_numel

    def tile_slot_numel(self, tile: int) -> int:
        """Elements ``tile`` takes in the local shard: its slice, padded to ``tile_align``."""
        return _ceil_div(self.tile_shard_numels[tile], self.tile_align) * self.tile_align

    @property
    def trained(self) -> bool:
        """Whether the optimizer steps it: a float parameter that requires a gradient (at stage 0 in its own
        storage, through ``param.grad``; at stages 1-3 through its fp32 master shard)."""
        return self.requires_grad and self.dtype.is_floating_point

    @property
    def common_numel(self) -> int:
        """Elements of the local state as every rank counts it: a broadcast parameter whole, as on its owner
        (what a choice every rank must make alike, the RAM cache's, is sized by)."""
        return self.shard_numel if self.partition == "allgather" else self.numel

    # --- the bytes it holds and moves: the one byte model (zinf.plan, the RAM cache, the pools read it) -------

    def state_bytes(self, grad_in_ram: bool = False, numel: int | None = None) -> dict[str, dict[str, int]]:
        """Bytes it puts on each tier (:data:`TIERS`) by kind (:data:`KINDS`) after backward, before the step:
        what ``zinf.memory_report`` counts for it then (its activations aside).  ``grad_in_ram``: an nvme
        optimizer tier's gradient kept in RAM (option nvme_grad_ram_bytes); ``numel``: the local elements
        counted (default this rank's; :attr:`common_numel` for a figure every rank shares)."""
        memory = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
        local = self.local_numel if numel is None else numel
        full = self.numel * self.dtype.itemsize
        if self.stage < 3:
            memory["device"]["params"] += full  # the parameter keeps its own storage
        if self.stage == 0:
            if self.trained:
                memory["device"]["grads"] += full
                memory["device"]["optimizer"] += 2 * full  # torch's Adam: two moments in the parameter's dtype
            return memory
        if not self.shard_is_param:
            memory[self.param_tier]["params"] += local * self.compute_dtype.itemsize
        if local == 0 or not self.dtype.is_floating_point:
            return memory
        if not self.trained:
            # A frozen parameter has no gradient nor moments, but keeps its fp32 master in memory where the shard
            # is not one (its exact value, which a checkpoint saves); on NVMe only the master's own files do.
            if self.opt_tier != "nvme" and not self.master_is_shard:
                memory[_in_memory(self.opt_tier)]["optimizer"] += local * 4
            return memory
        local_fp32 = local * 4
        if self.stage == 1:
            memory["device"]["grads"] += full  # param.grad, reduced into the shard at the step
        elif self.opt_tier == "nvme":
            memory["cpu" if grad_in_ram else "nvme"]["grads"] += local_fp32
        else:
            memory[_in_memory(self.opt_tier)]["grads"] += local_fp32
        if self.opt_tier == "nvme":
            memory["nvme"]["optimizer"] += 2 * local_fp32 + (0 if self.params_in_master else local_fp32)
        else:
            memory[_in_memory(self.opt_tier)]["optimizer"] += 2 * local_fp32 + (0 if self.master_is_shard else local_fp32)
        return memory

    @property
    def master_is_shard(self) -> bool:
        """The fp32 master is the shard itself (same tier, both in memory, fp32): no separate copy."""
        return self.param_tier == self.opt_tier != "nvme" and self.compute_dtype == torch.float32

    def traffic(self, grad_in_ram: bool = False, recompute: bool = False,
                numel: int | None = None) -> tuple[int, int, int]:
        """(disk read, disk write, collective) bytes of one step on this rank (``numel`` as for
        :meth:`state_bytes`); ``recompute``: activation checkpointing re-runs the forward (and its fetches)."""
        trained = self.trained and self.stage > 0
        local = self.local_numel if numel is None else numel
        shard_bytes = local * self.compute_dtype.itemsize
        local_fp32 = local * 4
        read = write = 0
        if self.param_tier == "nvme":
            read += shard_bytes * (3 if recompute else 2)  # forward, backward (and the recompute's forward)
            if trained and not self.params_in_master:
                write += shard_bytes  # the stepped value written back
        if trained and self.opt_tier == "nvme":
            # Master and two moments; a step during backward takes the master the backward's fetch read
            # (runtime/optim/fetched_masters.py) where the parameter is read from its master's files.
            read += (2 if self.params_in_master and self.step_in_backward else 3) * local_fp32
            write += 3 * local_fp32
            if not grad_in_ram:
                read += local_fp32
                write += local_fp32
        collective = 0
        if self.world_size > 1:
            gathered = self.gathered_numel * self.compute_dtype.itemsize  # a gather's output, a reduction's input
            if self.stage == 3:
                collective += gathered * (3 if recompute else 2)  # gathers: forward, backward (and the recompute)
            elif self.stage > 0:
                collective += gathered  # the stepped shards published to every rank
            if trained:
                collective += gathered  # the gradient's reduce-scatter
            elif self.stage == 0 and self.requires_grad:
                collective += 2 * self.numel * self.dtype.itemsize  # the gradient's all-reduce
        return read, write, collective

    def host_device_bytes(self, recompute: bool = False) -> int:
        """Bytes copied between host memory and an accelerator per step on this rank: its shard fetched to the
        device for forward and backward (and the recompute's forward) where it rests on the host (cpu or nvme
        tier), its reduced gradient sent to the host where the optimizer steps there, and the stepped shard
        sent back where the parameter rests on the device but its optimizer does not."""
        shard_bytes = self.local_numel * self.compute_dtype.itemsize  # (at stages 1-2 the stepped slice)
        moved = 0
        if self.param_tier != "device":
            moved += shard_bytes * (3 if recompute else 2)
        if self.trained and self.opt_tier != "device":
            moved += self.local_numel * self.compute_dtype.itemsize
            if self.param_tier == "device":
                moved += shard_bytes
        return moved

    def swap_bytes(self, trained: bool) -> int:
        """Bytes of one copy of this rank's swap files for the parameter: the nvme-tier shard's own files
        (unless the shard is the master's) and, for a ``trained`` parameter on the nvme optimizer tier, the
        fp32 state of :data:`OPTIMIZER_STATES` (master, moments, gradient)."""
        nbytes = 0
        if self.param_tier == "nvme" and not self.params_in_master:
            nbytes += sum(numel for _, _, numel in self.shard_swap) * self.compute_dtype.itemsize
        if self.opt_tier == "nvme" and trained:
            nbytes += len(OPTIMIZER_STATES) * self.local_numel * 4
        return nbytes

    def state_key(self, state: str, index: int) -> str:
        """The swap key of optimizer state ``state`` (see :data:`OPTIMIZER_STATES`) of sub-group ``index``."""
        return state_key(state, self.uid, index)

    def state_swap(self, state: str) -> tuple[tuple[str, int, int], ...]:
        """(swap key, start, stop) of optimizer state ``state`` (see :data:`OPTIMIZER_STATES`), per sub-group."""
        return tuple((self.state_key(state, index), start, stop)
                     for index, (start, stop) in enumerate(self.state_groups))


def choose_owner(owned_numel_by_rank: dict[int, int], world_size: int) -> int:
    """partition="broadcast": the rank that holds the next parameter whole, the one owning the fewest
    elements so far (the lowest rank on a tie); adoption order decides, the same on every rank."""
    return min(range(world_size), key=lambda rank: (owned_numel_by_rank.get(rank, 0), rank))


def plan_param(*, uid: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stage: int,
               partition: str,
               param_dtype: torch.dtype, param_tier: str, opt_tier: str, world_size: int, rank: int,
               owner: int | None = None, tile_rows: Sequence[int] | None = None, bucket_bytes: int = 0,
               requires_grad: bool = True, from_file: bool = False, step_in_backward: bool | str = False,
               nvme_copies: int = 2) -> ParamPlan:
    """The plan of one parameter of ``shape`` and ``dtype`` on rank ``rank`` of ``world_size``.

    ``param_dtype``: the compute dtype of a float parameter (an integer or bool one keeps its own and is never
    tiled).  ``owner``: partition="broadcast", the rank that holds it whole.  ``tile_rows``: rows per tile
    (checked to split the rows; a 1-D parameter's rows are its elements), None: untiled.  ``requires_grad``,
    ``from_file`` (its values come from a weights file, never its own storage), ``step_in_backward`` (the
    option overlap_optimizer: True, False or "auto") and ``nvme_copies`` decide where the bytes live.
    """
    shape = torch.Size(shape)
    numel = shape.numel()
    exact = not dtype.is_floating_point  # counters and masks: kept exact in their own dtype, never trained
    compute_dtype = dtype if exact else param_dtype
    tile_rows = None if exact or tile_rows is None else tuple(int(rows) for rows in tile_rows)
    if tile_rows is not None and (not shape or sum(tile_rows) != shape[0] or min(tile_rows) < 1):
        raise ZinfStoreError(f"tile_rows {tile_rows} do not split the {tuple(shape)} parameter's rows")
    if partition == "broadcast" and owner is None:
        raise ZinfStoreError("partition='broadcast' needs the owner rank")
    allgather = partition == "allgather"
    holds = allgather or rank == owner
    nvme_tiles = tile_rows is not None and param_tier == "nvme" and allgather  # each tile a swap key of its own
    tile_align = ALIGNMENT // compute_dtype.itemsize if nvme_tiles else 1

    tile_shard_numels, tile_local_ranges, local_ranges = (), (), ()
    if tile_rows is not None:
        row_numel = numel // shape[0]
        tile_numels = [rows * row_numel for rows in tile_rows]
        tile_shard_numels = tuple(_ceil_div(n, world_size) if allgather else n for n in tile_numels)
        slots = [_ceil_div(n, tile_align) * tile_align for n in tile_shard_numels]
        starts = [sum(slots[:tile]) for tile in range(len(tile_rows))]
        shard_numel = sum(slots)
        if holds:
            tile_local_ranges = tuple((start, start + n) for start, n in zip(starts, tile_shard_numels))
        else:
            tile_local_ranges = ((0, 0),) * len(tile_rows)
        if allgather:
            ranges, tile_first = [], 0
            for tile_numel, slice_numel, slot_start in zip(tile_numels, tile_shard_numels, starts):
                first = tile_first + rank * slice_numel
                stop = min(first + slice_numel, tile_first + tile_numel)
                if stop > first:
                    ranges.append((first, stop, slot_start))
                tile_first += tile_numel
            local_ranges = tuple(ranges)
    else:
        shard_numel = _ceil_div(numel, world_size)
        if allgather:
            first, stop = rank * shard_numel, min((rank + 1) * shard_numel, numel)
            local_ranges = ((first, stop, 0),) if stop > first else ()
    if not allgather:
        local_ranges = ((0, numel, 0),) if holds else ()
    local_numel = shard_numel if allgather else (numel if holds else 0)
    state_groups = tuple(sub_groups(local_numel))

    params_in_master = (param_tier == "nvme" and opt_tier == "nvme" and stage > 0
                        and compute_dtype == torch.float32 and tile_align == 1 and requires_grad
                        and all(start * 4 % ALIGNMENT == 0 for start, _ in state_groups))
    if params_in_master:
        shard_swap = tuple((state_key("master", uid, index), start, stop - start)
                           for index, (start, stop) in enumerate(state_groups))
    elif tile_rows is None or tile_align == 1:
        shard_swap = ((param_key(uid), 0, local_numel),)
    else:
        shard_swap = tuple((tile_key(uid, tile), start, _ceil_div(n, tile_align) * tile_align)
                           for tile, ((start, _), n) in enumerate(zip(tile_local_ranges, tile_shard_numels)))
    shard_is_param = (stage in (1, 2) and world_size == 1 and allgather and tile_rows is None
                      and param_tier == "device" and not exact and compute_dtype == dtype and not from_file)
    # Where the optimizer may step during backward: state on NVMe (early_adam.py), or in host memory at
    # stages 2-3, whose gradients land in the store during backward (early_host_adam.py).
    nvme_early = stage == 3 and param_tier == "nvme" and opt_tier == "nvme" and nvme_copies == 2
    host_early = stage >= 2 and opt_tier == "cpu"
    if step_in_backward == "auto":
        # NVMe: on. With the compute on an accelerator the CPU and the disk idle through backward.
        # On a CPU device too since the gradients stay in RAM by default (nvme_grad_ram_bytes
        # "auto"): backward then writes no gradients, and the early step's reads and writes fill
        # the idle disk (1.04-1.29x at world 2, 1.02-1.32x at world 1 in three runs;
        # benchmarks/RESULTS.md, 2026-11-25). With every gradient written to disk it measured -12% to +10%.
        # Host memory: on beside an accelerator only, whose backward leaves the host's cores idle; on a CPU
        # device the backward uses them all, and the step's copies would take them from it.
        step_in_backward = nvme_early or (host_early and torch.device(device).type != "cpu")
    step_in_backward = bool(step_in_backward and (nvme_early or host_early) and not exact and requires_grad)
    return ParamPlan(uid=uid, shape=shape, dtype=dtype, device=torch.device(device), compute_dtype=compute_dtype,
                     stage=stage, partition=partition, world_size=world_size, rank=rank,
                     owner=owner if not allgather else None, param_tier=param_tier, opt_tier=opt_tier,
                     tile_rows=tile_rows, tile_align=tile_align, bucket_bytes=bucket_bytes, shard_numel=shard_numel, local_numel=local_numel,
                     tile_shard_numels=tile_shard_numels, tile_local_ranges=tile_local_ranges,
                     local_ranges=local_ranges, shard_swap=shard_swap, state_groups=state_groups,
                     params_in_master=params_in_master, shard_is_param=shard_is_param,
                     step_in_backward=step_in_backward, requires_grad=requires_grad)
