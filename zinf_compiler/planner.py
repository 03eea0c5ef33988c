"""``zinf.plan``: what a model will hold and move on each rank under given options, before any run
(the command line: ``python -m zinf_compiler.plan_cli``).

Nothing is allocated: the parameters are read for their shapes and dtypes
only (a model built under ``torch.device("meta")`` is fine), each gets the
plan adoption would give it (:func:`~zinf_compiler.model_plan.plan_model`, the
same pure function the store's parameters are laid out by, which also sums
their bytes), and the example inputs,
if given, run forward and backward once on fake tensors to count the FLOPs,
the bytes the other ops move and the bytes autograd saves for backward.

What it predicts, per rank (the rank holding the most):

* ``memory``: bytes per tier (device, cpu, nvme) and kind (params, grads,
  optimizer, activations) after backward, before the step: the figures
  ``zinf.memory_report`` gives at that point, by the same rules;
* ``pinned``: the staging pools per consumer (runtime/pool_sizes.py's formulas);
* ``early_step_grads``: the fp32 gradient copies the optimizer's step during
  backward holds in RAM until it has stepped them (NVMe optimizer tier,
  gradients not kept in RAM): at most every such gradient at once, a peak;
* ``swap_space``: the bytes ``nvme_path`` needs (every copy, see ``nvme_copies``);
* ``disk_read`` / ``disk_write`` / ``collective`` / ``host_device``: bytes per
  step (the last: copies between host memory and an accelerator);
* ``step``: seconds of compute (the matmuls' FLOPs at the probed matmul rate
  and the other ops' bytes at the probed memory rate, a recompute forward
  added under activation checkpointing, and what tiling adds: see
  :func:`_tiling_bytes`), disk, collectives and host-device copies at the
  probed rates, and ``predicted``: on an accelerator the longest of them, on a
  CPU device their sum (they share its cores), plus the CPU optimizer's pass
  over the state it steps (bound by host memory; on a CPU device every tier's);
* ``peak_rss(process_bytes)``: the rank's peak RSS, from the process's own
  before the model and two calibrated terms (see :meth:`Prediction.peak_rss`).

Approximations, stated: activations are what eager autograd saves (an upper
bound under activation checkpointing, which saves less); the fp16 scaler's and
the optimizer's step counters (a few bytes per parameter) are left out; a
broadcast-partitioned parameter's owner follows adoption's rule in parameter
order, which is the graph's order only where they agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from .blueprint import Blueprint, blueprint
from .model_plan import PlanBudgets, PlannedParam, plan_model
from .options import ZinfOptions, budget_bytes, parse_options
from .runtime.host_memory import available_bytes, ranks_on_node
from .runtime.pool_sizes import auto_grad_ram_bytes
from .runtime.records import DTYPES
from .tile_plan import tile_rows_for
# What compiling and running a model's graphs keeps in RSS beyond its tensors (Dynamo, AOTAutograd and
# Inductor's state, the generated code, allocator slack): measured 89-157 MiB for the benchmark's GPT and
# Llama (4 layers, width 512) at world size 1 (benchmarks/plan_accuracy.py, 2026-11-26).
COMPILE_BYTES = 128 << 20
# At world size > 1: gathered parameters and unreduced gradients in flight, in units of the whole model's
# compute-dtype bytes (measured: 1.0-1.3 of them above COMPILE_BYTES at world size 2, stages 2 and 3).
# An overestimate for a model far larger than its buckets (max_live_bytes bounds the gathered ones).
IN_FLIGHT_MODELS = 1
# Bytes the CPU Adam pass moves per fp32 element it steps: it reads the master, two moments and the
# gradient and writes the master and two moments.
ADAM_BYTES_PER_ELEMENT = 7 * 4
# The host-memory early step (runtime/optim/early_host_adam.py) copies master and moments first: 12 bytes read, 12 written.
EARLY_COPY_BYTES_PER_ELEMENT = 6 * 4


@dataclasses.dataclass
class Prediction:
    """One option set's prediction for one rank (see the module docstring)."""

    options: dict
    world_size: int
    rank: int
    memory: dict[str, dict[str, int]]
    pinned: dict[str, int]
    swap_space: int
    disk_read: int
    disk_write: int
    collective: int
    host_device: int = 0  # bytes copied between host memory and an accelerator per step (0 on a CPU device)
    model_bytes: int = 0  # the whole model's parameters in compute dtype
    built_bytes: int = 0  # the whole model's parameters as built (their own dtypes), before zinf adopts them
    flops: int | None = None
    step: dict[str, float] | None = None
    # fp32 gradient copies the step during backward (runtime/optim/early_adam.py, ``start(owned=True)``) holds in RAM
    # until it has stepped them, for parameters whose gradient rests on NVMe: the runtime counts them as transient
    # cpu bytes (measured: up to 62% of them at once on the budgets GPT, varying step to step as the disk lags);
    # predicted at their whole, the bound.
    early_step_grads: int = 0
    # Set where zinf_compiler/budget.py chose the options: the budgets in bytes, the peak RSS it predicted
    # (with the process's own bytes), and every option set it weighed (a Prediction each, with its peak_rss).
    budget: dict[str, int] | None = None
    predicted_rss: int | None = None
    candidates: list = dataclasses.field(default_factory=list)

    def compile_options(self) -> dict:
        """The options to compile the model with: :attr:`options` less the planner's own ``device`` entry."""
        return {key: value for key, value in self.options.items() if key != "device"}

    def tier_total(self, tier: str) -> int:
        """Bytes on ``tier`` of every kind."""
        return sum(self.memory[tier].values())

    def host_bytes(self) -> int:
        """Host memory zinf holds on this rank: the cpu tier, the pinned pools and, on a CPU device, the
        device tier too (the process's own libraries and Python objects are not counted), at its peak: the
        gradients the step during backward holds (:attr:`early_step_grads`) included."""
        on_host = self.tier_total("cpu") + sum(self.pinned.values()) + self.early_step_grads
        if self.options.get("device", "cpu") == "cpu":
            on_host += self.tier_total("device")
        return on_host


    def peak_rss(self, process_bytes: int, built_in_memory: bool = True) -> int:
        """The rank's predicted peak RSS: ``process_bytes`` (the process before the model is built: Python,
        torch, zinf and the model's own libraries imported), :meth:`host_bytes`, what compiling and running
        the graphs keeps (:data:`COMPILE_BYTES`) and, at world size > 1, the collectives' staging: the
        gathered parameters and the unreduced gradients in flight, one model's worth of compute-dtype bytes
        (:data:`IN_FLIGHT_MODELS`).  The last two are calibrated (benchmarks/plan_accuracy.py, RESULTS.md).

        ``built_in_memory`` (``torch.compile(GPT(cfg), ...)``; not with ``zinf.materialize``): the model's
        parameters as built stay in RAM until the first call adopts them, beside the pinned pools and the
        compile, so the peak is at least that (it is the peak where the states then leave for NVMe).
        """
        in_flight = IN_FLIGHT_MODELS * self.model_bytes if self.world_size > 1 else 0
        running = process_bytes + self.host_bytes() + COMPILE_BYTES + in_flight
        if not built_in_memory:
            return running
        return max(running, process_bytes + self.built_bytes + sum(self.pinned.values()) + COMPILE_BYTES)


