"""ZeRO traffic per step (bytes per collective vs theory) and step time vs PyTorch FSDP2 and DDP.

    python benchmarks/zero_traffic.py [--world-size 2 --steps 5 --rounds 4]

Launches ``--world-size`` gloo ranks on localhost (one process each, like
``tests/support/multirank.py``). Every variant trains the same GPT (same initial
weights, same per-rank batches, AdamW lr 1e-3) in the same run:

* zinf at stages 1, 2, 3 with ``partition="allgather"`` (default buckets: one
  collective per transformer block), stage 3 with ``bucket_bytes=0`` (one
  collective per parameter, as before buckets), stage 3 with
  ``partition="broadcast"`` (the paper's baseline), and stage 0 (plain data
  parallel: one all-reduce per gradient) for reference;
* PyTorch FSDP2: ``fully_shard`` on every transformer block and on the root,
  eager (no ``torch.compile``), ``torch.optim.AdamW``;
* PyTorch DDP, eager, with the stock ``allreduce_hook`` registered so that its
  all-reduces go through Python and can be counted.

Traffic, two independent counts on rank 0 per measured step:

* zinf's own counters (``RUNTIME.comm.traffic_bytes``, ``runtime/comm.py``): each
  collective counts the full tensor it moves (all-gather: its output,
  reduce-scatter: its input, all-reduce: twice its size, broadcast and reduce:
  its size), the unit of ZeRO's theory: stages 1/2 move 2P (reduce-scatter of
  gradients + all-gather of updated parameters), stage 3 moves 3P (all-gather
  in forward, again in backward, reduce-scatter of gradients);
* a wrapper around the ``torch.distributed`` collectives themselves, counting
  by the same rule (the "wire" column): it checks zinf's counters and measures
  FSDP2 and DDP.

Deviations from 2P/3P are decomposed per parameter (each zinf gather and
gradient reduction is counted per parameter) and printed as notes: padding to
a multiple of the world size, frozen parameters (no gradient to reduce), and
parameters that stage 3's backward never reads (gathered once, not twice).

Step time: forward + backward + optimizer step + zero_grad, on rank 0 after
a barrier; variants interleaved in rounds; medians; ratios to FSDP2.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

ZINF_VARIANTS = [
    ("zinf stage 0", {"stage": 0}),
    ("zinf stage 1", {"stage": 1, "partition": "allgather"}),
    ("zinf stage 2", {"stage": 2, "partition": "allgather"}),
    ("zinf stage 3", {"stage": 3, "partition": "allgather"}),
    ("zinf stage 3 unbucketed", {"stage": 3, "partition": "allgather", "bucket_bytes": 0}),
    ("zinf stage 3 broadcast", {"stage": 3, "partition": "broadcast"}),
    # The ranks' fingerprint exchange before each compiled call (runtime/agreement.py) left out: its cost.
    ("zinf stage 3 agree at compile only", {"stage": 3, "partition": "allgather", "rank_agreement": "compile"}),
]
# With --hsdp R: zinf on the 2-D mesh (R replicas x world/R shards) against FSDP2 on the same mesh.
HSDP_VARIANTS = [(f"zinf stage {stage} HSDP", {"stage": stage, "partition": "allgather"}) for stage in (1, 2, 3)]
FSDP2 = "FSDP2 (fully_shard, eager)"
DDP = "DDP (eager)"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce")
# zinf's control traffic, not ZeRO's: the ranks' fingerprints before each compiled call (an all-gather,
# runtime/agreement.py) and rank 0's buffers (a broadcast, option broadcast_buffers). On the wire, not in theory.
CONTROL_KINDS = ("agreement", "buffers")
THEORY = {0: 2, 1: 2, 2: 2, 3: 3}  # x parameter bytes per step

# Counted by the wrappers around torch.distributed (installed in each rank).
WIRE_BYTES: collections.Counter = collections.Counter()
WIRE_CALLS: collections.Counter = collections.Counter()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per variant per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps per variant before measuring (compiles)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lower", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--frozen-scale", action="store_true",
                        help="add the GPT's frozen parameter (embed_scale, requires_grad=False)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds before the ranks are killed")
    parser.add_argument("--hsdp", type=int, default=0, metavar="R",
                        help="HSDP instead: a 2-D mesh of R replicas x world/R shards for zinf (option mesh, "
                             "stages 1-3) and FSDP2 (fully_shard on the same mesh); DDP as before")
    return parser.parse_args()


# --- counting at the torch.distributed level ----------------------------------------


def _install_wire_counters() -> None:
    """Wrap the collectives zinf, FSDP2 and DDP's Python hook call (``torch.distributed.X``)."""

    def tensor_arg(position: int, keyword: str):
        return lambda args, kwargs: args[position] if len(args) > position else kwargs[keyword]

    rules = {
        "all_gather_into_tensor": ("all_gather", tensor_arg(0, "output_tensor"), 1),
        "all_gather_single": ("all_gather", tensor_arg(0, "output_tensor"), 1),
        "reduce_scatter_tensor": ("reduce_scatter", tensor_arg(1, "input"), 1),
        "reduce_scatter_single": ("reduce_scatter", tensor_arg(1, "input"), 1),
        "all_reduce": ("all_reduce", tensor_arg(0, "tensor"), 2),
        "broadcast": ("broadcast", tensor_arg(0, "tensor"), 1),
        "reduce": ("reduce", tensor_arg(0, "tensor"), 1),
    }
    for name, (kind, pick, factor) in rules.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args, _original=original, _kind=kind, _pick=pick, _factor=factor, **kwargs):
            tensor = _pick(args, kwargs)
            WIRE_BYTES[_kind] += _factor * tensor.numel() * tensor.element_size()
            WIRE_CALLS[_kind] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, functools.wraps(original)(wrapper))


