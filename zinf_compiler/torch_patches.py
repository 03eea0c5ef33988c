"""Every change zinf makes to torch itself, in one place: installed on first use, reversible.

At stages 2-3 (and stage 1 on several ranks) a parameter's gradient lives in
zinf's shards and ``param.grad`` stays ``None``.  Three pieces of torch read
``param.grad`` and would then do nothing, silently; zinf routes each through a
guard (the guards themselves are in :mod:`zinf_compiler.optim`):

* ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``,
  ``clip_grads_with_norm_``): handed to the zinf optimizer that holds exactly
  those parameters, or refused with an error.  Loops often import them by name
  before zinf is imported, so the guard takes the place of the body that
  torch's ``no_grad`` wrapper calls through its closure cell ``func``: every
  reference to the wrapper reaches it.  (A torch without that cell gets its
  module attributes replaced instead.)
* ``nn.Module.zero_grad``: also discards the module's gradient shards.
* a global optimizer step pre-hook: a ``torch.optim`` optimizer stepping
  zinf-sharded parameters is refused, naming the zinf optimizer to use.

Importing zinf changes nothing: :func:`install` runs at the first compile,
``materialize`` or zinf optimizer (idempotent), and :func:`uninstall` puts
torch back as it was (tests use it).  Every guard passes calls that involve no
zinf parameter to torch's own code unchanged.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# (name in torch.nn.utils.clip_grad, public name in torch.nn.utils, guard's name in zinf_compiler.optim)
_CLIP_FUNCTIONS = (
    ("clip_grad_norm_", "clip_grad_norm_", "clip_grad_norm_"),
    ("clip_grad_value_", "clip_grad_value_", "clip_grad_value_"),
    ("_clip_grads_with_norm_", "clip_grads_with_norm_", "clip_grads_with_norm_"),  # (newer torch only)
)

_lock = threading.Lock()
# What install() replaced, to put back: ("cell", cell, original) or ("attr", owner, name, original).
_undo: list[tuple] = []
_hook_handle = None


def installed() -> bool:
    """Whether :func:`install` has run (and :func:`uninstall` not since)."""
    return _hook_handle is not None


def install() -> None:
    """Route torch's gradient clipping, ``nn.Module.zero_grad`` and optimizer steps through zinf's guards."""
    global _hook_handle
    from . import optim

    with _lock:
        if _hook_handle is not None:
            return
        for name, public_name, guard_name in _CLIP_FUNCTIONS:
            if hasattr(torch.nn.utils.clip_grad, name):
                guard = getattr(optim, guard_name)
                _install_clip_guard(name, public_name, guard)
                guard._zinf_replaces = optim.TORCH_CLIP[name]
        original_zero_grad = torch.nn.Module.zero_grad
        optim.TORCH_MODULE_ZERO_GRAD = _torch_own(original_zero_grad)
        optim.module_zero_grad_with_shards._zinf_replaces = optim.TORCH_MODULE_ZERO_GRAD
        torch.nn.Module.zero_grad = optim.module_zero_grad_with_shards
        _undo.append(("attr", torch.nn.Module, "zero_grad", original_zero_grad))
        _hook_handle = register_optimizer_step_pre_hook(optim.refuse_foreign_optimizers)


def uninstall() -> None:
    """Put back everything :func:`install` replaced (newest first)."""
    global _hook_handle
    with _lock:
        if _hook_handle is None:
            return
        _hook_handle.remove()
        _hook_handle = None
        while _undo:
            change = _undo.pop()
            if change[0] == "cell":
                _, cell, original = change
                cell.cell_contents = original
            else:
                _, owner, name, original = change
                setattr(owner, name, original)


def _install_clip_guard(name: str, public_name: str, guard: Callable) -> None:
    from . import optim

    torch_fn = getattr(torch.nn.utils.clip_grad, name)
    cells = dict(zip(torch_fn.__code__.co_freevars, torch_fn.__closure__ or ()))
    body_cell = cells.get("func")
    if body_cell is not None and callable(body_cell.cell_contents):
        optim.TORCH_CLIP[name] = _torch_own(body_cell.cell_contents)
        _undo.append(("cell", body_cell, body_cell.cell_contents))
        body_cell.cell_contents = guard
        return
    optim.TORCH_CLIP[name] = _torch_own(torch_fn)
    for owner, attribute in ((torch.nn.utils.clip_grad, name), (torch.nn.utils, public_name)):
        if hasattr(owner, attribute):
            _undo.append(("attr", owner, attribute, getattr(owner, attribute)))
            setattr(owner, attribute, guard)


def _torch_own(function: Callable) -> Callable:
    """``function``, or torch's own behind it if it is a guard of another copy of zinf (a reloaded module)."""
    return getattr(function, "_zinf_replaces", function)
