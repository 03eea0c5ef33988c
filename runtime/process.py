"""The process's zinf runtime: the one registry of process-wide state.

What a process holds for zinf whatever models it compiles lives in one
:class:`Runtime`, :data:`RUNTIME`, made at import: the step tracer, the copy
engine, the collectives of the default process group (subgroups and meshes
hang off it), the parameter store (with its pinned pool and swap engines) and
the activation store.  Nothing else in the runtime keeps mutable state at
module level, except what a signal handler must reach (the swap folders to
remove on SIGTERM, runtime/swap_folders.py) and the binding's per-thread
current call (runtime/binding.py).

What is a model's own is not here: its fp16 loss scaler, device budget,
collective timeout and mesh live in its :class:`~.ledger.Ledger` and its
parameters' records, so two models in one process never share them.
"""

from __future__ import annotations

import time

from .activations import ActivationStore
from .comm import Comm
from .copy_engine import CopyEngine
from .store import ParamStore
from .trace import Tracer

# A swap folder scan for the trace's nvme bytes at most this often.
NVME_SAMPLE_SECONDS = 0.05


class Runtime:
    """One process's tracer, copier, default-group collectives, parameter store and activation store."""

    def __init__(self) -> None:
        self.tracer = Tracer()
        self.copier = CopyEngine(self.tracer)
        self.comm = Comm(copier=self.copier, tracer=self.tracer)
        self.store = ParamStore(self.comm)
        self.activations = ActivationStore(self.store.process, self.copier)
        self._nvme_sampled = (0.0, 0)  # (when, bytes) of the last swap folder scan

    def trace_sample(self) -> dict[str, int]:
        """Bytes per tier now (parameters, gradients, states, activations), for the step trace's memory picture."""
        store = self.store
        activations = store.process.activations
        sample = {"device": store.resting["device"] + store.transient["device"] + activations["device"],
                  "cpu": store.resting["cpu"] + store.transient["cpu"] + activations["cpu"],
                  "pinned in use": store.pinned.in_use_bytes if store.pinned is not None else 0}
        engines = store.engines() + self.activations.engines()
        if engines:
            at = time.perf_counter()
            if at - self._nvme_sampled[0] > NVME_SAMPLE_SECONDS:  # a directory scan: not every 2 ms
                self._nvme_sampled = (at, sum(engine.bytes_on_disk() for engine in engines))
            sample["nvme"] = self._nvme_sampled[1]
        return sample


RUNTIME = Runtime()
