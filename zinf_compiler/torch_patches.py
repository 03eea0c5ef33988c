"""Every change zinf makes to torch itself: made and undone here, or documented here with where it is made.

At stages 2-3 (and stage 1 on several ranks) a parameter's gradient lives in
zinf's shards and ``param.grad`` stays ``None``.  Three pieces of torch read
``param.grad`` and would then do nothing, silently; zinf routes each through a
guard defined in this module:

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
``materialize`` or zinf optimizer (idempotent), handed the runtime's parts
the guards read (the parameter store and the live zinf optimizers), and
:func:`uninstall` puts torch back as it was (tests use it).  Every guard
passes calls that involve no zinf parameter to torch's own code unchanged.

Also made and undone here: :func:`set_dynamo_config` (zinf_compiler/backend.py
sets ``torch._dynamo.config.fail_on_recompile_limit_hit`` at stages 2-3: past
the recompile limit Dynamo would run the frame eagerly, which cannot train
sharded parameters); :func:`uninstall` puts the replaced value back.

Made elsewhere, where the state they touch lives (each says why there):

* ``runtime/grad_hooks.py``: the entries of a sharded parameter's
  ``param._backward_hooks`` are wrapped in place (``_ClaimedHook``, which
  ignores autograd's call with ``None``; zinf calls the user's function on the
  full gradient), and ``param._zinf_hooked_task`` is set.  Not undone: the
  dict keeps its keys, so the user's ``handle.remove()`` removes the hook, and
  a claimed hook still runs any gradient autograd hands it.
* ``runtime/store.py`` (releasing a stage-3 parameter's storage) and
  ``runtime/resting.py`` (``guard_aliases``): ``__class__`` swaps of the
  parameter to ``RestingParameter`` and of tensors sharing its storage to
  ``RestingAlias`` (or ``RestingParameter``), with ``_zinf_alias_*`` /
  ``_zinf_retired`` attributes, so that touching freed memory raises instead
  of crashing.  Not undone: the storage stays zinf's for the model's life;
  while it holds its full values (``zinf.gathered``) such a tensor reads them
  as in eager.  ``resting.py`` also switches ``RestingParameter.__torch_function__``
  off while a zinf graph runs, and back on after.
* ``zinf_compiler/lowering.py``: ``deterministic_lowering`` turns torch's
  deterministic algorithms on for one lowering and restores the user's
  setting after it (``ordered_index_put.py`` does the same around each
  accumulating index_put as the graph runs); ``backend.py``'s ``register``
  adds the ``"zinf"`` Dynamo backend.
* ``zinf_compiler/ops.py``: custom ops in the ``zinf::`` namespace (added to
  torch's registry, nothing of torch's replaced).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zinf_compiler.runtime.store import ParamRecord, ParamStore

# (name in torch.nn.utils.clip_grad, public name in torch.nn.utils, guard's name in this module)
_CLIP_FUNCTIONS = (
    ("clip_grad_norm_", "clip_grad_norm_", "clip_grad_norm_"),
    ("clip_grad_value_", "clip_grad_value_", "clip_grad_value_"),
    ("_clip_grads_with_norm_", "clip_grads_with_norm_", "clip_grads_with_norm_"),  # (newer torch only)
)

_lock = threading.Lock()
# What install() and set_dynamo_config() replaced, to put back: ("cell", cell, original) or
# ("attr", owner, name, original).
_undo: list[tuple] = []
_hook_handle = None
# The runtime's parts the guards read, handed to install().
_store: ParamStore | None = None
_optimizers = ()  # the live zinf optimizers (a weak set)


def installed() -> bool:
    """Whether :func:`install` has run (and :func:`uninstall` not since)."""
    return _hook_handle is not None


def install(store: ParamStore, optimizers) -> None:
    """Route torch's gradient clipping, ``nn.Module.zero_grad`` and optimizer steps through zinf's guards.

    ``store``: the parameter store whose records say which parameters zinf
    shards; ``optimizers``: the live zinf optimizers (a collection kept up to
    date by the caller), one of which ``clip_grad_norm_`` hands its work to.
    """
    global _hook_handle, _store, _optimizers, TORCH_MODULE_ZERO_GRAD
    with _lock:
        _store, _optimizers = store, optimizers
        if _hook_handle is not None:
            return
        guards = globals()
        for name, public_name, guard_name in _CLIP_FUNCTIONS:
            if hasattr(torch.nn.utils.clip_grad, name):
                guard = guards[guard_name]
                _install_clip_guard(name, public_name, guard)
                guard._zinf_replaces = TORCH_CLIP[name]
        original_zero_grad = torch.nn.Module.zero_grad
        TORCH_MODULE_ZERO_GRAD = _torch_own(original_zero_grad)
        module_zero_grad_with_shards._zinf_replaces = TORCH_MODULE_ZERO_GRAD
        torch.nn.Module.zero_grad = module_zero_grad_with_shards
        _undo.append(("attr", torch.nn.Module, "zero_grad", original_zero_grad))
        _hook_handle = register_optimizer_step_pre_hook(refuse_foreign_optimizers)


def uninstall() -> None:
    """Put back everything :func:`install` and :func:`set_dynamo_config` replaced (newest first)."""
    global _hook_handle
    with _lock:
        if _hook_handle is not None:
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


def set_dynamo_config(name: str, value) -> None:
    """Set ``torch._dynamo.config.<name>``; :func:`uninstall` puts back the value it first replaced."""
    config = torch._dynamo.config
    with _lock:
        if not any(change[0] == "attr" and change[1] is config and change[2] == name for change in _undo):
            _undo.append(("attr", config, name, getattr(config, name)))
        setattr(config, name, value)


def _install_clip_guard(name: str, public_name: str, guard: Callable) -> None:
    torch_fn = getattr(torch.nn.utils.clip_grad, name)
    cells = dict(zip(torch_fn.__code__.co_freevars, torch_fn.__closure__ or ()))
    body_cell = cells.get("func")
    if body_cell is not None and callable(body_cell.cell_contents):
        TORCH_CLIP[name] = _torch_own(body_cell.cell_contents)
        _undo.append(("cell", body_cell, body_cell.cell_contents))
        body_cell.cell_contents = guard
        return
    TORCH_CLIP[name] = _torch_own(torch_fn)
    for owner, attribute in ((torch.nn.utils.clip_grad, name), (torch.nn.utils, public_name)):
        if hasattr(owner, attribute):
            _undo.append(("attr", owner, attribute, getattr(owner, attribute)))
            setattr(owner, attribute, guard)


def _torch_own(function: Callable) -> Callable:
    """``function``, or torch's own behind it if it is a guard of another copy of zinf (a reloaded module)."""
    return getattr(function, "_zinf_replaces", function)


