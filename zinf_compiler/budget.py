"""Budgets instead of tiers: ``zinf.plan(model, example_inputs, {"host_memory": ..., "device_memory": ...})``
chooses the options that fit them and step fastest (issue 38, "Budgets as options").

``host_memory`` bounds the process's peak RSS (bytes, a fraction of the memory
available such as ``0.5``, or ``"auto"``: options.budget_bytes); ``device_memory``
the device tier's bytes (on a CPU device they are host bytes too, inside the
RSS).  Every option set of a small grid (:data:`PLACEMENTS`: stage 2 and 3,
each state kind on the device, the cpu or NVMe) is predicted by the planner
(:func:`~zinf_compiler.planner.plan_blueprint`, the one home of the byte and
time rules; the model's fake run happens once).  For a placement with an NVMe
tier the chooser also sizes, within what the budget leaves:

* the RAM cache (option ``ram_cache_bytes``): the predicted peak RSS with
  nothing cached, subtracted from ``host_memory`` (less :data:`RSS_MARGIN`), is what the cached states
  may take (re-predicted and trimmed by any excess, :data:`CACHE_TRIES` times);
* the gradient RAM (``nvme_grad_ram_bytes``): every gradient in RAM or none,
  whichever fits and steps faster.

Of the option sets whose predicted peak RSS (the planner's
``Prediction.peak_rss`` with the process's own bytes) fits host_memory less
:data:`RSS_MARGIN`, and whose device bytes fit device_memory,
the one with the shortest predicted step wins (ties: the earlier in the grid,
which lists the less offloaded first).  Options the caller sets win: a
placement that contradicts one is not weighed, and nothing weighed fitting is
a :class:`BudgetError` naming the smallest budget (and the disk) that would fit.

The choice is made here, before compiling, and shown: the returned
``Prediction``'s ``options`` (``compile_options()`` for ``torch.compile``),
``candidates`` (every option set weighed, :func:`describe_choice`), a log line
on the ``zinf`` logger, and at run time the RAM cache's dump line.  Not chosen
here: activation checkpointing and tiling (the planner predicts activations as
eager autograd saves them, so neither could show a saving), the pinned pools
(their "auto" sizes, counted in the prediction).
"""

from __future__ import annotations

import logging
import tempfile
from fractions import Fraction
from typing import Any, Mapping, Sequence

import torch

from .cost_model import nominal_profile
from .options import SPECS_BY_NAME, ZinfOptionError, budget_bytes
from .blueprint import Blueprint, blueprint
from .planner import Prediction, plan_blueprint
from .planner import plan as plan_options
from .runtime.host_memory import available_bytes, ranks_on_node, rss_figures

log = logging.getLogger("zinf")

