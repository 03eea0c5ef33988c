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

Other tensors may share a parameter's storage: ``state_dict()`` values
(``param.detach()``), ``param.data``, views, taken before compiling or inside
``zinf.gathered``.  Freeing the storage would leave them reading freed memory,
so :func:`guard_aliases` (called just before it is freed) turns each Python
one into a :class:`RestingAlias` (or, a parameter, a
:class:`RestingParameter`): while the parameter holds its full storage again
(inside ``zinf.gathered``) it reads the current value, as in eager, and
otherwise any op that would touch its data raises, naming the parameter.
``param.copy_(alias)`` of the parameter's own alias (``load_state_dict`` of a
state dict taken before compiling) writes nothing: in eager the alias holds
the parameter's current value.  A storage that something Python cannot reach
holds too (a view an autograd graph saved, a tensor of another subclass) is
not freed at all: the parameter moves to an empty storage of its own, those
holders keep the values of that moment, and the Python aliases stay errors
for good (``_zinf_retired``).

The guard finds a resting parameter's record through one lookup: :func:`rest`
gives the parameter a link to the store that adopted it (``_zinf_store``, a
weak reference that pickles and copies as nothing of the store), and
:func:`record_of` asks that store.  No process-wide store is reached.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch._C import DisableTorchFunctionSubclass

from . import binding

# Tensor methods that never touch the data (attribute getters and setters pass too, but ``.data``).
_METADATA = frozenset(getattr(torch.Tensor, name) for name in (
    "size", "dim", "numel", "stride", "storage_offset", "untyped_storage", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "nelement", "ndimension", "data_ptr", "requires_grad_", "__hash__",
    "__len__", "get_device", "type", "__reduce_ex__", "_is_view", "is_shared", "is_pinned",
    "register_hook", "register_post_accumulate_grad_hook",  # (hooks: runtime/grad_hooks.py)
    # Flags Dynamo's fake-tensor conversion reads of a graph input (torch 2.11 calls them outside
    # is_compiling(): a parameter zinf.materialize adopted before the first compile reached it there).
    "is_conj", "is_neg", "is_inference", "_is_zerotensor",
))


class ZinfRestingParameterError(RuntimeError):
    """A stage-3 parameter's data was touched outside zinf, where it does not exist."""


class RestingParameter(torch.nn.Parameter):
    """An adopted stage-3 parameter (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _checked_call(func, args, kwargs or {})


class RestingAlias(torch.Tensor):
    """A tensor sharing a stage-3 parameter's storage, made one when the storage was freed
    (see the module docstring).  Ops on it give plain tensors; ``torch.save`` and
    ``copy.deepcopy`` give plain tensors too, as they would in eager.

    Its ``_zinf_alias_uid`` and ``_zinf_alias_name`` name the parameter (its store record);
    ``_zinf_retired``: the parameter has moved to another storage, so this one's values are
    stale for good.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _checked_call(func, args, kwargs or {})

    def __reduce_ex__(self, proto):
        if _is_resting(self):
            _refuse(torch.Tensor.__reduce_ex__, self)
        with DisableTorchFunctionSubclass():
            return torch.Tensor._reduce_ex_internal(self, proto)  # saved as a plain tensor, as in eager

    def __deepcopy__(self, memo):
        if _is_resting(self):
            _refuse(torch.Tensor.__deepcopy__, self)
        with DisableTorchFunctionSubclass():
            plain = self.as_subclass(torch.Tensor)
            # Kept alive with the memo (``copy``'s own convention), as ``memo`` is keyed by id().
            memo.setdefault(id(memo), []).append(plain)
            return torch.Tensor.__deepcopy__(plain, memo)


def _checked_call(func, args, kwargs):
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
    """A resting parameter, or an alias of one: its storage is freed (or, ``_zinf_retired``, no longer
    the parameter's), so its data must not be touched."""
    return (isinstance(value, (RestingParameter, RestingAlias)) and value.numel() > 0
            and (value.untyped_storage().nbytes() == 0 or getattr(value, "_zinf_retired", False)))


def _first_resting(args, kwargs):
    for value in (*args, *kwargs.values()):
        if _is_resting(value):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if _is_resting(item):
                    return item
    return None


