"""The ``tile`` pass: memory-centric tiling of oversized matmuls (ZeRO-Infinity's idea 2).

A matmul whose weight (a parameter) is too large to gather at once is
rewritten as a mathematically equal sequence of matmuls over row tiles of the
weight (rows = the output dimension of ``nn.Linear``), so that each tile is
gathered, used and released alone and the working memory falls by the tile
factor.  No model change, no tensor slicing across ranks.

Plan (before adoption, :func:`plan_tiles`)
    Stage 3 only (elsewhere full parameters sit on every rank and a tile saves
    nothing).  A 2-D parameter over ``tile_threshold`` bytes that the Dynamo
    graph feeds to a matmul (``linear``, ``@``, ``mm``, ...) gets the rows per
    tile that :func:`zinf_compiler.tile_plan.tile_rows_for` decides (the one
    home of the rule, which ``zinf.materialize`` uses too), with the budget
    ``device_memory_limit`` or else the free CUDA memory, and as the other
    live bytes the largest untiled parameter plus the largest activation.  A
    weight that does not fit even one row per tile is a
    :class:`ZinfBudgetError` at compile time.  The plan fixes the parameter's
    layout in the parameter store (adopted with ``tile_rows``: tile-major, each row
    tile flattened, padded and split evenly over ranks), so a parameter keeps
    the plan of its first compile; the backend records it per Dynamo input
    position in ``ctx.captured.tile_rows``.

Rewrite (``run``, on forward, backward and inference ATen graphs)
    Every ``aten.mm`` / ``aten.addmm`` with one operand a tiled parameter
    ``W`` [out, in] or its transpose (through ``t`` / ``permute`` /
    ``transpose``) becomes, with ``W_j = W[rows_j]`` (an ``aten.slice`` node
    tagged ``meta["zinf_tile"]``):

        x @ W.T  (forward)         -> cat_j(x @ W_j.T, dim 1)   (addmm: bias slice per tile)
        g @ W    (input gradient)  -> sum_j g[:, rows_j] @ W_j  (a chain of addmm)
        W @ y                      -> cat_j(W_j @ y, dim 0)
        W.T @ y                    -> sum_j W_j.T @ y[rows_j]

    In backward, the gradient returned for ``W`` is split into one node per
    row tile by pushing the row slice into the expression that computes it
    (``mm(g.T, x)[rows_j] = mm(g[:, rows_j].T, x)``, through transposes and
    sums; anything else is sliced after the fact), and returned as
    ``cat(tile grads)`` tagged ``meta["zinf_tiled_grad"]``.  The graph stays
    valid as it is; the ``partition`` pass then gathers each
    ``meta["zinf_tile"]`` slice as its own unit (``gather_start(..., tile=j)``,
    release after its last use) and reduce-scatters each tile gradient on its
    own (``reduce_grad_start(grad_j, slot, tile=j)``), dropping the ``cat``.
    Other uses of a tiled parameter (an embedding tied to it) gather it whole.

Records ``ctx.facts["tiled"]``: one entry per tiled op ({"op", "param",
"factor", "weight_bytes", "tile_bytes", "bytes_saved"}) and
``ctx.facts["tiled_grads"]``: {param name: factor}; :func:`describe` puts them
in the dump header and index.json.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from zinf_compiler.context import CapturedGraph, GraphContext
from zinf_compiler.graph_utils import nbytes_hint, output_node
from zinf_compiler.options import ZinfOptions
from zinf_compiler.runtime.records import DTYPES
from zinf_compiler.tile_plan import TILE_PASS, tile_rows_for, wants_tiles

NAME = TILE_PASS
KINDS = ("forward", "backward", "inference")

TILE_META = "zinf_tile"  # on a weight slice: {"param", "tile", "rows": (start, stop), "factor"}
TILED_GRAD_META = "zinf_tiled_grad"  # on the cat of tile gradients: {"param", "factor"}

aten = torch.ops.aten
MM, ADDMM = aten.mm.default, aten.addmm.default
SLICE, CAT, PERMUTE, ADD = aten.slice.Tensor, aten.cat.default, aten.permute.default, aten.add.Tensor
_TRANSPOSES = (aten.t.default, aten.permute.default, aten.transpose.int)

# Dynamo-level calls that multiply by their weight operand (``nn.Linear`` is ``torch._C._nn.linear``).
_DYNAMO_MATMULS = {torch._C._nn.linear, torch.nn.functional.linear, operator.matmul, torch.matmul, torch.mm,
                   torch.addmm, torch.einsum}
_DYNAMO_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
_DYNAMO_TRANSPOSES = {"t", "transpose", "permute", "T", "mT"}


# --- plan ---------------------------------------------------------------------------------


def plan_tiles(captured: CapturedGraph, dynamo_gm: torch.fx.GraphModule, options: ZinfOptions,
               budget: int | None) -> dict[int, tuple[int, ...]]:
    """Rows per tile for each parameter (by Dynamo input position) that the tile pass should split.

    ``budget``: device bytes for gathered and in-flight tensors (``device_memory_limit`` or free device
    memory), None if unknown.  Called by the backend before the parameters are adopted.
    """
    placeholders = [node for node in dynamo_gm.graph.nodes if node.op == "placeholder"]
    compute_itemsize = DTYPES[options.param_dtype].itemsize
    candidates = {info.position: info for info in captured.params
                  if wants_tiles(info.shape, info.nbytes, options) and info.position < len(placeholders)
                  and _feeds_matmul(placeholders[info.position])}
    if not candidates:
        return {}
    untiled_param_bytes = [_numel(info.shape) * compute_itemsize
                           for info in captured.params if info.position not in candidates and info.shape is not None]
    activation_bytes = [_value_bytes(node.meta.get("example_value")) for node in dynamo_gm.graph.nodes
                        if node.op not in ("placeholder", "output", "get_attr")]
    other_bytes = max(untiled_param_bytes, default=0) + max(activation_bytes, default=0)
    plans = {}
    for position, info in candidates.items():
        rows = tile_rows_for(info.name, info.shape, info.nbytes, options, captured.world_size, budget, other_bytes)
        if rows is not None:
            plans[position] = rows
    return plans


def _numel(shape: Iterable[int]) -> int:
    return math.prod(int(size) for size in shape)


def _value_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return nbytes_hint(value)
    if isinstance(value, (tuple, list)):
        return max((_value_bytes(item) for item in value), default=0)
    return 0


def _feeds_matmul(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether a Dynamo-level value reaches a matmul directly or through transposes."""
    for user in node.users:
        if user.op == "call_function" and user.target in _DYNAMO_MATMULS:
            return True
        if user.op == "call_method" and user.target in _DYNAMO_MATMUL_METHODS:
            return True
        is_transpose = (user.op == "call_method" and user.target in _DYNAMO_TRANSPOSES) or (
            user.op == "call_function" and user.target in (torch.t, torch.transpose, torch.permute, getattr)
            and (user.target is not getattr or user.args[1] in ("T", "mT")))
        if is_transpose and depth < 4 and _feeds_matmul(user, depth + 1):
            return True
    return False