BUDGETS = ("host_memory", "device_memory")
PLACEMENT_KEYS = ("stage", "offload_param", "offload_optimizer")
# (stage, offload_param, offload_optimizer), the least offloaded first (it wins a tie).  Not weighed: the
# optimizer alone on NVMe.  Its predicted step is shorter than both states' on NVMe (fewer disk bytes), but
# the optimizer steps during backward only with both on NVMe (overlap_optimizer), which the planner does not
# model: measured 4.2 s against 1.8 s a step (benchmarks/budgets.py, 43M parameters, world size 1).
PLACEMENTS = (
    (2, "none", "none"),
    (3, "none", "none"),
    (2, "none", "cpu"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
)
# Times the RAM cache's share is re-predicted and trimmed by the predicted excess over host_memory.
CACHE_TRIES = 4
# Of host_memory, the share the predicted peak RSS leaves free: the planner's peak is within about 11% of the
# measured one (benchmarks/plan_accuracy.py) and under it with most state on NVMe (benchmarks/budgets.py).
RSS_MARGIN = Fraction(1, 20)
# What a BudgetError's smallest host_memory adds for the process's own growth before the caller asks again
# (the blueprint's fake run and torch's caches grew the RSS by 0.1-0.3 MiB a call: the exact figure named was
# refused when asked for); the figure is then rounded up to a whole MiB.
NAMED_BUDGET_SLACK = 4 << 20


class BudgetError(ZinfOptionError):
    """No option set fits the budgets (or the options the caller set do not)."""


def plan(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, options: Mapping | None = None,
         world_size: int | None = None, profile: Any = None, ranks_per_node: int | None = None,
         process_bytes: int | None = None, built_in_memory: bool = True,
         device: torch.device | str | None = None) -> Prediction:
    """``zinf.plan``: the planner's prediction for ``options`` (zinf_compiler/planner.py), or, where they name
    a budget (:func:`is_budget`), the prediction of the option set :func:`choose` picks.  ``built_in_memory``:
    False where the model will be made by ``zinf.materialize`` (never whole in RAM; see ``Prediction.peak_rss``).
    ``device``: where the model will train (default: its parameters' device; for a meta-device model this
    machine's GPU if it has one, else the CPU: blueprint.compute_device)."""
    options = dict(options or {})
    if not is_budget(options):
        return plan_options(model, example_inputs, options, world_size, profile, ranks_per_node, device)
    return choose(model, example_inputs, options, world_size, profile, ranks_per_node, process_bytes,
                  built_in_memory, device)


def is_budget(options: Mapping) -> bool:
    """Whether ``options`` name a budget to choose under: device_memory, or host_memory without an 'nvme'
    offload set (with one, host_memory is the RAM cache's budget, as the compile reads it: planned as such)."""
    if options.get("device_memory") is not None:
        return True
    return (options.get("host_memory") is not None
            and "nvme" not in (options.get("offload_param"), options.get("offload_optimizer")))


def choose(model: torch.nn.Module, example_inputs: Sequence[Any] | None, options: Mapping, world_size: int | None = None,
           profile: Any = None, ranks_per_node: int | None = None, process_bytes: int | None = None,
           built_in_memory: bool = True, device: torch.device | str | None = None) -> Prediction:
    """The prediction of the fastest option set that fits ``options``' budgets (see the module docstring), with
    ``budget`` and ``candidates`` set.  ``profile``: the rates the step is predicted at (default: the cost
    model's nominal ones for the device); ``process_bytes``: this process's RSS before the model (default: its
    RSS now less the model's allocated parameters and buffers); ``built_in_memory``: see
    ``Prediction.peak_rss``; ``device``: as for :func:`plan`."""
    if example_inputs is None:
        raise BudgetError("choosing options under a budget needs example_inputs (one batch): the activations and the "
                          "step's time decide it")
    budgets = _budget_bytes(options)
    fixed = {name: value for name, value in options.items() if name not in BUDGETS}
    model_blueprint = blueprint(model, example_inputs, device)
    if process_bytes is None:
        process_bytes = _process_bytes(model)
    profile = profile or nominal_profile(model_blueprint.device.type)
    if world_size is None:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    weighed = []  # (prediction, usable: False where it needs an nvme_path the caller did not give)
    for option_set in _option_sets(fixed, budgets, model_blueprint):
        nvme = "nvme" in (option_set.get("offload_param"), option_set.get("offload_optimizer"))
        usable = not nvme or "nvme_path" in fixed
        if nvme and not usable:  # (weighed all the same: the error says what a disk would allow)
            option_set["nvme_path"] = tempfile.gettempdir()
        prediction = _weigh(model_blueprint, option_set, budgets, process_bytes, world_size, profile,
                            ranks_per_node, built_in_memory)
        if not usable:
            prediction.options.pop("nvme_path")
        weighed.append((prediction, usable))
    fitting = [p for p, usable in weighed if usable and _fits(p, budgets)]
    if not fitting:
        raise BudgetError(_unfit(weighed, budgets, fixed, world_size))
    best = min(fitting, key=lambda p: p.step["predicted"])
    best.budget = budgets
    best.candidates = [p for p, _ in weighed]
    log.info("zinf: under %s chose %s (predicted peak RSS %s, step %.3f s)",
             ", ".join(f"{k}={_size(v)}" for k, v in budgets.items() if v is not None),
             _shown(best.compile_options()), _size(best.predicted_rss), best.step["predicted"])
    return best


def _budget_bytes(options: Mapping) -> dict[str, int | None]:
    """Each budget of ``options`` in bytes (None: not given)."""
    budgets = {}
    for name in BUDGETS:
        value = options.get(name)
        if value is None:
            budgets[name] = None
            continue
        try:
            parsed = SPECS_BY_NAME["host_memory"].parse(value)
        except ValueError as err:
            raise ZinfOptionError(f"bad value {value!r} for budget {name!r}: expected {err}") from None
        budgets[name] = budget_bytes(parsed, available_bytes(), ranks_on_node())
    return budgets


def _process_bytes(model: torch.nn.Module) -> int:
    """This process's RSS now, less the bytes of ``model``'s allocated (not meta) parameters and buffers."""
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
               if not t.is_meta and t.device.type == "cpu")
    return max(rss_figures()["VmRSS"] - held, 0)


