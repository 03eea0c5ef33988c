"""The RAM cache over the NVMe tier (option ``host_memory``): which parameters' states stay in RAM.

With ``offload_optimizer="nvme"`` every trained parameter's fp32 master and
Adam moments are read and written once per step (twice their bytes), and
with ``offload_param="nvme"`` every stage-3 shard is read once per fetch
(forward and backward) and written after the step (three times its bytes).
Under a ``host_memory`` budget the states that save the most disk bytes per
byte of RAM stay on the cpu tier instead (:func:`choose_cached`; a parameter
with both on NVMe stays whole on one tier, :func:`cache_items`); the
arithmetic is the same on either tier, so the result is bit-equal to the
all-NVMe run.

Under option ``ram_cache_bytes`` (which ``zinf.plan`` sets when it chooses the options for a ``host_memory``
budget, zinf_compiler/budget.py) that many bytes of states are cached, less what earlier graphs cached.
Else the budget (:func:`states_budget`) is the process's: every model adopted
under ``host_memory`` spends from one tally, the RAM the store's live records
already hold (:func:`held_by_records`), first come first served in the order
graphs are adopted (a model split by graph breaks spends it graph by graph;
``zinf.materialize`` plans the whole model at once).  Of ``host_memory``,
a quarter is left for what this module cannot size (activations, the
process's own RSS: Python, torch, the compiled code), and the pinned pool
(once it exists; adoption.py makes it only if some state stays on NVMe) and
the trained parameters' fp32 gradients that rest in RAM (4 bytes per
element; those whose optimizer state stays on NVMe only within
``nvme_grad_ram_bytes``: :func:`grad_charge`) are taken before any state is
cached.  Not counted: the activations' own pinned pool (``offload_activations``).
Everything here is computed from sizes every rank shares (a broadcast
parameter counts whole, as on its owner), so every rank makes the same
choice without a collective.

Pure: no store, no I/O; the compile side (adoption.py) hands in plans and records.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Callable, Iterable, Sequence

# Of host_memory, the share left for activations and the process's own RSS.
HEADROOM_FRACTION = Fraction(1, 4)

OPTIMIZER = "optimizer"  # an item's kind: a parameter's master and moments (its opt_tier)
SHARD = "shard"  # an item's kind: a stage-3 parameter shard (its param_tier)
WHOLE = "whole"  # an item's kind: both, of a parameter with both on NVMe
NAMES_LISTED = 8  # parameter names a dump line lists of each kind
# A plan of the parameter at ``index`` on other tiers: (index, param_tier, opt_tier) -> ParamPlan.
Replan = Callable[[int, str, str], object]


@dataclasses.dataclass(frozen=True)
class CacheItem:
    """One state of one parameter that could rest in RAM instead of on NVMe."""

    index: int  # the parameter's position in adoption order (graph order)
    kind: str  # OPTIMIZER, SHARD or WHOLE
    held_bytes: int  # RAM it takes on the cpu tier
    moved_bytes: int  # disk bytes it moves per step on the nvme tier

    @property
    def rate(self) -> Fraction:
        """Disk bytes saved per step per byte of RAM held."""
        return Fraction(self.moved_bytes, max(self.held_bytes, 1))


def _trained(plan) -> bool:
    """Whether the optimizer holds state for ``plan``'s parameter (and a gradient lands in its tier)."""
    return plan.trained and plan.stage > 0


def _held_in_ram(plan) -> int:
    """RAM ``plan``'s shard and optimizer state take on the cpu tier (its gradient aside: :func:`grad_bytes`),
    as every rank counts them (the plan's own byte model, ``ParamPlan.state_bytes``)."""
    cpu = plan.state_bytes(numel=plan.common_numel)["cpu"]
    return cpu["params"] + cpu["optimizer"]


def _disk_moved(plan, recompute: bool) -> int:
    """Disk bytes ``plan``'s shard and optimizer state move per step (its gradient aside), as every rank counts
    them (``ParamPlan.traffic``)."""
    read, write, _ = plan.traffic(grad_in_ram=True, recompute=recompute, numel=plan.common_numel)
    return read + write


