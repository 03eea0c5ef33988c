"""A model's plan on one rank: every parameter's layout and the bytes the model holds and moves, from one
pure function.

:func:`plan_model` takes what decides the layout (each parameter's shape,
dtype and tile rows, the options, the mesh's size and this rank) and what the
process has already spent (:class:`PlanBudgets`: the gradient RAM left, the
broadcast owners so far, the RAM the RAM cache's earlier choices hold, the
pinned pool), and returns a frozen :class:`ModelPlan`:

* each parameter's :class:`~zinf_compiler.runtime.param_plan.ParamPlan`, with
  the tiers the RAM cache chose for it (option ``host_memory`` /
  ``ram_cache_bytes``, :mod:`.ram_cache`), its owner rank
  (``partition="broadcast"``), its store uid and whether its gradient rests in
  RAM (option ``nvme_grad_ram_bytes``): what the store adopts it by;
* the bytes per tier and kind after backward (the figures
  ``zinf.memory_report`` gives then), the disk, collective and host-device
  bytes per step, the swap space, and the pinned pools the model needs.

The byte model itself is each plan's (``ParamPlan.state_bytes``, ``traffic``,
``host_device_bytes``; runtime/param_plan.py) and the pools' formulas are
runtime/pool_sizes.py's: this module adds them up.  Adoption
(zinf_compiler/adoption.py: the backend and ``zinf.materialize``) and
``zinf.plan`` (zinf_compiler/planner.py, and through it the budgets) both
plan a model here, so what a run holds is what the plan said.

Pure: no process group, no store, no I/O.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from . import ram_cache
from .options import ZinfOptions
from .runtime.param_plan import ParamPlan, choose_owner, plan_param
from .runtime.pool_sizes import early_step_pool_bytes, optimizer_pool_bytes, parameter_pool_bytes
from .runtime.records import DTYPES
from .runtime.tensor_parallel import local_of
from .runtime.tiers import KINDS, TIERS, store_tier

PINNED_CONSUMERS = ("parameters", "activations", "early_optimizer", "optimizer")  # runtime/pinned.py's quotas


@dataclasses.dataclass(frozen=True)
class PlannedParam:
    """What :func:`plan_model` reads of one parameter (real or on the meta device)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    tile_rows: tuple[int, ...] | None = None  # the tile pass's rows per tile, None: untiled
    from_file: bool = False  # its values come from a weights file (zinf.materialize), never its own storage

    @classmethod
    def of(cls, name: str, param: torch.Tensor, tile_rows=None, from_file: bool = False) -> "PlannedParam":
        """The planned view of ``param`` (a DTensor: its local tensor, which the store adopts, and its own
        requires_grad, which the local tensor does not carry)."""
        held = local_of(param)
        return cls(name, torch.Size(held.shape), held.dtype, param.requires_grad,
                   None if tile_rows is None else tuple(tile_rows), from_file)


@dataclasses.dataclass(frozen=True)
class PlanBudgets:
    """What the process has spent or promised before this model (all empty for ``zinf.plan``'s fresh process).

    ``grad_ram_left``: bytes of option nvme_grad_ram_bytes left for this model's nvme-tier gradients (resolved:
    "auto" is the store's fixed figure); ``owned_numel_by_rank``: elements each rank owns whole so far
    (``partition="broadcast"``); ``host_memory``: option host_memory resolved to bytes (None: no RAM cache
    budget); ``cache_held_bytes`` / ``cache_states_bytes``: RAM the adopted parameters already hold, as
    :func:`.ram_cache.held_by_records` / ``states_held_by_records`` count it; ``pinned_capacity``: the
    parameters' pinned pool, if made; else ``pool_sizing_plans``: the plans it will be sized from besides
    this model's (runtime/store_offload.py).
    """

    grad_ram_left: int = 0
    owned_numel_by_rank: Mapping[int, int] = dataclasses.field(default_factory=dict)
    host_memory: int | None = None
    cache_held_bytes: int = 0
    cache_states_bytes: int = 0
    pinned_capacity: int | None = None
    pool_sizing_plans: tuple = ()


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """One model's parameters on one rank, laid out, and what they hold and move (see the module docstring)."""

    names: tuple[str, ...]
    plans: tuple[ParamPlan, ...]  # in the order planned (adoption order), each with its uid
    # The plans as the options name the tiers, before the RAM cache's choice: what sizes the pinned pool.
    sizing_plans: tuple[ParamPlan, ...]
    memory: Mapping[str, Mapping[str, int]]  # tier -> kind -> bytes after backward (activations: not planned here)
    disk_read: int
    disk_write: int
    collective: int
    host_device: int  # bytes between host memory and an accelerator per step (0 on a CPU device)
    swap_space: int  # bytes nvme_path needs, every copy
    # fp32 gradient copies the step during backward holds in RAM until it stepped them (nvme optimizer tier,
    # gradients on disk): at most all of them at once, a peak (runtime/optim/early_adam.py).
    early_step_grads: int
    pinned: Mapping[str, int]  # consumer -> bytes of the pinned pool it needs (runtime/pool_sizes.py)