def _option_sets(fixed: dict, budgets: dict, model: Blueprint) -> list[dict]:
    """The option sets weighed: :data:`PLACEMENTS` that agree with the ``fixed`` ones (all of them set: those
    alone), each with the gradient RAM variants of an NVMe optimizer tier and ``device_memory_limit``."""
    wanted = {name: SPECS_BY_NAME[name].parse(fixed[name]) for name in PLACEMENT_KEYS if name in fixed}
    placements = [dict(zip(PLACEMENT_KEYS, placement)) for placement in PLACEMENTS]
    placements = [p for p in placements if all(p[name] == value for name, value in wanted.items())] or [{}]
    all_grads = 4 * sum(param.numel() for _, param in model.named)  # fp32 gradients of every parameter, bytes
    option_sets = []
    for placement in placements:
        option_set = {**placement, **fixed}
        if budgets["device_memory"] is not None:
            option_set.setdefault("device_memory_limit", budgets["device_memory"])
        if option_set.get("offload_optimizer") == "nvme" and "nvme_grad_ram_bytes" not in fixed:
            option_sets += [{**option_set, "nvme_grad_ram_bytes": grads} for grads in (all_grads, 0)]
        else:
            option_sets.append(option_set)
    return option_sets


def _weigh(model: Blueprint, option_set: dict, budgets: dict, process_bytes: int, world_size: int, profile: Any,
           ranks_per_node: int | None, built_in_memory: bool = True) -> Prediction:
    """``option_set``'s prediction with its peak RSS (``predicted_rss``); with an NVMe tier and a host budget,
    the RAM cache given what the budget leaves (see the module docstring)."""
    def predict(extra: dict) -> Prediction:
        prediction = plan_blueprint(model, {**option_set, **extra}, world_size, profile, ranks_per_node)
        prediction.predicted_rss = prediction.peak_rss(process_bytes, built_in_memory)
        return prediction

    host = budgets["host_memory"]
    nvme = "nvme" in (option_set.get("offload_param"), option_set.get("offload_optimizer"))
    if not nvme or "ram_cache_bytes" in option_set:
        return predict({})
    if host is None:
        return predict({"ram_cache_bytes": 0})
    room = _room(host)
    uncached = predict({"host_memory": host, "ram_cache_bytes": 0})
    cache_bytes = room - uncached.predicted_rss
    for _ in range(CACHE_TRIES):
        if cache_bytes <= 0:
            break
        cached = predict({"host_memory": host, "ram_cache_bytes": cache_bytes})
        if cached.predicted_rss <= room:
            return cached
        cache_bytes -= cached.predicted_rss - room
    return uncached