def cache_items(plans: Sequence, replan: Replan, recompute: bool = False) -> list[CacheItem]:
    """The cacheable states of ``plans`` (each a ``ParamPlan`` laid out for the nvme tiers, in adoption order;
    None: skip), each sized by the plans' byte model against its plan on the cpu tier (``replan``): an nvme
    optimizer state of a trained float parameter, read and written once a step, and an nvme stage-3 shard, read
    at each fetch (forward and backward) and written after the step.  A trained parameter with both on NVMe is
    one item, both kept in RAM or neither: the optimizer steps it during backward only while both rest on NVMe
    (overlap_optimizer; a parameter half in RAM would step after backward, on the step's critical path)."""
    items = []
    for index, plan in enumerate(plans):
        if plan is None or plan.common_numel == 0:
            continue
        optimizer = plan.opt_tier == "nvme" and _trained(plan)
        shard = plan.param_tier == "nvme"
        if optimizer and shard:
            kind, tiers = WHOLE, ("cpu", "cpu")
        elif optimizer:
            kind, tiers = OPTIMIZER, (plan.param_tier, "cpu")
        elif shard:
            kind, tiers = SHARD, ("cpu", plan.opt_tier)
        else:
            continue
        cached = replan(index, *tiers)
        items.append(CacheItem(index, kind, _held_in_ram(cached) - _held_in_ram(plan),
                               _disk_moved(plan, recompute) - _disk_moved(cached, recompute)))
    return items


def choose_cached(items: Iterable[CacheItem], budget: int) -> set[tuple[int, str]]:
    """The ``(index, kind)`` of the items to keep in RAM within ``budget`` bytes.

    Greedy by disk bytes saved per byte held, highest first (a shard, 3,
    before a whole parameter, then an optimizer state, 2); ties go to the
    earlier parameter.  An item that does not fit what is left is skipped and smaller
    ones after it may still fit.  Deterministic: a function of sizes alone.
    """
    chosen, left = set(), budget
    for item in sorted(items, key=lambda item: (-item.rate, item.index, item.kind)):
        if item.held_bytes <= left:
            chosen.add((item.index, item.kind))
            left -= item.held_bytes
    return chosen


def choose_tiers(plans: Sequence, replan: Replan, host_memory: int | None, held_bytes: int, pinned_bytes: int,
                 pool_bytes: int, states_bytes: int | None = None, grad_ram_bytes: int | None = None,
                 recompute: bool = False) -> list[tuple[str, str]]:
    """``(param_tier, opt_tier)`` of each of ``plans`` (laid out for the nvme tiers; ``replan`` lays one out on
    other tiers) under ``host_memory`` (bytes): the cached states on the cpu tier, the rest as planned.

    ``held_bytes``: what earlier graphs' records hold (:func:`held_by_records`), this graph's gradients are
    added here; ``pinned_bytes``: the pinned pool's, if it exists; else, should some state stay on NVMe,
    the pool of ``pool_bytes`` will be made, and its bytes come out of the budget too.
    ``states_bytes`` (option ``ram_cache_bytes`` less what earlier graphs cached, :func:`states_held_by_records`):
    the cached states' budget itself, which zinf.plan sized from the whole process's prediction; then
    ``host_memory``, ``held_bytes`` and the pool are not read.  ``grad_ram_bytes``: what is left of option
    nvme_grad_ram_bytes (None: no bound), the RAM the gradients of parameters whose optimizer state stays on
    NVMe may take (:func:`grad_charge`).  ``recompute``: activation checkpointing (a shard is read once more).
    """
    items = cache_items(plans, replan, recompute)
    if states_bytes is not None:
        chosen = choose_cached(items, max(states_bytes, 0))
    else:
        grads, items = grad_charge(plans, items, grad_ram_bytes)
        held = held_bytes + grads
        chosen = choose_cached(items, states_budget(host_memory, pinned_bytes, held))
        if len(chosen) < len(items) and not pinned_bytes:
            chosen = choose_cached(items, states_budget(host_memory, pool_bytes, held))
    tiers = []
    for index, plan in enumerate(plans):
        whole = (index, WHOLE) in chosen
        tiers.append(("cpu" if whole or (index, SHARD) in chosen else plan.param_tier,
                      "cpu" if whole or (index, OPTIMIZER) in chosen else plan.opt_tier))
    return tiers


