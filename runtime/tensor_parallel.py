"""Tensor-parallel parameters (DTensor, from torch's ``parallelize_module``): the tensor zinf shards.

SPIKE (issue 37).  A DTensor parameter is a wrapper: its values are this rank's TP-local tensor
(``_local_tensor``), and AOTAutograd hands the compiled ATen graphs that local tensor (the DTensor is
flattened into ``(_local_tensor, device_mesh)``).  zinf shards the local tensor over the data-parallel
ranks; the DTensor stays the user's handle (``model.parameters()``, the optimizer), and the store
finds the record of either through :func:`local_of`.
"""

from __future__ import annotations

import torch


def is_tp(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor (its values live in its TP-local tensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``param``'s values on this rank: a DTensor's local tensor, else ``param``."""
    return param._local_tensor if is_tp(param) else param


def flat_width(tensor: torch.Tensor) -> int:
    """How many inputs AOTAutograd flattens ``tensor`` into: 1 for a plain tensor; for a traceable subclass
    (``__tensor_flatten__``), the count of its inner tensors and opaque objects, recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return 1
    attrs, _ = tensor.__tensor_flatten__()
    return sum(flat_width(inner) if isinstance(inner := getattr(tensor, attr), torch.Tensor) else 1 for attr in attrs)
