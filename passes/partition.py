"""The ``partition`` pass: ZeRO's gathers, releases and gradient reductions.

* stage 3: every parameter placeholder is gathered right before its first use
  (``zinf.gather_start`` + ``zinf.gather_wait``) and released right after its
  last use, views of it included (``zinf.release``; a weight's ``t`` is read by
  the matmul after it), in forward and again in backward (the min-cut
  partitioner saves the storage-less parameter itself, not its full value, so
  backward must fetch it again).
* stages 2 and 3: each parameter gradient the backward graph returns is sent
  instead through ``zinf.reduce_grad_start``/``_wait`` into the rank's gradient
  shard, and the graph returns ``None`` for it, so ``param.grad`` stays ``None``.
* stage 1: graphs untouched; the optimizer reduce-scatters full gradients.
* stage 0 with world size > 1: each gradient is averaged over ranks
  (``zinf.all_reduce_grad``), plain data parallelism.

Buckets (:mod:`zinf_compiler.unit_plan`): parameters of one block are gathered by
one ``gather_start`` / ``gather_wait`` pair (the wait returns a list, one
value per parameter, read with ``getitem``), placed before the first use of
any of them and released after the last; the gradients of one block are
reduced by one ``reduce_grad_start`` placed after the last of them.

Tiles (the ``tile`` pass): each weight slice tagged ``meta["zinf_tile"]`` is
gathered as its own unit (``gather_start(param, [slot], None, tile)``, released
after its last use), and each tile gradient of a ``meta["zinf_tiled_grad"]``
cat is reduced on its own (``reduce_grad_start([grad_tile], [slot], tile)``).

Ops name a parameter by its *slot*, its position among the Dynamo graph's
inputs; the runtime binds slots to the parameters of each call.  Reads
``ctx.params`` (placeholder -> parameter); records ``ctx.facts["gathered"]``
and ``ctx.facts["reduced"]`` (slots).  The
schedule pass later moves every start earlier and every wait later.
"""

from __future__ import annotations

import operator

import torch

from zinf_compiler import ops, unit_plan
from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import (call_op, first_node, last_node, memory_readers, node_order, output_node,
                                      placeholders_by_name)
from zinf_compiler.passes.tile import TILE_META, TILED_GRAD_META

NAME = "partition"
KINDS = ("forward", "backward", "inference")


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
    """Insert the gather/release and gradient reduce ops of the ZeRO stage for every parameter."""
    stage = ctx.options.stage
    ctx.facts["gathered"] = _insert_gathers(gm.graph, ctx) if stage == 3 else []
    reduced = []
    if ctx.kind == "backward" and (stage >= 2 or (stage == 0 and ctx.captured.world_size > 1)):
        reduced = _reduce_gradients(gm.graph, ctx)
    ctx.facts["reduced"] = reduced
    return gm


def _insert_gathers(graph: torch.fx.Graph, ctx: GraphContext) -> list[int]:
    placeholders = placeholders_by_name(graph)
    gathered_slots = []
    whole = {}  # slot -> (placeholder, its compute users): parameters gathered whole
    for placeholder_name, info in ctx.params.items():
        param_node = placeholders[placeholder_name]
        # The output keeps the storage-less parameter (saved for backward, which
        # gathers again); only computation reads the gathered copy.
        compute_users = [user for user in param_node.users if user.op != "output"]
        weight_tiles = [user for user in compute_users if TILE_META in user.meta]
        if weight_tiles:
            _gather_tiles(graph, param_node, weight_tiles, info.position)
            compute_users = [user for user in compute_users if TILE_META not in user.meta]
            gathered_slots.append(info.position)
        if compute_users:
            whole[info.position] = (param_node, compute_users)
    order = node_order(graph)
    in_use_order = sorted(whole, key=lambda slot: order[first_node(whole[slot][1], order)])
    for bucket in unit_plan.buckets(ctx, in_use_order):
        _gather_bucket(graph, bucket, [whole[slot] for slot in bucket])
        gathered_slots.extend(slot for slot in bucket if slot not in gathered_slots)
    return gathered_slots


def _gather_bucket(graph: torch.fx.Graph, slots: list[int], members: list) -> None:
    """One gather for the parameters in ``slots``: before the first use of any, released after the last."""
    order = node_order(graph)
    param_nodes = [param_node for param_node, _ in members]
    label = param_nodes[0].name + (f"_and_{len(slots) - 1}" if len(slots) > 1 else "")
    shapes = [tuple(param_node.meta["val"].shape) for param_node in param_nodes]
    with graph.inserting_before(first_node([user for _, users in members for user in users], order)):
        token = call_op(graph, ops.GATHER_START, (slots, _device(param_nodes[0])), name=f"gg_start_{label}")
        gathered = call_op(graph, ops.GATHER_WAIT, (token, slots, *_shape_args(shapes), _dtype(param_nodes[0])),
                           name=f"gathered_{label}")
        values = [_item(graph, gathered, index, f"gathered_{param_node.name}")
                  for index, param_node in enumerate(param_nodes)]
    for (param_node, users), value in zip(members, values):
        for user in users:
            user.replace_input_with(param_node, value)
    order = node_order(graph)
    # After the last read of the values' memory, views of them included: a weight's ``t`` lives
    # until its matmul, and the ledger must count the weight as long as the memory is there.
    readers = [reader for value in values for reader in memory_readers(value)] or values
    with graph.inserting_after(last_node(readers, order)):
        call_op(graph, ops.RELEASE, (gathered, slots), name=f"release_{label}")


