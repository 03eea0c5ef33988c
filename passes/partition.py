"""The ``partition`` pass: ZeRO's gathers, releases and gradient reductions.

* stage 3: every parameter placeholder is gathered right before its first use
  (``zinf.gather_start`` + ``zinf.gather_wait``) and released right after its
  last use (``zinf.release``), in forward and again in backward (the min-cut
  partitioner saves the storage-less parameter itself, not its full value, so
  backward must fetch it again).
* stages 2 and 3: each parameter gradient the backward graph returns is sent
  instead through ``zinf.reduce_grad_start``/``_wait`` into the rank's gradient
  shard, and the graph returns ``None`` for it, so ``param.grad`` stays ``None``.
* stage 1: graphs untouched; the optimizer reduce-scatters full gradients.
* stage 0 with world size > 1: each gradient is averaged over ranks
  (``zinf.all_reduce_grad``), plain data parallelism.

Tiles (the ``tile`` pass): each weight slice tagged ``meta["zinf_tile"]`` is
gathered as its own unit (``gather_start(param, slot, None, tile)``, released
after its last use), and each tile gradient of a ``meta["zinf_tiled_grad"]``
cat is reduced on its own (``reduce_grad_start(grad_tile, slot, tile)``).

Ops name a parameter by its *slot*, its position among the Dynamo graph's
inputs; the runtime binds slots to the parameters of each call.  Reads
``ctx.params`` (placeholder -> parameter); records ``ctx.facts["gathered"]``
and ``ctx.facts["reduced"]`` (slots).  The
schedule pass later moves every start earlier and every wait later.
"""

from __future__ import annotations

import torch

from zinf_compiler import ops
from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import call_op, first_node, last_node, node_order, output_node, placeholders_by_name
from zinf_compiler.passes.tile import TILE_META, TILED_GRAD_META

NAME = "partition"
KINDS = ("forward", "backward", "inference")


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
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
        if not compute_users:
            continue
        slot = info.position
        order = node_order(graph)
        with graph.inserting_before(first_node(compute_users, order)):
            token = call_op(graph, ops.GATHER_START, (param_node, slot), name=f"gg_start_{placeholder_name}")
            gathered = call_op(graph, ops.GATHER_WAIT, (token, param_node, slot), name=f"gathered_{placeholder_name}")
        for user in compute_users:
            user.replace_input_with(param_node, gathered)
        order = node_order(graph)
        with graph.inserting_after(last_node(gathered.users, order)):
            call_op(graph, ops.RELEASE, (gathered, slot), name=f"release_{placeholder_name}")
        if slot not in gathered_slots:
            gathered_slots.append(slot)
    return gathered_slots


def _gather_tiles(graph: torch.fx.Graph, param_node: torch.fx.Node, weight_tiles: list, slot: int) -> None:
    """Each tile slice becomes its own gather, alive from that slice's first use to its last."""
    for weight_slice in weight_tiles:
        tile = weight_slice.meta[TILE_META]["tile"]
        start, stop = weight_slice.meta[TILE_META]["rows"]
        with graph.inserting_before(weight_slice):
            token = call_op(graph, ops.GATHER_START, (param_node, slot, None, tile),
                            name=f"gg_start_{param_node.name}_tile{tile}")
            gathered = call_op(graph, ops.GATHER_WAIT, (token, param_node, slot, tile, stop - start),
                               name=f"gathered_{param_node.name}_tile{tile}")
        weight_slice.replace_all_uses_with(gathered)
        graph.erase_node(weight_slice)
        if not gathered.users:  # nothing reads it (cannot happen after the tile pass, but stay valid)
            continue
        with graph.inserting_after(last_node(gathered.users, node_order(graph))):
            call_op(graph, ops.RELEASE, (gathered, slot, tile), name=f"release_{param_node.name}_tile{tile}")


def _reduce_gradients(graph: torch.fx.Graph, ctx: GraphContext) -> list[int]:
    output = output_node(graph)
    grads = list(output.args[0])
    inputs = ctx.captured.inputs
    offset = len(grads) - len(inputs)  # leading outputs for effect tokens, if any
    if offset < 0:
        raise RuntimeError(
            f"zinf partition: backward graph {ctx.graph_id} returns {len(grads)} gradients for "
            f"{len(inputs)} inputs; cannot match gradients to parameters"
        )
    reduced = []
    for index, grad in enumerate(grads):
        if index < offset or not isinstance(grad, torch.fx.Node):
            continue
        info = inputs[index - offset]
        if info.kind != "param":
            continue
        if TILED_GRAD_META in grad.meta and ctx.options.stage > 0:
            # One reduce per tile gradient, right after it; the cat that joined them goes.
            slot = info.position
            for tile, grad_tile in enumerate(grad.args[0]):
                with graph.inserting_after(grad_tile):
                    token = call_op(graph, ops.REDUCE_GRAD_START, (grad_tile, slot, tile), name=f"rs_start_{slot}_tile{tile}")
                with graph.inserting_after(token):
                    call_op(graph, ops.REDUCE_GRAD_WAIT, (token, slot, tile), name=f"rs_wait_{slot}_tile{tile}")
            grads[index] = None
            reduced.append(slot)
            output.args = (tuple(grads),) + tuple(output.args[1:])
            if not grad.users:
                graph.erase_node(grad)
            continue
        # As soon as the gradient exists (the schedule pass may push the wait later).
        where = graph.inserting_before(output) if grad.op == "placeholder" else graph.inserting_after(grad)
        if ctx.options.stage == 0:
            with where:
                grads[index] = call_op(graph, ops.ALL_REDUCE_GRAD, (grad,), name=f"averaged_grad_{index}")
            reduced.append(info.position)
            continue
        slot = info.position
        with where:
            token = call_op(graph, ops.REDUCE_GRAD_START, (grad, slot), name=f"rs_start_{slot}")
        with graph.inserting_after(token):
            call_op(graph, ops.REDUCE_GRAD_WAIT, (token, slot), name=f"rs_wait_{slot}")
        grads[index] = None
        reduced.append(slot)
    output.args = (tuple(grads),) + tuple(output.args[1:])
    return reduced