def plan(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, options: Mapping | None = None,
         world_size: int | None = None, profile: Any = None, ranks_per_node: int | None = None,
         device: torch.device | str | None = None) -> Prediction:
    """Predict, for ``options`` at ``world_size`` ranks (default: the process group's, else 1), what the
    rank that holds the most keeps on each tier and moves per step (see the module docstring).

    ``example_inputs``: one batch (positional arguments of the model); without it activations, FLOPs and
    the step's time are not predicted.  ``ranks_per_node``: ranks sharing one machine's disk and memory
    bandwidth (default: every rank, one machine); ``profile``'s rates are taken as one rank's share of
    compute (measure it with the threads a rank will have) and as the whole machine's disk and memory
    bandwidth.  ``profile``: a
    :class:`~zinf_compiler.cost_model.MachineProfile` for the step's time (None: no time predicted).
    ``device``: where the model will train (default: :func:`~zinf_compiler.blueprint.compute_device`; a
    meta-device model on a machine with a GPU is planned for the GPU).
    Options naming budgets (host_memory without the tiers, device_memory): ``zinf.plan`` is
    zinf_compiler/budget.py's, which chooses the options and calls :func:`plan_blueprint` for each.
    """
    return plan_blueprint(blueprint(model, example_inputs, device), options, world_size, profile, ranks_per_node)


