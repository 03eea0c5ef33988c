"""Overlap of compute and transfers: no prefetch (0/0/0) versus the default schedule (3/2/1) and a tuned one.

    python benchmarks/overlap.py [--n-layer 4 --n-embd 1024 --batch-size 1 --block-size 64 --rounds 3]

The example GPT with parameters on NVMe (``offload_param="nvme"``) and the
optimizer on the CPU trains ``--steps`` steps per run; each run is its own
process (one tracer, cold page cache does not matter: swap reads are
O_DIRECT), and the two schedules alternate ``--rounds`` times so machine
noise falls on both.  The last step of each run is traced (``dump_dir``,
``trace_step``); from the trace we report, for the whole step and for
forward+backward alone (the part the schedule orders):

* step: wall seconds;
* compute: the main thread's time not blocked on a transfer;
* transfer: the union of all transfer intervals (nc, cg, gg, rs, offload);
* step / max(compute, transfer): 1.0 is perfect overlap, sum/max when serial.

Compute runs on ``--threads`` torch threads (default 1) so that the NVMe
workers (which checksum every byte on the CPU) have the other core of this
2-core machine, as they would beside a GPU.  Medians over rounds are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
SCHEDULES = {"none (0/0/0)": (0, 0, 0), "default (3/2/1)": (3, 2, 1), "tuned (6/3/1)": (6, 3, 1)}
NAMES = {(0, 0, 0): "none", (3, 2, 1): "default"}


def parse_schedules(text: str) -> dict[str, tuple[int, int, int]]:
    """``"0/0/0,3/2/1,10/5/1"`` -> named prefetch distances (nc/cg/gg); the first is the baseline."""
    schedules = {}
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise argparse.ArgumentTypeError(f"--schedules item {item!r}: expected nc/cg/gg, e.g. 3/2/1")
        prefetch = tuple(int(part) for part in parts)
        schedules[f"{NAMES.get(prefetch, 'tuned')} ({item.strip()})"] = prefetch
    if len(schedules) < 2:
        raise argparse.ArgumentTypeError("--schedules needs at least two schedules (the first is the baseline)")
    return schedules


def run_one(args, prefetch: tuple[int, int, int], folder: str) -> dict:
    """Train in a child process; returns its step times and the trace summary."""
    swap = tempfile.mkdtemp(prefix="overlap-", dir=args.nvme_path)
    command = [sys.executable, __file__, "--child", json.dumps({
        "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size,
        "batch_size": args.batch_size, "steps": args.steps, "threads": args.threads, "lower": args.lower,
        "aio_threads": args.aio_threads,
        "prefetch": prefetch, "folder": folder, "nvme_path": swap})]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"child run failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(spec: dict) -> None:
    import torch

    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches

    torch.set_num_threads(spec["threads"])
    cfg = GPTConfig(vocab_size=256, block_size=spec["block_size"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                    n_embd=spec["n_embd"])
    torch.manual_seed(0)
    model = GPT(cfg)
    swap = spec["nvme_path"]  # a fresh folder of the parent's, removed by it
    nc, cg, gg = spec["prefetch"]
    compiled = torch.compile(model, backend="zinf", options={
        "stage": 3, "offload_param": "nvme", "offload_optimizer": "cpu", "nvme_path": swap,
        "lower": spec["lower"], "aio_threads": spec.get("aio_threads", 4), "prefetch_nc": nc, "prefetch_cg": cg, "prefetch_gg": gg,
        "dump_dir": spec["folder"], "trace_step": spec["steps"]})
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for idx, targets in synthetic_batches(cfg, spec["batch_size"], spec["steps"], seed=0):
        started = time.perf_counter()
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    trace = json.loads((pathlib.Path(spec["folder"]) / "trace.json").read_text())
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"times": times, "losses": losses, "summary": trace["otherData"]["summary"], "params": params}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6,
                        help="per run: the first compiles, the middle ones are timed, the last one is traced")
    parser.add_argument("--aio-threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", type=parse_schedules, default=SCHEDULES,
                        help="comma-separated nc/cg/gg prefetch distances, the first the baseline "
                             "(default 0/0/0,3/2/1,6/3/1)")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads")
    parser.add_argument("--lower", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--nvme-path", default=str(REPO / ".zinf_swap"))
    parser.add_argument("--figure", default=str(REPO / "benchmarks" / "figures" / "overlap_trace.png"),
                        help="where the default schedule's trace picture is copied")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    os.makedirs(args.nvme_path, exist_ok=True)
    print("command: python " + " ".join(sys.argv))
    print(f"{os.cpu_count()} cpus, compute threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    schedules = args.schedules
    results = {name: [] for name in schedules}
    work = tempfile.mkdtemp(prefix="zinf-overlap-")
    try:
        for round_index in range(args.rounds):
            for name, prefetch in schedules.items():
                folder = os.path.join(work, f"{round_index}-{prefetch[0]}{prefetch[1]}{prefetch[2]}")
                result = run_one(args, prefetch, folder)
                results[name].append(result)
                summary = result["summary"]
                print(f"round {round_index + 1} {name:<16} step {summary['step_seconds']:.3f} s, compute "
                      f"{summary['compute_seconds']:.3f} s, transfer {summary['transfer_seconds']:.3f} s, "
                      f"losses {[round(x, 4) for x in result['losses']]}", flush=True)
                if prefetch == (3, 2, 1) and round_index == args.rounds - 1 and os.path.exists(
                        os.path.join(folder, "memory.png")):
                    os.makedirs(os.path.dirname(args.figure), exist_ok=True)
                    shutil.copy(os.path.join(folder, "memory.png"), args.figure)
        first = results[next(iter(schedules))][0]
        print(f"model: {first['params'] / 1e6:.1f}M params ({first['params'] * 4 / 2**20:.0f} MiB fp32 on NVMe), "
              f"batch {args.batch_size}x{args.block_size}")
        report(results)
        if os.path.exists(args.figure):
            print(f"trace picture (default schedule, last round): {os.path.relpath(args.figure, REPO)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict) -> None:
    print("\nwall clock, median of the timed steps of every round (seconds)")
    walls = {}
    for name, runs in results.items():
        walls[name] = statistics.median(t for run in runs for t in run["times"][1:-1])
        print(f"{name:<16} {walls[name]:.3f}")
    names = list(results)
    for name in names[1:]:
        print(f"speedup of {name} over {names[0]} (wall clock): {walls[names[0]] / walls[name]:.2f}x")

    def median(name: str, window: str | None, key: str) -> float:
        values = []
        for result in results[name]:
            summary = result["summary"] if window is None else result["summary"][window]
            values.append(summary[key])
        return statistics.median(values)

    for window, title in ((None, "whole step (forward, backward, optimizer)"), ("graphs", "forward + backward")):
        print(f"\n{title}: medians over {len(next(iter(results.values())))} rounds (seconds)")
        print(f"{'schedule':<16} {'step':>7} {'compute':>8} {'transfer':>9} {'stall':>7} {'sum':>7} {'max':>7} "
              f"{'step/max':>9} {'step/sum':>9}")
        steps = {}
        for name in results:
            step = steps[name] = median(name, window, "step_seconds")
            compute, transfer = median(name, window, "compute_seconds"), median(name, window, "transfer_seconds")
            stall = median(name, window, "stall_seconds")
            print(f"{name:<16} {step:>7.3f} {compute:>8.3f} {transfer:>9.3f} {stall:>7.3f} {compute + transfer:>7.3f} "
                  f"{max(compute, transfer):>7.3f} {step / max(compute, transfer):>9.2f} "
                  f"{step / (compute + transfer):>9.2f}")
        for name in names[1:]:
            print(f"speedup of {name} over {names[0]} (traced step): {steps[names[0]] / steps[name]:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