# --- the guards ------------------------------------------------------------------------


def _grad_outside_param(record: ParamRecord | None) -> bool:
    """Whether ``param.grad`` misses this parameter's (averaged) gradient: it lives in zinf's shards
    (stages 2-3), or stage 1 with several ranks has not averaged it yet."""
    return record is not None and (record.stage >= 2 or (record.stage == 1 and record.world_size > 1))


def refuse_foreign_optimizers(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before any ``torch.optim`` step: refuse one that would silently miss zinf's gradients.

    At stages 2-3 a sharded parameter's gradient lives in zinf's store
    (``param.grad`` stays None), so a plain torch optimizer would step nothing;
    at stage 1 with several ranks it would step un-averaged gradients.  Its
    step raises instead, naming the zinf optimizer to use.
    """
    if optimizer in _optimizers or getattr(optimizer, "_zinf_inner", False):
        return
    _store.collect()
    for group in optimizer.param_groups:
        for param in group["params"]:
            record = _store.lookup(param)
            if not _grad_outside_param(record):
                continue
            name = type(optimizer).__name__
            suggestion = name if name in ("AdamW", "Adam", "SGD") else "AdamW"
            raise RuntimeError(
                f"{type(optimizer).__module__}.{name} cannot train parameter {record.name}: at zinf stage "
                f"{record.stage} its gradient and optimizer state live in zinf's shards (param.grad stays None), "
                f"so this optimizer would update nothing. Use zinf_compiler.optim.{suggestion}(model.parameters(), "
                f"...) (AdamW, Adam or SGD), which steps the shards and takes the same arguments"
            )


# ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` reads ``param.grad``; at
# stages 2-3 that is None, so it would return 0 and clip nothing, silently.  zinf
# puts a guard in front of torch's two clipping functions: it hands zinf's
# parameters to the zinf optimizer holding them and passes every other call to
# torch's own code (install() puts them in place).
TORCH_CLIP: dict[str, Callable] = {}  # name -> torch's function body, which the guards call


def _zinf_params_in(parameters) -> tuple[list[torch.Tensor], list[ParamRecord]]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not _store.records():
        return params, []
    return params, [r for r in map(_store.lookup, params) if _grad_outside_param(r)]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also sees zinf's gradient shards (same arguments)."""
    params, records = _zinf_params_in(parameters)
    if not records:
        return TORCH_CLIP["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    trainable = {id(p) for p in params if p.requires_grad}
    for optimizer in list(_optimizers):
        held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        if held == trainable:
            total_norm = optimizer.clip_grad_norm_(max_norm, norm_type)
            if error_if_nonfinite and not torch.isfinite(total_norm):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                                   f"non-finite, so it cannot be clipped (error_if_nonfinite=True)")
            return total_norm
    raise RuntimeError(
        f"torch.nn.utils.clip_grad_norm_ cannot see the gradient of parameter {records[0].name}: at zinf stage "
        f"{records[0].stage} it lives in zinf's shards (param.grad is not the averaged gradient), and no zinf "
        f"optimizer holds exactly the trainable parameters given. Pass the same parameters as to your "
        f"zinf_compiler.optim optimizer (e.g. model.parameters()), or call optimizer.clip_grad_norm_(max_norm)")


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, refused for zinf-sharded gradients (it would clip nothing)."""
    params, records = _zinf_params_in(parameters)
    if records:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_value_ cannot clip the gradient of parameter {records[0].name}: at zinf "
            f"stage {records[0].stage} it lives in zinf's shards, so it would clip nothing. zinf clips by norm: "
            f"call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or optimizer.clip_grad_norm_")
    return TORCH_CLIP["clip_grad_value_"](params, clip_value, foreach)


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, refused for zinf-sharded gradients: the norm the
    caller took with ``get_total_norm`` over ``param.grad`` missed them, and the scaling would too."""
    params, records = _zinf_params_in(parameters)
    if records:
        raise RuntimeError(
            f"torch.nn.utils.clip_grads_with_norm_ cannot scale the gradient of parameter {records[0].name}: at "
            f"zinf stage {records[0].stage} it lives in zinf's shards (param.grad is not it, so a norm taken with "
            f"get_total_norm over param.grad misses it too). Call torch.nn.utils.clip_grad_norm_(model.parameters(), "
            f"max_norm) or optimizer.clip_grad_norm_(max_norm): both return the global norm")
    return TORCH_CLIP["_clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


# ``model.zero_grad()`` (the HF Trainer's call, and many loops') clears ``param.grad``;
# at stages 2-3 zinf keeps gradients in sharded buffers instead, which it would
# leave alone: the next step would add two backwards' gradients up, silently.
TORCH_MODULE_ZERO_GRAD = torch.nn.Module.zero_grad  # torch's own (install() sets it)


def module_zero_grad_with_shards(self: torch.nn.Module, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad`` that also discards the zinf gradient shards of the module's parameters."""
    TORCH_MODULE_ZERO_GRAD(self, set_to_none)
    if _store.records():
        records = [record for record in map(_store.lookup, self.parameters()) if record is not None]
        if records:
            _store.drop_grads(records)
