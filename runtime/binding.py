"""Which parameters a running graph works on: bound at run time, per call.

Dynamo hands one compiled graph every module whose code and guards match
(two instances of one class, the blocks of a stack after a graph break, a
new model built after an old one); parameters are graph inputs.  So the
graph's zinf ops name a parameter by its *slot* (its position among the
Dynamo graph's inputs), never by an identity fixed at compile time, and the
runtime resolves slots against the :class:`Binding` of the call in progress:

* forward: the compiled callable's wrapper builds the binding from the call's
  own arguments and makes it current while the graph runs (:func:`bound`);
* backward: the autograd node of that call gets a pre-hook that makes the
  same binding current while its backward graph runs, and a hook that ends it
  (:func:`bind_backward`).  Autograd runs a node's pre-hooks, the node and its
  hooks on one thread, so a thread-local current binding is enough.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree


class ZinfBindingError(RuntimeError):
    """A zinf op ran outside a bound call (not from a graph zinf compiled)."""


class Binding:
    """The store records of one compiled call, by slot (Dynamo input position), the store holding them,
    and the activation store its saved activations go to.

    The graph's ops reach the runtime's parts through the binding of the call they
    run in, not through a global: the store (and through it the communicator,
    ``store.comm``) and the activation store; a store built in a test serves the
    ops it binds.  A stage-0 call binds no records, only the parts.
    """

    __slots__ = ("records", "graph_id", "store", "activations", "_units")

    def __init__(self, records: dict[int, Any], graph_id: int, store: Any, activations: Any = None):
        self.records = records
        self.graph_id = graph_id
        self.store = store
        self.activations = activations  # runtime/activations.py's ActivationStore (None: the graph offloads none)
        # (slots, tile) -> the store's unit: each unit's several ops in a call (fetch steps, gather, release,
        # its reduction in backward) look it up once (the records bound to the slots are fixed for the call).
        self._units: dict[tuple, Any] = {}

    def unit(self, slots: list[int], tile: int | None = None):
        """The store's unit of the parameters bound to ``slots`` (a bucket, or one; ``tile``: that row tile)."""
        key = (tuple(slots), tile)
        unit = self._units.get(key)
        if unit is None:
            unit = self._units[key] = self.store.unit([self.record(slot) for slot in slots], tile)
        return unit

    def model_ledger(self):
        """The ledger of the model this call runs (its first bound parameter's group), where its saved
        activations count; None when no parameter is bound (stage 0)."""
        return next(iter(self.records.values())).group.ledger if self.records else None

    def record(self, slot: int):
        """The store record bound to input ``slot`` of this call; raises naming the graph if none is."""
        try:
            return self.records[slot]
        except KeyError:
            raise ZinfBindingError(
                f"zinf graph {self.graph_id}: no parameter bound to input slot {slot} in this call"
            ) from None


_local = threading.local()
_METADATA_KEY = "zinf_bound_graph"


def current() -> Binding:
    """The binding of the graph call running on this thread; raises when no zinf graph runs."""
    binding = getattr(_local, "binding", None)
    if binding is None:
        raise ZinfBindingError(
            "a zinf op ran outside a call of a graph compiled by zinf (no parameters are bound); "
            "zinf ops are inserted by the backend and only run inside its compiled graphs"
        )
    return binding


def active() -> bool:
    """Whether a zinf graph is running on this thread (its ops may touch resting parameters)."""
    return getattr(_local, "binding", None) is not None


@contextlib.contextmanager
def bound(binding: Binding) -> Iterator[None]:
    """Make ``binding`` current on this thread for the block (nests)."""
    previous = getattr(_local, "binding", None)
    _set(binding)
    try:
        yield
    finally:
        _set(previous)


# Told whenever a binding starts or ends (runtime/resting.py: its guard is off while a graph runs).
_listeners: list = []


def on_change(listener) -> None:
    """Call ``listener(active: bool)`` whenever this thread's binding starts or ends."""
    _listeners.append(listener)


def _set(binding: "Binding | None") -> None:
    _local.binding = binding
    for listener in _listeners:
        listener(binding is not None)


def bind_backward(outputs: Any, binding: Binding) -> int:
    """Make ``binding`` current while the backward of the call that produced ``outputs`` runs.

    Returns the number of autograd nodes hooked (0 when nothing needs a backward).
    """
    hooked = 0
    for node in compiled_backward_nodes(outputs):
        # A node already bound belongs to an earlier call whose output this
        # call passed through: it keeps its own binding.
        if _METADATA_KEY in node.metadata:
            continue
        node.metadata[_METADATA_KEY] = binding.graph_id
        node.register_prehook(_enter(binding))
        node.register_hook(_leave)
        hooked += 1
    return hooked


def _enter(binding: Binding):
    def prehook(grad_outputs):
        _set(binding)

    return prehook


def _leave(grad_inputs, grad_outputs):
    _set(None)


# How far from an output's grad_fn the call's own node may sit: AOTAutograd
# regenerates aliased outputs (views) outside its autograd.Function.
_SEARCH_DEPTH = 4


def compiled_backward_nodes(outputs: Any) -> list:
    """The autograd nodes of AOTAutograd's ``CompiledFunction`` reached from ``outputs``."""
    found, seen = [], set()
    frontier = [t.grad_fn for t in pytree.tree_leaves(outputs)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(_SEARCH_DEPTH):
        next_frontier = []
        for node in frontier:
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in node.name():
                found.append(node)
                continue
            next_frontier.extend(child for child, _ in node.next_functions)
        frontier = next_frontier
        if not frontier:
            break
    return found