def plan_blueprint(model: Blueprint, options: Mapping | None = None, world_size: int | None = None,
                   profile: Any = None, ranks_per_node: int | None = None) -> Prediction:
    """:func:`plan` of a model's :class:`Blueprint`."""
    parsed = parse_options(dict(options or {}))
    if world_size is None:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    best = None
    for rank in range(world_size):
        prediction = _plan_rank(model, parsed, options or {}, world_size, rank, profile, ranks_per_node or world_size)
        if best is None or prediction.host_bytes() + prediction.tier_total("device") > \
                best.host_bytes() + best.tier_total("device"):
            best = prediction
    return best


def _plan_rank(model: Blueprint, options: ZinfOptions, asked: Mapping, world_size: int, rank: int, profile: Any,
               sharing: int) -> Prediction:
    named, saved, flops = model.named, model.saved, model.flops
    grad_ram = options.nvme_grad_ram_bytes
    if grad_ram == "auto":
        grad_ram = auto_grad_ram_bytes(available_bytes(), ranks_on_node())
    recompute = options.activation_checkpointing != "none"
    planned = []
    tiling_moved = 0  # bytes the tile pass's rewrite moves beyond the untiled model's ops
    for name, param in named:
        itemsize = torch.empty((), dtype=param.dtype).element_size() if param.dtype.is_floating_point else 1
        tile_rows = (tile_rows_for(name, param.shape, param.numel() * itemsize, options, world_size,
                                   options.device_memory_limit, 0) if options.stage == 3 else None)
        planned.append(PlannedParam.of(name, param, tile_rows))
        if tile_rows is not None and len(tile_rows) > 1 and name in model.weight_matmuls:
            compute_itemsize = DTYPES[options.param_dtype].itemsize if param.dtype.is_floating_point else itemsize
            tiling_moved += _tiling_bytes(*model.weight_matmuls[name], len(tile_rows), compute_itemsize)
    host_memory = (None if options.host_memory is None else
                   budget_bytes(options.host_memory, available_bytes(), ranks_on_node()))
    # A fresh process: nothing adopted, no pinned pool yet, the whole gradient RAM budget left.
    budgets = PlanBudgets(grad_ram_left=int(grad_ram), host_memory=host_memory)
    model_plan = plan_model(planned, options, world_size=world_size, rank=rank, device=model.device, budgets=budgets)
    plans = model_plan.plans
    memory = {tier: dict(kinds) for tier, kinds in model_plan.memory.items()}
    if saved is not None:
        memory["device"]["activations"] = saved
    accelerated = model.device.type == "cuda"
    # fp32 elements the optimizer steps on the CPU (cpu, nvme and, on a CPU device, all tiers)
    host_stepped = sum(plan.local_numel if plan.stage > 0 else plan.numel for plan in plans
                       if plan.trained and (plan.opt_tier != "device" or not accelerated))
    step = None
    if profile is not None and flops is not None:
        host_early = accelerated and any(p.step_in_backward and p.opt_tier == "cpu" for p in plans)
        step = _step_seconds(flops, model.moved or 0, tiling_moved, recompute, model_plan.disk_read,
                             model_plan.disk_write, model_plan.collective, model_plan.host_device, host_stepped,
                             profile, sharing, overlapped=accelerated, optimizer_in_backward=host_early)
    shown = {key: value for key, value in dict(asked).items() if key != "mesh"}
    shown.setdefault("device", model.device.type)
    model_bytes = sum(plan.numel * plan.compute_dtype.itemsize for plan in plans)
    built_bytes = sum(param.numel() * param.element_size() for _, param in named)
    return Prediction(options=shown, world_size=world_size, rank=rank, memory=memory, pinned=dict(model_plan.pinned),
                      swap_space=model_plan.swap_space, disk_read=model_plan.disk_read,
                      disk_write=model_plan.disk_write, collective=model_plan.collective,
                      host_device=model_plan.host_device, model_bytes=model_bytes, built_bytes=built_bytes,
                      flops=flops, step=step, early_step_grads=model_plan.early_step_grads)


def _tiling_bytes(inputs: int, outputs: int, tiles: int, itemsize: int) -> int:
    """Bytes the tile pass's rewrite of ``x @ W.T`` into ``tiles`` row tiles (passes/tile.py) reads and writes
    beyond the untiled matmuls, for ``inputs`` elements of x and ``outputs`` of the product: forward, the tiles'
    products are concatenated (each output read and written once more); backward, the output gradient's
    column slices are copied for the input gradient's and the weight gradient's matmuls (read and written twice),
    the input gradient is accumulated over the tiles (read and written once per tile after the first) and x is
    read by each tile's weight-gradient matmul (once per tile after the first).  Measured without this term: the
    plan_accuracy GPT tiled by 4 stepped 11% slower than untiled on the device (RESULTS.md, 2026-11-27)."""
    return itemsize * (2 * outputs + 2 * outputs + 2 * (tiles - 1) * inputs + (tiles - 1) * inputs)


