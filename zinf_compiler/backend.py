"""The ``zinf`` torch.compile backend: capture, rewrite, lower.

``torch.compile(model, backend="zinf", options={...})`` calls :func:`zinf_backend`
once per Dynamo subgraph (a graph break gives several).  Each subgraph goes
through AOTAutograd into forward and backward ATen graphs; every ATen graph
runs the pass pipeline (:mod:`zinf_compiler.pipeline`) and is then lowered:

* ``lower="inductor"``: Inductor's own ``compile_fx`` drives AOTAutograd, its
  joint-graph passes and the min-cut partitioner; zinf hooks in as
  ``inner_compile``, rewriting each ATen graph right before Inductor lowers it.
* ``lower="eager"``: zinf runs AOTAutograd itself (same min-cut partitioner,
  no decompositions beyond AOTAutograd's own) and runs the rewritten graph's
  generated Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .context import CapturedGraph, GraphContext
from .cost_model import CostModel, agreed_free_bytes, is_profiled, profile_machine
from .runtime import agreement
from .runtime.aio import validate_folder
from .runtime.binding import Binding, bind_backward, bound, compiled_backward_nodes
from .runtime.grad_hooks import claim_grad_hooks
from .runtime.binding import active as binding_active
from .api import RUNTIME
from .runtime.store import DTYPES, ZinfStoreError
from .runtime.units import layout_of
from .dump import GraphDumper
from .options import ZinfOptions, parse_options
from .pipeline import run_passes
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
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    return compile_captured(gm, example_inputs, parsed)


def compile_captured(gm: torch.fx.GraphModule, example_inputs: list[Any], options: ZinfOptions) -> Callable:
    """Compile one Dynamo subgraph under already parsed ``options`` (:func:`zinf_backend` after parsing).

    Adopts the graph's parameters into the store (stages 1-3), rewrites and lowers each ATen graph, and returns
    the callable Dynamo runs in its place, which binds each call's own parameters (see :func:`_run_time_wrapper`).
    """
    RUNTIME.store.collect()
    captured = CapturedGraph.from_dynamo(gm, example_inputs, options)
    captured.mesh = model_mesh(options)
    captured.world_size = captured.mesh.shard.world_size
    # Collectives of no model (stage 0's all-reduce, checkpoints' exchanges): the last compile's setting;
    # each model's own use its ledger's (set below).
    RUNTIME.store.comm.timeout = options.collective_timeout
    if captured.mesh.everyone.world_size > 1:
        _agree_before_compiling(captured)
    adopted = []
    if options.stage > 0:
        from . import torch_patches

        torch_patches.install()  # clipping, model.zero_grad() and torch optimizers must see the shards
        _check_materialized(captured)
        plan_offload(list(captured.param_tensors.values()), options)
        from zinf_compiler.passes import tile as tile_pass

        # Which weights the tile pass splits: known before adoption, which lays them out tile by tile.
        tile_plans = tile_pass.plan_tiles(captured, gm, options, _device_budget(options, captured))
        # This graph's parameters count as one model (with any they were grouped
        # with before, e.g. by its optimizer), under this compile's device budget.
        ledger = RUNTIME.store.group(captured.param_tensors.values(), device_memory_limit=options.device_memory_limit,
                             collective_timeout=options.collective_timeout)
        for position, param in captured.param_tensors.items():
            record = _adopt(captured, position, param, tile_plans.get(position), ledger)
            if record.tile_rows is not None:
                captured.tile_rows[position] = record.tile_rows
            captured.layouts[position] = layout_of(record)
            adopted.append(record)
    _plan_schedule(captured, options)
    dumper = GraphDumper(captured)
    dumper.dump_dynamo(gm)
    if dumper.enabled:
        RUNTIME.tracer.arm(dumper.root, options.trace_step, RUNTIME.trace_sample)
    rewrite = functools.partial(_rewrite_aten_graph, captured, dumper)
    joint_hook = joint_graph_hook(captured)  # the checkpointing policy, on the joint graph
    if options.offload_activations == "nvme":
        RUNTIME.activations.configure(options.nvme_path, options.aio_block_size, options.aio_queue_depth, options.aio_threads)
    # The AOTAutograd cache would hand back a previously compiled graph and skip
    # our hooks, silently dropping every pass: keep it off for zinf graphs.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        if options.lower == "inductor":
            compiled = _compile_with_inductor(gm, example_inputs, rewrite, joint_hook)
        else:
            compiled = _compile_eager(gm, example_inputs, rewrite, joint_hook)
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


def _adopt(captured: CapturedGraph, position: int, param: torch.Tensor, tile_rows, ledger):
    options = captured.options
    return RUNTIME.store.adopt(
        param, captured.inputs[position].name, stage=options.stage, partition=options.partition,
        param_dtype=options.param_dtype, param_tier=TIERS[options.offload_param],
        opt_tier=TIERS[options.offload_optimizer], tile_rows=tile_rows, ledger=ledger,
        bucket_bytes=options.bucket_bytes, grad_ram_bytes=options.nvme_grad_ram_bytes, mesh=captured.mesh,
        step_in_backward=options.overlap_optimizer,
    )


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
            ledger = RUNTIME.store.group([args[slot] for slot in slots],
                                 device_memory_limit=captured.options.device_memory_limit,
                                 collective_timeout=captured.options.collective_timeout)
            for slot in unseen:
                records[slot] = _adopt_at_run_time(captured, slot, args[slot], ledger)
        if captured.options.stage >= 2:
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
        if not binding_active():
            # Transfers left in flight by a graph that raised half way (forward or
            # backward) would pair with this call's waits: drop them first.
            RUNTIME.store.abandon_transfers()
        with bound(binding):
            outputs = compiled(*args)
        bind_backward(outputs, binding)
        if check_calls:
            _agree_before_backward(outputs, captured)
        ledger = next(iter(binding.records.values())).ledger if binding.records else None
        RUNTIME.activations.count_saved(compiled_backward_nodes(outputs), list(inputs), ledger)
        return outputs

    functools.update_wrapper(run, compiled)
    run.zinf_captured = captured
    return run


def _adopt_at_run_time(captured: CapturedGraph, slot: int, param: torch.Tensor, ledger):
    options = captured.options
    name = captured.inputs[slot].name
    if param.is_meta:
        _check_materialized(dataclasses.replace(captured, param_tensors={slot: param}))
    if options.stage == 3 and param.untyped_storage().nbytes() < param.numel() * param.element_size():
        raise ZinfStoreError(f"zinf: parameter {name} holds no memory and zinf has no record of it; "
                             f"was it sharded by another process or a dropped model?")
    plan_offload([param], options)
    record = _adopt(captured, slot, param, captured.tile_rows.get(slot), ledger)
    if record.tile_rows != captured.tile_rows.get(slot):
        raise ZinfStoreError(
            f"zinf graph {captured.graph_id}: parameter {name} was laid out in row tiles {record.tile_rows}, "
            f"this graph expects {captured.tile_rows.get(slot)}")
    RUNTIME.store.release_full_storage([record])
    return record


TIERS = {"none": "device", "cpu": "cpu", "nvme": "nvme"}


def model_mesh(options: ZinfOptions):
    """The ranks a model with ``options`` shards over (option ``mesh``; default: every rank)."""
    return options.mesh or RUNTIME.store.comm.mesh()


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


def plan_offload(params: list[torch.Tensor], options: ZinfOptions) -> None:
    """Before ``params`` are adopted: configure the swap and pinned pool, check nvme_path has room."""
    RUNTIME.store.configure_offload(options.nvme_path, options.pinned_bytes, options.aio_block_size,
                            options.aio_queue_depth, options.aio_threads, options.nvme_copies)
    if "nvme" not in (options.offload_param, options.offload_optimizer):
        return
    world = model_mesh(options).shard.world_size
    needed = 0
    for param in params:
        if RUNTIME.store.lookup(param) is not None:
            continue
        local_numel = -(-param.numel() // world) if options.partition == "allgather" else param.numel()
        RUNTIME.store.plan_shards(local_numel)
        copies = options.nvme_copies
        trained_on_nvme = options.offload_optimizer == "nvme" and param.requires_grad
        # An fp32 parameter trained on nvme is read from its master's files (ParamLayout.params_in_master);
        # a tiled one keeps files of its own, which this check does not foresee (a full disk still fails cleanly).
        if options.offload_param == "nvme" and not (trained_on_nvme and options.param_dtype == "fp32"
                                                    and param.is_floating_point()):
            needed += copies * local_numel * DTYPES[options.param_dtype].itemsize
        if trained_on_nvme:
            needed += copies * 4 * local_numel * 4  # fp32 master, two moments and the gradient
    validate_folder(options.nvme_path, needed)


# The schedule pass's order is the plan: Inductor may fuse kernels but must not
# move zinf's starts and waits (its peak-memory reordering pulled gathers earlier).
_KEEP_NODE_ORDER = {name: False for name in ("reorder_for_peak_memory", "reorder_for_locality",
                                              "reorder_for_compute_comm_overlap")}


@contextlib.contextmanager
def _deterministic_lowering():
    """Lower with torch's deterministic algorithms on, for this compile only.

    Inductor's CPU code adds into a tensor at indices (the embedding's backward, index_put, scatter_add)
    with atomic adds across threads, so with 2+ threads the same step gives different last bits from run to
    run (plain ``torch.compile`` too); a resume would then not be bit-identical.  In deterministic mode it
    lowers those ops to ATen's, which add in order.  The flag is read while lowering and restored after:
    the user's eager code keeps its own setting.  (Uninitialized memory stays unfilled, as without it.)
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill if enabled else False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _forget_outputs_rewritten_to_none(aten_gm: torch.fx.GraphModule) -> None:
    """Inductor records which graph outputs the user sees (to keep their strides) before calling its inner
    compile; the partition pass then returns ``None`` for gradients that went to zinf's shards.  With
    comprehensive padding (on for GPU inputs) Inductor walks back from each of those outputs and fails on a
    ``None`` one, so those indices are dropped: no tensor leaves there any more."""
    output = aten_gm.graph.find_nodes(op="output")[0]
    visible = output.meta.get("user_visible_output_idxs")
    if visible is None:
        return
    values = output.args[0] if not isinstance(output.args[0], torch.fx.Node) else output.args
    output.meta["user_visible_output_idxs"] = [
        idx for idx in visible if idx < len(values) and isinstance(values[idx], torch.fx.Node)]


