"""The schedule pass's table: what it decided, and what the cost model expects of it.

:func:`build` turns the schedule pass's final placement into the table dumped
as ``<kind>.schedule.json`` (``ctx.facts["schedule"]``): per op, what is in
flight, the live and pinned bytes the store will count, and the compute the
cost model estimates; per transfer, its distance (wanted and after the caps)
and the compute estimated between its start and its wait, with the part left
exposed (where a longer prefetch distance would hide more).
:func:`describe` prints it for the dump header.
"""

from __future__ import annotations

from typing import Any

import torch

from zinf_compiler.context import GraphContext


def build(ctx: GraphContext, graph: torch.fx.Graph, planner, distances: dict, device_cap, pinned_cap, note) -> dict:
    """The schedule table of ``graph`` in its final order (``planner``: the schedule pass's placement)."""
    order = list(graph.nodes)
    position = {node: index for index, node in enumerate(order)}
    simulated = planner.simulate(order)
    cost = ctx.cost_model
    op_nodes = planner.op_nodes
    op_index = {node: index for index, node in enumerate(op_nodes)}
    # The op each node belongs to: the last op at or before it (-1: before the first).
    op_of, current = {}, -1
    for node in order:
        current = op_index.get(node, current)
        op_of[node] = current

    # Estimated compute before each node (prefix sums): what a transfer in flight can hide behind.
    compute_before, total = [], 0.0
    for node in order:
        compute_before.append(total)
        total += cost.node_seconds(node)

    transfers = []
    for fetch in planner.fetches:
        for step in ("nc", "cg", "gg"):
            if step not in fetch.groups:
                continue
            if step == "nc":
                start, wait = fetch.groups["nc"][0], fetch.groups["cg"][0]
            elif step == "cg":
                start, wait = fetch.groups["cg"][-1], fetch.groups["gg"][0]
            else:
                start, wait = fetch.groups["gg"][-1], fetch.wait
            nbytes = {"nc": fetch.pinned_bytes, "cg": fetch.shard_bytes, "gg": fetch.gathered_bytes}[step]
            cost_step = step
            if fetch.kind == "activation":
                cost_step = "nc" if ctx.options.offload_activations == "nvme" else "cg"
            transfers.append({
                "param": fetch.name, "slots": fetch.slots, "tile": fetch.tile,
                "step": "act" if fetch.kind == "activation" else step,
                "start": start.name, "wait": wait.name, "start_pos": position[start], "wait_pos": position[wait],
                "use_op": fetch.op, "issued_before_op": fetch.op - fetch.distance[step] if fetch.distance[step] else None,
                "wanted_distance": fetch.wanted[step], "distance": fetch.distance[step],
                "capped": fetch.distance[step] < fetch.wanted[step], "bytes": nbytes,
                **_exposure(cost.transfer_seconds(cost_step, nbytes), compute_before, position[start],
                            position[wait]),
            })
    for reduce in planner.reduces:
        transfers.append({
            "param": reduce.name, "slots": reduce.slots, "tile": reduce.tile, "step": "rs",
            "start": reduce.start.name, "wait": reduce.wait.name, "start_pos": position[reduce.start],
            "wait_pos": position[reduce.wait], "use_op": None, "issued_before_op": None,
            "wanted_distance": reduce.wanted, "distance": reduce.delay, "capped": reduce.delay < reduce.wanted,
            "bytes": reduce.staging_bytes,
            **_exposure(cost.transfer_seconds("rs", reduce.staging_bytes), compute_before, position[reduce.start],
                        position[reduce.wait]),
        })
    # Per op: compute estimate of the nodes from this op to the next, what is in flight when it runs.
    compute = [0.0] * len(op_nodes)
    for node in order:
        if op_of[node] >= 0:
            compute[op_of[node]] += cost.node_seconds(node)
    rows = []
    for index, node in enumerate(op_nodes):
        at = position[node]
        in_flight = {step: [] for step in ("nc", "cg", "gg", "rs", "act")}
        for transfer in transfers:
            if transfer["start_pos"] < at < transfer["wait_pos"]:
                in_flight[transfer["step"]].append(transfer["param"])
        region = [n for n in order if op_of[n] == index]
        rows.append({
            "op": index, "node": node.name, "target": _target_name(node.target),
            "in_flight": in_flight,
            "live_bytes": max(simulated["after"][n]["device"] for n in region),
            "pinned_bytes": max(simulated["after"][n]["pinned"] for n in region),
            "estimated_compute_seconds": compute[index],
        })
    before_first = [n for n in order if op_of[n] < 0]
    return {
        "graph": ctx.graph_id, "kind": ctx.kind,
        "prefetch": {"nc": ctx.options.prefetch_nc, "cg": ctx.options.prefetch_cg, "gg": ctx.options.prefetch_gg},
        "effective_distances": distances,
        "max_live_bytes": device_cap, "pinned_capacity": pinned_cap, "note": note,
        "peak_live_bytes": simulated["peak_device"], "peak_pinned_bytes": simulated["peak_pinned"],
        "live_bytes_before_first_op": max((simulated["after"][n]["device"] for n in before_first), default=0),
        "cost_model": cost.describe(),
        "ops": rows, "transfers": transfers,
    }


