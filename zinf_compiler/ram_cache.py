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
# Bytes per element of a trained parameter's optimizer state on the nvme tier: fp32 master, exp_avg, exp_avg_sq.
OPTIMIZER_STATE_BYTES = 12
GRAD_BYTES = 4  # the fp32 reduced gradient of one element

OPTIMIZER = "optimizer"  # an item's kind: a parameter's master and moments (its opt_tier)
SHARD = "shard"  # an item's kind: a stage-3 parameter shard (its param_tier)
WHOLE = "whole"  # an item's kind: both, of a parameter with both on NVMe
NAMES_LISTED = 8  # parameter names a dump line lists of each kind


@dataclasses.dataclass(frozen=True)
class CacheItem:
    """One state of one parameter that could rest in RAM instead of on NVMe."""

    index: int  # the parameter's position in adoption order (graph order)
    kind: str  # OPTIMIZER or SHARD
    held_bytes: int  # RAM it takes on the cpu tier
    moved_bytes: int  # disk bytes it moves per step on the nvme tier

    @property
    def rate(self) -> Fraction:
        """Disk bytes saved per step per byte of RAM held."""
        return Fraction(self.moved_bytes, max(self.held_bytes, 1))


def _numel(plan) -> int:
    """Elements of ``plan``'s local state as every rank counts it (a broadcast parameter whole, as on its owner)."""
    return plan.shard_numel if plan.partition == "allgather" else plan.numel


def _trained(plan, requires_grad: bool) -> bool:
    """Whether the optimizer holds state for ``plan``'s parameter (and a gradient lands in its tier)."""
    return requires_grad and plan.stage > 0 and plan.dtype.is_floating_point


def cache_items(plans: Sequence, requires_grad: Sequence[bool]) -> list[CacheItem]:
    """The cacheable states of ``plans`` (each a ``ParamPlan`` laid out for the nvme tiers, in adoption order;
    None: skip; ``requires_grad`` of each): an nvme optimizer state of a trained float parameter, read and
    written once a step, and an nvme stage-3 shard, read at each fetch (forward and backward) and written after
    the step.  A trained parameter with both on NVMe is one item, both kept in RAM or neither: the optimizer
    steps it during backward only while both rest on NVMe (overlap_optimizer; a parameter half in RAM would
    step after backward, on the step's critical path)."""
    items = []
    for index, (plan, trained) in enumerate(zip(plans, requires_grad)):
        if plan is None or _numel(plan) == 0:
            continue
        optimizer = OPTIMIZER_STATE_BYTES * _numel(plan) if plan.opt_tier == "nvme" and _trained(plan, trained) else 0
        shard = _numel(plan) * plan.compute_dtype.itemsize if plan.param_tier == "nvme" else 0
        if optimizer and shard:
            items.append(CacheItem(index, WHOLE, optimizer + shard, 2 * optimizer + 3 * shard))
        elif optimizer:
            items.append(CacheItem(index, OPTIMIZER, optimizer, 2 * optimizer))
        elif shard:
            items.append(CacheItem(index, SHARD, shard, 3 * shard))
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


def choose_tiers(plans: Sequence, requires_grad: Sequence[bool], host_memory: int | None, held_bytes: int,
                 pinned_bytes: int, pool_if_needed: Callable[[], int],
                 states_bytes: int | None = None, grad_ram_bytes: int | None = None) -> list[tuple[str, str]]:
    """``(param_tier, opt_tier)`` of each of ``plans`` (laid out for the nvme tiers) under ``host_memory``
    (bytes): the cached states on the cpu tier, the rest as planned.

    ``held_bytes``: what earlier graphs' records hold (:func:`held_by_records`), this graph's gradients are
    added here; ``pinned_bytes``: the pinned pool's, if it exists; else, should some state stay on NVMe,
    ``pool_if_needed()`` sizes (the store: makes) the pool, whose bytes then come out of the budget too.
    ``states_bytes`` (option ``ram_cache_bytes`` less what earlier graphs cached, :func:`states_held_by_records`):
    the cached states' budget itself, which zinf.plan sized from the whole process's prediction; then
    ``host_memory``, ``held_bytes`` and the pool are not read.  ``grad_ram_bytes``: what is left of option
    nvme_grad_ram_bytes (None: no bound), the RAM the gradients of parameters whose optimizer state stays on
    NVMe may take (:func:`grad_charge`).
    """
    items = cache_items(plans, requires_grad)
    if states_bytes is not None:
        chosen = choose_cached(items, max(states_bytes, 0))
    else:
        grads, items = grad_charge(plans, requires_grad, items, grad_ram_bytes)
        held = held_bytes + grads
        chosen = choose_cached(items, states_budget(host_memory, pinned_bytes, held))
        if len(chosen) < len(items) and not pinned_bytes:
            chosen = choose_cached(items, states_budget(host_memory, pool_if_needed(), held))
    tiers = []
    for index, plan in enumerate(plans):
        whole = (index, WHOLE) in chosen
        tiers.append(("cpu" if whole or (index, SHARD) in chosen else plan.param_tier,
                      "cpu" if whole or (index, OPTIMIZER) in chosen else plan.opt_tier))
    return tiers


