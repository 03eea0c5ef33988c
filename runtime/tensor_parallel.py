"""A tensor-parallel parameter (a DTensor from torch's ``parallelize_module``) as the store holds it.

A DTensor's values on this rank are its TP-local tensor: the store
adopts, shards (over the data-parallel ranks) and rests that tensor, and finds its record from the
DTensor the user holds (``model.parameters()``, the optimizer) through :func:`local_of`.
"""

from __future__ import annotations

import torch


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s values on this rank: a DTensor's local tensor, else ``tensor``."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