# --- one rank ------------------------------------------------------------------------


def _worker(args: argparse.Namespace, out_path: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # c10d's deprecation notice on every call
    _install_wire_counters()
    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
    from zinf_compiler.api import RUNTIME

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    # Per-parameter counts of zinf's gathers and gradient reductions (wrapping
    # the store's entry points on this process's instance; zinf is unchanged).
    uid_gathers: collections.Counter = collections.Counter()
    uid_reduces: collections.Counter = collections.Counter()
    store_gather, store_reduce = RUNTIME.store.gather_start, RUNTIME.store.reduce_grad_start

    def counted_gather(unit, *a, **k):
        for piece in unit.pieces:
            uid_gathers[piece.layout.uid] += 1
        return store_gather(unit, *a, **k)

    def counted_reduce(unit, *a, **k):
        for piece in unit.pieces:
            uid_reduces[piece.layout.uid] += 1
        return store_reduce(unit, *a, **k)

    RUNTIME.store.gather_start, RUNTIME.store.reduce_grad_start = counted_gather, counted_reduce

    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, frozen_scale=args.frozen_scale)
    torch.manual_seed(0)
    base = GPT(cfg)
    params = dict(base.named_parameters())  # tied weights appear once
    param_info = {name: {"numel": p.numel(), "bytes": p.numel() * p.element_size(), "trainable": p.requires_grad,
                         "shape": list(p.shape)} for name, p in params.items()}
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    batches = [(idx[mine], tgt[mine])
               for idx, tgt in synthetic_batches(cfg, args.batch_size * world, max(args.steps, args.warmup), seed=1)]

    variants = {}  # name -> dict(model, opt, module, zinf options)
    errors = {}
    from torch.distributed.device_mesh import init_device_mesh

    if args.hsdp:
        mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
        zinf_variants = HSDP_VARIANTS
    else:
        mesh = init_device_mesh("cpu", (world,))
        zinf_variants = ZINF_VARIANTS
    for name, options in zinf_variants:
        if args.hsdp:
            options = {**options, "mesh": mesh}
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="zinf", options={**options, "lower": args.lower})
        variants[name] = {"model": compiled, "module": model, "options": options,
                          "opt": zinf.optim.AdamW(model.parameters(), lr=1e-3)}
    fsdp_error = None
    try:
        from torch.distributed.fsdp import fully_shard

        fsdp_model = copy.deepcopy(base)
        for block in fsdp_model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp_model, mesh=mesh)
        variants[FSDP2] = {"model": fsdp_model, "module": fsdp_model, "options": None,
                           "opt": torch.optim.AdamW(fsdp_model.parameters(), lr=1e-3)}
    except Exception as err:  # reported in the output, zinf figures still printed
        fsdp_error = f"{type(err).__name__}: {err}"
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ddp_model.register_comm_hook(None, allreduce_hook)  # same math as DDP's built-in, but through dist.all_reduce
    variants[DDP] = {"model": ddp_model, "module": ddp_model.module, "options": None,
                     "opt": torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)}

    def one_step(variant, idx, targets) -> tuple[float, float]:
        dist.barrier()
        started = time.perf_counter()
        loss = variant["model"](idx, targets)
        loss.backward()
        variant["opt"].step()
        variant["opt"].zero_grad()
        return time.perf_counter() - started, loss.item()

    # Warm-up: compiles, adopts (shards) parameters, creates optimizer state.
    for name, variant in list(variants.items()):
        try:
            for idx, targets in batches[: args.warmup]:
                one_step(variant, idx, targets)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {str(err)[:500]}"
            del variants[name]
            dist.barrier()  # the other ranks failed too (same code path), or will wait here

    stats = {name: {"times": [], "losses": [], "comm": [], "comm_calls": collections.Counter(), "wire": [],
                    "wire_calls": collections.Counter(), "gathers": collections.Counter(),
                    "reduces": collections.Counter()} for name in variants}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            record = stats[name]
            for idx, targets in batches[: args.steps]:
                RUNTIME.comm.reset_traffic()
                WIRE_BYTES.clear()
                WIRE_CALLS.clear()
                uid_gathers.clear()
                uid_reduces.clear()
                seconds, loss = one_step(variant, idx, targets)
                record["times"].append(seconds)
                record["losses"].append(loss)
                record["comm"].append(dict(RUNTIME.comm.traffic_bytes))
                record["comm_calls"].update(RUNTIME.comm.calls)
                record["wire"].append(dict(WIRE_BYTES))
                record["wire_calls"].update(WIRE_CALLS)
                record["gathers"].update(uid_gathers)
                record["reduces"].update(uid_reduces)

    measured = args.rounds * args.steps
    result = {"rank": rank, "world": world, "param_info": param_info, "fsdp_error": fsdp_error, "errors": errors,
              "measured_steps": measured, "variants": {},
              "load": ", ".join(f"{value:.1f}" for value in os.getloadavg())}
    for name, record in stats.items():
        variant = variants[name]
        entry = {
            "times_ms": [seconds * 1000 for seconds in record["times"]],
            "losses": record["losses"],
            "comm": record["comm"],
            "comm_calls": {k: v / measured for k, v in record["comm_calls"].items()},
            "wire": record["wire"],
            "wire_calls": {k: v / measured for k, v in record["wire_calls"].items()},
        }
        if variant["options"] is not None:
            per_param = {}
            for pname, param in variant["module"].named_parameters():
                store_record = RUNTIME.store.lookup(param)
                if store_record is None:
                    continue
                per_param[pname] = {
                    "gathers": record["gathers"][store_record.uid] / measured,
                    "reduces": record["reduces"][store_record.uid] / measured,
                    "gathered_bytes": store_record.gathered_numel * store_record.compute_dtype.itemsize,
                    "bytes": store_record.numel * store_record.compute_dtype.itemsize,
                }
            entry["per_param"] = per_param
        result["variants"][name] = entry
    with open(f"{out_path}.rank{rank}", "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


# --- launcher ------------------------------------------------------------------------


def _launch(args: argparse.Namespace) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "result.json")
        procs = []
        for rank in range(args.world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZEROBENCH_OUT=out_path,
                       OMP_NUM_THREADS="1", TMPDIR=folder)
            log = open(os.path.join(folder, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env,
                                           stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    if other.poll() is None:
                        other.kill()
                codes.append("timeout")
            log.close()
        if any(code != 0 for code in codes):
            for rank, code in enumerate(codes):
                if code != 0:
                    with open(os.path.join(folder, f"rank{rank}.log")) as handle:
                        print(f"--- rank {rank} (exit {code}) ---\n{handle.read()[-6000:]}")
            raise SystemExit(f"ranks exited with {codes}")
        results = []
        for rank in range(args.world_size):
            with open(f"{out_path}.rank{rank}") as handle:
                results.append(json.load(handle))
        return results


# --- report --------------------------------------------------------------------------


def _mean(per_step: list[dict]) -> dict[str, float]:
    total: collections.Counter = collections.Counter()
    for step in per_step:
        total.update(step)
    return {kind: total[kind] / len(per_step) for kind in KINDS}


def _group_names(names: list[str]) -> str:
    """``blocks.0.attn.qkv.bias, blocks.1.attn.qkv.bias`` -> ``blocks.*.attn.qkv.bias (x2)``."""
    groups = collections.Counter(re.sub(r"\.\d+\.", ".*.", name) for name in names)
    return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in groups.items())


def _fmt(value: float) -> str:
    return f"{value:,.0f}"


def _report(args: argparse.Namespace, results: list[dict]) -> None:
    head = results[0]
    info = head["param_info"]
    world = head["world"]
    p_bytes = sum(v["bytes"] for v in info.values())
    frozen_bytes = sum(v["bytes"] for v in info.values() if not v["trainable"])
    padded = sum(-(-v["numel"] // world) * world * 4 for v in info.values())
    print(f"parameters: {sum(v['numel'] for v in info.values()):,} in {len(info)} tensors "
          f"(tied lm_head/wte counted once); P = {p_bytes:,} bytes fp32 "
          f"(frozen: {frozen_bytes:,}; padded to multiples of W={world}: {padded:,})")
    print(f"measured: {head['measured_steps']} steps per variant ({args.rounds} rounds x {args.steps}), "
          f"after {args.warmup} warm-up steps; traffic on rank 0, per step\n")

    variants = head["variants"]
    notes, problems = [], []
    print("| variant | all_gather | reduce_scatter | all_reduce | broadcast | reduce | total / step "
          "| wire total | theory | total / theory | calls / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(name, options) for name, options in ZINF_VARIANTS] + [(FSDP2, None), (DDP, None)]
    for name, options in rows:
        if name not in variants:
            reason = head["errors"].get(name) or (head["fsdp_error"] if name == FSDP2 else "missing")
            print(f"| {name} | not run: {reason} |" + " |" * 9)
            continue
        entry = variants[name]
        wire = _mean(entry["wire"])
        wire_total = sum(wire.values())
        if options is None:
            per_kind, total, calls = wire, wire_total, entry["wire_calls"]
            theory_x = 3 if name == FSDP2 else 2
        else:
            per_kind = _mean(entry["comm"])
            total = sum(per_kind.values())
            calls = entry["comm_calls"]
            theory_x = THEORY[options["stage"]]
        theory = theory_x * p_bytes
        calls_text = ", ".join(f"{kind} {count:g}" for kind, count in sorted(calls.items()) if count)
        total_cell = _fmt(total) if options is not None else "(wire)"
        print(f"| {name} | " + " | ".join(_fmt(per_kind[kind]) for kind in KINDS)
              + f" | {total_cell} | {_fmt(wire_total)} | {theory_x}P = {_fmt(theory)} | {total / theory:.4f} "
              f"| {calls_text} |")

        # Consistency: every measured step the same, every rank the same, zinf's counter = wire.
        source = "comm" if options is not None else "wire"
        step_totals = {sum(step.values()) for step in entry[source]}
        if len(step_totals) > 1:
            problems.append(f"{name}: traffic differs between steps on rank 0: {sorted(step_totals)}")
        for other in results[1:]:
            theirs = other["variants"].get(name)
            if theirs is not None and _mean(theirs[source]) != _mean(entry[source]):
                problems.append(f"{name}: rank {other['rank']} counted {_fmt(sum(_mean(theirs[source]).values()))} "
                                f"bytes per step, rank 0 {_fmt(total)}")
        control = {kind: sum(step.get(kind, 0) for step in entry[source]) / len(entry[source])
                   for kind in CONTROL_KINDS} if options is not None else {}
        if options is not None and abs(wire_total - total - sum(control.values())) > 0.5:
            problems.append(f"{name}: zinf's RUNTIME.comm counted {_fmt(total)} bytes per step (and {control} of control "
                            f"traffic) but the torch.distributed calls moved {_fmt(wire_total)} (wire: {wire}; "
                            f"RUNTIME.comm: {per_kind})")
        if any(control.values()):
            notes.append(f"{name}: control traffic per step besides ZeRO's (on the wire, not in theory): "
                         + ", ".join(f"{kind} {_fmt(nbytes)} bytes" for kind, nbytes in control.items()))

        if options is not None:
            notes.extend(_explain(name, options, entry, info, world, total, theory))
        elif name == FSDP2:
            notes.extend(_explain_fsdp2(info, world, per_kind, theory))
        else:
            notes.append(f"{name}: one bucketed all-reduce per bucket; gradients of trainable parameters only: "
                         f"2 x {_fmt(sum(v['bytes'] for v in info.values() if v['trainable']))} expected, "
                         f"{_fmt(total)} measured")

    print("\nBytes count the full tensor each collective moves (all-gather: output, reduce-scatter: input, "
          "all-reduce: 2x size, broadcast/reduce: size). 'total' is zinf's RUNTIME.comm counter; 'wire' counts the same "
          "rule at the torch.distributed calls (independent check for zinf; the only count for FSDP2/DDP). "
          "Theory: stage 0 / DDP 2P (all-reduce), stage 1/2 2P, stage 3 / FSDP2 3P.")
    print("\nNotes (measured = theory + padding - frozen gradients not reduced - stage-3 parameters backward "
          "does not re-gather; computed per parameter from zinf's gather/reduce calls):")
    for note in notes:
        print(f"- {note}")
    if problems:
        print("\nINCONSISTENCIES:")
        for problem in problems:
            print(f"- {problem}")
    else:
        print("- every measured step moved the same bytes, every rank counted the same, "
              "and zinf's RUNTIME.comm counters equal the bytes handed to torch.distributed")

    _print_losses_and_step_times(head)


def _report_hsdp(args: argparse.Namespace, results: list[dict]) -> None:
    """HSDP: bytes per step on rank 0 at the torch.distributed calls, zinf against FSDP2 on one mesh."""
    head = results[0]
    info, world = head["param_info"], head["world"]
    shards = world // args.hsdp
    p_bytes = sum(v["bytes"] for v in info.values())
    print(f"HSDP mesh: {args.hsdp} replicas x {shards} shards; P = {p_bytes:,} bytes fp32 in {len(info)} tensors; "
          f"{head['measured_steps']} measured steps per variant; bytes per step on rank 0\n")
    print("| variant | all_gather | reduce_scatter | all_reduce | total (wire) | theory | total / theory "
          "| vs FSDP2 HSDP | calls / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    variants = head["variants"]
    fsdp_total = sum(_mean(variants[FSDP2]["wire"]).values()) if FSDP2 in variants else None
    for name in [name for name, _ in HSDP_VARIANTS] + [FSDP2, DDP]:
        if name not in variants:
            reason = head["errors"].get(name) or (head["fsdp_error"] if name == FSDP2 else "missing")
            print(f"| {name} | not run: {reason} |" + " |" * 7)
            continue
        entry = variants[name]
        wire = _mean(entry["wire"])
        total = sum(wire.values())
        # Shard group: gathers (stage 3: forward and backward) and a reduce-scatter, each of the full P;
        # replicas: an all-reduce of this rank's 1/S slice (2x its size). FSDP2 regathers in backward too.
        # DDP: one all-reduce of every gradient.
        if name == DDP:
            theory_x, theory_text = 2.0, "2P"
        else:
            gathers = 1 if name == "zinf stage 1 HSDP" or name == "zinf stage 2 HSDP" else 2
            theory_x = gathers + 1 + 2 / shards
            theory_text = f"{gathers + 1}P + 2P/{shards}"
        ratio = f"{total / fsdp_total:.3f}" if fsdp_total and name != FSDP2 else ""
        calls = ", ".join(f"{kind} {count:g}" for kind, count in sorted(entry["wire_calls"].items()) if count)
        print(f"| {name} | {_fmt(wire['all_gather'])} | {_fmt(wire['reduce_scatter'])} | {_fmt(wire['all_reduce'])} "
              f"| {_fmt(total)} | {theory_text} = {_fmt(theory_x * p_bytes)} | {total / (theory_x * p_bytes):.4f} "
              f"| {ratio} | {calls} |")
    print("\nwire: the bytes handed to torch.distributed (all-gather: output, reduce-scatter: input, all-reduce: "
          "2x size, broadcast: size), the only count FSDP2 and DDP have; zinf's also include its control traffic "
          "(the ranks' fingerprint all-gathers, rank 0's buffers).")
    _print_losses_and_step_times(head)


def _print_losses_and_step_times(head: dict) -> None:
    """The variants' losses (same training: they should agree) and step times, medians against FSDP2."""
    variants = head["variants"]
    print("\n| variant | loss, first measured step | loss, last measured step |\n|---|---|---|")
    for name, entry in variants.items():
        print(f"| {name} | {entry['losses'][0]:.6f} | {entry['losses'][-1]:.6f} |")

    medians = {name: statistics.median(entry["times_ms"]) for name, entry in variants.items()}
    baseline = FSDP2 if FSDP2 in medians else DDP
    if head["fsdp_error"]:
        print(f"\nFSDP2 could not run here: {head['fsdp_error']}")
    for name, error in head["errors"].items():
        print(f"\n{name} failed: {error}")
    print(f"\nStep time on rank 0 (forward + backward + step + zero_grad), {head['measured_steps']} steps per "
          f"variant, variants interleaved per round; load average {head['load']} at the end of the run")
    print(f"\n| variant | median step (ms) | quartiles (ms) | median vs {baseline} |\n|---|---|---|---|")
    for name, median in medians.items():
        times = variants[name]["times_ms"]
        low, _, high = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0], None, times[0])
        print(f"| {name} | {median:.1f} | {low:.1f} - {high:.1f} | {median / medians[baseline]:.2f} |")


def _explain_fsdp2(info: dict, world: int, per_kind: dict, theory: float) -> list[str]:
    """FSDP2's bytes from its layout: dim-0 padding per parameter, the root group gathered once."""

    def padded(v: dict) -> int:
        rows = v["shape"][0] if v["shape"] else 1
        return -(-rows // world) * world * (v["numel"] // max(rows, 1)) * 4

    root = [pname for pname in info if not pname.startswith("blocks.")]
    gathers = sum(padded(v) * (1 if pname in root else 2) for pname, v in info.items())
    reduces = sum(padded(v) for v in info.values() if v["trainable"])
    measured = per_kind["all_gather"] + per_kind["reduce_scatter"]
    agree = abs(gathers - per_kind["all_gather"]) < 0.5 and abs(reduces - per_kind["reduce_scatter"]) < 0.5
    return [f"{FSDP2}: {_fmt(theory - measured)} bytes under 3P: the root group ({', '.join(root)}) is not "
            f"resharded after forward (FSDP2's default for the root), so it is all-gathered once per step, not "
            f"twice; with each parameter's dim 0 padded to a multiple of W and frozen parameters not reduced, "
            f"expected all_gather {_fmt(gathers)} + reduce_scatter {_fmt(reduces)}: "
            + ("matches" if agree else f"DOES NOT match the measured {per_kind}")]


def _explain(name: str, options: dict, entry: dict, info: dict, world: int, total: float, theory: float) -> list[str]:
    """Decompose zinf's measured bytes into theory and named deviations, per parameter."""
    stage = options["stage"]
    per_param = entry.get("per_param", {})
    if stage == 0:
        trainable = sum(v["bytes"] for v in info.values() if v["trainable"])
        return [f"{name}: nothing sharded; one all-reduce per gradient of a trainable parameter: "
                f"2 x {_fmt(trainable)} expected, {_fmt(total)} measured"]
    padding = frozen_rs = frozen_gg = once = 0.0
    once_names, odd = [], []
    expected_gathers = 2 if stage == 3 else 1
    for pname, p in per_param.items():
        trainable = info[pname]["trainable"]
        pad = p["gathered_bytes"] - p["bytes"]
        padding += pad * (p["gathers"] + p["reduces"])
        if not trainable:
            frozen_rs += p["bytes"]
        if not trainable and stage in (1, 2):
            # Stages 1/2 keep full parameters and only rebuild what the step changed.
            frozen_gg += p["bytes"]
            if p["gathers"] != 0:
                odd.append(f"{pname}: frozen, yet all-gathered {p['gathers']:g}x per step")
            continue
        if p["reduces"] != (1 if trainable else 0):
            odd.append(f"{pname}: {p['reduces']:g} gradient reductions per step")
        if p["gathers"] == expected_gathers - 1 and stage == 3:
            once += p["bytes"]
            once_names.append(pname)
        elif p["gathers"] != expected_gathers:
            odd.append(f"{pname}: {p['gathers']:g} gathers per step (expected {expected_gathers})")
    residual = total - (theory + padding - frozen_rs - frozen_gg - once)
    parts = [f"{name}: measured {total / theory:.4f} x theory = theory"]
    parts.append(f"+ padding {_fmt(padding)}")
    parts.append(f"- frozen params not reduced {_fmt(frozen_rs)}")
    if stage in (1, 2):
        parts.append(f"- frozen params not re-gathered {_fmt(frozen_gg)}")
    if stage == 3:
        parts.append(f"- gathered once, not twice {_fmt(once)}")
    parts.append(f"(residual {_fmt(residual)} bytes)")
    notes = [" ".join(parts)]
    if once_names:
        twice = [pname for pname in per_param if pname not in once_names]
        notes.append(f"{name}: gathered in forward only, backward needs no copy of them (no gradient formula "
                     f"reads them): {_group_names(once_names)}; every other parameter is gathered twice "
                     f"({len(twice)} tensors, LayerNorm biases included: aten's native_layer_norm_backward "
                     f"takes the bias as an input, so backward re-gathers {_fmt(sum(per_param[n]['bytes'] for n in twice if n.endswith('bias')))} "
                     f"bytes of biases it does not need)")
    notes.extend(f"{name}: {line}" for line in odd)
    return notes


def main() -> int:
    args = _parse()
    if "ZEROBENCH_OUT" in os.environ:
        _worker(args, os.environ["ZEROBENCH_OUT"])
        return 0
    print("command: " + shlex.join([os.path.basename(sys.executable), *sys.argv]))
    print(f"torch {torch.__version__}, world size {args.world_size} (gloo, localhost, one process per rank, "
          f"OMP_NUM_THREADS=1), zinf lower={args.lower}, {os.cpu_count()} CPUs")
    print(f"load average at start: {', '.join(f'{value:.1f}' for value in os.getloadavg())}")
    print(f"GPT: n_layer {args.n_layer}, n_embd {args.n_embd}, n_head {args.n_head}, vocab {args.vocab_size}, "
          f"block {args.block_size}, batch {args.batch_size} per rank, frozen_scale {args.frozen_scale}")
    started = time.monotonic()
    results = _launch(args)
    (_report_hsdp if args.hsdp else _report)(args, results)
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
