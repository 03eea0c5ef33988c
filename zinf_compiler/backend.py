"""The ``zinf`` torch.compile backend: capture, rewrite, lower.

``torch.compile(model, backend="zinf", options={...})`` calls :func:`zinf_backend`
once per Dynamo subgraph (a graph break gives several).  Each subgraph goes
through AOTAutograd into forward and backward ATen graphs; every ATen graph
runs the pass pipeline (:mod:`zinf_compiler.pipeline`) and is then lowered
(:mod:`zinf_compiler.lowering`):

* ``lower="inductor"``: Inductor's own ``compile_fx`` drives AOTAutograd, its
  joint-graph passes and the min-cut partitioner; zinf hooks in as
  ``inner_compile``, rewriting each ATen graph right before Inductor lowers it.
* ``lower="eager"``: zinf runs AOTAutograd itself (same min-cut partitioner,
  no decompositions beyond AOTAutograd's own) and runs the rewritten graph's
  generated Python.

This module is part of the entry layer: it hands the process's runtime parts
(the parameter store, activations, tracer) to what it calls, including
``zinf.materialize`` (:func:`materialize`), which adopts parameters ahead of
the first compile through the same settings (:mod:`zinf_compiler.adoption`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Mapping

import torch

from . import materialize as materializing
from . import tensor_parallel
from .adoption import adopt, model_mesh, plan_offload
from .context import CapturedGraph
from .cost_model import CostModel, agreed_free_bytes, is_profiled, profile_machine
from .runtime import agreement
from .runtime.binding import Binding, bind_backward, bound, compiled_backward_nodes
from .runtime.grad_hooks import claim_grad_hooks
from .runtime.binding import active as binding_active
from .api import RUNTIME
from .runtime.store import DTYPES, ZinfStoreError
from .runtime.units import layout_of
from .dump import GraphDumper
from .lowering import compile_eager, compile_with_inductor, rewrite_aten_graph
from .options import ZinfOptions, parse_options
from .recompute import joint_graph_hook

log = logging.getLogger("zinf")


def zinf_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict | None = None) -> Callable:
    """The backend entry point (registered as ``"zinf"``)."""
    from zinf_compiler.passes import pass_names

    parsed = parse_options(options, known_passes=pass_names(), comm=RUNTIME.comm)
    if parsed.stage >= 2 and not torch._dynamo.config.fail_on_recompile_limit_hit:
        # Past the recompile limit Dynamo would run the frame eagerly: eager code
        # cannot read stage-3 parameters (they hold no memory), and at stage 2 its
        # gradients would land in param.grad, which zinf's optimizer never reads
        # (a silently untrained model).  Ask Dynamo for an error instead.  (At
        # stages 0-1 graphs keep full parameters and gradients: eager is right.)
        log.warning("zinf: stage %d sets torch._dynamo.config.fail_on_recompile_limit_hit = True (an eager "
                    "fallback would not train sharded parameters); mark varying input sizes dynamic "
                    "(torch._dynamo.mark_dynamic or dynamic=True) to avoid recompiles", parsed.stage)
        from . import torch_patches

        torch_patches.set_dynamo_config("fail_on_recompile_limit_hit", True)  # (undone by torch_patches.uninstall)
    return compile_captured(gm, example_inputs, parsed)


def compile_captured(gm: torch.fx.GraphModule, example_inputs: list[Any], options: ZinfOptions) -> Callable:
    """Compile one Dynamo subgraph under already parsed ``options`` (:func:`zinf_backend` after parsing).

    Adopts the graph's parameters into the store (stages 1-3), rewrites and lowers each ATen graph, and returns
    the callable Dynamo runs in its place, which binds each call's own parameters (see :func:`_run_time_wrapper`).
    """
    RUNTIME.store.collect()
    # Tensor parallel (zinf_compiler/tensor_parallel.py): DTensor inputs enter AOTAutograd as their local
    # tensors; a DTensor parameter is still adopted (and bound at each call) through the DTensor itself.
    dtensors = list(example_inputs)
    example_inputs, tp_slots = tensor_parallel.unwrap_dtensor_inputs(gm, example_inputs)
    captured = CapturedGraph.from_dynamo(gm, example_inputs, options)
    captured.tp_slots = tp_slots
    captured.param_tensors.update({slot: dtensors[slot] for slot in tp_slots if slot in captured.param_tensors})
    captured.mesh = model_mesh(options, RUNTIME.store.comm)
    captured.world_size = captured.mesh.shard.world_size
    # Collectives of no model (stage 0's all-reduce, checkpoints' exchanges): the last compile's setting;
    # each model's own use its model group's (set below, ParamStore.claim).
    RUNTIME.store.comm.timeout = options.collective_timeout
    if captured.mesh.everyone.world_size > 1:
        _agree_before_compiling(captured)
    adopted = []
    if options.stage > 0:
        from . import torch_patches

        torch_patches.install(RUNTIME.store, RUNTIME.optimizers)  # clipping, model.zero_grad() and torch optimizers must see the shards
        _check_materialized(captured)
        tensor_parallel.check_params(captured.param_tensors, {p: captured.inputs[p].name for p in captured.param_tensors},
                                     captured.mesh, options.stage)
        from zinf_compiler.passes import tile as tile_pass

        # Which weights the tile pass splits: known before adoption, which lays them out tile by tile.
        tile_plans = tile_pass.plan_tiles(captured, gm, options, _device_budget(options, captured))
        plans = plan_offload(RUNTIME.store, [(captured.inputs[position].name, param, tile_plans.get(position))
                                             for position, param in captured.param_tensors.items()], options)
        # This graph's parameters are one model's (the group an optimizer, a load or an earlier graph claimed
        # them for, else a new one), under this compile's device budget and timeout.
        RUNTIME.store.claim(captured.param_tensors.values(), device_memory_limit=options.device_memory_limit,
                            collective_timeout=options.collective_timeout)
        for position, param in captured.param_tensors.items():
            record = _adopt(captured, position, param, plans.get(id(param)))
            if record.tile_rows is not None:
                captured.tile_rows[position] = record.tile_rows
            captured.layouts[position] = layout_of(record)
            adopted.append(record)
    _plan_schedule(captured, options)
    dumper = GraphDumper(captured)
    dumper.dump_dynamo(gm)
    if dumper.enabled:
        RUNTIME.tracer.arm(dumper.root, options.trace_step, RUNTIME.trace_sample, captured.param_tensors.values())
    rewrite = functools.partial(rewrite_aten_graph, captured, dumper)
    joint_hook = joint_graph_hook(captured)  # the checkpointing policy, on the joint graph
    if options.offload_activations == "nvme":
        RUNTIME.activations.configure(options.nvme_path, options.aio_block_size, options.aio_queue_depth, options.aio_threads)
    # The AOTAutograd cache would hand back a previously compiled graph and skip
    # our hooks, silently dropping every pass: keep it off for zinf graphs.
    with torch._functorch.config.patch(enable_autograd_cache=False), tensor_parallel.dtensor_outputs_refused(gm):
        if options.lower == "inductor":
            compiled = compile_with_inductor(gm, example_inputs, rewrite, joint_hook)
        else:
            compiled = compile_eager(gm, example_inputs, rewrite, joint_hook)
    # Only now, with tracing done, may stage 3 parameters give up their memory.
    RUNTIME.store.release_full_storage(adopted)
    # The compiled graph serves any module Dynamo hands it: it must not keep this one alive.
    captured.param_tensors = {}
    return _run_time_wrapper(compiled, captured)


# Options each rank may set for itself: they change no collective.
_RANK_LOCAL_OPTIONS = frozenset({"dump_dir", "trace_step", "nvme_path", "aio_block_size", "aio_queue_depth",
                                 "aio_threads", "pinned_bytes", "collective_timeout", "lower", "nvme_grad_ram_bytes",
                                 "rank_agreement", "overlap_optimizer"})


def _agree_before_compiling(captured: CapturedGraph) -> None:
    """At world size > 1: fingerprint the graph, and agree with the other ranks before any collective.

    The graph's identity is the parameters and buffers it reads, in order (a
    recompile for other input shapes on one rank runs the same collectives);
    its configuration is the options that decide collectives and the shapes of
    those tensors.  A compile that runs collectives (profiling the machine,
    sharding new parameters) must be one all ranks make together: it exchanges
    its fingerprints first (see runtime/agreement.py).
    """
    state = [(info.kind, info.name) for info in captured.inputs if info.kind in ("param", "buffer")]
    dtypes = {info.name: str(info.dtype) for info in captured.inputs if info.kind in ("param", "buffer")}
    captured.graph_print = agreement.fingerprint(state)
    captured.config_print = agreement.fingerprint(sorted(_collective_options(captured).items(), key=str),
                                                  sorted(_state_shapes(captured).items()), sorted(dtypes.items()))
    devices = [param.device for param in captured.param_tensors.values()]
    device = devices[0] if devices else torch.device("cpu")
    offloads = (captured.options.offload_param, captured.options.offload_optimizer,
                captured.options.offload_activations)
    runs_collectives = (not is_profiled(device, DTYPES[captured.options.param_dtype],
                                        captured.options.nvme_path if "nvme" in offloads else None,
                                        captured.mesh.everyone)
                        or (captured.options.stage > 0
                            and any(RUNTIME.store.lookup(param) is None for param in captured.param_tensors.values())))
    if runs_collectives:
        _agree(captured, agreement.COMPILE)


def _collective_options(captured: CapturedGraph) -> dict[str, Any]:
    """The graph's options that decide its collectives (all but the rank-local ones)."""
    return {name: value for name, value in dataclasses.asdict(captured.options).items()
            if name not in _RANK_LOCAL_OPTIONS}