class _StoreLink:
    """A resting parameter's weak link to its store (see :func:`rest`): pickled, it comes back dead;
    copied, it is the same link (the copy is no adopted parameter, so the store never finds it)."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, store=None):
        self._ref = weakref.ref(store) if store is not None else None

    def store(self):
        """The store, or None (collected, or a link that went through pickle)."""
        return self._ref() if self._ref is not None else None

    def __reduce__(self):
        return (_StoreLink, ())

    def __deepcopy__(self, memo):
        return self


def rest(param: torch.nn.Parameter, store) -> None:
    """Mark adopted stage-3 ``param`` resting: a :class:`RestingParameter` (if still a plain parameter)
    linked to ``store``, the one the guard asks for its record (:func:`record_of`)."""
    param._zinf_store = _StoreLink(store)
    if type(param) is torch.nn.Parameter:
        param.__class__ = RestingParameter  # touched outside zinf: an error, not a segfault


def record_of(param):
    """``(store, record)`` of a resting parameter, through the store :func:`rest` linked it to;
    ``(None, None)`` for a tensor no store made rest (an alias), or whose store is gone."""
    link = getattr(param, "_zinf_store", None)
    store = link.store() if isinstance(link, _StoreLink) else None
    record = store.lookup(param) if store is not None else None
    return (store, record) if record is not None else (None, None)


def _name(param) -> str:
    _, record = record_of(param)
    return record.name if record is not None else "a parameter"


def _refuse(func, param) -> None:
    if getattr(func, "__name__", "") == "__get__":
        what = f".{getattr(getattr(func, '__self__', None), '__name__', 'attribute')}"
    else:
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    owner = getattr(param, "_zinf_alias_name", None)
    if owner is not None:
        kind = "parameter" if isinstance(param, torch.nn.Parameter) else "tensor"
        raise ZinfRestingParameterError(
            f"{what} on a {kind} that shares the storage of stage-3 parameter {owner} (a state_dict() value, "
            f"param.detach(), param.data or a view, taken before compiling or inside zinf_compiler.gathered): "
            f"zinf freed that storage, the parameter's data is in its shards. Read current values with "
            f"zinf_compiler.full_state_dict(model) (every rank must call it); inside "
            f"`with zinf_compiler.gathered(model):` this {kind} reads the current value again; to keep values "
            f"past such a block, copy them in it ({{k: v.clone() for k, v in model.state_dict().items()}})"
        )
    raise ZinfRestingParameterError(
        f"{what} on stage-3 parameter {_name(param)}: zinf keeps its data in shards and the parameter itself "
        f"holds no memory between uses. Read the full values with zinf_compiler.full_state_dict(model) "
        f"(every rank must call it); for eager code (model.generate(...), an eager evaluation) wrap it in "
        f"`with zinf_compiler.gathered(model):`; load new values with model.load_state_dict(...) (or "
        f"param.copy_(value) under torch.no_grad()), which write into the shards; or use stage <= 2 to keep "
        f"full parameters"
    )


def _assign(param, value):
    store, record = record_of(param)
    if record is None:
        _refuse(torch.Tensor.copy_, param)
    if torch.is_grad_enabled() and param.requires_grad:
        raise ZinfRestingParameterError(
            f"copy_ into stage-3 parameter {record.name} with grad enabled: wrap it in torch.no_grad() "
            f"(model.load_state_dict does)")
    if _is_whole_alias_of(value, record):
        return param  # in eager this alias holds the parameter's current value: copying it changes nothing
    store.assign_full(record, value)
    return param


def _is_whole_alias_of(value, record) -> bool:
    """``value`` is an alias of ``record``'s parameter laid out as the parameter is (a ``state_dict()``
    value, ``param.detach()``, ``param.data``)."""
    return (isinstance(value, RestingAlias) and getattr(value, "_zinf_alias_uid", None) == record.uid
            and value.dtype == record.dtype and tuple(value.shape) == tuple(record.shape)
            and value.storage_offset() == 0 and value.is_contiguous())


def guard_aliases(params, lookup) -> set[int]:
    """Just before stage 3 frees these parameters' storages: guard the Python tensors sharing one.

    ``params``: ``(parameter, record uid, name)`` triples; ``lookup``: the store's
    ``lookup`` (a parameter's record, or None if it adopted none).  A plain tensor sharing
    a parameter's storage becomes a :class:`RestingAlias`, a plain parameter a
    :class:`RestingParameter` (both raise instead of reading freed memory).
    Returns the ``id()`` of each parameter whose storage something else holds
    as well (a tensor of another subclass, or one only C++ holds: a view an
    autograd graph saved): its storage must not be freed.  The Python objects
    are found by one scan of the garbage collector's objects, run only when a
    storage's use count shows more holders than the parameter.
    """
    owners = {}
    for param, uid, name in params:
        storage = param.untyped_storage()
        # Besides the parameter: Python's one storage object per storage (``storage`` here).
        others = torch._C._storage_Use_Count(storage._cdata) - 2
        if others > 0:
            owners[storage._cdata] = {"param": param, "uid": uid, "name": name, "others": others, "found": []}
    if not owners:
        return set()
    with DisableTorchFunctionSubclass():
        for value in gc.get_objects():
            if not issubclass(type(value), torch.Tensor):
                continue
            try:
                owner = owners.get(value.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue  # no storage (a wrapper subclass, a sparse tensor)
            if owner is None or value is owner["param"]:
                continue
            if isinstance(value, torch.nn.Parameter) and lookup(value) is not None:
                continue  # another adopted parameter on this storage: the storage stays whole for it
            if type(value) is torch.Tensor:
                value.__class__ = RestingAlias
            elif type(value) is torch.nn.Parameter:
                value.__class__ = RestingParameter
            elif type(value) not in (RestingAlias, RestingParameter):
                continue  # another subclass: left as it is, so the storage stays
            value._zinf_alias_uid, value._zinf_alias_name = owner["uid"], owner["name"]
            owner["found"].append(value)
            owner["others"] -= 1
    kept = set()
    for owner in owners.values():
        if owner["others"] > 0:
            kept.add(id(owner["param"]))
            for value in owner["found"]:
                value._zinf_retired = True  # the parameter moves to a new storage: these keep stale values
    return kept