def _room(host: int) -> int:
    """What of ``host_memory`` the predicted peak RSS may take (less :data:`RSS_MARGIN`)."""
    return int(host * (1 - RSS_MARGIN))


def _smallest_host(predicted_rss: int) -> int:
    """The smallest host_memory to name for ``predicted_rss``: one whose :func:`_room` holds it with
    :data:`NAMED_BUDGET_SLACK` to spare, in whole MiB (so that asking for it again fits)."""
    exact = -(-(predicted_rss + NAMED_BUDGET_SLACK) * RSS_MARGIN.denominator
              // (RSS_MARGIN.denominator - RSS_MARGIN.numerator))
    return -(-exact // (1 << 20)) * (1 << 20)


def _fits(prediction: Prediction, budgets: dict) -> bool:
    host, device = budgets["host_memory"], budgets["device_memory"]
    return ((host is None or prediction.predicted_rss <= _room(host))
            and (device is None or prediction.tier_total("device") <= device))


def _unfit(weighed: list, budgets: dict, fixed: dict, world_size: int) -> str:
    """Why nothing fits: the budgets, and the smallest that would (with its options and disk)."""
    given = ", ".join(f"{name}={_size(value)}" for name, value in budgets.items() if value is not None)
    under = f" with the options set ({_shown(fixed)})" if fixed else ""
    lines = [f"no option set fits {given} for this model at world size {world_size}{under}."]
    predictions = [p for p, _ in weighed]
    if budgets["device_memory"] is not None:
        on_device = [p for p in predictions if p.tier_total("device") <= budgets["device_memory"]]
        if not on_device:
            least = min(predictions, key=lambda p: p.tier_total("device"))
            lines.append(f"The least device memory any needs is {_size(least.tier_total('device'))} "
                         f"({_shown(least.compile_options())}): raise device_memory to at least that.")
            return " ".join(lines)
        predictions = on_device
    least = min(predictions, key=lambda p: p.predicted_rss)
    smallest = _smallest_host(least.predicted_rss)
    disk = f", and {_size(least.swap_space)} of disk at nvme_path" if least.swap_space else ""
    shown = {k: v for k, v in least.compile_options().items() if k != "host_memory"}
    lines.append(f"The smallest host_memory that fits is {_size(smallest)} ({smallest:,} bytes: the predicted peak "
                 f"RSS, the process's own included, and a {float(RSS_MARGIN):.0%} margin, rounded up) with {_shown(shown)}{disk}.")
    if "nvme_path" not in fixed and least.swap_space:
        lines.append("Give an nvme_path to let zinf stream state from disk.")
    return " ".join(lines)


def _size(nbytes: int | None) -> str:
    """``nbytes`` for a message: GiB from 1 GiB up, else MiB (a small model's budget reads as more than 0.01 GiB)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _shown(options: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items() if k != "nvme_path") or "defaults"


def describe_choice(chosen: Prediction) -> str:
    """A table of every option set :func:`choose` weighed: its options, predicted peak RSS and device bytes,
    whether it fits, the predicted step; the chosen one marked."""
    budgets = chosen.budget or {}
    lines = ["| options | peak RSS (MiB) | device (MiB) | fits | step (s) |", "|---|---|---|---|---|"]
    for prediction in chosen.candidates:
        mark = "**chosen**: " if prediction is chosen else ""
        fits = "yes" if _fits(prediction, {**dict.fromkeys(BUDGETS), **budgets}) else "no"
        shown = {k: v for k, v in prediction.compile_options().items() if k != "host_memory"}  # (the budget)
        lines.append(f"| {mark}{_shown(shown)} | {prediction.predicted_rss / 2**20:,.0f} | "
                     f"{prediction.tier_total('device') / 2**20:,.1f} | {fits} | {prediction.step['predicted']:.3f} |")
    return "\n".join(lines)
