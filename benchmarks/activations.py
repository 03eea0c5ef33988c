"""Saved-activation memory and step time per checkpointing policy and activation tier (issue 16).

    python benchmarks/activations.py [--layers 8 --seq 1024 --width 128 --batch 4 --steps 4 --rounds 2]

Trains the example GPT (stage 3, lower="eager", zinf AdamW) at a long
sequence under each variant, each in its own process (so peak RSS is its
own), variants interleaved over ``--rounds``:

* none: no checkpointing, everything saved on the device;
* block: recompute inside each block, save block inputs;
* block+cpu, block+nvme: the same, saved values offloaded;
* recompute@B: ``auto`` at budget B (PyTorch's knapsack, recompute only);
* offload@B: no checkpointing, saved values offloaded to NVMe largest first
  until what stays fits B (``auto`` with every choice forced to offload);
* auto@B: ``auto`` with NVMe offload, each tensor recomputed or offloaded as
  the cost model says.

B is ``--budget`` (a fraction of the bytes eager autograd saves).  Reported
per variant: saved-activation bytes on the device and offloaded (the
runtime's ledger, ``memory_report`` between forward and backward), peak RSS,
median step time and its ratio to ``block``.  Losses are checked equal
(1e-5) across variants before any time is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def variants(budget: float) -> dict[str, dict]:
    return {
        "none": {},
        "block": {"activation_checkpointing": "block"},
        "block+cpu": {"activation_checkpointing": "block", "offload_activations": "cpu"},
        "block+nvme": {"activation_checkpointing": "block", "offload_activations": "nvme"},
        f"recompute@{budget}": {"activation_checkpointing": "auto", "activation_memory_budget": budget},
        f"offload@{budget}": {"activation_checkpointing": "auto", "activation_memory_budget": budget,
                              "offload_activations": "nvme", "_force": "offload"},
        f"auto@{budget}": {"activation_checkpointing": "auto", "activation_memory_budget": budget,
                           "offload_activations": "nvme"},
    }


def child(args) -> None:
    sys.path.insert(0, ROOT)
    import torch

    import zinf_compiler as zinf
    from zinf_compiler import recompute
    from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches

    options = json.loads(args.options)
    force = options.pop("_force", None)
    if force == "offload":
        # offload-all at the budget: the per-tensor choice with recomputing priced out.
        original = recompute.choose_per_tensor

        def offload_only(saved, budget_bytes, cost_model, tier, min_bytes, forward_seconds=0.0):
            class _Never:
                profile = cost_model.profile

                def node_seconds(self, node):
                    return float("inf")

                def transfer_seconds(self, step, nbytes):
                    return cost_model.transfer_seconds(step, nbytes)

            return original(saved, budget_bytes, _Never(), tier, min_bytes, forward_seconds)

        recompute.choose_per_tensor = offload_only
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    model = GPT(cfg)
    options = {"stage": 3, "lower": "eager", **options}
    if options.get("offload_activations") == "nvme":
        options["nvme_path"] = args.nvme
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times, saved = [], [], None
    for step, (idx, targets) in enumerate(synthetic_batches(cfg, args.batch, args.steps + 1)):
        started = time.perf_counter()
        loss = compiled(idx, targets)
        if step == args.steps:  # the ledger between forward and backward, off the clock
            report = zinf.memory_report(compiled)
            saved = {tier: report[tier]["activations"] for tier in ("device", "cpu", "nvme")}
            started = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step > 0:
            times.append(time.perf_counter() - started)
        losses.append(loss.item())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"losses": losses, "times": times, "saved": saved, "peak_rss": rss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--variants", default=None,
                        help="comma-separated names to run (default: all), e.g. block,recompute@0.2,auto@0.3")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--nvme", default=None, help="folder for NVMe offload (default: a temporary folder here)")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    nvme = args.nvme or tempfile.mkdtemp(prefix="zinf-act-bench-", dir=ROOT)
    results: dict[str, list] = {}
    table = variants(args.budget)
    if args.variants:
        # Names as the table prints them; a budgeted one may name another budget (recompute@0.2).
        for name in args.variants.split(","):
            if name not in table and "@" in name:
                table.update(variants(float(name.split("@")[1])))
        table = {name: table[name] for name in args.variants.split(",")}
    for round_index in range(args.rounds):
        for name, options in table.items():
            command = [sys.executable, __file__, "--child", "--options", json.dumps(options), "--nvme", nvme,
                       "--layers", str(args.layers), "--seq", str(args.seq), "--width", str(args.width),
                       "--batch", str(args.batch), "--steps", str(args.steps)]
            print(f"round {round_index + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
            if done.returncode != 0:
                results.setdefault(name, []).append({"error": done.stderr[-2000:]})
                continue
            results.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    reference_name = "none" if "none" in results else next(iter(results))
    reference = next(run for run in results[reference_name] if "error" not in run)["losses"]
    for name, runs in results.items():
        for run in runs:
            if "error" in run:
                print(f"{name}: FAILED\n{run['error']}")
                continue
            worst = max(abs(a - b) / abs(a) for a, b in zip(reference, run["losses"]))
            if worst > 1e-5:
                raise SystemExit(f"{name}: losses differ from {reference_name!r} by {worst:.2e}; "
                                 "no speed figures printed")
    print(f"losses of every variant equal {reference_name!r}'s within 1e-5: {[round(x, 5) for x in reference]}")
    print(f"GPT {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}; stage 3, eager "
          f"lowering; {args.rounds} rounds x {args.steps} steps; budget {args.budget}")
    header = f"{'variant':<16} {'device act MiB':>14} {'cpu act MiB':>11} {'nvme act MiB':>12} {'peak RSS MiB':>12} " \
             f"{'step ms':>8} {'vs block':>8}"
    print(header)
    medians = {name: statistics.median(t for run in runs if "error" not in run for t in run["times"])
               for name, runs in results.items() if any("error" not in run for run in runs)}
    for name, runs in results.items():
        good = [run for run in runs if "error" not in run]
        if not good:
            continue
        saved = good[-1]["saved"]
        rss = max(run["peak_rss"] for run in good)
        print(f"{name:<16} {saved['device'] / 2**20:>14.1f} {saved['cpu'] / 2**20:>11.1f} "
              f"{saved['nvme'] / 2**20:>12.1f} {rss / 2**20:>12.0f} {medians[name] * 1e3:>8.0f} "
              f"{medians[name] / medians.get('block', next(iter(medians.values()))):>8.2f}")
    if not args.nvme:
        import shutil

        shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