def _compile_with_inductor(gm, example_inputs, rewrite, joint_hook) -> Callable:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(aten_gm: torch.fx.GraphModule, aten_inputs, **kwargs):
        if kwargs.get("is_backward", False):
            kind = "backward"
        elif kwargs.get("is_inference", False):
            kind = "inference"
        else:
            kind = "forward"
        aten_gm = rewrite(aten_gm, kind)
        _forget_outputs_rewritten_to_none(aten_gm)
        # A placeholder the activations pass turned into a handle takes a handle now.
        placeholders = [node for node in aten_gm.graph.nodes if node.op == "placeholder"]
        aten_inputs = [node.meta["val"] if node.meta.get("zinf_activation_handle") else example
                       for node, example in zip(placeholders, aten_inputs)]
        with torch._inductor.config.patch(_KEEP_NODE_ORDER), _deterministic_lowering():
            return compile_fx_inner(aten_gm, aten_inputs, **kwargs)

    patches = {}
    if joint_hook is not None:
        # Inductor runs this on the joint graph right before its min-cut partitioner.
        existing = torch._inductor.config.joint_custom_pre_pass
        patches["joint_custom_pre_pass"] = joint_hook if existing is None else _chain(existing, joint_hook)
    with torch._inductor.config.patch(patches):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def _chain(existing, hook):
    passes = tuple(existing) if isinstance(existing, (list, tuple)) else (existing,)

    def chained(graph):
        for graph_pass in passes:
            graph_pass(graph)
        hook(graph)

    return chained


