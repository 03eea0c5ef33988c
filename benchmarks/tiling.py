"""Largest hidden size that trains under one device-memory budget, untiled vs with tiling (the paper's Fig. 6b).

    python benchmarks/tiling.py [--device-memory-limit 16MiB --max-hidden 8192]

ZeRO-Infinity trains a one-block model with hidden size 64K on a GPU where,
without tiling, 8K is the largest.  Scaled to this machine: the "device" is
the CPU and its memory is the budget ``device_memory_limit`` that the runtime
enforces on gathered and in-flight parameter bytes (going over is a
ZinfBudgetError naming the op).  One transformer block (attention and a 4x
MLP, 12*h^2 parameters) trains one step (forward, backward, AdamW) on a
[1, 8, h] input, stage 3, parameters in CPU memory, optimizer state on NVMe
(``--nvme-path``, one copy); each trial is its own process.

Search: the hidden size doubles from ``--start`` while a step succeeds, then
bisects (multiples of 256) between the last success and the first failure,
separately without tiling (tile_threshold above every weight) and with
``tile_factor="auto"`` (every weight over 1 MiB is tiled; the planner picks the
smallest factor whose working set fits the budget).  A trial succeeds if its
loss is finite and the runtime's peak of gathered and in-flight bytes stayed
within the budget.  Prints each trial and the ratio of the two largest sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
STEP = 256


def child(spec: dict) -> None:
    import resource

    import torch

    import zinf_compiler as zinf
    from zinf_compiler.gpt import Block, GPTConfig
    from zinf_compiler.runtime.ledger import ZinfBudgetError
    from zinf_compiler.api import RUNTIME

    torch.manual_seed(0)
    hidden = spec["hidden"]
    block = Block(GPTConfig(n_embd=hidden, n_head=max(1, hidden // 128), block_size=8))
    options = {"stage": 3, "offload_param": "cpu", "offload_optimizer": "nvme", "nvme_path": spec["nvme_path"],
               "nvme_copies": 1, "lower": "eager", "device_memory_limit": spec["limit"]}
    if spec["tiled"]:
        options.update(tile_threshold=1 << 20, tile_factor="auto")
    else:
        options.update(tile_threshold=1 << 50)
    compiled = torch.compile(block, backend="zinf", options=options)
    opt = zinf.optim.AdamW(block.parameters(), lr=1e-4)
    x = torch.randn(1, 8, hidden)
    result = {"hidden": hidden, "params": sum(p.numel() for p in block.parameters())}
    try:
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        result.update(ok=math.isfinite(loss.item()), loss=loss.item())
    except ZinfBudgetError as err:
        result.update(ok=False, error=str(err).split(";")[0])
    except torch._dynamo.exc.BackendCompilerFailed as err:
        if not isinstance(err.inner_exception, ZinfBudgetError):
            raise
        result.update(ok=False, error=str(err.inner_exception).split(";")[0])
    result["peak_device_bytes"] = RUNTIME.store.peak_transient["device"]
    result["within_budget"] = RUNTIME.store.peak_transient["device"] <= spec["limit"]
    result["ok"] = result["ok"] and result["within_budget"]
    result["tiles"] = {record.name: len(record.tile_rows) for record in RUNTIME.store.records() if record.tile_rows}
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))


def trial(args, hidden: int, tiled: bool) -> dict:
    swap = tempfile.mkdtemp(prefix="tiling-", dir=args.nvme_path)
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(
            {"hidden": hidden, "tiled": tiled, "limit": args.device_memory_limit, "nvme_path": swap})],
            capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        result = {"hidden": hidden, "ok": False, "error": "crashed: " + " | ".join(tail)}
    else:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - started
    label = "tiled" if tiled else "untiled"
    status = "trains" if result["ok"] else f"fails ({result.get('error', 'over budget')})"
    extra = ""
    if "peak_device_bytes" in result:
        extra = (f", peak device {result['peak_device_bytes'] / 2**20:.1f} MiB, peak RSS "
                 f"{result['peak_rss_bytes'] / 2**30:.2f} GiB")
        if result.get("tiles"):
            extra += f", tiles {sorted(set(result['tiles'].values()))}"
    print(f"  {label:<8} hidden {hidden:>6}: {status}{extra} ({result['seconds']:.0f} s)", flush=True)
    return result


def largest(args, tiled: bool) -> tuple[int, list[dict]]:
    trials, good, bad = [], 0, None
    hidden = args.start
    while hidden <= args.max_hidden:
        result = trial(args, hidden, tiled)
        trials.append(result)
        if not result["ok"]:
            bad = hidden
            break
        good = hidden
        hidden *= 2
    if bad is None:
        bad = args.max_hidden + STEP  # the cap, not a failure
        if good < args.max_hidden:
            result = trial(args, args.max_hidden, tiled)
            trials.append(result)
            if result["ok"]:
                return args.max_hidden, trials
            bad = args.max_hidden
    while bad - good > STEP:
        middle = (good + bad) // 2 // STEP * STEP
        if middle <= good:
            break
        result = trial(args, middle, tiled)
        trials.append(result)
        if result["ok"]:
            good = middle
        else:
            bad = middle
    return good, trials


def describe(result: dict | None) -> str:
    """One table cell: the outcome of a trial, its accounted peak, RSS, tiles and time."""
    if result is None:
        return "-"
    if not result["ok"]:
        error = result.get("error", "over budget").removeprefix("device_memory_limit exceeded: ")
        return f"fails: {error.split(' (')[0]}"
    cell = f"trains (loss {result['loss']:.3g}, peak {result['peak_device_bytes'] / 2**20:.1f} MiB"
    tiles = sorted(set(result.get("tiles", {}).values()))
    if tiles:
        cell += f", tiles {tiles[0]}" + (f"-{tiles[-1]}" if tiles[-1] != tiles[0] else "")
    else:
        cell += ", no tiles"
    return cell + f", RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB, {result['seconds']:.0f} s)"


def print_table(untiled_trials: list[dict], tiled_trials: list[dict]) -> None:
    """Markdown table of every trial, one row per hidden size."""
    by_hidden = {}
    for column, trials in enumerate((untiled_trials, tiled_trials)):
        for result in trials:
            by_hidden.setdefault(result["hidden"], [None, None])[column] = result
    print("\n| hidden | params | untiled | tiled (tile_factor=auto) |\n|---|---|---|---|")
    for hidden in sorted(by_hidden):
        row = by_hidden[hidden]
        params = next((result["params"] for result in row if result and "params" in result), 12 * hidden**2)
        print(f"| {hidden} | {params / 1e6:.1f}M | {describe(row[0])} | {describe(row[1])} |")


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is none."""
    from zinf_compiler.runtime.host_memory import available_bytes

    return available_bytes()


