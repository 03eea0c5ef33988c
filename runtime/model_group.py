"""One model as the runtime sees it: the parameters adopted together, and what belongs to the model
rather than to any one parameter.

A :class:`ModelGroup` is made the first time some of a model's parameters are
*claimed* (``ParamStore.claim``): by the compile that adopts them, by an
optimizer or a checkpoint load that comes first, or by ``zinf.materialize``.
Every parameter belongs to one group for its whole life; a claim over
parameters with no group puts them in the group the others of the claim
already share (the first, in the parameters' order), else in a new one.
Groups never merge: where one optimizer spans several (a graph break compiled
before the optimizer existed gives each subgraph its own), the optimizer makes
one decision for all of them (:func:`agree_on_skip`), and ``memory_report``
adds their ledgers up.

A group owns: the records of its parameters (each with its frozen
:class:`~.param_plan.ParamPlan`), its :class:`~.ledger.Ledger` (bytes per tier,
device budget), its mesh (the ranks it shards over, fixed at its first
adoption), the pipeline it is a stage of (if any), its collective timeout, its fp16 loss scale
(:class:`Fp16GradScaler`) and the values and gradients a pipeline step holds for it, so that
one model's overflow never skips another's step and one model's options never change another's.
The store keeps no map keyed by group (tests/unit/test_model_group_owns.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Iterable

import torch

from .ledger import Ledger, ZinfStoreError

if TYPE_CHECKING:
    # (records.py and the store import this module: ParamRecord, ParamStore and Unit are named, not imported)
    from .comm import Comm, MeshComm

_group_numbers = itertools.count()


@dataclasses.dataclass(eq=False)
class GradHold:
    """A model's gradients summed over a pipeline step's backwards (ParamStore.hold_grads)."""

    sums: dict = dataclasses.field(default_factory=dict)  # unit key -> its pieces' summed flat gradients
    last: bool = False  # the next backward reduces the sums

    def nbytes(self) -> int:
        """The device bytes the held sums take (counted as transient device bytes while held)."""
        return sum(flat.numel() * flat.element_size() for flats in self.sums.values() for flat in flats)


class Fp16GradScaler:
    """Dynamic scaling of gradients on their way through fp16 (``param_dtype="fp16"``).

    The graph computes in the model's own dtype; gradients become fp16 only
    to be reduced.  They are multiplied by ``scale`` before that cast and
    divided after it, so that small values survive.  An inf or nan seen on
    any rank skips the optimizer step and halves the scale; ``growth_interval``
    good steps in a row double it (the policy of ``torch.amp.GradScaler``).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.found_inf = False
        self.good_steps = 0
        self.skipped_steps = 0

    def state(self) -> dict:
        """What a checkpoint keeps (see :meth:`load_state`)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict) -> None:
        """Restore the scale and its counters from :meth:`state`'s dict."""
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]

    def check(self, reduced_grad: torch.Tensor) -> None:
        """Note an overflow if ``reduced_grad`` has an inf or NaN (the step will be skipped)."""
        if not self.found_inf and not bool(torch.isfinite(reduced_grad).all()):
            self.found_inf = True

    def record_step(self, skipped: bool) -> None:
        """After the ranks agreed (:func:`agree_on_skip`): halve on a skip, double after enough good steps."""
        self.found_inf = False
        if skipped:
            self.scale /= 2.0
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0


def agree_on_skip(scalers: list[Fp16GradScaler], comm: "Comm", device: torch.device,
                  timeout: float | None = None) -> bool:
    """Whether an optimizer step over ``scalers``' models is skipped: any overflow seen by any of them on
    any rank (one all-reduce over ``comm``) skips it for all, and each scaler records the outcome, so
    models stepped by one optimizer keep their scales in step.  ``device``: where the flag is reduced
    (NCCL reduces device tensors only)."""
    found = any(scaler.found_inf for scaler in scalers)
    flag = torch.tensor(1.0 if found else 0.0, device=device)
    comm.all_reduce_sum(flag, "all_reduce of the fp16 overflow flag (optimizer step)", timeout)
    skipped = flag.item() > 0
    for scaler in scalers:
        scaler.record_step(skipped)
    return skipped


def combined_scaler_state(scalers: Iterable[Fp16GradScaler]) -> dict:
    """One checkpoint entry for the scalers of one model's groups (kept in step by :func:`agree_on_skip`;
    where they differ, the most cautious figures)."""
    states = [scaler.state() for scaler in scalers] or [Fp16GradScaler().state()]
    return {"scale": min(s["scale"] for s in states), "good_steps": min(s["good_steps"] for s in states),
            "skipped_steps": max(s["skipped_steps"] for s in states)}


