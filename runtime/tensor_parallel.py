"""A tensor-parallel parameter (a DTensor from torch's ``parallelize_module``) as the store and the optimizer see it.

A DTensor's values on this rank are its TP-local tensor: the store
adopts, shards (over the data-parallel ranks) and rests that tensor, and finds its record from the
DTensor the user holds (``model.parameters()``, the optimizer) through :func:`local_of`.
"""

from __future__ import annotations

import dataclasses

import torch


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s values on this rank: a DTensor's local tensor, else ``tensor``."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one parameter lies across the tensor-parallel ranks: what ``from_local`` needs, and what a full
    state dict needs to rebuild the whole tensor."""

    mesh: object  # the DeviceMesh of the tp dimension
    placements: tuple
    shape: torch.Size  # the whole (global) tensor's
    stride: tuple[int, ...]


def layout_of(param: torch.Tensor) -> TPLayout | None:
    """``param``'s TP layout if it is a DTensor, else None."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return TPLayout(param.device_mesh, tuple(param.placements), param.shape, param.stride())
    return None


def model_tp_mesh(params, what: str = "zinf checkpoints") -> object | None:
    """The one tp DeviceMesh of the DTensor ``params`` (None: no tensor-parallel parameter).  Parameters on
    several tp meshes, or on a tp mesh of more than one dimension, are refused (``what`` refuses them)."""
    from .checkpoint_files import ZinfCheckpointError

    meshes = {}
    for param in params:
        layout = layout_of(param)
        if layout is not None:
            meshes.setdefault(id(layout.mesh), layout.mesh)
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ZinfCheckpointError(f"{what}: the model's tensor-parallel parameters lie on "
                                  f"{len(meshes)} different device meshes; one tp mesh per model is supported")
    (mesh,) = meshes.values()
    if mesh.ndim != 1:
        raise ZinfCheckpointError(f"{what}: a {mesh.ndim}-D tensor-parallel mesh is not supported (a "
                                  f"1-D mesh[\"tp\"] is)")
    return mesh


def holds_own_slice(param: torch.Tensor) -> bool:
    """Whether ``param``'s TP-local tensor is a slice no other tp rank holds (a Shard placement); a Replicate
    DTensor or a plain parameter of a TP model is the same on every tp rank (tp rank 0 alone saves it)."""
    layout = layout_of(param)
    return layout is not None and any(placement.is_shard() for placement in layout.placements)