def parse_bytes(text: str) -> int:
    from zinf_compiler.options import parse_bytes as parse

    return parse(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-memory-limit", type=parse_bytes, default=16 << 20)
    parser.add_argument("--start", type=int, default=256)
    parser.add_argument("--max-hidden", type=int, default=8192,
                        help="search cap (8192: 805M parameters, 11 GiB peak RSS, 13 GiB of optimizer state on disk; "
                             "16384 would need about 50 GiB of RAM)")
    parser.add_argument("--nvme-path", default=str(REPO / ".zinf_swap"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    os.makedirs(args.nvme_path, exist_ok=True)
    free = shutil.disk_usage(args.nvme_path).free
    needed = 12 * args.max_hidden**2 * 16 * 1.1
    if free < needed:
        raise SystemExit(f"{args.nvme_path} has {free / 2**30:.1f} GiB free; --max-hidden {args.max_hidden} needs "
                         f"{needed / 2**30:.1f} GiB of optimizer state: lower --max-hidden or use another --nvme-path")
    # Host RAM holds the block as built (fp32), its parameter shards and gradients and the
    # swap staging buffers: the 8192 trial peaked at 14.8 bytes per parameter (11.1 GiB).
    ram_needed = 12 * args.max_hidden**2 * 16
    ram_free = available_ram()
    if ram_free is not None and ram_free < ram_needed:
        raise SystemExit(f"{ram_free / 2**30:.1f} GiB of RAM available; --max-hidden {args.max_hidden} needs about "
                         f"{ram_needed / 2**30:.1f} GiB (16 bytes per parameter): lower --max-hidden")
    print("command: python " + " ".join(sys.argv))
    print(f"device_memory_limit {args.device_memory_limit / 2**20:.1f} MiB; one block, input [1, 8, h]")
    started = time.perf_counter()
    print("without tiling:")
    untiled, untiled_trials = largest(args, tiled=False)
    print("with tile_factor=auto:")
    tiled, tiled_trials = largest(args, tiled=True)
    print_table(untiled_trials, tiled_trials)
    capped = " (the search cap)" if tiled >= args.max_hidden else ""
    print(f"\nlargest hidden size under {args.device_memory_limit / 2**20:.0f} MiB: untiled {untiled}, "
          f"tiled {tiled}{capped}; ratio {tiled / max(untiled, 1):.1f}x (paper: 8K -> 64K, 8x)")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