class ModelGroup:
    """One model's parameters and what belongs to the model (see the module docstring).

    ``store``: the services it was handed (the process's ParamStore: transfers, swap engines, pinned pool,
    communicator), which every model shares; what the group holds is its own."""

    def __init__(self, store: "ParamStore | None" = None):
        self.number = next(_group_numbers)  # for messages and dumps: groups in the order they were made
        self.store = store
        # Its units (buckets, row tiles), by key, each built once (ParamStore.unit): a unit's parameters are
        # one model's, and two models share none.
        self.units: dict[tuple, "Unit"] = {}
        self.ledger = Ledger()
        self.fp16_scaler = Fp16GradScaler()
        # Seconds this model's collectives wait for the other ranks (option collective_timeout; None: the
        # process's default, runtime/comm.py).
        self.collective_timeout: float | None = None
        self.mesh: "MeshComm | None" = None  # fixed by the first adoption (see join)
        self.records: dict[int, "ParamRecord"] = {}  # uid -> record, in adoption order
        # A pipeline stage's model: the ranks of the pipeline (one per stage), which hold the rest of the whole
        # model's parameters (its gradient norm spans them); set by zinf_compiler/pipeline_parallel.py.
        self.pipeline: "Comm | None" = None
        # And which stage it is: (index, number of stages); checkpoints of the pipeline put each in its folder.
        self.stage: tuple[int, int] | None = None
        # While a pipeline step holds the model's gathered parameters (ParamStore.hold_gathers): (parameter uid,
        # tile) -> a copy of its gathered value; None when no hold is open.
        self.held_gathers: dict | None = None
        # While it holds the model's gradients over the step's micro-batches (ParamStore.hold_grads).
        self.grad_hold: GradHold | None = None

    @property
    def device_memory_limit(self) -> int | None:
        """The model's budget of gathered and in-flight device bytes (None: unlimited); its ledger enforces it."""
        return self.ledger.device_memory_limit

    def configure(self, *, device_memory_limit: int | None, collective_timeout: float | None) -> None:
        """Take a compile's options (the latest compile of the model sets them)."""
        self.ledger.device_memory_limit = device_memory_limit
        self.collective_timeout = collective_timeout

    def check_mesh(self, mesh: "MeshComm", name: str) -> None:
        """Refuse to adopt ``name`` over another mesh than the model's (one model, one set of ranks)."""
        if self.mesh is not None and mesh is not self.mesh:
            raise ZinfStoreError(
                f"parameter {name} is asked to shard over {mesh.describe()}, but its model (zinf model group "
                f"{self.number}) already shards over {self.mesh.describe()}: compile every part of one model with "
                f"the same mesh option (or give the parts separate optimizers, as separate models)")

    def join(self, record: "ParamRecord") -> None:
        """Count ``record`` as the model's (at adoption); its mesh becomes the model's if it has none yet."""
        self.check_mesh(record.mesh, record.name)
        self.mesh = record.mesh
        self.records[record.uid] = record

    def leave(self, record: "ParamRecord") -> None:
        """``record``'s parameter was collected (its bytes were already given back): it and its units go."""
        self.records.pop(record.uid, None)
        for key in [key for key in self.units if any(uid == record.uid for uid, _ in key)]:
            del self.units[key]

    def __repr__(self) -> str:
        return f"ModelGroup({self.number}, {len(self.records)} parameters)"


@dataclasses.dataclass(frozen=True, eq=False)
class ModelView:
    """One model as the top layer (checkpoints, pipeline stages) reaches it: the groups its parameters are in
    and the services they share (the process's ParamStore).

    One group for a model trained the usual way (its optimizer, a load or its first compile claimed it
    whole); several for a model compiled in parts before anything claimed it whole (groups never merge), or
    for a container of models.  ``lookup`` finds only this model's parameters' records, so code handed one
    model's view never reaches another's state.
    """

    groups: tuple[ModelGroup, ...]
    store: "ParamStore"

    @property
    def group(self) -> ModelGroup:
        """The model's group: its first (the one a claim puts its unclaimed parameters in)."""
        return self.groups[0]

    @property
    def comm(self) -> "Comm":
        """The process's communicator (every rank): what the model's checkpoints agree over."""
        return self.store.comm

    def lookup(self, param: torch.Tensor) -> "ParamRecord | None":
        """The record of ``param`` if it is this model's (adopted into one of its groups), else None."""
        record = self.store.lookup(param)
        return record if record is not None and any(record.group is group for group in self.groups) else None