def _step_seconds(flops: int, moved: int, tiling_moved: int, recompute: bool, read: int, write: int,
                  collective: int, host_device: int, host_stepped: int, profile: Any, sharing: int,
                  overlapped: bool, optimizer_in_backward: bool = False) -> dict[str, float | None]:
    """Seconds of one step's parts at ``profile``'s rates, and the predicted step (see the module docstring);
    ``sharing`` ranks move their bytes through one disk and one memory bus at once.  ``overlapped`` (an
    accelerator computes): the disk and the collectives hide under the compute, the step is the longest of
    them; on a CPU device the compute, the I/O's own CPU work and the optimizer share the cores, and the
    parts add up (measured: benchmarks/plan_accuracy.py).  Compute: the matmuls' FLOPs at the probed matmul
    rate and the other ops' bytes (``moved``) at the probed memory rate, both one rank's own work at the rates
    of the threads it has, with ``tiling_moved`` (the tile pass's own bytes, also shown alone as ``tiling``);
    the recompute under activation checkpointing adds a forward, a third of both.  On an accelerator the
    host-device copies (``host_device`` bytes, each rank over its own link) at the probed rate overlap too; the
    optimizer's pass over the state it steps on the host runs at the host memory's rate, after the rest, or
    (``optimizer_in_backward``: the host-memory early step) from the start of backward, with its copies' bytes
    (the forward, a third of the compute or a quarter with recompute, has no gradient to step)."""
    recompute_factor = 4 / 3 if recompute else 1
    tiling = tiling_moved / profile.memory_bandwidth * recompute_factor
    compute = (flops / profile.matmul_flops + moved / profile.memory_bandwidth) * recompute_factor + tiling
    disk = 0.0
    if read or write:
        disk = sharing * (read / (profile.disk_read or profile.memory_bandwidth) + write / (
            profile.disk_write or profile.memory_bandwidth))
    # (No measured rate, e.g. planning world size 2 from one process: left out of the prediction, shown as -.)
    wire = (collective / profile.collective if profile.collective else None) if collective else 0.0
    transfer = host_device / profile.host_to_device
    if overlapped and optimizer_in_backward:
        optimizer = (sharing * host_stepped * (ADAM_BYTES_PER_ELEMENT + EARLY_COPY_BYTES_PER_ELEMENT)
                     / profile.host_bandwidth)
        forward = compute / (4 if recompute else 3)
        predicted = max(compute, disk, wire or 0.0, transfer, forward + optimizer)
    else:
        optimizer = sharing * host_stepped * ADAM_BYTES_PER_ELEMENT / profile.host_bandwidth
        predicted = (max(compute, disk, wire or 0.0, transfer) if overlapped else compute + disk + (wire or 0.0)) + optimizer
    return {"compute": compute, "tiling": tiling, "disk": disk, "collective": wire, "transfer": transfer,
            "optimizer": optimizer, "predicted": predicted}


def describe(predictions: Sequence[Prediction]) -> str:
    """A table: one row per prediction (option set), bytes in MiB, seconds per step where predicted."""
    def mib(nbytes: int) -> str:
        return f"{nbytes / 2**20:,.1f}"

    head = ("| options | device | cpu | nvme | pinned | host (zinf) | swap space | disk r/w per step | "
            "collective per step | step (s): compute / disk / coll. / host-device / optim. -> predicted |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in predictions:
        options = ", ".join(f"{k}={v}" for k, v in p.options.items() if k != "device") or "defaults"
        step = "-"
        if p.step is not None:
            s = p.step
            wire = "-" if s["collective"] is None else f"{s['collective']:.3f}"
            step = (f"{s['compute']:.3f} / {s['disk']:.3f} / {wire} / {s['transfer']:.3f} / {s['optimizer']:.3f} -> "
                    f"**{s['predicted']:.3f}**")
        lines.append(f"| {options} | {mib(p.tier_total('device'))} | {mib(p.tier_total('cpu'))} | "
                     f"{mib(p.tier_total('nvme'))} | {mib(sum(p.pinned.values()))} | {mib(p.host_bytes())} | "
                     f"{mib(p.swap_space)} | {mib(p.disk_read)} / {mib(p.disk_write)} | {mib(p.collective)} | "
                     f"{step} |")
    return "\n".join(lines)

