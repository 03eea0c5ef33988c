"""The ``schedule`` pass: start every fetch ahead of its use and let reductions overlap backward.

The partition and offload passes leave each parameter's fetch as a chain
right before its first use::

    nc_start -> nc_wait -> cg_start -> cg_wait -> gather_start -> gather_wait -> use ... release

so every transfer is waited on as soon as it starts.  This pass only moves
nodes (it adds and removes none), so the graph's values are unchanged.

Ops.  The graph's *ops* are the computations that use a gathered parameter:
the first user of each ``gather_wait``, followed through views (the weight
``permute`` of a linear is not an op; the ``addmm`` is, and the weight and
bias of one linear belong to the same op).  A graph without gathers (stage
1/2 backward) takes its gradient-producing nodes as ops.  Op ``k`` is the
k-th such node in graph order.

Fetch placement.  For a parameter first used by op ``k``, with distances
``gg = prefetch_gg``, ``cg = max(prefetch_cg, gg)`` and ``nc =
max(prefetch_nc, cg)`` (a read must finish before its copy, a copy before its
gather)::

    nc_start                 before op k - nc
    nc_wait,  cg_start       before op k - cg
    cg_wait,  gather_start   before op k - gg
    gather_wait              stays right before the first use

A distance of 0 leaves that part where it was (no prefetch); ``k - d < 0``
means the top of the graph.  So before op i runs, nc for op i+nc, cg for op
i+cg and gg for op i+gg are in flight, the paper's prefetch rule.

Saved activations (the ``activations`` pass) come back like parameters:
each ``act_fetch_start`` goes ``prefetch_cg`` ops ahead of its value's first
use (``prefetch_nc`` when they rest on NVMe), and the value counts as live
from there to its last use.

Backward reductions.  ``reduce_grad_start`` stays right after its gradient;
its wait moves to just before the second op after it, so the reduce-scatter
of op i+1's gradient runs during op i's compute (with the nvme optimizer
tier, the wait hands the reduced gradient to asynchronous swap writes, which
then overlap the ops after it).

Caps.  Simulating the runtime's accounting on the final order (cg staging +
gathered buffers + reduce staging, the device bytes the parameter store counts
as transient), no point may exceed ``max_live_bytes`` (``ctx.captured.live_bytes_cap``:
the option, or the backend's auto value); pinned bytes of nc reads in flight
may not exceed ``ctx.captured.pinned_capacity`` (a prefetch waiting for a
pinned buffer only the graph's later nodes free would deadlock).  Units are
placed in op order, each at its full distances if the caps allow, else at the
largest ones that fit (distances shrink one op at a time, cg/gg before nc).
If the graph without any prefetch already exceeds the cap, nothing is
prefetched (the runtime's device_memory_limit check names the op that needs
more).

The result is a deterministic function of the graph and options.  Records
``ctx.facts["schedule"]``: the table dumped as ``<kind>.schedule.json`` and
printed in the dump header (op, what is in flight, live bytes, the cost
model's estimates, and per transfer the compute estimated between its start
and its wait and the part of it left exposed: where to lengthen a distance);
built by :mod:`schedule_table`.
"""

from __future__ import annotations

import dataclasses
import operator
import torch

from zinf_compiler import ops, unit_plan
from zinf_compiler.context import GraphContext
from zinf_compiler.graph_utils import memory_readers
from zinf_compiler.passes import schedule_table

NAME = "schedule"
KINDS = ("forward", "backward", "inference")

REDUCE_DELAY = 1  # ops a gradient's reduction runs across before it is waited on


@dataclasses.dataclass(eq=False)
class _Fetch:
    """One gather (of a unit: a bucket, a parameter or one tile of one) and the nc/cg steps feeding it."""

    name: str
    slots: list
    tile: int
    wait: torch.fx.Node  # gather_wait: never moves
    groups: dict  # "nc" / "cg" / "gg" -> nodes moved together, in chain order
    release: torch.fx.Node | None
    op: int = 0  # the op that first uses the parameter
    shard_bytes: int = 0  # cg staging on the device (0: the shard rests on the device)
    gathered_bytes: int = 0
    pinned_bytes: int = 0  # nc staging in pinned host memory (0: not on NVMe)
    copy_out_bytes: int = 0  # a bucket's values copied out of its gathered matrix, at the wait
    kind: str = "param"  # or "activation": a saved activation fetched back (groups["gg"]: its fetch start)
    distance: dict = dataclasses.field(default_factory=dict)  # step -> ops ahead (after caps)
    wanted: dict = dataclasses.field(default_factory=dict)  # step -> ops ahead (before caps)


@dataclasses.dataclass(eq=False)
class _Reduce:
    name: str
    slots: list
    tile: int
    start: torch.fx.Node
    wait: torch.fx.Node
    staging_bytes: int
    grad_bytes: int = 0  # the graph's gradient, counted while the start runs
    delay: int = 0  # ops the wait is pushed past (0: right after the start)
    wanted: int = 0


