"""The ``activations`` pass: saved activations leave the device after forward and come back for backward.

Forward (``offload_activations`` = "cpu" or "nvme"): each value the graph
saves for backward (its outputs past the user-visible ones, as AOTAutograd's
metadata counts them) that is an activation of at least
``activation_offload_min_bytes``, not an overlapping view, of static shape, and (under the
``"auto"`` policy) chosen for offload by :mod:`zinf_compiler.recompute`, is
bracketed by::

    value = ...                                   # computed
    handle = zinf.act_offload_start(value, tier)  # the copy off the device begins
    ... the value's forward uses ...
    zinf.act_offload_wait(handle, value)          # after its last use: copy done, value freed
    return (..., handle, ...)                     # saved for backward instead of the value

Backward: the placeholder that received the value now receives the handle;
``zinf.act_fetch_start(handle)`` / ``zinf.act_fetch_wait(...)`` bring the
value back before its first use (the schedule pass moves the start ahead,
like a parameter fetch, under ``max_live_bytes``).  Parameters, user inputs,
views of them and values with symbolic shapes stay where they are.

Records ``ctx.facts["activations"]`` (and, forward, the offloaded names on
``ctx.captured.offloaded_activations`` for the backward graph): every saved
value with its bytes and where it rests; backward: the forward nodes it
recomputes.  Both go to the dump header.
"""

from __future__ import annotations

import contextlib
import operator

import torch

from zinf_compiler import ops
from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import call_op, last_node, nbytes_hint, node_order, output_node, view_base

NAME = "activations"
KINDS = ("forward", "backward")


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
    """Tag what to recompute and insert activation offload ops (forward), per the activations plan."""
    if ctx.kind == "forward":
        ctx.facts["activations"] = _forward(gm.graph, ctx)
    else:
        ctx.facts["activations"] = _backward(gm.graph, ctx)
    return gm


def _static(value) -> bool:
    return all(isinstance(size, int) for size in (*value.shape, *value.stride()))


def _overlapping(value) -> bool:
    """Whether two elements share memory (an expanded view): copying it out would multiply its bytes."""
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(value.shape, value.stride()) if size != 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _first_saved(ctx: GraphContext, outputs: list) -> int | None:
    """Index of the first saved-for-backward output (AOTAutograd's metadata), or None if unknown."""
    tracing = torch._guards.TracingContext.try_get()
    metadata = getattr(tracing, "fw_metadata", None) if tracing is not None else None
    if metadata is None:
        return None
    first = len(getattr(metadata, "tokens", None) or ()) + metadata.num_forward
    return first if first <= len(outputs) else None


def _forward(graph: torch.fx.Graph, ctx: GraphContext) -> dict:
    options = ctx.options
    tier = options.offload_activations
    output = output_node(graph)
    outputs = list(output.args[0])
    first = _first_saved(ctx, outputs)
    rows = []
    if first is None:
        return {"saved": rows, "note": "saved values unknown (no AOTAutograd metadata): nothing offloaded"}
    visible = set(outputs[:first])
    auto = options.activation_checkpointing == "auto"
    chosen, kept_by_policy = [], []  # (output index, node, row) to offload / that auto chose to keep
    activations = []  # (node, row) of every saved activation
    for index in range(first, len(outputs)):
        node = outputs[index]
        if not isinstance(node, torch.fx.Node):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        base = view_base(node)
        if base.op != "placeholder":
            kind = "activation"
        else:
            kind = "parameter" if base.name in ctx.params else "input"
        row = {"name": node.name, "bytes": nbytes_hint(value) if _static(value) else None, "kind": kind,
               "where": "device", "recompute_tag": str(node.meta.get("recompute", "")) or None}
        rows.append(row)
        if kind == "activation":
            activations.append((node, row))
        if tier == "none" or kind != "activation":
            continue
        why_not = None
        if not _static(value):
            why_not = "symbolic shape"
        elif _overlapping(value):
            why_not = "overlapping view"
        elif row["bytes"] < options.activation_offload_min_bytes:
            why_not = "below activation_offload_min_bytes"
        elif node in visible:
            why_not = "also a forward output"
        elif auto and not node.meta.get("zinf_offload"):
            why_not = "auto policy keeps it"
            kept_by_policy.append((index, node, row))
        if why_not is not None:
            row["kept_because"] = why_not
            continue
        chosen.append((index, node, row))
    plan = ctx.captured.activation_plan or {}
    if auto and "enforced_bytes" in plan:
        # The policy priced the values eager autograd would save; the partitioner may save
        # others (it cuts where it likes).  Past the budget, those leave too, largest first:
        # recomputing them is no longer an option after the cut.
        leaving = {id(row) for _, _, row in chosen}
        for index, node, row in sorted(kept_by_policy, key=lambda item: item[2]["bytes"], reverse=True):
            if _held_bytes([node for node, row in activations if id(row) not in leaving]) <= plan["enforced_bytes"]:
                break
            leaving.add(id(row))
            del row["kept_because"]
            row["offloaded_because"] = "over activation_memory_budget after the partition"
            chosen.append((index, node, row))
    for index, node, row in chosen:
        outputs[index] = _offload(graph, node, tier, options.nvme_path or "")
        row["where"] = tier
        ctx.captured.offloaded_activations[node.name] = node.meta["val"]
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    return {"saved": rows}