def _state_shapes(captured: CapturedGraph) -> dict[str, list[int]]:
    """Shape of each parameter and buffer the graph reads, by name."""
    return {info.name: list(info.shape) for info in captured.inputs
            if info.kind in ("param", "buffer") and info.shape is not None}


def _agree(captured: CapturedGraph, doing: int) -> None:
    def describe() -> dict:
        params = [info.name for info in captured.params]
        words = (f"graph {captured.graph_id} (parameters {', '.join(params[:3])}"
                 f"{f' and {len(params) - 3} more' if len(params) > 3 else ''})" if params else
                 f"graph {captured.graph_id} (no parameters)")
        return {"graph": words, "options": _collective_options(captured), "params": _state_shapes(captured)}

    agreement.check(captured.mesh.everyone, doing, captured.graph_print, captured.config_print, describe,
                    captured.options.collective_timeout)


def _agree_before_backward(outputs, captured: CapturedGraph) -> None:
    """Each backward of this call first agrees with the other ranks (an autograd pre-hook)."""
    for node in compiled_backward_nodes(outputs):
        if _AGREEMENT_KEY in node.metadata:
            continue  # an earlier call's node, passed through: it checks for itself
        node.metadata[_AGREEMENT_KEY] = True
        node.register_prehook(lambda grad_outputs: _agree(captured, agreement.BACKWARD))