def _device(param_node: torch.fx.Node) -> torch.device:
    return param_node.meta["val"].device


def _dtype(param_node: torch.fx.Node) -> torch.dtype:
    return param_node.meta["val"].dtype


def _shape_args(shapes: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """``gather_wait``'s ``sizes`` and ``dims`` for values of ``shapes`` (see ``ops.split_shapes``)."""
    return [int(size) for shape in shapes for size in shape], [len(shape) for shape in shapes]


def _item(graph: torch.fx.Graph, values: torch.fx.Node, index: int, name: str) -> torch.fx.Node:
    """``values[index]`` of a list-valued node, with its ``meta["val"]``."""
    node = graph.call_function(operator.getitem, (values, index))
    node._rename(name)
    if "val" in values.meta:
        node.meta["val"] = values.meta["val"][index]
    return node


def _gather_tiles(graph: torch.fx.Graph, param_node: torch.fx.Node, weight_tiles: list, slot: int) -> None:
    """Each tile slice becomes its own gather, alive from that slice's first use to its last."""
    for weight_slice in weight_tiles:
        tile = weight_slice.meta[TILE_META]["tile"]
        start, stop = weight_slice.meta[TILE_META]["rows"]
        tile_shape = (stop - start,) + tuple(param_node.meta["val"].shape[1:])
        with graph.inserting_before(weight_slice):
            token = call_op(graph, ops.GATHER_START, ([slot], _device(param_node), None, tile),
                            name=f"gg_start_{param_node.name}_tile{tile}")
            gathered = call_op(graph, ops.GATHER_WAIT,
                               (token, [slot], *_shape_args([tile_shape]), _dtype(param_node), tile),
                               name=f"gathered_{param_node.name}_tile{tile}")
            value = _item(graph, gathered, 0, f"{param_node.name}_tile{tile}")
        weight_slice.replace_all_uses_with(value)
        graph.erase_node(weight_slice)
        readers = memory_readers(value) or [value]  # nothing reads it (cannot happen after the tile pass, but stay valid)
        with graph.inserting_after(last_node(readers, node_order(graph))):
            call_op(graph, ops.RELEASE, (gathered, [slot], tile), name=f"release_{param_node.name}_tile{tile}")


def _reduce_gradients(graph: torch.fx.Graph, ctx: GraphContext) -> list[int]:
    output = output_node(graph)
    grads = list(output.args[0])
    flat_inputs = ctx.captured.flat_inputs()
    # Leading outputs for effect tokens, if any; a DTensor input's gradient is its local tensor's and its mesh.
    offset = len(grads) - sum(info.flat_width for info in ctx.captured.inputs)
    if offset < 0:
        raise RuntimeError(
            f"zinf partition: backward graph {ctx.graph_id} returns {len(grads)} gradients for "
            f"{len(flat_inputs)} inputs; cannot match gradients to parameters"
        )
    reduced = []
    whole = {}  # slot -> its gradient node, reduced in buckets below
    for start, info in flat_inputs:
        index = offset + start
        grad = grads[index]
        if not isinstance(grad, torch.fx.Node) or info.kind != "param":
            continue
        slot = info.position
        if ctx.options.stage == 0:
            where = graph.inserting_before(output) if grad.op == "placeholder" else graph.inserting_after(grad)
            with where:
                grads[index] = call_op(graph, ops.ALL_REDUCE_GRAD, (grad,), name=f"averaged_grad_{index}")
            reduced.append(slot)
            continue
        if TILED_GRAD_META in grad.meta:
            # One reduce per tile gradient, right after it; the cat that joined them goes.
            for tile, grad_tile in enumerate(grad.args[0]):
                with graph.inserting_after(grad_tile):
                    token = call_op(graph, ops.REDUCE_GRAD_START, ([grad_tile], [slot], tile),
                                    name=f"rs_start_{slot}_tile{tile}")
                with graph.inserting_after(token):
                    call_op(graph, ops.REDUCE_GRAD_WAIT, (token, [slot], tile), name=f"rs_wait_{slot}_tile{tile}")
            grads[index] = None
            reduced.append(slot)
            output.args = (tuple(grads),) + tuple(output.args[1:])
            if not grad.users:
                graph.erase_node(grad)
            continue
        whole[slot] = grad
        grads[index] = None
        reduced.append(slot)
    output.args = (tuple(grads),) + tuple(output.args[1:])
    order = node_order(graph)
    # A gradient passed straight through from an input counts as made at the end.
    made_at = {slot: len(order) if grad.op == "placeholder" else order[grad] for slot, grad in whole.items()}
    for bucket in unit_plan.buckets(ctx, sorted(whole, key=made_at.__getitem__)):
        # As soon as the bucket's last gradient exists (the schedule pass may push the wait later).
        last = max(bucket, key=made_at.__getitem__)
        label = f"{bucket[0]}" + (f"_and_{len(bucket) - 1}" if len(bucket) > 1 else "")
        where = (graph.inserting_before(output) if whole[last].op == "placeholder"
                 else graph.inserting_after(whole[last]))
        with where:
            token = call_op(graph, ops.REDUCE_GRAD_START, ([whole[slot] for slot in bucket], bucket),
                            name=f"rs_start_{label}")
        with graph.inserting_after(token):
            call_op(graph, ops.REDUCE_GRAD_WAIT, (token, bucket), name=f"rs_wait_{label}")
    return reduced