# --- rewrite --------------------------------------------------------------------------------


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
    """Split each oversized matmul into row tiles whose parameter pieces are fetched one at a time."""
    ctx.facts["tiled"] = []
    ctx.facts["tiled_grads"] = {}
    tile_rows = getattr(ctx.captured, "tile_rows", {})
    if ctx.options.stage != 3 or not tile_rows:
        return gm
    graph = gm.graph
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    weights = {}  # placeholder node -> (InputInfo, rows per tile)
    for placeholder_name, info in ctx.params.items():
        rows = tile_rows.get(info.position)
        if rows is not None and placeholder_name in placeholders:
            weights[placeholders[placeholder_name]] = (info, tuple(rows))
    rewriter = _Rewriter(graph, weights, ctx)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (MM, ADDMM):
            rewriter.tile_matmul(node)
    if ctx.kind == "backward":
        # Every tiled weight's gradient, whether or not backward reads the weight itself.
        rewriter.split_weight_grads({position: rows for position, rows in tile_rows.items()})
    rewriter.erase_dead()
    gm.recompile()
    return gm


def describe(ctx: GraphContext) -> list[str]:
    """Dump header lines (and index.json notes): each tiled op, its factor and the bytes saved."""
    lines = []
    for entry in ctx.facts.get("tiled", []):
        lines.append(f"tiled {entry['op']} on {entry['param']}: factor {entry['factor']}, weight "
                     f"{entry['weight_bytes']:,} bytes, largest tile {entry['tile_bytes']:,} bytes, "
                     f"saved {entry['bytes_saved']:,} bytes of working memory")
    for param, factor in ctx.facts.get("tiled_grads", {}).items():
        lines.append(f"tiled gradient of {param}: {factor} tiles, each reduced on its own")
    return lines


