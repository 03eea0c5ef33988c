"""Optimizers that step where zinf keeps the state: on this rank's fp32 master shards.

``zinf_compiler.optim.AdamW(model.parameters(), lr=...)`` is a regular
``torch.optim.Optimizer`` (param_groups, LR schedulers, ``state_dict``,
``zero_grad``, ``clip_grad_norm_``); runtime/optim/optimizer.py says how it
binds to the shards and steps them.

This module is part of the entry layer (with api.py and backend.py): the
optimizer itself is the runtime's (runtime/optim/), and these public classes
hand it the process's parts (``RUNTIME``'s store, tracer and set of live
optimizers) and install the guards that route torch's clipping and
``zero_grad`` to it (torch_patches.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.optim.optimizer import OptimizerParts, ShardOptimizer
from zinf_compiler.runtime.optim.state import Slot, StreamedState

from . import torch_patches

__all__ = ["AdamW", "Adam", "SGD", "ZinfOptimizer", "Slot", "StreamedState"]


class ZinfOptimizer(ShardOptimizer):
    """A torch optimizer of ``inner_class`` over zinf's shards, handed the process's runtime.

    Subclasses (:class:`AdamW`, :class:`Adam`, :class:`SGD`) name the torch optimizer that does the
    arithmetic and take its arguments.
    """

    def __init__(self, params: Iterable, **defaults: Any):
        # Clipping, zero_grad and foreign optimizers see zinf's shards.
        torch_patches.install(RUNTIME.store, RUNTIME.optimizers)
        super().__init__(params, OptimizerParts(RUNTIME.store, RUNTIME.tracer, RUNTIME.optimizers), **defaults)


class AdamW(ZinfOptimizer):
    """``torch.optim.AdamW`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class Adam(ZinfOptimizer):
    """``torch.optim.Adam`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class SGD(ZinfOptimizer):
    """``torch.optim.SGD`` over zinf's shards (same arguments and defaults)."""

    inner_class = torch.optim.SGD

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **kwargs)
