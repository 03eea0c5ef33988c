"""How big the pinned staging pools and the gradient RAM budget are made: one home for each formula,
read by the runtime when it makes them and by the planner (zinf_compiler/planner.py) before any run."""

from __future__ import annotations

from typing import Iterable

from .param_plan import ParamPlan
from .records import GRAD_WRITES_IN_FLIGHT
from .swap_layout import ALIGNMENT, STATE_NAMES, SUB_GROUP_NUMEL, align

# The early optimizer step (early_adam.py): sub-groups whose reads run ahead of the one being stepped.
READ_AHEAD = 2
# nvme_grad_ram_bytes="auto": gradients in RAM up to this fraction (1/N) of the memory available at the
# first compile, shared by the node's ranks.  An eighth leaves room for the activations, the pinned pool
# and the optimizer's streaming buffers of a model much larger than RAM.
AUTO_GRAD_RAM_SHARE = 8
# The store's pool is never smaller (unless the model's every nvme slice takes less): the schedule's prefetch
# (prefetch_nc blocks ahead) and a transfer's slack fit in it.
POOL_FLOOR = 64 << 20


def _largest_group(plans) -> int:
    """Bytes of the largest optimizer sub-group (fp32) among ``plans`` whose optimizer rests on NVMe."""
    return max([plan.state_groups[0][1] * 4 for plan in plans if plan.opt_tier == "nvme" and plan.local_numel]
               + [0])


def _largest_shard(plans) -> int:
    """Bytes (aligned) of the largest shard in compute dtype among ``plans`` that an optimizer step stages for
    an nvme parameter tier's own files (none for one read from its master's)."""
    return max([align(plan.local_numel * plan.compute_dtype.itemsize)
                for plan in plans if plan.param_tier == "nvme" and not plan.params_in_master] + [0])


def grad_write_reserve_bytes(plans) -> int:
    """What gradient writes to NVMe may hold of the store's pool during backward: GRAD_WRITES_IN_FLIGHT
    sub-groups, and one more being filled (store_grads.py)."""
    return (GRAD_WRITES_IN_FLIGHT + 1) * align(_largest_group(plans))


def parameter_pool_bytes(largest_fp32_bytes: int, plans=()) -> int:
    """The store's pool (option ``pinned_bytes="auto"``), given the largest fp32 slice it will stage and the
    ``plans`` of the parameters it serves: two such slices (a fetch in flight while the previous one is
    copied out), a third up to one sub-group's size (the prefetch reading further ahead; no more for a huge
    one, an embedding of gigabytes), and the gradient writes' reserve; never under :data:`POOL_FLOOR` (room
    for the schedule's prefetch of several blocks), unless every nvme-tier slice of ``plans`` at once takes
    less: then that, sized to the model (a small model on NVMe holds no more pinned memory than its states).

    The optimizer's step after backward takes its buffers from a pool of its own
    (:func:`optimizer_pool_bytes`), so this one is not sized for them."""
    fetches = 2 * align(largest_fp32_bytes) + align(min(largest_fp32_bytes, SUB_GROUP_NUMEL * 4))
    reserve = grad_write_reserve_bytes(plans)
    everything = sum(align(plan.local_numel * 4) for plan in plans if "nvme" in (plan.param_tier, plan.opt_tier))
    return max(min(POOL_FLOOR, everything + reserve), fetches + reserve, ALIGNMENT)  # (one block: planned nothing)


def optimizer_pool_bytes(plans: Iterable[ParamPlan]) -> int:
    """The NVMe optimizer's step after backward (nvme_adam.py) for parameters with ``plans``: three
    sub-groups in flight (one being written, one stepped, the next read), four buffers each (master, two
    moments, gradient), and one parameter shard in compute dtype being staged for its swap file."""
    plans = list(plans)
    return 3 * (len(STATE_NAMES) + 1) * align(_largest_group(plans)) + _largest_shard(plans)


def early_step_pool_bytes(plans: Iterable[ParamPlan], all_plans: Iterable[ParamPlan] = ()) -> int:
    """The early optimizer step's pool for parameters with ``plans``: the sub-groups reading ahead and one
    writing, three state buffers each, and the shards of two parameters in compute dtype (one being written
    while the next is staged).  The step after backward borrows it, idle by then, for the optimizer's
    ``all_plans`` (those stepped late), so it is never smaller than :func:`optimizer_pool_bytes` of them."""
    plans = list(plans)  # (early ones: their parameter tier is nvme)
    early = (READ_AHEAD + 1) * len(STATE_NAMES) * align(_largest_group(plans)) + 2 * _largest_shard(plans)
    return max(early, optimizer_pool_bytes(all_plans))


def auto_grad_ram_bytes(available: int | None, ranks_on_node: int) -> int:
    """``nvme_grad_ram_bytes="auto"``: an eighth of the memory ``available`` (0 where unknown), shared by the
    ranks on this node."""
    return (available or 0) // (AUTO_GRAD_RAM_SHARE * ranks_on_node)