def _is_transpose(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return True


class _Rewriter:
    def __init__(self, graph: torch.fx.Graph, weights: dict, ctx: GraphContext):
        self.graph = graph
        self.weights = weights
        self.ctx = ctx
        self.maybe_dead: list[torch.fx.Node] = []
        self.slices: dict = {}

    # helpers

    def emit(self, op, args: tuple, name: str | None = None, meta: dict | None = None) -> torch.fx.Node:
        """Insert ``op(*args)`` at the insertion point with ``meta["val"]`` from fake tensors."""
        node = self.graph.call_function(op, args)
        if name:
            node._rename(name)
        fake_args = torch.fx.node.map_arg(args, lambda arg: arg.meta.get("val"))
        mode = next((value.fake_mode for value in torch.utils._pytree.tree_leaves(fake_args)
                     if isinstance(value, FakeTensor)), None)
        if mode is not None:
            with mode:
                node.meta["val"] = op(*fake_args)
        if meta:
            node.meta.update(meta)
        return node

    def transpose(self, node: torch.fx.Node) -> torch.fx.Node:
        # permute, not aten.t: Inductor's decompositions turn t into permute, and lowering a
        # graph that still has aten.t fails there.
        return self.emit(PERMUTE, (node, [1, 0]))

    def slice(self, node: torch.fx.Node, dim: int, start: int, stop: int) -> torch.fx.Node:
        return self.emit(SLICE, (node, dim, start, stop))

    def weight_of(self, operand: Any) -> tuple[torch.fx.Node, bool] | None:
        """(tiled weight placeholder, transposed?) if ``operand`` is one, seen through transposes."""
        transposed = False
        while _is_transpose(operand):
            transposed = not transposed
            operand = operand.args[0]
        if isinstance(operand, torch.fx.Node) and operand in self.weights:
            return operand, transposed
        return None

    def weight_tile(self, weight: torch.fx.Node, tile: int, start: int, stop: int) -> torch.fx.Node:
        info, rows = self.weights[weight]
        return self.emit(SLICE, (weight, 0, start, stop), name=f"{weight.name}_tile{tile}",
                         meta={TILE_META: {"param": weight.name, "tile": tile, "rows": (start, stop),
                                           "factor": len(rows)}})

    @staticmethod
    def tile_ranges(rows: tuple[int, ...]) -> list[tuple[int, int, int]]:
        ranges, start = [], 0
        for tile, count in enumerate(rows):
            ranges.append((tile, start, start + count))
            start += count
        return ranges

    # matmuls

    def tile_matmul(self, node: torch.fx.Node) -> None:
        if node.kwargs:  # addmm with beta / alpha: not worth a special case
            return
        if node.target is ADDMM:
            bias, left, right = node.args
        else:
            (left, right), bias = node.args, None
        left_weight, right_weight = self.weight_of(left), self.weight_of(right)
        if (left_weight is None) == (right_weight is None):
            return  # no tiled weight, or both operands are one (leave such products whole)
        weight, transposed = left_weight or right_weight
        info, rows = self.weights[weight]
        weight_on_right = right_weight is not None
        # Which output dimension the weight's rows index, or None when they are the contraction.
        out_dim = {(True, True): 1, (False, False): 0}.get((weight_on_right, transposed))
        with self.graph.inserting_before(node):
            pieces, accumulated = [], None
            for tile, start, stop in self.tile_ranges(rows):
                weight_tile = self.weight_tile(weight, tile, start, stop)
                if transposed:
                    weight_tile = self.transpose(weight_tile)
                if out_dim is not None:
                    other = left if weight_on_right else right
                    operands = (other, weight_tile) if weight_on_right else (weight_tile, other)
                    if bias is None:
                        pieces.append(self.emit(MM, operands))
                    else:
                        pieces.append(self.emit(ADDMM, (self.bias_tile(bias, node, out_dim, start, stop),) + operands))
                else:
                    # The rows are the contraction: the other operand's matching slice, summed over tiles.
                    if weight_on_right:
                        operands = (self.slice(left, 1, start, stop), weight_tile)
                    else:
                        operands = (weight_tile, self.slice(right, 0, start, stop))
                    if accumulated is None:
                        accumulated = self.emit(ADDMM, (bias,) + operands) if bias is not None else self.emit(MM, operands)
                    else:
                        accumulated = self.emit(ADDMM, (accumulated,) + operands)
            result = self.emit(CAT, (pieces, out_dim)) if out_dim is not None else accumulated
        node.replace_all_uses_with(result)
        self.maybe_dead.append(node)
        self.graph.erase_node(node)
        self.maybe_dead.extend(arg for arg in (left, right) if isinstance(arg, torch.fx.Node))
        weight_bytes = _value_bytes(weight.meta.get("val"))
        tile_bytes = weight_bytes * max(rows) // sum(rows)
        self.ctx.facts["tiled"].append({"op": node.name, "param": info.name, "factor": len(rows),
                                        "weight_bytes": weight_bytes, "tile_bytes": tile_bytes,
                                        "bytes_saved": weight_bytes - tile_bytes})

    def bias_tile(self, bias: Any, node: torch.fx.Node, out_dim: int, start: int, stop: int) -> Any:
        """addmm's ``input`` restricted to the output columns (or rows) ``start:stop`` (it broadcasts)."""
        value = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return bias
        # Align the bias's dims to the 2-D output from the right, as broadcasting does.
        bias_dim = out_dim - (2 - value.dim())
        if bias_dim < 0 or value.shape[bias_dim] == 1:
            return bias
        return self.slice(bias, bias_dim, start, stop)

    # weight gradients (backward)

    def split_weight_grads(self, tile_rows: dict[int, tuple[int, ...]]) -> None:
        output = output_node(self.graph)
        grads = list(output.args[0])
        inputs = self.ctx.captured.inputs
        offset = len(grads) - len(inputs)
        if offset < 0:
            return
        for position, rows in tile_rows.items():
            info = inputs[position]
            index = offset + position
            grad = grads[index]
            if not isinstance(grad, torch.fx.Node) or grad.op == "placeholder":
                continue
            # Slices cached so far were emitted at other places (a later matmul's rewrite,
            # another gradient's split): reusing one here could read it before it exists.
            self.slices = {}
            # Each tile gradient is computed where the whole one was, one after the other
            # (inserting_after(grad) would put successive nodes in reverse order).
            with self.graph.inserting_before(grad.next):
                tile_grads = []
                for tile, start, stop in self.tile_ranges(rows):
                    tile_grad, transposed = self.sliced(grad, 0, start, stop)
                    tile_grads.append(self.transpose(tile_grad) if transposed else tile_grad)
                joined = self.emit(CAT, (tile_grads, 0), name=f"tiled_grad_{position}",
                                   meta={TILED_GRAD_META: {"param": info.name, "factor": len(rows)}})
            grads[index] = joined
            self.maybe_dead.append(grad)
            self.ctx.facts["tiled_grads"][info.name] = len(rows)
        output.args = (tuple(grads),) + tuple(output.args[1:])

    def sliced(self, node: torch.fx.Node, dim: int, start: int, stop: int) -> tuple[torch.fx.Node, bool]:
        """A node for ``node`` restricted to ``start:stop`` along 2-D ``dim``, as (value, transposed?).

        The slice is pushed into the computation where that saves work: into
        the matching operand of an ``mm``, through transposes and sums;
        elsewhere it is taken of the finished value.
        """
        key = (node, dim, start, stop)
        if key in self.slices:
            return self.slices[key]
        self.maybe_dead.append(node)
        if _is_transpose(node):
            inner, transposed = self.sliced(node.args[0], 1 - dim, start, stop)
            result = (inner, not transposed)
        elif node.op == "call_function" and node.target is MM and not node.kwargs:
            left, right = node.args
            if dim == 0:
                result = (self.emit(MM, (self.materialize(self.sliced(left, 0, start, stop)), right)), False)
            else:
                result = (self.emit(MM, (left, self.materialize(self.sliced(right, 1, start, stop)))), False)
        elif (node.op == "call_function" and node.target is ADD and not node.kwargs
              and all(isinstance(arg, torch.fx.Node) and _same_shape(arg, node) for arg in node.args)):
            left, right = (self.materialize(self.sliced(arg, dim, start, stop)) for arg in node.args)
            result = (self.emit(ADD, (left, right)), False)
        else:
            result = (self.slice(node, dim, start, stop), False)
        self.slices[key] = result
        return result

    def materialize(self, sliced: tuple[torch.fx.Node, bool]) -> torch.fx.Node:
        node, transposed = sliced
        return self.transpose(node) if transposed else node

    def erase_dead(self) -> None:
        """Erase what the rewrite left unused (the whole matmuls, their transposes), nothing else."""
        pending = list(self.maybe_dead)
        while pending:
            node = pending.pop()
            if _node_gone(node) or node.op != "call_function" or node.users or node.is_impure():
                continue
            pending.extend(arg for arg in node.all_input_nodes)
            self.graph.erase_node(node)


def _node_gone(node: torch.fx.Node) -> bool:
    return getattr(node, "_erased", False)


def _same_shape(left: torch.fx.Node, right: torch.fx.Node) -> bool:
    left_value, right_value = left.meta.get("val"), right.meta.get("val")
    return (isinstance(left_value, torch.Tensor) and isinstance(right_value, torch.Tensor)
            and tuple(left_value.shape) == tuple(right_value.shape) and left_value.dim() == 2)
