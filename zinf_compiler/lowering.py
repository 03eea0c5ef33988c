"""Lowering: the rewritten ATen graphs handed to Inductor, or run as Python.

The backend (:mod:`zinf_compiler.backend`) calls :func:`compile_with_inductor`
(``lower="inductor"``) or :func:`compile_eager` (``lower="eager"``) with a
``rewrite(aten_gm, kind)`` callable (:func:`rewrite_aten_graph`: the pass
pipeline) and the joint-graph hook of activation checkpointing.  What zinf
changes in Inductor's lowering lives here: the node order it must keep, the
deterministic algorithms it lowers with (and runs the accumulating index_puts with:
:mod:`.ordered_index_put`), and the outputs the partition pass
rewrote to ``None``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .context import CapturedGraph, GraphContext
from .dump import GraphDumper
from .ordered_index_put import deterministic_algorithms, order_accumulating_index_puts
from .pipeline import run_passes


# The schedule pass's order is the plan: Inductor may fuse kernels but must not
# move zinf's starts and waits (its peak-memory reordering pulled gathers earlier).
KEEP_NODE_ORDER = {name: False for name in ("reorder_for_peak_memory", "reorder_for_locality",
                                              "reorder_for_compute_comm_overlap")}


@contextlib.contextmanager
def deterministic_lowering():
    """Lower with torch's deterministic algorithms on, for this compile only.

    Inductor's CPU code adds into a tensor at indices (the embedding's backward, index_put, scatter_add)
    with atomic adds across threads, so with 2+ threads the same step gives different last bits from run to
    run (plain ``torch.compile`` too); a resume would then not be bit-identical.  In deterministic mode it
    lowers those ops to ATen's, which add in order only if the flag is on when they run too
    (:mod:`.ordered_index_put` sees to that).  The flag is read while lowering and restored after:
    the user's eager code keeps its own setting.  (Uninitialized memory stays unfilled, as without it.)
    """
    with deterministic_algorithms():
        yield


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


def compile_with_inductor(gm, example_inputs, rewrite, joint_hook) -> Callable:
    """Lower Dynamo's ``gm`` through Inductor's ``compile_fx``, with ``rewrite(aten_gm, kind)`` as its inner compile's
    first step and ``joint_hook`` (or None) run on the joint graph before the partitioner."""
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
        order_accumulating_index_puts(aten_gm)  # ATen's kernel picks its add order when it runs
        # A placeholder the activations pass turned into a handle takes a handle now.
        placeholders = [node for node in aten_gm.graph.nodes if node.op == "placeholder"]
        aten_inputs = [node.meta["val"] if node.meta.get("zinf_activation_handle") else example
                       for node, example in zip(placeholders, aten_inputs)]
        with torch._inductor.config.patch(KEEP_NODE_ORDER), deterministic_lowering():
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


def compile_eager(gm, example_inputs, rewrite, joint_hook) -> Callable:
    """AOTAutograd with the min-cut partitioner; each rewritten ATen graph runs as its generated Python."""
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


def rewrite_aten_graph(
    captured: CapturedGraph, dumper: GraphDumper, aten_gm: torch.fx.GraphModule, kind: str
) -> torch.fx.GraphModule:
    """Run the pass pipeline over one ATen graph (``kind``: forward, backward or inference) of ``captured``."""
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
        leading = len(placeholders) - sum(info.flat_width for info in captured.inputs)
        tracing = torch._guards.TracingContext.try_get()
        metadata = getattr(tracing, "fw_metadata", None) if tracing is not None else None
        tokens = len(getattr(metadata, "tokens", None) or ())
        if leading < 0 or leading < tokens:
            raise RuntimeError(
                f"zinf: graph {captured.graph_id} {kind} has {len(placeholders)} inputs for "
                f"{len(captured.inputs)} Dynamo inputs; cannot identify its parameters"
            )
        for info, node in zip(captured.inputs, _dynamo_input_placeholders(placeholders, tokens, captured)):
            if node is None:
                continue
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



def _dynamo_input_placeholders(placeholders: list, tokens: int, captured: CapturedGraph) -> list:
    """The forward graph's placeholder of each Dynamo input, in Dynamo order: after the effect tokens, one
    each, or a tensor subclass's first (a DTensor's local tensor; see :meth:`CapturedGraph.flat_inputs`)."""
    return [placeholders[tokens + start] if tokens + start < len(placeholders) else None
            for start, _ in captured.flat_inputs()]
