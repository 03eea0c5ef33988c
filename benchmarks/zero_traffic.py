"""ZeRO traffic per step (bytes per collective vs theory) and step time vs PyTorch FSDP2 and DDP.

    python benchmarks/zero_traffic.py [--world-size 2 --steps 4 --rounds 3]

Launches ``--world-size`` gloo ranks on localhost (one process each). Every
variant trains the same GPT on the same per-rank batches:
zinf at stages 1, 2, 3 (allgather) and stage 3 with partition="broadcast",
FSDP2 (``fully_shard`` per block and at the root, eager) and DDP.
Traffic comes from zinf's runtime counters (``runtime/comm.py``): each
collective counts the full tensor it moves, the unit of ZeRO's theory
(stages 1/2: reduce-scatter of gradients + all-gather of parameters = 2x
parameter bytes; stage 3: two all-gathers + one reduce-scatter = 3x).
Step times are medians over interleaved rounds, as ratios to FSDP2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ZINF_VARIANTS = [
    ("zinf stage 1", {"stage": 1, "partition": "allgather"}),
    ("zinf stage 2", {"stage": 2, "partition": "allgather"}),
    ("zinf stage 3", {"stage": 3, "partition": "allgather"}),
    ("zinf stage 3 broadcast", {"stage": 3, "partition": "broadcast"}),
]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lower", choices=["eager", "inductor"], default="eager")
    return parser.parse_args()


def _worker(args: argparse.Namespace, out_path: str) -> None:
    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
    from zinf_compiler.runtime.comm import COMM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    batches = [(idx[mine], tgt[mine]) for idx, tgt in synthetic_batches(cfg, args.batch_size * world, args.steps, seed=1)]

    variants = {}
    for name, options in ZINF_VARIANTS:
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="zinf", options={**options, "lower": args.lower})
        variants[name] = (compiled, zinf.optim.AdamW(model.parameters(), lr=1e-3), True)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fsdp_model = copy.deepcopy(base)
        mesh = init_device_mesh("cpu", (world,))
        for block in fsdp_model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp_model, mesh=mesh)
        variants["FSDP2 (fully_shard, eager)"] = (fsdp_model, torch.optim.AdamW(fsdp_model.parameters(), lr=1e-3), False)
        fsdp_error = None
    except Exception as err:  # report, don't hide: the table says why FSDP2 is missing
        fsdp_error = f"{type(err).__name__}: {err}"
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    variants["DDP (eager)"] = (ddp_model, torch.optim.AdamW(ddp_model.parameters(), lr=1e-3), False)

    def run_steps(model, opt) -> list[float]:
        times = []
        for idx, targets in batches:
            dist.barrier()
            started = time.perf_counter()
            loss = model(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - started)
        return times

    errors = {}
    for name, (model, opt, _) in list(variants.items()):
        try:
            run_steps(model, opt)  # warm-up: compiles
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {str(err)[:300]}"
            del variants[name]
    traffic, samples = {}, {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, (model, opt, is_zinf) in variants.items():
            COMM.reset_traffic()
            samples[name].extend(run_steps(model, opt))
            if is_zinf and round_index == 0:
                traffic[name] = {kind: count / args.steps for kind, count in COMM.traffic_bytes.items()}
    result = {"param_bytes": param_bytes, "traffic": traffic, "fsdp_error": fsdp_error, "errors": errors,
              "median_ms": {name: statistics.median(times) * 1000 for name, times in samples.items()}}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)
    dist.destroy_process_group()


def _launch(args: argparse.Namespace) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "result.json")
        procs = []
        for rank in range(args.world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), ZEROBENCH_OUT=out_path, OMP_NUM_THREADS="1", TMPDIR=folder)
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
        codes = [proc.wait() for proc in procs]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        with open(out_path) as handle:
            return json.load(handle)


def main() -> int:
    args = _parse()
    if "ZEROBENCH_OUT" in os.environ:
        _worker(args, os.environ["ZEROBENCH_OUT"])
        return 0
    print("command: python " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, world size {args.world_size} (gloo, localhost), lower={args.lower}")
    result = _launch(args)
    param_bytes = result["param_bytes"]
    print(f"parameter bytes P = {param_bytes:,} (fp32, tied weights once)\n")
    print("| variant | all_gather | reduce_scatter | broadcast | reduce | total / step | theory | total / P |")
    print("|---|---|---|---|---|---|---|---|")
    for name, options in ZINF_VARIANTS:
        per_kind = result["traffic"].get(name)
        if per_kind is None:
            print(f"| {name} | failed: {result['errors'].get(name)} |")
            continue
        total = sum(per_kind.values())
        theory = 3 if options["stage"] == 3 else 2
        cells = " | ".join(f"{per_kind.get(kind, 0):,.0f}" for kind in ("all_gather", "reduce_scatter", "broadcast", "reduce"))
        print(f"| {name} | {cells} | {total:,.0f} | {theory}P = {theory * param_bytes:,} | {total / param_bytes:.3f} |")
    medians = result["median_ms"]
    baseline = "FSDP2 (fully_shard, eager)"
    if result["fsdp_error"]:
        print(f"\nFSDP2 could not run here: {result['fsdp_error']}")
        baseline = "DDP (eager)"
    for name, error in result["errors"].items():
        print(f"\n{name} failed: {error}")
    print(f"\n| variant | median step (ms) | vs {baseline} |\n|---|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {median:.1f} | {median / medians[baseline]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
