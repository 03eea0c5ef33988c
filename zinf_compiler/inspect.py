"""Summarise a zinf dump folder: ``python -m zinf_compiler.inspect DIR``.

Prints, per compiled graph, its parameters and for each ATen graph (forward,
backward, inference) the chain of stages with op counts and what each pass
changed.  ``--graph N --kind forward --stage partition`` prints one graph file.
"""

from __future__ import annotations

import argparse
import os
import sys

from .dump import read_index


def summarize(dump_dir: str) -> str:
    """The summary of ``dump_dir``: per graph its parameters, and per ATen graph each stage's op count and change."""
    index = read_index(dump_dir)
    lines = [f"zinf dump {dump_dir}: {len(index['graphs'])} compiled graph(s)"]
    for entry in sorted(index["graphs"], key=lambda e: e["graph_id"]):
        params = entry.get("params", [])
        param_bytes = sum(p["bytes"] for p in params)
        options = entry.get("options", {})
        lines.append(
            f"\ngraph {entry['graph_id']} ({entry['folder']}): {len(params)} parameters, {param_bytes:,} bytes; "
            f"stage={options.get('stage')} lower={options.get('lower')}"
        )
        for kind, stages in entry.get("graphs", {}).items():
            lines.append(f"  {kind}:")
            for stage in stages:
                if "skipped" in stage:
                    lines.append(f"    {stage['stage']:<12} skipped: {stage['skipped']}")
                else:
                    lines.append(f"    {stage['stage']:<12} {stage['ops']:>5} ops  {stage['change']}  [{stage['file']}]")
    return "\n".join(lines)


def stage_file(dump_dir: str, graph_id: int, kind: str, stage: str) -> str:
    """Path of graph ``graph_id``'s ``kind`` graph as dumped after ``stage``; exits naming what there is if none."""
    index = read_index(dump_dir)
    root = dump_dir if os.path.exists(os.path.join(dump_dir, "index.json")) else os.path.join(dump_dir, "rank0")
    for entry in index["graphs"]:
        if entry["graph_id"] != graph_id:
            continue
        for recorded in entry.get("graphs", {}).get(kind, []):
            if recorded["stage"] == stage and "file" in recorded:
                return os.path.join(root, entry["folder"], recorded["file"])
        known = [s["stage"] for s in entry.get("graphs", {}).get(kind, []) if "file" in s]
        raise SystemExit(f"graph {graph_id} has no {kind} stage {stage!r}; it has: {', '.join(known) or 'none'}")
    raise SystemExit(f"no graph {graph_id} in {dump_dir}")


def main(argv: list[str] | None = None, prog: str = "python -m zinf_compiler.inspect") -> int:
    """Print a dump folder's summary, or with ``--graph`` one graph file; returns the exit status (2: file missing)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir", help="a folder written with options={'dump_dir': ...}")
    parser.add_argument("--graph", type=int, help="print one graph file: its graph id")
    parser.add_argument("--kind", default="forward", choices=["forward", "backward", "inference"])
    parser.add_argument("--stage", default="capture", help="'capture' or a pass name")
    args = parser.parse_args(argv)
    try:
        if args.graph is None:
            print(summarize(args.dump_dir))
        else:
            with open(stage_file(args.dump_dir, args.graph, args.kind, args.stage)) as handle:
                sys.stdout.write(handle.read())
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
