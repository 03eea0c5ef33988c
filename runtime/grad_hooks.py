"""Gradient hooks on sharded parameters (stages 2-3): run where the full gradient exists.

At stages 2-3 a parameter's gradient never reaches ``param.grad``: the
backward graph hands it to zinf, which reduces it into this rank's shard, and
autograd's own accumulation for the parameter sees nothing (``None``).  A hook
registered with ``param.register_hook(fn)`` would be called by autograd with
``None`` and its result lost.  So zinf *claims* such hooks: each is wrapped so
that autograd's call with ``None`` does nothing, and zinf calls the user's
function itself on the full local gradient right before the reduce, as eager
PyTorch (and DDP) call it before accumulating and averaging.  What it returns
replaces the gradient.  The dict entries stay where they are, so the user's
``handle.remove()`` still removes the hook.

``register_post_accumulate_grad_hook`` expects ``param.grad`` to hold the
accumulated gradient, which it never does at stages 2-3: refused with an
error naming the parameter.  A tiled parameter's gradient is reduced tile by
tile, never whole: hooks on it are refused too.
"""

from __future__ import annotations

from typing import Callable

import torch


class ZinfHookError(RuntimeError):
    """A gradient hook zinf cannot honour on a sharded parameter."""


class _ClaimedHook:
    """A user's tensor hook that zinf calls itself; autograd's call (with ``None``) is a no-op."""

    __slots__ = ("user_hook",)

    def __init__(self, user_hook: Callable):
        self.user_hook = user_hook

    def __call__(self, grad):
        if grad is None:
            return None
        return self.user_hook(grad)


def claim_grad_hooks(param: torch.Tensor, name: str, tiled: bool) -> None:
    """Before a call of a graph that reduces ``param``'s gradient: claim its hooks, refuse what cannot work."""
    post_hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if post_hooks:
        raise ZinfHookError(
            f"parameter {name} has a register_post_accumulate_grad_hook hook: at zinf stages 2-3 its gradient is "
            f"reduced into zinf's shards and param.grad stays None, so the hook would see no gradient. Use "
            f"param.register_hook(fn) (zinf runs it on the full gradient before the reduce), stage 1 (full "
            f"gradients in param.grad), or remove the hook")
    hooks = param._backward_hooks
    if not hooks:
        return
    if tiled:
        raise ZinfHookError(
            f"parameter {name} has a gradient hook (register_hook) but zinf tiles it: its gradient is reduced one "
            f"row tile at a time and never exists whole. Raise tile_threshold (or set tile_factor=1) for this "
            f"parameter, or remove the hook")
    for key, hook in list(hooks.items()):
        if not isinstance(hook, _ClaimedHook):
            hooks[key] = _ClaimedHook(hook)


def run_grad_hooks(param: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """``grad`` after every claimed hook of ``param``, in registration order (a hook returning None keeps it).

    Eager runs a parameter's hook once per backward, on the sum of its uses'
    gradients.  A parameter used by two compiled graphs (a weight shared across
    a graph break) gets its gradient in two pieces within one backward: a hook
    would see each piece, not the sum, so the second piece is refused.
    """
    hooks = param._backward_hooks
    if not hooks:
        return grad
    task = torch._C._current_graph_task_id()  # one per backward call; -1 outside autograd
    if task != -1 and getattr(param, "_zinf_hooked_task", None) == task:
        raise ZinfHookError(
            f"parameter {name} has a gradient hook (register_hook) and reaches this backward through two compiled "
            f"graphs (a weight shared across a graph break): its gradient comes in pieces, and the hook would run "
            f"on each piece instead of their sum as in eager. Remove the graph break between its uses, or the hook")
    param._zinf_hooked_task = task
    for hook in list(hooks.values()):
        user_hook = hook.user_hook if isinstance(hook, _ClaimedHook) else hook
        result = user_hook(grad)
        if result is not None:
            if not isinstance(result, torch.Tensor) or result.shape != grad.shape:
                raise ZinfHookError(f"a gradient hook returned {type(result).__name__} "
                                    f"{tuple(getattr(result, 'shape', ()))} for a gradient of shape {tuple(grad.shape)}")
            grad = result
    return grad