def grad_charge(plans: Sequence, items: list[CacheItem], grad_ram_bytes: int | None) -> tuple[int, list[CacheItem]]:
    """The gradients' RAM taken before any state is cached, and ``items`` with what caching one adds.

    A gradient whose optimizer state rests in RAM is in RAM; one whose state stays on NVMe is in RAM only
    within ``grad_ram_bytes`` (option nvme_grad_ram_bytes, else in swap).  Where those gradients all fit it,
    they are all charged; else ``grad_ram_bytes`` is, and caching a parameter's optimizer state charges its
    gradient too (it then rests in RAM, beyond that bound): at most what the run holds, so the budget holds."""
    on_nvme = [plan if plan is not None and plan.opt_tier == "nvme" else None for plan in plans]
    elsewhere = [None if plan is None or plan.opt_tier == "nvme" else plan for plan in plans]
    grads_on_nvme = grad_bytes(on_nvme)
    grads = grad_bytes(elsewhere)
    if grad_ram_bytes is None or grads_on_nvme <= grad_ram_bytes:
        return grads + grads_on_nvme, items
    with_grads = [item if item.kind == SHARD else
                  dataclasses.replace(item, held_bytes=item.held_bytes + grad_bytes([plans[item.index]]))
                  for item in items]
    return grads + grad_ram_bytes, with_grads


def grad_bytes(plans: Sequence) -> int:
    """RAM the fp32 gradients of ``plans``' trained parameters off the device take when in RAM (charged before
    any cached state), as every rank counts them (``ParamPlan.state_bytes``)."""
    return sum(plan.state_bytes(grad_in_ram=True, numel=plan.common_numel)["cpu"]["grads"]
               for plan in plans if plan is not None and plan.opt_tier != "device" and _trained(plan))


def states_budget(host_memory: int, pinned_bytes: int, held_bytes: int) -> int:
    """What is left of ``host_memory`` for cached states: less the headroom (:data:`HEADROOM_FRACTION`), the
    pinned pool's ``pinned_bytes`` and ``held_bytes`` (gradients, states cached before); never negative."""
    headroom = int(host_memory * HEADROOM_FRACTION)
    return max(0, host_memory - headroom - pinned_bytes - held_bytes)


def held_by_records(records: Iterable) -> int:
    """RAM the adopted ``records`` hold that :func:`states_budget` counts: gradients of trained parameters
    (not those in swap files: nvme_grad_ram_bytes), optimizer states and shards on the cpu tier (sized as
    :func:`cache_items` sizes them)."""
    plans = [record.plan for record in records]
    in_ram = [plan for plan in plans if plan.opt_tier != "nvme" or plan.grad_in_ram]
    return grad_bytes(in_ram) + sum(_held_in_ram(plan) for plan in plans)


def states_held_by_records(records: Iterable) -> int:
    """RAM the optimizer states and shards of the adopted ``records`` on the cpu tier hold (as :func:`cache_items`
    sizes them): what option ``ram_cache_bytes`` has spent already."""
    return sum(_held_in_ram(record.plan) for record in records)


def describe_cached(named_layouts: Iterable, options) -> str | None:
    """One line naming the parameters of ``named_layouts`` ((name, layout or plan) pairs) whose states the cache
    kept in RAM against ``options``' nvme tiers (for the dumps); None without host_memory or ram_cache_bytes."""
    if options.host_memory is None and options.ram_cache_bytes is None:
        return None
    named_layouts = list(named_layouts)
    kept = {kind: [name for name, layout in named_layouts if asked == "nvme" and getattr(layout, tier) == "cpu"]
            for kind, tier, asked in ((OPTIMIZER, "opt_tier", options.offload_optimizer),
                                      (SHARD, "param_tier", options.offload_param))}

    def listed(names: list[str]) -> str:
        return f"{len(names)} ({', '.join(names[:NAMES_LISTED])}{', ...' if len(names) > NAMES_LISTED else ''})"

    budget = (f"ram_cache_bytes {options.ram_cache_bytes:,}" if options.ram_cache_bytes is not None else
              f"host_memory {options.host_memory:,}" if isinstance(options.host_memory, int) else
              f"host_memory {options.host_memory!r}")
    return (f"ram cache ({budget} bytes): of {len(named_layouts)} parameters, in RAM "
            f"the optimizer state of {listed(kept[OPTIMIZER])}, the shard of {listed(kept[SHARD])}; the rest on nvme")