_AGREEMENT_KEY = "zinf_rank_agreement"


def _adopt(captured: CapturedGraph, position: int, param: torch.Tensor, plan):
    """Adopt a graph parameter by its model's ``plan`` into the model group it was claimed for (see
    ParamStore.claim); one adopted before keeps its record."""
    return adopt(RUNTIME.store, param, captured.inputs[position].name, captured.options, captured.mesh, plan)


def _check_materialized(captured: CapturedGraph) -> None:
    meta = [captured.inputs[position].name for position, p in captured.param_tensors.items() if p.is_meta]
    if meta:
        raise ZinfStoreError(
            f"zinf: parameters {meta[:4]}{' ...' if len(meta) > 4 else ''} are on the meta device (built under "
            f"`with torch.device('meta')`); call zinf.materialize(model, options, init_fn=...) before "
            f"torch.compile to build them straight into their shards"
        )


def _run_time_wrapper(compiled: Callable, captured: CapturedGraph) -> Callable:
    """Wrap ``compiled`` for each call: rank 0's buffers first, then the call's own parameters bound.

    * At world size > 1 with ``broadcast_buffers`` (DDP's default), the
      buffers the graph reads are copied from rank 0 before it runs.
    * Stages 1-3: the call runs on the parameters it is handed (see
      runtime/binding.py).  A parameter this graph has not seen (another
      instance of the same module class, the next block after a graph break,
      a model built after an old one) is adopted at its first call, with the
      layout the graph was compiled for.
    * The device bytes each call saves for backward are counted, in the
      model's ledger (stage 0: the process's).
    """
    slots = [info.position for info in captured.params]
    everyone = captured.mesh.everyone  # (a 2-D mesh: replicas too)
    check_calls = everyone.world_size > 1 and captured.options.rank_agreement == "call"
    buffer_slots = ([info.position for info in captured.inputs if info.kind == "buffer"]
                    if captured.options.broadcast_buffers and everyone.world_size > 1 else [])

    def bind(args) -> Binding:
        RUNTIME.store.collect()
        records, unseen = {}, []
        for slot in slots:
            record = RUNTIME.store.lookup(args[slot])
            if record is None:
                unseen.append(slot)
                continue
            if captured.tile_rows.get(slot) != record.tile_rows:
                raise ZinfStoreError(
                    f"zinf graph {captured.graph_id}: parameter {record.name} is laid out in row tiles "
                    f"{record.tile_rows}, this graph was compiled for {captured.tile_rows.get(slot)}; one parameter "
                    f"used by graphs with different tile plans is not supported (set tile_factor to a fixed value)"
                )
            records[slot] = record
        if unseen:
            # (A new instance's parameters: a new group of their own; the rest join the group of those seen.)
            RUNTIME.store.claim([args[slot] for slot in slots],
                                device_memory_limit=captured.options.device_memory_limit,
                                collective_timeout=captured.options.collective_timeout)
            for slot in unseen:
                records[slot] = _adopt_at_run_time(captured, slot, args[slot])
        if captured.options.stage >= 2:
            # (A resting parameter's __torch_function__ would run for each attribute read: a Python call each.)
            with torch._C.DisableTorchFunctionSubclass():
                for slot, record in records.items():
                    claim_grad_hooks(args[slot], record.name, tiled=record.tile_rows is not None)
        return Binding(records, captured.graph_id, RUNTIME.store, RUNTIME.activations)

    def run(*args):
        # Boxed (one list of inputs) or not, as Dynamo calls ``compiled``: graph
        # inputs are tensors and numbers, never a list.
        boxed = len(args) == 1 and isinstance(args[0], list)
        inputs = args[0] if boxed else args
        if check_calls:
            _agree(captured, agreement.FORWARD)
        if buffer_slots:
            everyone.broadcast_coalesced([inputs[slot] for slot in buffer_slots], src=0,
                                           what=f"broadcast of graph {captured.graph_id}'s buffers from rank 0",
                                           timeout=captured.options.collective_timeout)
        if captured.options.stage == 0:
            # Stage 0: no parameter is bound; the graph's ops (stage-0 all-reduce) name none, only the parts.
            binding = Binding({}, captured.graph_id, RUNTIME.store, RUNTIME.activations)
            with bound(binding):
                outputs = compiled(*args)
            bind_backward(outputs, binding)
            if check_calls:
                _agree_before_backward(outputs, captured)
            RUNTIME.activations.count_saved(compiled_backward_nodes(outputs), list(inputs), None)
            return outputs
        binding = bind(inputs)
        if captured.tp_slots:
            inputs = list(inputs)
            for slot in captured.tp_slots:
                inputs[slot] = tensor_parallel.local_input(inputs[slot])
            args = (inputs,) if boxed else tuple(inputs)
        if not binding_active():
            # Transfers left in flight by a graph that raised half way (forward or
            # backward) would pair with this call's waits: drop them first.
            RUNTIME.store.abandon_transfers()
        with bound(binding):
            outputs = compiled(*args)
        bind_backward(outputs, binding)
        if check_calls:
            _agree_before_backward(outputs, captured)
        RUNTIME.activations.count_saved(compiled_backward_nodes(outputs), list(inputs), binding.model_ledger())
        return outputs

    functools.update_wrapper(run, compiled)
    run.zinf_captured = captured
    return run