def _held_bytes(kept: list[torch.fx.Node]) -> int:
    """Device bytes the saved values ``kept`` hold alive: each distinct base's storage once.

    A view keeps its whole base (q keeps the fused qkv output), which is what
    the runtime's ledger counts too.
    """
    values = [view_base(node).meta.get("val") for node in {view_base(node) for node in kept}]
    return sum(nbytes_hint(value) for value in values if isinstance(value, torch.Tensor) and _static(value))


def _offload(graph: torch.fx.Graph, node: torch.fx.Node, tier: str, nvme_path: str) -> torch.fx.Node:
    uses = [user for user in node.users if user.op != "output"]
    with graph.inserting_after(node):
        handle = call_op(graph, ops.ACT_OFFLOAD_START, (node, tier, nvme_path, node.name),
                         name=f"offload_{node.name}")
    after = last_node(uses, node_order(graph)) if uses else handle
    with graph.inserting_after(after):
        call_op(graph, ops.ACT_OFFLOAD_WAIT, (handle, node), name=f"offloaded_{node.name}")
    return handle


def _backward(graph: torch.fx.Graph, ctx: GraphContext) -> dict:
    offloaded = ctx.captured.offloaded_activations
    fetched = []
    order = node_order(graph)
    for placeholder in [node for node in graph.nodes if node.op == "placeholder" and node.name in offloaded]:
        saved = offloaded[placeholder.name]
        uses = list(placeholder.users)
        fake_mode = getattr(saved, "fake_mode", None)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            placeholder.meta["val"] = ops.handle_like(saved)
        placeholder.meta["zinf_activation_handle"] = True
        placeholder.meta.pop("tensor_meta", None)
        if not uses:
            continue
        first_use = min(uses, key=order.__getitem__)
        with graph.inserting_before(first_use):
            token = call_op(graph, ops.ACT_FETCH_START, (placeholder,), name=f"fetch_{placeholder.name}")
            # The value comes back with its own strides, a view with gaps (q of a fused qkv)
            # included: ops recomputed from it in backward propagate strides as in forward
            # (SDPA's output follows q's layout; a later view relies on it).
            value = graph.call_function(ops.ACT_FETCH_WAIT, (token, placeholder, list(saved.shape),
                                                             list(saved.stride()), saved.dtype, saved.device))
            value._rename(f"fetched_{placeholder.name}")
            value.meta["val"] = saved
        for use in uses:
            use.replace_input_with(placeholder, value)
        fetched.append({"name": placeholder.name, "bytes": nbytes_hint(saved)})
    recomputed = [{"name": node.name, "bytes": nbytes_hint(node.meta.get("val"))} for node in graph.nodes
                  if node.op == "call_function" and node.meta.get("partitioner_tag") == "is_forward"
                  and node.target is not operator.getitem
                  and not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)]
    return {"fetched": fetched, "recomputed": recomputed}


def describe(ctx: GraphContext) -> list[str]:
    """Lines for the dump's header: what the pass decided for this graph."""
    facts = ctx.facts.get("activations") or {}
    lines = []
    plan = ctx.captured.activation_plan
    if plan and ctx.kind == "forward":
        summary = {key: value for key, value in plan.items() if key != "decisions"}
        lines.append(f"activations: checkpointing {summary}")
        for decision in plan.get("decisions", []):
            lines.append(f"  auto: {decision['node']} {decision['bytes']:,} bytes -> {decision['choice']} "
                         f"(recompute {decision['recompute_ms']:.3f} ms, offload {decision['offload_ms']:.3f} ms "
                         "not hidden by compute)")
    if "note" in facts:
        lines.append(f"activations: {facts['note']}")
    if "saved" in facts:
        rows = facts["saved"]
        by_where: dict[str, int] = {}
        for row in rows:
            if row["kind"] == "activation" and row["bytes"] is not None:
                by_where[row["where"]] = by_where.get(row["where"], 0) + row["bytes"]
        lines.append(f"activations: {len(rows)} values saved for backward; activation bytes per tier "
                     + (", ".join(f"{where} {nbytes:,}" for where, nbytes in by_where.items()) or "none"))
        for row in rows:
            nbytes = "symbolic" if row["bytes"] is None else f"{row['bytes']:,}"
            extra = f" (kept: {row['kept_because']})" if row.get("kept_because") else ""
            if row.get("offloaded_because"):
                extra = f" ({row['offloaded_because']})"
            lines.append(f"  saved {row['name']:<28} {nbytes:>14} bytes  {row['kind']:<10} -> {row['where']}{extra}")
    if "fetched" in facts:
        lines.append(f"activations: {len(facts['fetched'])} fetched back "
                     f"({sum(row['bytes'] for row in facts['fetched']):,} bytes); "
                     f"{len(facts['recomputed'])} forward nodes recomputed "
                     f"({sum(row['bytes'] for row in facts['recomputed']):,} bytes computed again)")
        for row in facts["recomputed"]:
            lines.append(f"  recomputed {row['name']:<28} {row['bytes']:>14,} bytes")
    return lines


def table(ctx: GraphContext) -> dict | None:
    """The pass's per-activation decisions for the dump (None when it made none)."""
    return ctx.facts.get("activations")
