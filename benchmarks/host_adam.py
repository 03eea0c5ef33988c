"""zinf's host AdamW against DeepSpeed's cpu_adam: parameters per second with the same threads, in one run.

    python benchmarks/host_adam.py [--params 64M --threads 1,2 --rounds 5]    (DeepSpeed: scripts/install_bench.sh)

zinf steps host-resident optimizer state with torch's fused CPU AdamW kernel: the cpu tier's optimizer
(``runtime/optim/step.make_inner``: ``torch.optim.AdamW(fused=True)`` over the fp32 masters) and the NVMe
tier's sub-group step (``runtime/optim/nvme_adam.adam_kernel``, also what the early step runs).  This script times that
kernel over ``--params`` fp32 elements (a list of 16M-element tensors, the NVMe tier's sub-group size) beside
``DeepSpeedCPUAdam`` (AdamW mode, its own AVX/OpenMP kernel) on equal copies of the same state and gradients,
taking turns for ``--rounds`` steps each.  Each thread count runs in a process of its own with
``OMP_NUM_THREADS`` set (torch and DeepSpeed's extension each bring their own OpenMP runtime).

It also checks what zinf promises of its own step: the cpu tier's optimizer and the NVMe tier's sub-group step
give bit-equal masters and moments (so a state moved between tiers steps the same), and DeepSpeed's result is
within float rounding of zinf's (its kernel orders the arithmetic differently).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCH_SITE = REPO / ".bench" / "site"
TORCH_EXTENSIONS = REPO / ".bench" / "torch_extensions"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PIECE = 16 << 20  # elements per tensor: the NVMe tier's sub-group (runtime/swap_layout.SUB_GROUP_NUMEL)


def parse_count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def one(numel: int, rounds: int) -> dict:
    """In a process with OMP_NUM_THREADS set: both kernels' steps per second and the bit checks."""
    import torch

    from zinf_compiler.runtime.optim.nvme_adam import adam_kernel

    threads = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    sizes = [min(PIECE, numel - start) for start in range(0, numel, PIECE)]
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(size, generator=generator) for size in sizes]
    grads = [[torch.randn(size, generator=generator) * 1e-2 for size in sizes] for _ in range(2)]

    # zinf's cpu tier: the inner torch optimizer over the masters, as runtime/optim/step.make_inner builds it.
    masters = [torch.nn.Parameter(t.clone()) for t in initial]
    inner = torch.optim.AdamW(masters, fused=True, **HYPER)

    def zinf_step(step: int) -> None:
        for master, grad in zip(masters, grads[step % 2]):
            master.grad = grad
        inner.step()

    # zinf's NVMe tier (and early step): the sub-group kernel, state in plain tensors.
    sub_masters = [t.clone() for t in initial]
    sub_moments = [(torch.zeros_like(t), torch.zeros_like(t)) for t in initial]
    beta1, beta2 = HYPER["betas"]

    def nvme_step(step: int) -> None:
        for master, grad, (exp_avg, exp_avg_sq) in zip(sub_masters, grads[step % 2], sub_moments):
            adam_kernel(True, master, grad, exp_avg, exp_avg_sq, step + 1, lr=HYPER["lr"], beta1=beta1,
                        beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])

    result = {"threads": threads, "params": numel}
    ds_step = None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_params = [torch.nn.Parameter(t.clone()) for t in initial]
        ds = DeepSpeedCPUAdam(ds_params, adamw_mode=True, **HYPER)

        def ds_step(step: int) -> None:
            for param, grad in zip(ds_params, grads[step % 2]):
                param.grad = grad
            ds.step()
    except Exception as err:  # not installed, or its op does not build here
        result["deepspeed"] = f"not run: {type(err).__name__}: {err}"

    systems = {"zinf cpu tier (torch.optim.AdamW fused)": zinf_step, "zinf nvme sub-group kernel": nvme_step}
    if ds_step is not None:
        systems["DeepSpeed cpu_adam"] = ds_step
    seconds = {name: [] for name in systems}
    for step in range(rounds + 1):  # the first step of each touches fresh state memory: not timed
        for name, fn in systems.items():
            started = time.perf_counter()
            fn(step)
            if step:
                seconds[name].append(time.perf_counter() - started)
    result["params_per_s"] = {name: numel / statistics.median(times) for name, times in seconds.items()}
    # Bit-equal: the cpu tier's step and the NVMe tier's kernel, after the same steps.
    state = inner.state[masters[0]]
    result["cpu_tier_equals_nvme_kernel"] = all(
        torch.equal(master.detach(), sub) for master, sub in zip(masters, sub_masters)) and all(
        torch.equal(inner.state[m]["exp_avg"], a) and torch.equal(inner.state[m]["exp_avg_sq"], b)
        for m, (a, b) in zip(masters, sub_moments))
    del state
    if ds_step is not None:
        scale = max(float(m.detach().abs().max()) for m in masters)
        result["deepspeed_max_relative_difference"] = max(
            float((m.detach() - p.detach()).abs().max()) for m, p in zip(masters, ds_params)) / scale
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="64M")
    parser.add_argument("--threads", default="", help="comma-separated (default: 1 and every core)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    numel = parse_count(args.params)
    if args.one:
        print(json.dumps(one(numel, args.rounds)))
        return 0
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    print(f"command: python benchmarks/host_adam.py {' '.join(sys.argv[1:])}")
    rows = []
    for count in threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(count), DS_ACCELERATOR="cpu",
                   TORCH_EXTENSIONS_DIR=str(TORCH_EXTENSIONS),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH_SITE), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, __file__, "--one", "--params", args.params, "--rounds",
                               str(args.rounds)], capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            print(done.stdout[-2000:] + done.stderr[-3000:])
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{numel / 1e6:.0f}M fp32 parameters in {PIECE >> 20}M-element tensors, median of {args.rounds} steps")
    print("| threads | system | M params/s | vs DeepSpeed |\n|---|---|---|---|")
    for row in rows:
        rates = row["params_per_s"]
        ds = rates.get("DeepSpeed cpu_adam")
        for name, rate in rates.items():
            print(f"| {row['threads']} | {name} | {rate / 1e6:.0f} | {rate / ds:.2f}x |" if ds else
                  f"| {row['threads']} | {name} | {rate / 1e6:.0f} | |")
        print(f"threads {row['threads']}: cpu tier bit-equal to the NVMe sub-group kernel: "
              f"{row['cpu_tier_equals_nvme_kernel']}; DeepSpeed's masters within "
              f"{row.get('deepspeed_max_relative_difference', float('nan')):.1e} of zinf's"
              + (f"; {row['deepspeed']}" if "deepspeed" in row else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(row["cpu_tier_equals_nvme_kernel"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
