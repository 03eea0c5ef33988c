"""Step time of the example GPT: eager PyTorch vs torch.compile (Inductor) vs zinf, in one process.

    python benchmarks/step_time.py [--rounds 5 --steps 10 ...]

Each variant trains its own copy of the same model on the same batches
(forward, backward, AdamW step, zero_grad). After a warm-up that compiles,
the variants take turns so machine noise falls on all of them: by default
one step each in turn (``--interleave step``), or ``--steps`` steps each per
turn (``--interleave round``). Prints median step times, the spread
(interquartile range) and ratios, plus the load average before and after, so
a run disturbed by other processes shows it. zinf runs without sharding
(stage 0, world size 1) by default, so the ratio to Inductor is the cost of
zinf's capture, passes and runtime hooks; ``--stage 3`` measures ZeRO-3 at
world 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import torch  # noqa: E402

import zinf_compiler as zinf  # noqa: E402
from zinf_compiler.lowering import deterministic_lowering  # noqa: E402
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stage", type=int, default=0, help="zinf's ZeRO stage (world size 1)")
    parser.add_argument("--interleave", choices=["step", "round"], default="step",
                        help="take turns every step (default) or every --steps steps")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, threads {torch.get_num_threads()}")
    print(f"load average before: {_loadavg()}")

    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M params, batch {args.batch_size}x{args.block_size}")
    batches = synthetic_batches(cfg, args.batch_size, args.steps)

    variants = {}
    eager_model = copy.deepcopy(base)
    variants["eager"] = (eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3, fused=True))
    inductor_model = copy.deepcopy(base)
    variants["inductor"] = (torch.compile(inductor_model),
                            torch.optim.AdamW(inductor_model.parameters(), lr=1e-3, fused=True))
    # Plain Inductor compiled as zinf compiles (torch's deterministic algorithms on while lowering, see
    # lowering.deterministic_lowering): what determinism alone costs, apart from zinf.
    deterministic_model = copy.deepcopy(base)
    variants["inductor (deterministic)"] = (torch.compile(deterministic_model),
                                            torch.optim.AdamW(deterministic_model.parameters(), lr=1e-3, fused=True))
    zinf_model = copy.deepcopy(base)
    variants[f"zinf (stage {args.stage})"] = (
        torch.compile(zinf_model, backend="zinf", options={"stage": args.stage, "lower": "inductor"}),
        zinf.optim.AdamW(zinf_model.parameters(), lr=1e-3),
    )

    def one_step(model, opt, idx, targets) -> float:
        started = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    def run_steps(model, opt) -> list[float]:
        return [one_step(model, opt, idx, targets) for idx, targets in batches]

    for name, (model, opt) in variants.items():
        started = time.perf_counter()
        with deterministic_lowering() if name == "inductor (deterministic)" else contextlib.nullcontext():
            run_steps(model, opt)  # compiles
        print(f"warm-up {name}: {time.perf_counter() - started:.1f}s (compile included)", flush=True)

    samples = {name: [] for name in variants}
    for round_index in range(args.rounds):
        if args.interleave == "round":
            for name, (model, opt) in variants.items():
                samples[name].extend(run_steps(model, opt))
        else:
            for idx, targets in batches:
                for name, (model, opt) in variants.items():
                    samples[name].append(one_step(model, opt, idx, targets))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    print(f"load average after: {_loadavg()}")

    medians = {name: statistics.median(times) * 1000 for name, times in samples.items()}
    print(f"\n{len(next(iter(samples.values())))} steps per variant, interleaved per {args.interleave}")
    print("| variant | median step (ms) | IQR (ms) | vs eager | vs inductor |\n|---|---|---|---|---|")
    for name, median in medians.items():
        quartiles = statistics.quantiles([t * 1000 for t in samples[name]], n=4, method="inclusive")
        print(f"| {name} | {median:.1f} | {quartiles[0]:.1f}-{quartiles[2]:.1f} | {median / medians['eager']:.3f} "
              f"| {median / medians['inductor']:.3f} |")
    return 0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3]) + " (1, 5, 15 min)"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