def _exposure(seconds: float, compute_before: list[float], start: int, wait: int) -> dict:
    """A transfer's estimate, the compute estimated between its start and its wait, and what is left over."""
    covered = compute_before[wait] - compute_before[start]
    return {"estimated_seconds": seconds, "covering_compute_seconds": covered,
            "exposed_seconds": max(0.0, seconds - covered)}


def _target_name(target: Any) -> str:
    return getattr(target, "__name__", str(target)) if not isinstance(target, torch._ops.OpOverload) else str(target)


def describe(table: dict | None) -> list[str]:
    """Dump header lines for ``table``: the cost model and one line per op (in flight, live bytes, estimates)."""
    if not table:
        return ["schedule: nothing to schedule in this graph"]
    cap = table["max_live_bytes"]
    lines = list(table["cost_model"]) + [
        f"schedule: prefetch nc/cg/gg {table['effective_distances']['nc']}/{table['effective_distances']['cg']}/"
        f"{table['effective_distances']['gg']} ops ahead (options {table['prefetch']['nc']}/{table['prefetch']['cg']}/"
        f"{table['prefetch']['gg']}), max_live_bytes {'unlimited' if cap is None else f'{cap:,}'}, "
        f"peak live {table['peak_live_bytes']:,} bytes, peak pinned {table['peak_pinned_bytes']:,} bytes",
    ]
    if table["note"]:
        lines.append(f"schedule: {table['note']}")
    capped = [t for t in table["transfers"] if t["capped"]]
    if capped:
        lines.append(f"schedule: {len(capped)} transfers started later than asked to respect the caps")
    exposed = [t for t in table["transfers"] if t["exposed_seconds"] > 0]
    if exposed:
        # Where the cost model expects stalls: a larger prefetch distance for that step would hide more.
        worst = max(exposed, key=lambda t: t["exposed_seconds"])
        per_step = {}
        for transfer in exposed:
            per_step[transfer["step"]] = per_step.get(transfer["step"], 0.0) + transfer["exposed_seconds"]
        lines.append(
            "schedule: estimated exposed transfer time "
            + ", ".join(f"{step} {seconds * 1000:.3f} ms" for step, seconds in per_step.items())
            + f" ({len(exposed)} of {len(table['transfers'])} transfers); the most exposed: {worst['step']} of "
            f"{worst['param']} ({worst['estimated_seconds'] * 1000:.3f} ms estimated, "
            f"{worst['covering_compute_seconds'] * 1000:.3f} ms of compute between its start and wait)")
    lines.append(f"{'op':>4}  {'node':<28} {'live bytes':>14} {'est ms':>8}  in flight")
    for row in table["ops"]:
        flight = "; ".join(f"{step}: {', '.join(names)}" for step, names in row["in_flight"].items() if names)
        lines.append(f"{row['op']:>4}  {row['node']:<28} {row['live_bytes']:>14,} "
                     f"{row['estimated_compute_seconds'] * 1000:>8.3f}  {flight or '-'}")
    return lines
