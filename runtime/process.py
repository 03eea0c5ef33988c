"""The process's zinf runtime: what builds the runtime's parts, once, and hands them to each other.

What a process holds for zinf whatever models it compiles lives in one
:class:`Runtime`: the step tracer, the copy engine, the collectives of the
default process group (subgroups and meshes hang off it), the pinned memory
(each consumer's staging pool a quota of it), the parameter store (with its
swap engines) and the activation store, the swap folders a SIGTERM must
remove, and the zinf optimizers alive.  This module
makes no instance: the process's one instance belongs to the entry layer
(zinf_compiler/api.py, read by backend.py and optim.py), and no other module
imports this one.  Each part is given the others it uses when built here
(a store its communicator, an engine its tracer and folder watch), so no part
reaches up for them.  Nothing else in the runtime keeps mutable state at module
level, except the binding's per-thread current call and the listeners told
when it changes (runtime/binding.py): that is how a graph's ops are handed the
call they run in, thread state like torch's grad mode, not state of a model.

What is a model's own is not here: its parameters' records and plans, its
ledger, fp16 loss scaler, device budget, collective timeout and mesh live in
its :class:`~.model_group.ModelGroup`, so two models in one process never
share them.
"""

from __future__ import annotations

import time
import weakref

from .activations import ActivationStore
from .comm import Comm
from .copy_engine import CopyEngine
from .pinned import PinnedMemory
from .store import ParamStore
from .swap_folders import FolderWatch
from .trace import Tracer

# A swap folder scan for the trace's nvme bytes at most this often.
NVME_SAMPLE_SECONDS = 0.05


class Runtime:
    """One process's tracer, copier, default-group collectives, pinned memory, parameter and activation stores,
    swap folders and live optimizers."""

    def __init__(self) -> None:
        self.swap_folders = FolderWatch()  # before any swap engine: each registers its folder here
        # The zinf optimizers alive (zinf_compiler/optim.py): clip_grad_norm_'s guard finds the one holding
        # the parameters it is given; zinf.memory_report counts their state.
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.tracer = Tracer()
        self.copier = CopyEngine(self.tracer)
        self.comm = Comm(copier=self.copier, tracer=self.tracer)
        # Every pinned staging pool is a quota of this one allocator (the store's, the activations', each
        # early optimizer's, via the store); each quota's bytes count once, in the store's process figures.
        self.pinned_memory = PinnedMemory(lambda nbytes: self.store.count_pinned_pool(nbytes))
        self.store = ParamStore(self.comm, self.swap_folders, self.pinned_memory)
        self.activations = ActivationStore(self.store.process, self.copier, self.pinned_memory, self.swap_folders)
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
