"""A stage-3 parameter at rest: its storage holds nothing, so touching it must raise, not crash.

Between uses a stage-3 parameter keeps its shape but its storage is resized
to 0 (the data is in zinf's shards).  Read by a plain torch op, such a
tensor segfaults (CPU kernels read its null data pointer).  Adopted stage-3
parameters therefore become :class:`RestingParameter`: an ``nn.Parameter``
whose ``__torch_function__`` lets through what is safe (metadata, the graph
zinf compiled, zinf's own runtime) and

* turns ``param.copy_(value)`` (what ``model.load_state_dict`` does) into a
  write of ``value`` into zinf's shards, on every tier;
* raises :class:`ZinfRestingParameterError` for any other op that would read
  or write the missing data, saying what to use instead.

Dynamo traces through ``__torch_function__`` with ``torch.compiler.is_compiling()``
true, so compiled graphs see a plain parameter.  While a zinf graph runs the
guard is switched off for the class (one Python call per op on a parameter
cost ~14 ms per step of a 4-layer GPT); the switch is process-wide, so
another thread touching a resting parameter during a compiled call is not
caught.
"""

from __future__ import annotations

import torch
from torch._C import DisableTorchFunctionSubclass

from . import binding

# Tensor methods that read metadata only (attribute getters and setters pass too, but ``.data``).
_METADATA = frozenset(getattr(torch.Tensor, name) for name in (
    "size", "dim", "numel", "stride", "storage_offset", "untyped_storage", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "nelement", "ndimension", "data_ptr", "requires_grad_", "__hash__",
    "__len__", "get_device", "type", "__reduce_ex__", "_is_view", "is_shared", "is_pinned",
))


class ZinfRestingParameterError(RuntimeError):
    """A stage-3 parameter's data was touched outside zinf, where it does not exist."""


class RestingParameter(torch.nn.Parameter):
    """An adopted stage-3 parameter (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            if not _allowed(func):
                resting = _first_resting(args, kwargs)
                if resting is not None:
                    if func is torch.Tensor.copy_ and args and args[0] is resting:
                        return _assign(resting, args[1])
                    _refuse(func, resting)
            return func(*args, **kwargs)


def _guard(graph_running: bool) -> None:
    """While a zinf graph runs, parameters reach zinf's own ops: no guard (the plain parameter's
    disabled ``__torch_function__``, a C fast path, instead of a Python call per op)."""
    RestingParameter.__torch_function__ = _UNGUARDED if graph_running else _GUARDED


_GUARDED = RestingParameter.__dict__["__torch_function__"]
_UNGUARDED = torch._C._disabled_torch_function_impl
binding.on_change(_guard)


def _allowed(func) -> bool:
    if torch.compiler.is_compiling() or binding.active():
        return True  # tracing, or zinf's graph and runtime, which know the parameter's state
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(func, "__self__", None) is not torch.Tensor.data  # ``.data`` aliases the missing storage
    return func in _METADATA


def _is_resting(value) -> bool:
    return (isinstance(value, RestingParameter) and value.untyped_storage().nbytes() == 0
            and value.numel() > 0)


def _first_resting(args, kwargs):
    for value in (*args, *kwargs.values()):
        if _is_resting(value):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if _is_resting(item):
                    return item
    return None


def _name(param) -> str:
    from .store import STORE

    record = STORE.lookup(param)
    return record.name if record is not None else "a parameter"


def _refuse(func, param) -> None:
    if getattr(func, "__name__", "") == "__get__":
        what = f".{getattr(getattr(func, '__self__', None), '__name__', 'attribute')}"
    else:
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    raise ZinfRestingParameterError(
        f"{what} on stage-3 parameter {_name(param)}: zinf keeps its data in shards and the parameter itself "
        f"holds no memory between uses. Read the full values with zinf_compiler.full_state_dict(model) "
        f"(every rank must call it); for eager code (model.generate(...), an eager evaluation) wrap it in "
        f"`with zinf_compiler.gathered(model):`; load new values with model.load_state_dict(...) (or "
        f"param.copy_(value) under torch.no_grad()), which write into the shards; or use stage <= 2 to keep "
        f"full parameters"
    )


def _assign(param, value):
    from .store import STORE

    record = STORE.lookup(param)
    if record is None:
        _refuse(torch.Tensor.copy_, param)
    if torch.is_grad_enabled() and param.requires_grad:
        raise ZinfRestingParameterError(
            f"copy_ into stage-3 parameter {record.name} with grad enabled: wrap it in torch.no_grad() "
            f"(model.load_state_dict does)")
    STORE.assign_full(record, value)
    return param