def grad_charge(plans: Sequence, requires_grad: Sequence[bool], items: list[CacheItem],
                grad_ram_bytes: int | None) -> tuple[int, list[CacheItem]]:
    """The gradients' RAM taken before any state is cached, and ``items`` with what caching one adds.

    A gradient whose optimizer state rests in RAM is in RAM; one whose state stays on NVMe is in RAM only
    within ``grad_ram_bytes`` (option nvme_grad_ram_bytes, else in swap).  Where those gradients all fit it,
    they are all charged; else ``grad_ram_bytes`` is, and caching a parameter's optimizer state charges its
    gradient too (it then rests in RAM, beyond that bound): at most what the run holds, so the budget holds."""
    on_nvme = [plan if plan is not None and plan.opt_tier == "nvme" else None for plan in plans]
    elsewhere = [None if plan is None or plan.opt_tier == "nvme" else plan for plan in plans]
    grads_on_nvme = grad_bytes(on_nvme, requires_grad)
    grads = grad_bytes(elsewhere, requires_grad)
    if grad_ram_bytes is None or grads_on_nvme <= grad_ram_bytes:
        return grads + grads_on_nvme, items
    with_grads = [item if item.kind == SHARD else
                  dataclasses.replace(item, held_bytes=item.held_bytes + GRAD_BYTES * _numel(plans[item.index]))
                  for item in items]
    return grads + grad_ram_bytes, with_grads


def grad_bytes(plans: Sequence, requires_grad: Sequence[bool]) -> int:
    """RAM the fp32 gradients of ``plans``' trained parameters off the device take (charged before any cached
    state; ``requires_grad`` of each plan)."""
    return sum(GRAD_BYTES * _numel(plan) for plan, trained in zip(plans, requires_grad)
               if plan is not None and plan.opt_tier != "device" and _trained(plan, trained))


def states_budget(host_memory: int, pinned_bytes: int, held_bytes: int) -> int:
    """What is left of ``host_memory`` for cached states: less the headroom (:data:`HEADROOM_FRACTION`), the
    pinned pool's ``pinned_bytes`` and ``held_bytes`` (gradients, states cached before); never negative."""
    headroom = int(host_memory * HEADROOM_FRACTION)
    return max(0, host_memory - headroom - pinned_bytes - held_bytes)


def held_by_records(records: Iterable) -> int:
    """RAM the adopted ``records`` hold that :func:`states_budget` counts: gradients of trained parameters
    (not those in swap files: nvme_grad_ram_bytes), optimizer states and shards on the cpu tier (sized as
    :func:`cache_items` sizes them)."""
    records = list(records)
    in_ram = [record for record in records if record.plan.opt_tier != "nvme" or record.grad_in_ram]
    return sum(grad_bytes([record.plan], [record.trainable]) for record in in_ram) + states_held_by_records(records)


def states_held_by_records(records: Iterable) -> int:
    """RAM the optimizer states and shards of the adopted ``records`` on the cpu tier hold (as :func:`cache_items`
    sizes them): what option ``ram_cache_bytes`` has spent already."""
    held = 0
    for record in records:
        plan = record.plan
        if plan.opt_tier == "cpu" and _trained(plan, record.trainable):
            held += OPTIMIZER_STATE_BYTES * _numel(plan)
        if plan.param_tier == "cpu":
            held += _numel(plan) * plan.compute_dtype.itemsize
    return held


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