def plan_model(params: Sequence[PlannedParam], options: ZinfOptions, *, world_size: int, rank: int,
               device: torch.device, budgets: PlanBudgets = PlanBudgets(), first_uid: int = 0) -> ModelPlan:
    """The :class:`ModelPlan` of ``params`` (in adoption order) under ``options`` on ``rank`` of ``world_size``
    (the mesh's shard group), computing on ``device``, after what ``budgets`` says the process spent; the
    parameters get the uids ``first_uid``, ``first_uid + 1``, ... (their swap keys' names)."""
    device = torch.device(device)
    param_tier, opt_tier = store_tier(options.offload_param), store_tier(options.offload_optimizer)
    owned = dict(budgets.owned_numel_by_rank)
    owners = []
    for param in params:
        owner = None
        if options.partition == "broadcast":
            owner = choose_owner(owned, world_size)
            owned[owner] = owned.get(owner, 0) + param.shape.numel()
        owners.append(owner)

    def planned(index: int, param_tier: str, opt_tier: str) -> ParamPlan:
        param = params[index]
        return plan_param(uid=first_uid + index, shape=param.shape, dtype=param.dtype, device=device,
                          stage=options.stage, partition=options.partition, param_dtype=DTYPES[options.param_dtype],
                          param_tier=param_tier, opt_tier=opt_tier, world_size=world_size, rank=rank,
                          owner=owners[index], tile_rows=param.tile_rows, bucket_bytes=options.bucket_bytes,
                          requires_grad=param.requires_grad, from_file=param.from_file,
                          step_in_backward=options.overlap_optimizer, nvme_copies=options.nvme_copies)

    sizing = [planned(index, param_tier, opt_tier) for index in range(len(params))]
    # The parameters' pinned pool: the one made (grown to fit these too, with "auto"), or the one that will be.
    pool_plans = list(budgets.pool_sizing_plans) + sizing
    auto = options.pinned_bytes == "auto"
    pool_bytes = (parameter_pool_bytes(max([plan.local_numel * 4 for plan in pool_plans] + [0]), pool_plans) if auto
                  else int(options.pinned_bytes))
    if budgets.pinned_capacity is not None:
        pool_bytes = max(budgets.pinned_capacity, pool_bytes) if auto else budgets.pinned_capacity
    plans = sizing
    recompute = options.activation_checkpointing != "none"
    if options.host_memory is not None or options.ram_cache_bytes is not None:
        states_bytes = (None if options.ram_cache_bytes is None
                        else options.ram_cache_bytes - budgets.cache_states_bytes)
        existing = 0 if budgets.pinned_capacity is None else pool_bytes
        tiers = ram_cache.choose_tiers(sizing, planned, budgets.host_memory, budgets.cache_held_bytes,
                                       existing, pool_bytes, states_bytes=states_bytes,
                                       grad_ram_bytes=budgets.grad_ram_left, recompute=recompute)
        plans = [plan if (pt, ot) == (plan.param_tier, plan.opt_tier) else planned(index, pt, ot)
                 for index, (plan, (pt, ot)) in enumerate(zip(sizing, tiers))]
    plans = _grads_in_ram(plans, budgets.grad_ram_left)
    return _totals(params, plans, sizing, options, device, recompute, pool_bytes)


def _grads_in_ram(plans: list[ParamPlan], grad_ram_left: int) -> list[ParamPlan]:
    """The plans with ``grad_in_ram`` set for the nvme-tier gradients that fit ``grad_ram_left``, in order (the
    rule the store reserves them by: first come, first served)."""
    laid_out = []
    for plan in plans:
        grad_bytes = plan.local_numel * 4
        if plan.opt_tier == "nvme" and plan.dtype.is_floating_point and 0 < grad_bytes <= grad_ram_left:
            plan = dataclasses.replace(plan, grad_in_ram=True)
            grad_ram_left -= grad_bytes
        laid_out.append(plan)
    return laid_out


def _totals(params: Sequence[PlannedParam], plans: list[ParamPlan], sizing: list[ParamPlan], options: ZinfOptions,
            device: torch.device, recompute: bool, pool_bytes: int) -> ModelPlan:
    memory = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
    read = write = collective = host_device = swap_space = early_step_grads = 0
    for plan in plans:
        for tier, kinds in plan.state_bytes(plan.grad_in_ram).items():
            for kind, nbytes in kinds.items():
                memory[tier][kind] += nbytes
        moved = plan.traffic(plan.grad_in_ram, recompute)
        read, write, collective = read + moved[0], write + moved[1], collective + moved[2]
        if device.type == "cuda":
            host_device += plan.host_device_bytes(recompute)
        swap_space += options.nvme_copies * plan.swap_bytes(trained=plan.requires_grad)
        if plan.opt_tier == "nvme" and plan.step_in_backward and not plan.grad_in_ram and plan.trained:
            early_step_grads += plan.local_numel * 4
    pinned = dict.fromkeys(PINNED_CONSUMERS, 0)
    if any("nvme" in (plan.param_tier, plan.opt_tier) for plan in plans):  # (what reads and writes swap)
        pinned["parameters"] = pool_bytes
    # The NVMe optimizer's buffers: the early step's pool, which the step after backward borrows; without an
    # early step, a pool of the late step's own (runtime/optim/nvme_adam.py).
    stepped_on_disk = [plan for plan in plans if plan.opt_tier == "nvme" and plan.local_numel and plan.requires_grad]
    early = [plan for plan in stepped_on_disk if plan.step_in_backward]
    if early:
        pinned["early_optimizer"] = early_step_pool_bytes(early, stepped_on_disk)
    elif stepped_on_disk:
        pinned["optimizer"] = optimizer_pool_bytes(stepped_on_disk)
    frozen = MappingProxyType({tier: MappingProxyType(kinds) for tier, kinds in memory.items()})
    return ModelPlan(names=tuple(param.name for param in params), plans=tuple(plans), sizing_plans=tuple(sizing),
                     memory=frozen, disk_read=read, disk_write=write, collective=collective, host_device=host_device,
                     swap_space=swap_space, early_step_grads=early_step_grads, pinned=MappingProxyType(pinned))
