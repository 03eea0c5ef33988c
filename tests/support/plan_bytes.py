"""Bytes a parameter holds by the plans' byte model (runtime/param_plan.py), for tests that size a budget."""

from __future__ import annotations

import torch

from zinf_compiler.runtime.param_plan import plan_param


def ram_per_element(param_tier: str, opt_tier: str) -> tuple[int, int]:
    """(states, gradient) bytes one fp32 element of a parameter on these tiers holds in RAM, by the plans' byte
    model (``ParamPlan.state_bytes``), which the RAM cache sizes its choice by."""
    numel = 4096
    plan = plan_param(uid=0, shape=(numel,), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                      partition="allgather", param_dtype=torch.float32, param_tier=param_tier, opt_tier=opt_tier,
                      world_size=1, rank=0)
    cpu = plan.state_bytes(grad_in_ram=True)["cpu"]
    return (cpu["params"] + cpu["optimizer"]) // numel, cpu["grads"] // numel