def _adopt_at_run_time(captured: CapturedGraph, slot: int, param: torch.Tensor):
    options = captured.options
    name = captured.inputs[slot].name
    if param.is_meta:
        _check_materialized(dataclasses.replace(captured, param_tensors={slot: param}))
    if options.stage == 3 and param.untyped_storage().nbytes() < param.numel() * param.element_size():
        raise ZinfStoreError(f"zinf: parameter {name} holds no memory and zinf has no record of it; "
                             f"was it sharded by another process or a dropped model?")
    plans = plan_offload(RUNTIME.store, [(name, param, captured.tile_rows.get(slot))], options)
    record = _adopt(captured, slot, param, plans.get(id(param)))
    if record.tile_rows != captured.tile_rows.get(slot):
        raise ZinfStoreError(
            f"zinf graph {captured.graph_id}: parameter {name} was laid out in row tiles {record.tile_rows}, "
            f"this graph expects {captured.tile_rows.get(slot)}")
    RUNTIME.store.release_full_storage([record])
    return record


def _device_budget(options: ZinfOptions, captured: CapturedGraph) -> int | None:
    """Device bytes the tile plan must fit: ``device_memory_limit``, else free CUDA memory, else unknown."""
    if options.device_memory_limit is not None:
        return options.device_memory_limit
    devices = {param.device for param in captured.param_tensors.values()}
    if len(devices) == 1 and (device := devices.pop()).type == "cuda":
        if any(RUNTIME.store.lookup(param) is None for param in captured.param_tensors.values()):
            # New parameters get their tile layout now: the least any rank has, so every rank tiles
            # alike (the tiles' gathers are collectives).  Every rank compiles here together (this
            # compile agreed first: _agree_before_compiling).
            return agreed_free_bytes(device, captured.mesh.everyone)
        # Every layout is fixed already; a recompile may happen on one rank alone: no collective.
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return free_bytes
    return None


