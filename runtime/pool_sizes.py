"""How big the pinned staging pools and the gradient RAM budget are made: one home for each formula,
read by the runtime when it makes them and by the planner (zinf_compiler/planner.py) before any run."""

from __future__ import annotations

from typing import Iterable

from .nvme_adam import STATE_NAMES
from .param_plan import ParamPlan
from .swap_layout import ALIGNMENT, SUB_GROUP_NUMEL

# The early optimizer step (early_adam.py): sub-groups whose reads run ahead of the one being stepped.
READ_AHEAD = 2
# nvme_grad_ram_bytes="auto": gradients in RAM up to this fraction (1/N) of the memory available at the
# first compile, shared by the node's ranks.  An eighth leaves room for the activations, the pinned pool
# and the optimizer's streaming buffers of a model much larger than RAM.
AUTO_GRAD_RAM_SHARE = 8


def parameter_pool_bytes(largest_fp32_bytes: int) -> int:
    """The store's pool (option ``pinned_bytes="auto"``), given the largest fp32 slice it will stage: two of
    them (a fetch in flight while the optimizer stages one) plus the optimizer's twelve sub-group buffers
    (three groups of master, two moments and gradient in flight); never under 64 MiB."""
    group = min(largest_fp32_bytes, SUB_GROUP_NUMEL * 4)
    return max(64 << 20, 2 * largest_fp32_bytes + 12 * group)


def early_step_pool_bytes(plans: Iterable[ParamPlan]) -> int:
    """The early optimizer step's pool for parameters with ``plans``: the sub-groups reading ahead and one
    writing, three state buffers each, and the shards of two parameters in compute dtype (one being written
    while the next is staged)."""
    plans = list(plans)
    group = max(plan.state_groups[0][1] * 4 + ALIGNMENT for plan in plans)
    shard = max([plan.local_numel * plan.compute_dtype.itemsize + ALIGNMENT
                 for plan in plans if not plan.params_in_master] + [0])
    return (READ_AHEAD + 1) * len(STATE_NAMES) * group + 2 * shard


def auto_grad_ram_bytes(available: int | None, ranks_on_node: int) -> int:
    """``nvme_grad_ram_bytes="auto"``: an eighth of the memory ``available`` (0 where unknown), shared by the
    ranks on this node."""
    return (available or 0) // (AUTO_GRAD_RAM_SHARE * ranks_on_node)