def _compile_eager(gm, example_inputs, rewrite, joint_hook) -> Callable:
    def make_compiler(kind: str):
        def compiler(aten_gm: torch.fx.GraphModule, aten_inputs):
            aten_gm = rewrite(aten_gm, kind)
            return make_boxed_func(aten_gm.forward)

        return compiler

    def partition(joint_module, joint_inputs, **kwargs):
        if joint_hook is not None:
            joint_hook(joint_module.graph)
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=make_compiler("forward"),
        bw_compiler=make_compiler("backward"),
        inference_compiler=make_compiler("inference"),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _rewrite_aten_graph(
    captured: CapturedGraph, dumper: GraphDumper, aten_gm: torch.fx.GraphModule, kind: str
) -> torch.fx.GraphModule:
    ctx = GraphContext(captured=captured, kind=kind, params=_param_placeholders(captured, aten_gm, kind))
    return run_passes(aten_gm, ctx, dumper)


def _param_placeholders(captured: CapturedGraph, aten_gm: torch.fx.GraphModule, kind: str) -> dict:
    """Map this ATen graph's parameter placeholders to the Dynamo inputs they carry.

    The forward (or inference) graph takes the Dynamo inputs in order, after
    any effect tokens AOTAutograd prepends.  The backward graph receives saved
    parameters under their forward placeholder names (``primals_3``).
    """
    placeholders = [node for node in aten_gm.graph.nodes if node.op == "placeholder"]
    if kind != "backward":
        leading = len(placeholders) - len(captured.inputs)
        tracing = torch._guards.TracingContext.try_get()
        metadata = getattr(tracing, "fw_metadata", None) if tracing is not None else None
        tokens = len(getattr(metadata, "tokens", None) or ())
        if leading < 0 or leading < tokens:
            raise RuntimeError(
                f"zinf: graph {captured.graph_id} {kind} has {len(placeholders)} inputs for "
                f"{len(captured.inputs)} Dynamo inputs; cannot identify its parameters"
            )
        for info, node in zip(captured.inputs, placeholders[tokens:]):
            value = node.meta.get("val")
            # Parameters only: their shapes are static, while comparing a user input's
            # symbolic sizes would add a guard that specializes dynamic shapes.
            if (info.kind == "param" and info.shape is not None and isinstance(value, torch.Tensor)
                    and tuple(value.shape) != info.shape):
                raise RuntimeError(
                    f"zinf: graph {captured.graph_id} {kind}: input {node.name} has shape {tuple(value.shape)}, "
                    f"expected {info.shape} for {info.name}; cannot identify its parameters"
                )
            captured.input_by_placeholder[node.name] = info
    return {
        node.name: captured.input_by_placeholder[node.name]
        for node in placeholders
        if node.name in captured.input_by_placeholder and captured.input_by_placeholder[node.name].kind == "param"
    }


def register() -> None:
    """Register ``"zinf"`` by hand, for a source tree used without ``pip install``.

    Installed, the ``torch_dynamo_backends`` entry point registers it on first
    lookup; registering while that lookup imports this package would collide,
    which is why importing ``zinf_compiler`` does not call this.
    """
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "zinf" not in _COMPILER_FNS:
        register_backend(zinf_backend, name="zinf")