def run(gm: torch.fx.GraphModule, ctx: GraphContext) -> torch.fx.GraphModule:
    """Move each fetch's start ops ahead of use (the nc/cg/gg prefetch distances) within the byte budgets."""
    graph = gm.graph
    nodes = list(graph.nodes)
    fetches = _find_fetches(nodes, ctx)
    reduces = _find_reduces(nodes, ctx)
    if not fetches and not reduces:
        ctx.facts["schedule"] = None
        return gm
    op_nodes = _ops(nodes, fetches, reduces)
    position = {node: index for index, node in enumerate(nodes)}
    op_index = {node: index for index, node in enumerate(op_nodes)}
    for fetch in fetches:
        fetch.op = op_index[_anchor(fetch.wait, position)]
    distances = _distances(ctx)
    top = next(node for node in nodes if node.op != "placeholder" and not _is_chain(node, fetches))
    planner = _Planner(nodes, op_nodes, top, fetches, reduces)
    device_cap = ctx.captured.live_bytes_cap
    pinned_cap = ctx.captured.pinned_capacity
    baseline_peak = planner.simulate()["peak_device"]
    note = None
    allowed = device_cap is None or baseline_peak <= device_cap
    if not allowed:
        note = (f"max_live_bytes={device_cap:,} is below what the graph holds without prefetch "
                f"({baseline_peak:,} bytes): nothing is prefetched")
    # An activation's fetch (a copy from host memory, or a read from NVMe and a copy) starts as far
    # ahead as a parameter's cg, or its nc for NVMe.
    activation_distance = distances["nc" if ctx.options.offload_activations == "nvme" else "cg"]
    for fetch in sorted(fetches, key=lambda f: (f.op, position[f.wait])):
        fetch.wanted = {step: distances[step] if fetch.groups.get(step) else 0 for step in ("nc", "cg", "gg")}
        if fetch.kind == "activation":
            fetch.wanted["gg"] = activation_distance
        planner.place_fetch(fetch, device_cap, pinned_cap, allowed)
    for reduce in sorted(reduces, key=lambda r: position[r.start]):
        reduce.wanted = REDUCE_DELAY
        planner.place_reduce(reduce, device_cap, allowed)
    planner.apply(graph)
    ctx.facts["schedule"] = schedule_table.build(ctx, graph, planner, distances, device_cap, pinned_cap, note)
    gm.recompile()
    return gm


# --- finding what to schedule ------------------------------------------------------------------


def _is_chain(node: torch.fx.Node, fetches: list[_Fetch]) -> bool:
    return node.op == "call_function" and node.target in (
        ops.NC_START, ops.NC_WAIT, ops.CG_START, ops.CG_WAIT, ops.GATHER_START, ops.GATHER_WAIT,
        ops.ACT_FETCH_START, ops.ACT_FETCH_WAIT)


