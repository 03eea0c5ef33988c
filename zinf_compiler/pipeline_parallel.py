"""Pipeline parallelism (torch.distributed.pipelining) over stages compiled with zinf (issue 37).

Each pipeline stage is a submodule compiled with ``backend="zinf"`` over its stage's data-parallel ranks
(option ``mesh`` = ``mesh["dp"]`` of a ``("pp", "dp")`` mesh), wrapped in :class:`ZinfPipelineStage`, and
driven by torch's schedules (``ScheduleGPipe``, ``Schedule1F1B``).  What zinf needs from the stage, and why
torch's own ``PipelineStage`` is not enough:

* **Gradient scaling.** With ``scale_grads=True`` (torch's default) a schedule divides each parameter's
  ``.grad`` by the number of micro-batches after the last backward.  At stages 2-3 zinf keeps the
  gradients in its store (``param.grad`` stays None), so torch's division would miss them and the step
  would train on micro-batches' *sum*.  :meth:`ZinfPipelineStage.scale_grads` divides the store's
  gradient shards (in memory, or lazily for gradients in NVMe swap files).
* **Static stage shapes.** Without ``input_args`` / ``output_args`` torch infers them at the first step
  by running the stage forward and an ``autograd.grad`` backward on placeholder values.  zinf's backward
  graph reduces the parameters' gradients into their shards as it runs (and an NVMe optimizer may step
  on them during backward), so that inference would add a gradient of placeholder values to the first
  step.  The stage refuses to be built without both.
* **One mesh per stage.** The zinf mesh of a stage must not include ranks of another stage (they hold
  other parameters: their collectives would mix two models, or wait for ranks that are blocked in the
  pipeline's receives).  Checked when the stage is built, from the options it was compiled with, on
  every rank before any collective.

* **Gathered once per step** (``gather_once=True``): from the step's first forward to its last backward
  the stage's parameters stay gathered (the store's hold, runtime/store_fetch.py, keyed by parameter), so
  each is all-gathered once per step, not once per micro-batch and pass (the forward and backward graphs
  bucket them differently: the backward's units are served from the forward's values).  That holds the
  stage's whole parameters on the device for the step; ``gather_once=False`` gathers per use, as without
  pipelining.  Any lowering: each use gets its own copy of the held values, which the compiled graph may
  overwrite (Inductor reuses an op output's buffer after its last use).

* **Reduced once per step** (``reduce_once=True``): each unit's gradients are summed on the device over
  the step's micro-batches (runtime/store_grads.py, hold_grads) and reduce-scattered by the step's last
  backward, not after each micro-batch's.  That holds the stage's unsharded gradients on the device for
  the step (FSDP2's ``set_requires_gradient_sync(False)`` until the last micro-batch);
  ``reduce_once=False`` reduces per micro-batch and accumulates into the shards.

* **The default** (``"auto"`` for both): once per step where the stage's parameters rest on the device
  (FSDP2's choice: fewer collectives for the memory of the stage's whole parameters and gradients), per
  micro-batch where any rests offloaded (``offload_param`` cpu or nvme): a model offloaded because it does
  not fit must not be held whole on the device for a step (benchmarks/RESULTS.md, "Peak RSS per rank on a
  model built on meta", has both measured).

docs/notes/pipeline.md has the measured counts and what is left.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from .api import store_of, unwrap


class ZinfPipelineError(RuntimeError):
    """A pipeline stage set up in a way zinf cannot train correctly."""


class ZinfPipelineStage(PipelineStage):
    """torch's ``PipelineStage`` for a submodule compiled with zinf (see the module docstring).

    Takes ``PipelineStage``'s arguments; ``input_args`` and ``output_args`` (example tensors of one
    micro-batch, ``requires_grad=True`` where a gradient flows between stages) are required.
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 input_args=None, output_args=None, group: dist.ProcessGroup | None = None, *,
                 gather_once: bool | str = "auto", reduce_once: bool | str = "auto", **kwargs):
        if input_args is None or output_args is None:
            raise ZinfPipelineError(
                f"pipeline stage {stage_index}: zinf needs the stage's shapes up front: pass input_args and "
                f"output_args (one micro-batch's example tensors, requires_grad=True where a gradient flows "
                f"between stages). Without them torch infers the shapes by running a backward at the first "
                f"step, whose gradients zinf would add to that step's.")
        for name, value in (("gather_once", gather_once), ("reduce_once", reduce_once)):
            if value not in (True, False, "auto"):
                raise ZinfPipelineError(f"pipeline stage {stage_index}: {name}={value!r}; use True, False or "
                                        f"'auto' (once per step unless the stage's parameters are offloaded)")
        _agree_on_stages(submodule, stage_index, group, input_args, output_args)
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group, **kwargs)
        self.gather_once, self.reduce_once = gather_once, reduce_once
        self._grads_held = False  # this step's gradients are summed over its micro-batches (reduce_once)
        self._holding: set = set()  # the model groups whose gathers or gradients this stage holds now
        # The stage's model is part of a whole one: its gradient norm (clip_grad_norm_) spans the pipeline.
        # The stage's model, claimed whole now: one group, which its compile adopts the parameters into.
        self._view = store_of(submodule)
        model_group = self._view.group
        model_group.pipeline = self._view.comm.subgroup(group)
        model_group.stage = (stage_index, num_stages)  # (zinf.save writes each stage into its stage folder)

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, *rest, **more):
        """torch's forward of one micro-batch, inside the step's hold of gathered parameters."""
        if fwd_chunk_id == 0:
            self._end_hold()  # a step that raised half way left its hold open: its values may be stale
        self._hold()
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **more)
        self._hold()  # (the first step's hold starts once its first forward has adopted the parameters)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args, last_backward: bool = False, **kwargs):
        """torch's backward of one micro-batch; the step's last one reduces the held gradients and ends
        the hold."""
        if not last_backward:
            return super().backward_one_chunk(bwd_chunk_id, *args, last_backward=last_backward, **kwargs)
        store = self._view.store
        if self._grads_held:
            store.reduce_held_grads_next(self._holding)
        try:
            output = super().backward_one_chunk(bwd_chunk_id, *args, last_backward=last_backward, **kwargs)
            store.end_held_grads(self._holding)  # (raises if a held sum was not reduced)
            return output
        finally:  # the step's last use of the parameters before the optimizer changes them
            self._end_hold()

    def _hold(self) -> None:
        """From the step's first forward to its last backward, each parameter of the stage is gathered once
        (gather_once; runtime/store_fetch.py, hold_gathers), not once per micro-batch and pass, and each
        unit's gradients are reduced once (reduce_once; runtime/store_grads.py, hold_grads)."""
        if self._holding or not (self.has_backward and torch.is_grad_enabled()):
            return
        records = self._records()
        self._holding = {record.group for record in records}
        store = self._view.store
        offloaded = any(record.param_tier != "device" for record in records)
        if self.gather_once is True or (self.gather_once == "auto" and not offloaded):
            store.hold_gathers(self._holding)
        self._grads_held = self.reduce_once is True or (self.reduce_once == "auto" and not offloaded)
        if self._grads_held:
            store.hold_grads(self._holding)

    def _end_hold(self) -> None:
        store = self._view.store
        store.end_held_gathers(self._holding)
        store.end_held_grads(self._holding, reduced=False)  # (dropped: what is left belongs to a failed step)
        self._holding, self._grads_held = set(), False

    def _records(self) -> list:
        return [record for record in map(self._view.lookup, unwrap(self.submod).parameters()) if record is not None]

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the stage's gradients by ``grad_scale_factor`` (the schedule's micro-batches), wherever
        they are: ``param.grad`` (torch's own division) and zinf's gradient shards."""
        super().scale_grads(grad_scale_factor)
        if grad_scale_factor != 1:
            self._view.store.scale_grads(self._records(), 1.0 / grad_scale_factor)


def compile_options(module: torch.nn.Module) -> dict | None:
    """The options ``module`` was compiled with (``torch.compile(module, backend="zinf", options=...)``),
    or None if it was not compiled with zinf.  (Read from Dynamo's wrapper of the backend.)"""
    from torch._dynamo.eval_frame import innermost_backend

    context = getattr(module, "dynamo_ctx", None)
    backend = innermost_backend(context.callback) if context is not None else None
    if getattr(backend, "compiler_name", None) not in ("zinf", "zinf_backend"):
        return None
    return dict(getattr(backend, "kwargs", {}).get("options", {}))


def _mesh_problem(submodule: torch.nn.Module, stage_index: int, group: dist.ProcessGroup | None) -> str | None:
    """What is wrong with the stage's zinf mesh (it reaches into another stage's ranks), or None."""
    options = compile_options(submodule)
    if options is None:
        return (f"pipeline stage {stage_index}: ZinfPipelineStage takes a module compiled with "
                f"torch.compile(module, backend='zinf', options=...); use torch's PipelineStage for others")
    from .options import parse_options

    world = set(range(dist.get_world_size()))
    shard, replicate = parse_options(options).mesh or (None, None)
    if replicate is not None or shard in (None, dist.GroupMember.WORLD):
        mesh_ranks = world  # (a 2-D mesh spans every rank)
    else:
        mesh_ranks = set(dist.get_process_group_ranks(shard))
    stage_ranks = set(dist.get_process_group_ranks(group)) if group is not None else world
    others = sorted((mesh_ranks & stage_ranks) - {dist.get_rank()})
    if others:
        return (f"pipeline stage {stage_index}: its zinf mesh spans ranks {sorted(mesh_ranks)}, which include "
                f"rank(s) {others} of other pipeline stages (they hold other parameters); compile each stage "
                f"with options={{'mesh': mesh['dp']}}, its own data-parallel ranks")
    return None


def _metas(tensors) -> list:
    tensors = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return [(tuple(t.shape), str(t.dtype), t.requires_grad) for t in tensors]


def _agree_on_stages(submodule, stage_index: int, group, input_args, output_args) -> None:
    """Every stage of the pipeline checks every other's setup, and all raise the same error if one is
    wrong (a stage raising alone would leave the others waiting in the pipeline's first receive): its
    zinf mesh (:func:`_mesh_problem`), and each boundary's shapes, dtypes and ``requires_grad`` as the
    two stages beside it declared them (``output_args`` of one, ``input_args`` of the next)."""
    mine = {"stage": stage_index, "inputs": _metas(input_args), "outputs": _metas(output_args),
            "problem": _mesh_problem(submodule, stage_index, group)}
    stages = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
    stages.sort(key=lambda stage: stage["stage"])
    problems = [stage["problem"] for stage in stages if stage["problem"]]
    for before, after in zip(stages, stages[1:]):
        if before["outputs"] != after["inputs"]:
            problems.append(f"pipeline stages {before['stage']} and {after['stage']} disagree on the tensors "
                            f"between them: output_args {before['outputs']} vs input_args {after['inputs']} "
                            f"(shape, dtype, requires_grad)")
    if problems:
        raise ZinfPipelineError("; ".join(problems))
