"""Adopting one parameter into a store by hand, for the in-process tests of the runtime (no compile).

The backend and ``zinf.materialize`` adopt a model's parameters by its plan (zinf_compiler/model_plan.py:
``plan_offload`` then ``adopt``); a test of the store alone plans one parameter with
``runtime/param_plan.plan_param`` as that plan would (the next uid, a broadcast owner by the store's count,
its gradient in RAM within ``grad_ram_bytes``) and hands the plan to ``ParamStore.adopt``.
"""

from __future__ import annotations

import dataclasses

import torch

from zinf_compiler.runtime.param_plan import choose_owner, plan_param
from zinf_compiler.runtime.records import DEFAULT_BUCKET_BYTES, DTYPES
from zinf_compiler.runtime.tensor_parallel import local_of


def adopt_in(store, param: torch.nn.Parameter, name: str, *, stage: int, partition: str, param_dtype: str,
             param_tier: str = "device", opt_tier: str = "device", tile_rows=None, group=None, read_local=None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_ram_bytes: int | str = 0, mesh=None,
             step_in_backward: bool | str = False):
    """``param``'s record in ``store`` (adopted now, unless it was before) under these settings."""
    record = store.lookup(param)
    if record is not None:
        return record
    mesh = mesh or store.comm.mesh()
    held = local_of(param)
    world_size, rank = mesh.shard.world_size, mesh.shard.rank
    owner = choose_owner(store.owned_numel_by_rank(), world_size) if partition == "broadcast" else None
    plan = plan_param(uid=store.reserve_uids(1), shape=held.shape, dtype=held.dtype, device=held.device, stage=stage,
                      partition=partition, param_dtype=DTYPES[param_dtype], param_tier=param_tier, opt_tier=opt_tier,
                      world_size=world_size, rank=rank, owner=owner, tile_rows=tile_rows, bucket_bytes=bucket_bytes,
                      requires_grad=param.requires_grad, from_file=read_local is not None,
                      step_in_backward=step_in_backward, nvme_copies=store.offload.settings.get("nvme_copies", 2))
    if (opt_tier == "nvme" and plan.dtype.is_floating_point
            and 0 < plan.local_numel * 4 <= store.grad_ram_left(grad_ram_bytes)):
        plan = dataclasses.replace(plan, grad_in_ram=True)
    return store.adopt(param, name, plan, group=group, read_local=read_local, mesh=mesh)
