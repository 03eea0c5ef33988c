"""The CUDA path against eager PyTorch on one GPU: equal losses and parameters, then speed and memory.

Part 1 (``check``): for each configuration (stages 0-3, tiers none/cpu/nvme, bf16
shards, tiling, activation offload and checkpointing, Inductor and eager
lowering) train a GPT on the GPU eagerly and under zinf on the same batches and
report the worst relative loss and parameter errors, next to what plain
``torch.compile`` (Inductor, no zinf) gives on the same model: zinf must be no
further from eager than Inductor itself is, beyond float rounding.  Each
configuration runs in a child process, so a crash (a segfault in a kernel)
fails one row, not the run.

Part 2 (``bench``): step time and peak device memory of a larger GPT under
eager, ``torch.compile`` and zinf stage 3 on each tier, as ratios to eager in
the same run.

    python benchmarks/gpu_check.py check [--jobs 4] [--only NAME,...]
    python benchmarks/gpu_check.py bench [--layers 8 --embd 1024]

Runs on the CUDA device (scripts/gpu_check.sh runs both on a GPU machine, with
zinf installed into a temporary folder); ``GPU_CHECK_DEVICE=cpu`` runs the same
checks on the CPU, which is how this script itself is tested where there is no GPU
(tests/integration/test_gpu_check_script.py).
First run on one H100 (torch 2.11) on 2026-11-26; figures in RESULTS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> zinf options (lower: inductor unless said); {"plan": budgets}: the options zinf.plan chooses under them.
CONFIGS: dict[str, dict] = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3-eager-lower": {"stage": 3, "lower": "eager"},
    "stage3-cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    "stage3-nvme": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
    "stage2-opt-cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "stage3-bf16": {"stage": 3, "param_dtype": "bf16"},
    "stage3-bf16-cpu": {"stage": 3, "param_dtype": "bf16", "offload_param": "cpu", "offload_optimizer": "cpu"},
    "stage3-tiled": {"stage": 3, "tile_threshold": 4096, "tile_factor": 2},
    "stage3-block-ckpt": {"stage": 3, "activation_checkpointing": "block"},
    "stage3-act-cpu": {"stage": 3, "offload_activations": "cpu", "activation_offload_min_bytes": 1024},
    "stage3-act-nvme": {"stage": 3, "offload_activations": "nvme", "activation_offload_min_bytes": 1024,
                        "offload_param": "nvme", "offload_optimizer": "nvme"},
    "stage3-noprefetch": {"stage": 3, "offload_param": "cpu", "prefetch_nc": 0, "prefetch_cg": 0, "prefetch_gg": 0},
    # The RAM cache over the NVMe tier: about a third of the states stay in RAM, the rest stream from disk.
    "stage3-nvme-cache": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "ram_cache_bytes": "2MiB"},
    # Budgets: zinf.plan chooses the options on the GPU (the model needs 16 MiB of device memory as it is).
    "budget-device": {"plan": {"device_memory": "12MiB"}},
    "budget-host": {"plan": {"host_memory": "auto"}},
    "inductor": None,  # plain torch.compile: the yardstick
}

ADAMW = dict(lr=1e-2, eps=1e-6)


def check_device() -> torch.device:
    # (Not ZINF_*: zinf reads every ZINF_<NAME> variable as an option and warns about the ones it does not know.)
    return torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_zinf():
    import zinf_compiler as zinf

    zinf.register()
    return zinf


def _train_pair(options: dict | None, cfg, steps: int, batch_size: int, nvme_path: str) -> dict:
    from zinf_compiler.gpt import GPT, synthetic_batches

    zinf = _load_zinf()
    device = check_device()
    torch.manual_seed(0)
    eager_model = GPT(cfg).to(device)
    model = copy.deepcopy(eager_model)
    if options is None:
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    else:
        options = dict(options)
        if "plan" in options:  # the model as it will train (on the GPU) and its first batch
            first = next(iter(synthetic_batches(cfg, batch_size, 1)))
            options = zinf.plan(model, tuple(t.to(device) for t in first),
                                dict(options.pop("plan"), nvme_path=nvme_path)).compile_options()
        if "nvme" in (options.get("offload_param"), options.get("offload_optimizer"),
                      options.get("offload_activations")):
            options["nvme_path"] = nvme_path
        compiled = torch.compile(model, backend="zinf", options=options)
        opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), fused=True, **ADAMW)
    eager_losses, losses = [], []
    _reset_peak(device)
    for idx, targets in synthetic_batches(cfg, batch_size, steps):
        idx, targets = idx.to(device), targets.to(device)
        loss = eager_model(idx, targets)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_losses.append(loss.item())
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = zinf.full_state_dict(compiled) if options is not None else dict(model.named_parameters())
    param_errors = {}
    for name, expected in eager_model.named_parameters():
        actual = state[name].detach().to(device=device, dtype=expected.dtype)
        param_errors[name] = float((expected.detach() - actual).abs().max()
                                   / expected.detach().abs().max().clamp_min(1e-12))
    worst = max(param_errors, key=param_errors.get)
    return {"eager_losses": eager_losses, "losses": losses,
            "loss_error": max(abs(a - b) / abs(a) for a, b in zip(eager_losses, losses)),
            "param_error": param_errors[worst], "worst_param": worst,
            "all_finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
            "options": {k: v for k, v in (options or {}).items() if k != "nvme_path"},
            "report": zinf.memory_report(compiled) if options is not None else None}


def run_one(name: str, out_path: str) -> None:
    from zinf_compiler.gpt import GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64, frozen_scale=True)
    with tempfile.TemporaryDirectory(prefix="zinf_gpu_") as nvme_path:
        started = time.perf_counter()
        try:
            result = _train_pair(CONFIGS[name], cfg, steps=5, batch_size=8, nvme_path=nvme_path)
            result["ok"] = True
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - started
    with open(out_path, "w") as out:
        json.dump(result, out, default=str)


def check(args) -> int:
    names = args.only.split(",") if args.only else list(CONFIGS)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    results: dict[str, dict] = {}

    def launch(name: str) -> tuple[str, dict]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out_path = handle.name
        done = subprocess.run([sys.executable, __file__, "one", name, out_path], capture_output=True, text=True,
                              env=env, timeout=args.timeout)
        try:
            with open(out_path) as handle:
                result = json.load(handle)
        except (OSError, ValueError):
            result = {"ok": False, "error": f"child exited {done.returncode} without a result"}
        result["log"] = (done.stdout + done.stderr)[-6000:]
        result["returncode"] = done.returncode
        return name, result

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for name, result in pool.map(launch, names):
            results[name] = result
            status = "ok" if result.get("ok") else "FAILED"
            print(f"{name:22s} {status:7s} "
                  + (f"loss err {result['loss_error']:.2e}  param err {result['param_error']:.2e} "
                     f"({result['worst_param']})  {result['seconds']:.0f} s" if result.get("ok") else
                     result.get("error", "").strip().splitlines()[-1:].__str__()), flush=True)
            if result.get("ok") and "plan" in (CONFIGS[name] or {}):
                print(f"{'':22s} chosen: {result['options']}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1, default=str)
    for name, result in results.items():
        if not result.get("ok"):
            print(f"\n===== {name} (exit {result['returncode']}) =====\n{result.get('error', '')}\n"
                  f"{result['log'][-3000:]}")
    return 0 if all(result.get("ok") for result in results.values()) else 1


def bench(args) -> int:
    from zinf_compiler.gpt import GPT, GPTConfig

    from zinf_compiler.plan_cli import probe_rates

    zinf = _load_zinf()
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block)
    device = check_device()
    rows = []
    variants = [("eager", None), ("torch.compile", "inductor"), ("zinf stage3", {"stage": 3}),
                ("zinf stage3 cpu", {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}),
                ("zinf stage3 nvme", {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"}),
                # the optimizer stepped after backward, not during it (overlap_optimizer's gain on a GPU)
                ("zinf nvme late", {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                    "overlap_optimizer": False})]
    with tempfile.TemporaryDirectory(prefix="zinf_gpu_bench_") as nvme_path:
        # zinf.plan's prediction of each zinf row at this machine's probed rates, beside what it measures.
        profile = probe_rates(nvme_path, torch.float32, 1, device)
        print("rates: " + "; ".join(profile.describe()), flush=True)
        for label, options in variants:
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device)
            targets = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), device=device)
            predicted = None
            params = sum(p.numel() for p in model.parameters())
            if options is None:
                compiled, opt = model, torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
            elif options == "inductor":
                compiled, opt = torch.compile(model), torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
            else:
                options = dict(options, nvme_path=nvme_path) if "nvme" in options.values() else options
                predicted = zinf.plan(model, (idx, targets), options, profile=profile)
                compiled = torch.compile(model, backend="zinf", options=options)
                opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
            times = []
            try:
                _reset_peak(device)
                for step in range(args.warmup + args.steps):
                    _sync(device)
                    started = time.perf_counter()
                    loss = compiled(idx, targets)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    _sync(device)
                    if step >= args.warmup:
                        times.append(time.perf_counter() - started)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                rows.append({"variant": label, "params": params, "step_s": statistics.median(times),
                             "peak_device_bytes": peak, "loss": loss.item()})
                if predicted is not None:
                    rows[-1].update(predicted_step_s=predicted.step["predicted"], predicted_parts=predicted.step,
                                    predicted_device_bytes=predicted.tier_total("device"))
            except Exception:
                rows.append({"variant": label, "error": traceback.format_exc()})
            print(json.dumps(rows[-1])[:3000], flush=True)
            del compiled, opt, model
    base = next((row for row in rows if row["variant"] == "eager" and "step_s" in row), None)
    print(f"\nGPT {args.layers}x{args.embd}, batch {args.batch}x{args.block}, median of {args.steps} steps")
    print(f"{'variant':18s} {'step s':>8s} {'vs eager':>9s} {'peak GiB':>9s} {'vs eager':>9s} "
          f"{'plan: step s':>13s} {'device GiB':>11s}")
    for row in rows:
        if "step_s" not in row:
            print(f"{row['variant']:18s} FAILED")
            continue
        peak_ratio = row["peak_device_bytes"] / base["peak_device_bytes"] if base["peak_device_bytes"] else 0.0
        planned = (f"{row['predicted_step_s']:13.4f} {row['predicted_device_bytes'] / 2**30:11.3f}"
                   if "predicted_step_s" in row else "")
        print(f"{row['variant']:18s} {row['step_s']:8.4f} {row['step_s'] / base['step_s']:8.2f}x "
              f"{row['peak_device_bytes'] / 2**30:9.3f} {peak_ratio:8.2f}x {planned}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0 if all("step_s" in row for row in rows) else 1


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "one":
        run_one(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check_parser = sub.add_parser("check")
    check_parser.add_argument("--jobs", type=int, default=4)
    check_parser.add_argument("--only", default="")
    check_parser.add_argument("--timeout", type=int, default=400)
    check_parser.add_argument("--json", default="")
    bench_parser = sub.add_parser("bench")
    bench_parser.add_argument("--layers", type=int, default=8)
    bench_parser.add_argument("--heads", type=int, default=16)
    bench_parser.add_argument("--embd", type=int, default=1024)
    bench_parser.add_argument("--block", type=int, default=512)
    bench_parser.add_argument("--batch", type=int, default=8)
    bench_parser.add_argument("--warmup", type=int, default=3)
    bench_parser.add_argument("--steps", type=int, default=5)
    bench_parser.add_argument("--json", default="")
    args = parser.parse_args()
    if check_device().type == "cuda" and not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (GPU_CHECK_DEVICE=cpu runs it on the CPU)", file=sys.stderr)
        return 2
    return check(args) if args.command == "check" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