def _find_fetches(nodes: list[torch.fx.Node], ctx: GraphContext) -> list[_Fetch]:
    fetches = []
    position = {node: index for index, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "call_function" and node.target is ops.ACT_FETCH_WAIT:
            # Held from its fetch to its last use, through views of it (the graph frees it then), like a
            # gathered unit.
            handle = ops.arg(node, "handle")
            readers = memory_readers(node)
            fetches.append(_Fetch(
                name=f"activation {handle.name}", slots=[], tile=-1, wait=node,
                groups={"gg": [ops.arg(node, "token")]},
                release=max(readers, key=position.__getitem__) if readers else None,
                gathered_bytes=unit_plan.value_bytes([node]), kind="activation"))
            continue
        if node.op != "call_function" or node.target is not ops.GATHER_WAIT:
            continue
        start = ops.arg(node, "token")
        slots, tile = ops.arg(start, "slots"), ops.tile_of(start)
        groups = {"gg": [start]}
        after = ops.arg(start, "after")
        if isinstance(after, torch.fx.Node) and after.target is ops.CG_WAIT:
            cg_start = ops.arg(after, "token")
            groups["gg"] = [after, start]
            groups["cg"] = [cg_start]
            source = ops.arg(cg_start, "after")
            if isinstance(source, torch.fx.Node) and source.target is ops.NC_WAIT:
                groups["cg"] = [source, cg_start]
                groups["nc"] = [ops.arg(source, "token")]
        release = next((user for user in node.users if user.target is ops.RELEASE), None)
        sizes = unit_plan.unit_sizes(ctx, slots, tile)
        fetches.append(_Fetch(
            name=unit_plan.unit_name(ctx, slots, tile), slots=list(slots), tile=-1 if tile is None else tile, wait=node,
            groups=groups, release=release, shard_bytes=sizes.local if "cg" in groups else 0,
            gathered_bytes=sizes.gathered, pinned_bytes=sizes.pinned if "nc" in groups else 0,
            copy_out_bytes=sizes.copy_out))
    return fetches


def _find_reduces(nodes: list[torch.fx.Node], ctx: GraphContext) -> list[_Reduce]:
    reduces = []
    for node in nodes:
        if node.op != "call_function" or node.target is not ops.REDUCE_GRAD_START:
            continue
        wait = next(user for user in node.users if user.target is ops.REDUCE_GRAD_WAIT)
        grads, slots, tile = ops.arg(node, "grads"), ops.arg(node, "slots"), ops.tile_of(node)
        reduces.append(_Reduce(name=unit_plan.unit_name(ctx, slots, tile), slots=list(slots),
                               tile=-1 if tile is None else tile, start=node, wait=wait,
                               staging_bytes=unit_plan.unit_sizes(ctx, slots, tile).reduce,
                               grad_bytes=unit_plan.value_bytes(grads)))
    return reduces


def _is_view(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.is_view) or node.target is operator.getitem


def _compute_users(node: torch.fx.Node):
    """The nodes that compute with ``node``'s value, seen through views (and a gather's list items)."""
    for user in node.users:
        if user.target is ops.RELEASE or user.op == "output":
            continue
        if _is_view(user):
            yield from _compute_users(user)
        else:
            yield user


def _anchor(gathered: torch.fx.Node, position: dict) -> torch.fx.Node:
    """The op of a gathered unit: the first node computing with any of its values."""
    return min(_compute_users(gathered), key=position.__getitem__, default=gathered)


def _ops(nodes: list[torch.fx.Node], fetches: list[_Fetch], reduces: list[_Reduce]) -> list[torch.fx.Node]:
    position = {node: index for index, node in enumerate(nodes)}
    if fetches:
        anchors = {_anchor(fetch.wait, position) for fetch in fetches}
    else:
        anchors = {max(grads, key=position.__getitem__) for reduce in reduces
                   if (grads := [g for g in ops.arg(reduce.start, "grads") if isinstance(g, torch.fx.Node)])}
    return sorted(anchors, key=position.__getitem__)


def _distances(ctx: GraphContext) -> dict[str, int]:
    gg = ctx.options.prefetch_gg
    cg = max(ctx.options.prefetch_cg, gg)
    return {"gg": gg, "cg": cg, "nc": max(ctx.options.prefetch_nc, cg)}


# --- placement ---------------------------------------------------------------------------------


class _Planner:
    """Where each moved group goes, and the accounting that the caps are checked against.

    A placement is a target node (the group goes right before it); order keys
    put moved groups before their target, in op order, chain order kept.
    """

    def __init__(self, nodes, op_nodes, top, fetches, reduces):
        self.nodes = nodes
        self.position = {node: index for index, node in enumerate(nodes)}
        self.op_nodes = op_nodes
        self.top = top
        self.fetches = fetches
        self.reduces = reduces
        self.output = nodes[-1]
        self.placed: list = []  # (fetch or reduce) in placement order: the tie-break among equal targets
        self.target: dict = {}  # (unit, step) -> node the group goes before
        for fetch in fetches:
            fetch.distance = {step: 0 for step in fetch.groups if step in ("nc", "cg", "gg")}
            for step in fetch.groups:
                self.target[(fetch, step)] = fetch.wait
        for reduce in reduces:
            self.target[(reduce, "wait")] = None  # None: where it is (right after its start)

    def fetch_target(self, fetch: _Fetch, distance: int) -> torch.fx.Node:
        if distance == 0:
            return fetch.wait
        index = fetch.op - distance
        node = self.op_nodes[index] if index >= 0 else self.top
        # Never after its own wait (a first use that precedes the op, e.g. an early view).
        return min(node, fetch.wait, key=self.position.__getitem__)

    def reduce_target(self, reduce: _Reduce, delay: int) -> torch.fx.Node | None:
        if delay == 0:
            return None
        start = self.position[reduce.start]
        later = [node for node in self.op_nodes if self.position[node] > start]
        return later[delay] if len(later) > delay else self.output

    def order(self) -> list[torch.fx.Node]:
        """The node order this placement gives."""
        moved_before: dict = {}
        moved = set()
        for unit in self.placed:
            if isinstance(unit, _Fetch):
                for step in ("nc", "cg", "gg"):
                    if step in unit.groups:
                        target = self.target[(unit, step)]
                        moved_before.setdefault(target, []).extend(unit.groups[step])
                        moved.update(unit.groups[step])
            else:
                target = self.target[(unit, "wait")]
                if target is not None:
                    moved_before.setdefault(target, []).append(unit.wait)
                    moved.add(unit.wait)
        order = []
        for node in self.nodes:
            order.extend(moved_before.get(node, ()))
            if node not in moved:
                order.append(node)
        return order

    def simulate(self, order: list[torch.fx.Node] | None = None) -> dict:
        """Device and pinned bytes after each node of ``order``, as the store counts them."""
        order = order or self.order()
        deltas: dict = {}
        for fetch in self.fetches:
            if "nc" in fetch.groups:
                deltas.setdefault(fetch.groups["nc"][0], []).append(("pinned", fetch.pinned_bytes))
            if "cg" in fetch.groups:
                cg_start = fetch.groups["cg"][-1]
                deltas.setdefault(cg_start, []).append(("device", fetch.shard_bytes))
                cg_wait = fetch.groups["gg"][0]
                deltas.setdefault(cg_wait, []).append(("pinned", -fetch.pinned_bytes))
            gather_start = fetch.groups["gg"][-1]
            deltas.setdefault(gather_start, []).append(("device", fetch.gathered_bytes - fetch.shard_bytes))
            copy_out = fetch.copy_out_bytes
            deltas.setdefault(fetch.wait, []).extend([("device", copy_out), ("device", -copy_out)])
            if fetch.release is not None:
                deltas.setdefault(fetch.release, []).append(("device", -fetch.gathered_bytes))
        for reduce in self.reduces:
            deltas.setdefault(reduce.start, []).extend(
                [("device", reduce.grad_bytes), ("device", reduce.staging_bytes), ("device", -reduce.grad_bytes)])
            deltas.setdefault(reduce.wait, []).append(("device", -reduce.staging_bytes))
        live = {"device": 0, "pinned": 0}
        after = {}
        peak = {"device": 0, "pinned": 0}
        for node in order:
            for tier, delta in deltas.get(node, ()):
                live[tier] += delta
                peak[tier] = max(peak[tier], live[tier])
            after[node] = dict(live)
        return {"after": after, "peak_device": peak["device"], "peak_pinned": peak["pinned"], "order": order}

    def _fits(self, device_cap, pinned_cap) -> bool:
        result = self.simulate()
        return ((device_cap is None or result["peak_device"] <= device_cap)
                and (pinned_cap is None or result["peak_pinned"] <= pinned_cap))

    def place_fetch(self, fetch: _Fetch, device_cap, pinned_cap, allowed: bool = True) -> None:
        """The largest distances up to ``fetch.wanted`` that keep both caps; cg/gg shrink first."""
        self.placed.append(fetch)
        if allowed:
            for distances in _shrinking(fetch.wanted):
                self._set(fetch, distances)
                if self._fits(device_cap, pinned_cap):
                    return
        self._set(fetch, {step: 0 for step in fetch.wanted})

    def _set(self, fetch: _Fetch, distances: dict) -> None:
        fetch.distance = {step: distances[step] for step in fetch.groups if step in distances}
        for step, distance in fetch.distance.items():
            self.target[(fetch, step)] = self.fetch_target(fetch, distance)

    def place_reduce(self, reduce: _Reduce, device_cap, allowed: bool = True) -> None:
        self.placed.append(reduce)
        for delay in range(reduce.wanted if allowed else 0, -1, -1):
            reduce.delay = delay
            self.target[(reduce, "wait")] = self.reduce_target(reduce, delay)
            if self._fits(device_cap, None):
                return

    def apply(self, graph: torch.fx.Graph) -> None:
        order = self.order()
        # Re-link the nodes in ``order`` (each node moved right after the previous one).
        previous = None
        for node in order:
            if previous is not None and previous.next is not node:
                previous.append(node)
            previous = node
        self.final_order = list(graph.nodes)


def _shrinking(wanted: dict) -> list[dict]:
    """Distance choices from ``wanted`` down to all zero: gg and cg shrink first (they hold device bytes).

    Every choice keeps nc >= cg >= gg (a read before its copy, a copy before its gather).
    """
    nc, cg, gg = wanted.get("nc", 0), wanted.get("cg", 0), wanted.get("gg", 0)
    choices = []
    for device_ahead in range(max(cg, gg), -1, -1):
        gg_ahead = min(gg, device_ahead)
        cg_ahead = max(min(cg, device_ahead), gg_ahead)
        for nc_ahead in range(max(nc, cg_ahead), cg_ahead - 1, -1):
            choice = {"nc": nc_ahead, "cg": cg_ahead, "gg": gg_ahead}
            if choice not in choices:
                choices.append(choice)
    return choices


def describe(ctx: GraphContext) -> list[str]:
    """Dump header lines: the cost model and one line per op (see :func:`schedule_table.describe`)."""
    return schedule_table.describe(ctx.facts.get("schedule"))


def table(ctx: GraphContext) -> dict | None:
    """The schedule table, for ``<kind>.schedule.json`` in the dump folder."""
    return ctx.facts.get("schedule")
