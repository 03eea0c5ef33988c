"""The runtime's overhead per unit: a GPT of many small layers, zinf stage 3 beside torch.compile, one process.

    python benchmarks/overhead.py [--n-layer 24 --n-embd 64 --rounds 5 --steps 20 --device cpu --json F]

Compute is kept small on purpose (a narrow, deep model, a short batch), so
what zinf adds to torch.compile's step is mostly its runtime's own work: the
``zinf::`` ops' Python calls, the store's bookkeeping, the copies a gather
makes.  Each variant trains its own copy of the same model on the same batch
(forward, backward, AdamW step, zero_grad); after a warm-up that compiles,
the variants take turns every step so machine noise falls on all of them.

Printed per variant: the median step, its ratio to torch.compile, and for
zinf the overhead (its median less torch.compile's) per parameter and per
unit per step, with the number of units and of ``zinf::`` op calls one step
makes (counted in a separate step, outside the timed ones).  A *unit* is what
one gather or reduction moves (a parameter, a row tile, or a bucket of a
block's parameters).  On a GPU (``--device cuda``) each timed step ends with a
synchronize, and ``--trace DIR`` writes a torch.profiler trace of a few zinf
steps (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import torch  # noqa: E402

import zinf_compiler as zinf  # noqa: E402
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402
from zinf_compiler.runtime.store import ParamStore  # noqa: E402

# The store's methods the graph's zinf ops call, one call per op (what a step's op count counts).
OP_METHODS = ("nc_start", "nc_wait", "cg_start", "cg_wait", "gather_start", "gather_wait", "release",
              "reduce_grad_start", "reduce_grad_wait")
UNIT_METHODS = ("gather_start", "reduce_grad_start")  # one call per unit moved


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="compile,zinf0,zinf3",
                        help="comma-separated: compile, zinf0 (stage 0), zinf3 (stage 3, device tier), "
                             "zinf3-cpu (stage 3, parameters and optimizer on the cpu tier)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--trace", help="write a torch.profiler trace of zinf stage 3's steps into this folder")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("command: python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"load average {_loadavg()}", flush=True)

    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    n_params = sum(1 for _ in base.parameters())
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M elements in {n_params} parameters, "
          f"batch {args.batch_size}x{args.block_size}")
    idx, targets = synthetic_batches(cfg, args.batch_size, 1)[0]
    idx, targets = idx.to(device), targets.to(device)

    variants = {}
    for name in args.variants.split(","):
        model = copy.deepcopy(base)
        if name == "compile":
            variants[name] = (torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
            continue
        options = {"zinf0": {"stage": 0}, "zinf3": {"stage": 3},
                   "zinf3-cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}}[name]
        variants[name] = (torch.compile(model, backend="zinf", options=options),
                          zinf.optim.AdamW(model.parameters(), lr=1e-3))

    def one_step(model, opt) -> float:
        started = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    for name, (model, opt) in variants.items():
        started = time.perf_counter()
        for _ in range(3):
            one_step(model, opt)  # compiles
        print(f"warm-up {name}: {time.perf_counter() - started:.1f}s (compile included)", flush=True)

    samples = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for _ in range(args.steps):
            for name, (model, opt) in variants.items():
                samples[name].append(one_step(model, opt))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)

    counts = {name: _count_ops(lambda m=model, o=opt: one_step(m, o))
              for name, (model, opt) in variants.items() if name.startswith("zinf")}
    if args.trace and "zinf3" in variants:
        _trace(args.trace, lambda: one_step(*variants["zinf3"]), device)

    medians = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    reference = medians.get("compile")
    rows = []
    print(f"\n{len(samples[next(iter(samples))])} steps per variant, turns every step; load average {_loadavg()}")
    print("| variant | median step (ms) | IQR (ms) | vs compile | units/step | op calls/step | "
          "overhead us/param/step | overhead us/unit/step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, median in medians.items():
        q1, _, q3 = statistics.quantiles([t * 1e3 for t in samples[name]], n=4, method="inclusive")
        row = {"variant": name, "median_ms": median, "iqr_ms": [q1, q3]}
        cells = [f"{median:.2f}", f"{q1:.2f}-{q3:.2f}", "", "", "", "", ""]
        if reference:
            row["vs_compile"] = median / reference
            cells[2] = f"{median / reference:.3f}"
        if name in counts:
            units, calls = counts[name]
            row.update(units_per_step=units, op_calls_per_step=calls)
            cells[3], cells[4] = str(units), str(calls)
            if reference:
                overhead_us = (median - reference) * 1e3
                row["overhead_us_per_param"] = overhead_us / n_params
                cells[5] = f"{overhead_us / n_params:.1f}"
                if units:
                    row["overhead_us_per_unit"] = overhead_us / units
                    cells[6] = f"{overhead_us / units:.1f}"
        rows.append(row)
        print(f"| {name} | " + " | ".join(cells) + " |")
    result = {"command": sys.argv, "device": str(device), "torch": torch.__version__, "params": n_params,
              "rows": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _count_ops(step) -> tuple[int, int]:
    """(units moved, zinf op calls) in one step, by counting the store methods the ops call."""
    calls = dict.fromkeys(OP_METHODS, 0)
    originals = {name: getattr(ParamStore, name) for name in OP_METHODS}

    def counting(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in OP_METHODS:
        setattr(ParamStore, name, counting(name))
    try:
        step()
    finally:
        for name, original in originals.items():
            setattr(ParamStore, name, original)
    return sum(calls[name] for name in UNIT_METHODS), sum(calls.values())


def _trace(folder: str, step, device: torch.device) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(3):
            step()
    path = pathlib.Path(folder) / "overhead_zinf3.json"
    profiler.export_chrome_trace(str(path))
    print(f"trace: {path}")


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