def _plan_schedule(captured: CapturedGraph, options: ZinfOptions) -> None:
    """What the schedule pass needs from this machine: its cost model and the caps it must keep."""
    devices = [param.device for param in captured.param_tensors.values()]
    device = devices[0] if devices else torch.device("cpu")
    offloads = (options.offload_param, options.offload_optimizer, options.offload_activations)
    nvme_path = options.nvme_path if "nvme" in offloads else None
    profile = profile_machine(device, DTYPES[options.param_dtype], nvme_path, captured.mesh.everyone)
    captured.cost_model = CostModel(profile, captured.world_size, RUNTIME.store.prefetch_pinned_bytes())
    if options.max_live_bytes != "auto":
        captured.live_bytes_cap = options.max_live_bytes
    elif options.device_memory_limit is not None:
        captured.live_bytes_cap = options.device_memory_limit
    elif profile.free_device_bytes is not None:
        captured.live_bytes_cap = profile.free_device_bytes // 2  # the other half: activations
    captured.pinned_capacity = RUNTIME.store.prefetch_pinned_bytes()


def materialize(model: torch.nn.Module, options: Mapping[str, Any] | None = None,
                init_fn: Callable[[torch.nn.Module], None] | None = None, device: torch.device | str | None = None,
                progress: bool = True, weights: str | os.PathLike | None = None) -> torch.nn.Module:
    """``zinf.materialize``: build ``model``'s meta-device parameters straight into this process's parameter store.

    See :func:`zinf_compiler.materialize.materialize` (which is handed the store) for the arguments and contract.
    """
    from . import torch_patches

    torch_patches.install(RUNTIME.store, RUNTIME.optimizers)  # sharded parameters exist from here on (see torch_patches)
    return materializing.materialize(RUNTIME.store, model, options, init_fn=init_fn, device=device,
                                     progress=progress, weights=weights)


def register() -> None:
    """Register ``"zinf"`` by hand, for a source tree used without ``pip install``.

    Installed, the ``torch_dynamo_backends`` entry point registers it on first
    lookup; registering while that lookup imports this package would collide,
    which is why importing ``zinf_compiler`` does not call this.
    """
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "zinf" not in _COMPILER_FNS:
        register_backend(zinf_backend, name="zinf")
