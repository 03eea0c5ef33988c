"""The device bytes a compiled call saves for backward: counted from the call until its backward ran.

Offloaded activations are counted by the activation store as they move
(runtime/activations.py); what a call's autograd node keeps on the device is
counted here, per node, on the model's ledger (stage 0: none) and the
process's.  The count ends when the node's backward has run (its saved
tensors are freed then) or when the node is freed.
"""

from __future__ import annotations

from typing import Callable

import torch

from .ledger import Ledger

# The node metadata key of a node already counted (one count per node, however many calls reach it).
_SAVED_KEY = "zinf_saved_activations"


class _SavedOnDevice:
    """Device bytes one call's autograd node saves, counted until its backward ran or the node died."""

    __slots__ = ("process", "ledger", "nbytes", "__weakref__")

    def __init__(self, process: Ledger, ledger, nbytes: int):
        self.process = process
        self.ledger = ledger
        self.nbytes = nbytes
        self.process.add_activations("device", nbytes)
        if ledger is not None:
            ledger.add_activations("device", nbytes)

    def release(self, *_ignored) -> None:
        if self.nbytes:
            self.process.add_activations("device", -self.nbytes)
            if self.ledger is not None:
                self.ledger.add_activations("device", -self.nbytes)
            self.nbytes = 0

    def __del__(self) -> None:
        self.release()


def count_saved(nodes: list, inputs: list, ledger, process: Ledger,
                is_handle: Callable[[torch.Tensor], bool]) -> int:
    """Count on ``ledger`` and ``process`` the device bytes the autograd ``nodes`` of one call saved.

    Inputs (parameters, user inputs), storage-less tensors and offloaded
    activations' handles (``is_handle``) are not counted.  Returns the bytes
    counted.
    """
    with torch._C.DisableTorchFunctionSubclass():  # (resting parameters: no Python call per storage read)
        skip = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    total = 0
    for node in nodes:
        if _SAVED_KEY in node.metadata:
            continue
        try:
            saved = node.saved_tensors
        except RuntimeError:
            continue  # already freed, or not unpackable here
        storages = {}
        for tensor in saved:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in skip or storage.data_ptr() == 0 or is_handle(tensor):
                continue  # parameters, user inputs, storage-less parameters, handles of offloaded values
            storages[storage.data_ptr()] = storage.nbytes()
        nbytes = sum(storages.values())
        counter = _SavedOnDevice(process, ledger, nbytes)
        node.metadata[_SAVED_KEY] = counter
        node.register_hook(counter.release)
        total += nbytes
    return total
