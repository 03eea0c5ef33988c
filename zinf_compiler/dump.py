"""Inspection dumps: every graph after capture and after every pass, as Python.

Layout under ``dump_dir`` (``rank<R>/`` is inserted when world size > 1)::

    index.json                      graphs, their passes, files and op counts
    graph_000/dynamo.py             the Dynamo-level graph the backend received
    graph_000/forward.00_capture.py the ATen forward graph after AOTAutograd
    graph_000/forward.01_<pass>.py  ... after each pass
    graph_000/backward.00_capture.py

Each graph file starts with a comment header naming the pass, the op-count
change and the parameter bytes, so two dumps can be compared with ``diff``.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import Any

import torch

from . import ram_cache, unit_plan
from .context import CapturedGraph, GraphContext

INDEX_FILE = "index.json"
_index_lock = threading.Lock()
_index_by_dir: dict[str, dict[str, Any]] = {}


def op_counts(gm: torch.fx.GraphModule) -> collections.Counter:
    """How many times each call target occurs in ``gm`` (``aten.mm.default``: 4)."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            counts[_target_name(node.target)] += 1
    return counts


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", repr(target))


def describe_count_change(before: collections.Counter, after: collections.Counter) -> str:
    """``37 -> 45 ops (+8): +4 zinf.gather.default, +4 zinf.release.default``."""
    total_before, total_after = sum(before.values()), sum(after.values())
    changes = []
    for name in sorted(set(before) | set(after)):
        delta = after[name] - before[name]
        if delta:
            changes.append(f"{delta:+d} {name}")
    text = f"{total_before} -> {total_after} ops ({total_after - total_before:+d})"
    return text + (": " + ", ".join(changes) if changes else ": unchanged")


def rank_dump_dir(dump_dir: str) -> str:
    """``dump_dir`` itself, or its ``rank<R>`` folder when torch.distributed runs more than one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return os.path.join(dump_dir, f"rank{dist.get_rank()}")
    return dump_dir


class GraphDumper:
    """Writes the files of one captured graph and keeps ``index.json`` current."""

    def __init__(self, captured: CapturedGraph):
        self.captured = captured
        self.root = rank_dump_dir(captured.options.dump_dir) if captured.options.dump_dir else None
        self.folder = os.path.join(self.root, f"graph_{captured.graph_id:03d}") if self.root else None

    @property
    def enabled(self) -> bool:
        """Whether ``dump_dir`` is set: otherwise every dump method returns without writing."""
        return self.folder is not None

    def _entry(self) -> dict[str, Any]:
        index = _index_by_dir.setdefault(self.root, {"graphs": []})
        for entry in index["graphs"]:
            if entry["graph_id"] == self.captured.graph_id:
                return entry
        entry = {
            "graph_id": self.captured.graph_id,
            "folder": os.path.basename(self.folder),
            "options": {k: list(v) if isinstance(v, tuple) else (v.describe() if k == "mesh" and v is not None else v)
                        for k, v in self.captured.options.as_dict().items()},
            "params": [
                {"name": p.name, "shape": list(p.shape or ()), "dtype": str(p.dtype), "bytes": p.nbytes,
                 "requires_grad": p.requires_grad}
                for p in self.captured.params
            ],
            "graphs": {},
        }
        index["graphs"].append(entry)
        return entry

    def _write_index(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, INDEX_FILE)
        tmp_path = path + ".tmp"
        with open(tmp_path, "w") as handle:
            json.dump(_index_by_dir[self.root], handle, indent=1, default=str)
        os.replace(tmp_path, path)

    def dump_dynamo(self, gm: torch.fx.GraphModule) -> None:
        """Write ``dynamo.py`` (the graph the backend received, its inputs in the header) and list it in the index."""
        if not self.enabled:
            return
        header = [
            f"zinf dump: graph {self.captured.graph_id}, Dynamo-level graph as received by the backend",
            f"inputs: {len(self.captured.inputs)} ({len(self.captured.params)} parameters, "
            f"{sum(p.nbytes for p in self.captured.params):,} parameter bytes)",
        ]
        header += [f"  input {i.position}: {i.kind:<6} {i.name} {list(i.shape or ())} {i.dtype}" for i in self.captured.inputs]
        self._write_graph("dynamo.py", header, gm)
        with _index_lock:
            self._entry()["dynamo_file"] = "dynamo.py"
            self._write_index()

    def dump_stage(
        self,
        gm: torch.fx.GraphModule,
        ctx: GraphContext,
        step: int,
        stage: str,
        before: collections.Counter | None,
        seconds: float,
        extra_header: list[str] | None = None,
        table: dict | None = None,
    ) -> None:
        """Write ``<kind>.<step>_<stage>.py`` (and ``<kind>.<stage>.json`` for a table) and record them in the index.

        The header lines of a pass go into the index as ``notes`` unless it
        also gives a table (the table is the structured form then).
        """
        if not self.enabled:
            return
        after = op_counts(gm)
        change = describe_count_change(before, after) if before is not None else f"{sum(after.values())} ops"
        tier_bytes = unit_plan.param_bytes_per_tier(ctx)
        header = [
            f"zinf dump: graph {ctx.graph_id} {ctx.kind}, after {stage!r} (step {step})",
            f"ops: {change}",
            f"parameters: {len(ctx.params)} in this graph, {ctx.param_bytes():,} bytes",
            "parameter bytes per tier (this rank, between steps): " + ", ".join(f"{tier} {count:,}" for tier, count in tier_bytes.items()),
            f"pass time: {seconds * 1000:.1f} ms",
        ] + list(extra_header or [])
        layouts = ctx.captured.layouts
        cached = ram_cache.describe_cached(((info.name, layouts[info.position]) for info in ctx.params.values()
                                            if info.position in layouts), ctx.captured.options)
        header += [cached] if cached else []
        filename = f"{ctx.kind}.{step:02d}_{stage}.py"
        self._write_graph(filename, header, gm)
        entry = {"stage": stage, "file": filename, "ops": sum(after.values()), "change": change}
        if table is not None:
            entry["table"] = f"{ctx.kind}.{stage}.json"
            with open(os.path.join(self.folder, entry["table"]), "w") as handle:
                json.dump(table, handle, indent=1, default=str)
        elif extra_header:
            entry["notes"] = list(extra_header)
        with _index_lock:
            self._entry()["graphs"].setdefault(ctx.kind, []).append(entry)
            self._write_index()

    def record_skipped(self, ctx: GraphContext, stage: str, reason: str) -> None:
        """Record in the index that pass ``stage`` did not run on ``ctx``'s graph, and why (no graph file)."""
        if not self.enabled:
            return
        with _index_lock:
            self._entry()["graphs"].setdefault(ctx.kind, []).append({"stage": stage, "skipped": reason})
            self._write_index()

    def _write_graph(self, filename: str, header: list[str], gm: torch.fx.GraphModule) -> None:
        body = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, filename), "w") as handle:
            handle.write("".join(f"# {line}\n" for line in header))
            handle.write("\n")
            handle.write(body)
            if not body.endswith("\n"):
                handle.write("\n")


def read_index(dump_dir: str) -> dict[str, Any]:
    """Load ``index.json`` from a dump folder (or its ``rank0`` for multi-rank dumps)."""
    for candidate in (dump_dir, os.path.join(dump_dir, "rank0")):
        path = os.path.join(candidate, INDEX_FILE)
        if os.path.exists(path):
            with open(path) as handle:
                return json.load(handle)
    raise FileNotFoundError(f"no {INDEX_FILE} under {dump_dir!r}: was it written with options={{'dump_dir': ...}}?")
