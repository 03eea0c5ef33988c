"""zinf next to torch's own compositions at world 4 (issue 37, acceptance 5): TP x DP and PP x DP.

    python benchmarks/parallel_peers.py [--compositions tp,pp --rounds 3 --steps 2 --warmup 2]

Four gloo ranks on localhost (one process each, one compute thread each), the same model for every
system: ``--blocks`` residual MLP blocks (``x + fc2(gelu(fc1(x)))``, fc1 width -> 4 width), the same
initial weights, the same global batches (each dp rank takes its rows), MSE loss, AdamW with the same
hyper-parameters (torch's for FSDP2, ``zinf.optim.AdamW`` for zinf).

* ``tp`` (tp 2 x dp 2, mesh ``("dp", "tp")``): every block through torch's ``parallelize_module`` on
  ``mesh["tp"]`` (fc1 colwise, fc2 rowwise).  FSDP2: ``fully_shard`` on each block and the root over
  ``mesh["dp"]``.  zinf: ``torch.compile(model, backend="zinf", options={"stage": 3, "mesh": mesh["dp"]})``.
* ``pp`` (pp 2 x dp 2, mesh ``("pp", "dp")``): half the blocks per stage, ``Schedule1F1B`` with
  ``--micro-batches`` micro-batches.  FSDP2: ``fully_shard`` per block and on the stage over
  ``mesh["dp"]``, torch's ``PipelineStage``.  zinf: the stage compiled over ``mesh["dp"]``, wrapped in
  ``ZinfPipelineStage``.

Each composition runs twice:

1. **Side by side** (device tier): FSDP2 and zinf live in the same rank processes; after ``--warmup``
   steps each (compiles), ``--rounds`` rounds in which each takes ``--steps`` steps in turn (the machine
   is shared: interleaving lets both see the same load).  Step = forward, backward, optimizer step,
   zero_grad, timed on rank 0 after a barrier; medians.  Collective bytes per step per rank, counted the
   same way for both by wrappers: the ``torch.distributed`` collectives (``zero_traffic.py``'s counters:
   all-gather counts its output, reduce-scatter its input, all-reduce twice its size, broadcast its size),
   the functional collectives (``torch.ops._c10d_functional``: DTensor's TP collectives, in eager and in
   zinf's compiled graphs; same rule) and the pipeline's sends (the bytes each rank sends).  zinf's own
   counters (``RUNTIME.comm.traffic_bytes``) are printed next to the wrapper's count of the
   ``torch.distributed`` part as a check.
2. **Own processes** (peak RSS): FSDP2, zinf and zinf with ``offload_param``/``offload_optimizer`` =
   ``nvme`` each in its own 4 processes; ``ru_maxrss`` of each rank.  With ``--meta`` every system builds the
   model on the meta device and fills each parameter where it lives (FSDP2: ``to_empty``, then each rank its
   shards; zinf: ``zinf.materialize``, each shard straight to its tier), with values that depend only on the
   parameter's name (the eager reference computes the same): no rank ever holds the whole model, which is what
   a model whose states outgrow RAM needs.

Every system's losses (global-batch loss, averaged over the dp ranks) are compared with eager PyTorch's
on the whole model and batch (one process, computed by the parent): a system off by more than
``--loss-rtol`` gets no figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib

import torch

import zero_traffic  # the torch.distributed byte counters (same rules as the ZeRO traffic benchmark)
from peers import log

WORLD = 4
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SYSTEMS = {"fsdp2": "FSDP2", "zinf": "zinf stage 3", "zinf_nvme": "zinf stage 3, nvme"}
COMPOSITIONS = {"tp": "TP x DP (tp 2 x dp 2)", "pp": "PP x DP (pp 2 x dp 2, 1F1B)"}


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build(args, keep=range(10**9), prepare=lambda block: None, meta: bool = False) -> torch.nn.Sequential:
    """The model (the same initial weights everywhere): of its blocks, those ``keep`` names, each handed to
    ``prepare`` (sharding) as soon as it is built, so that no rank holds more than one whole block at once.

    ``meta``: the blocks are built on the meta device (shapes only), each remembering its index in the whole
    model (``whole_index``), for :func:`meta_init` to fill them where they will live."""
    torch.manual_seed(0)
    blocks = []
    for index in range(args.blocks):
        if meta:
            with torch.device("meta"):
                block = Block(args.width)
        else:
            block = Block(args.width)
        block.whole_index = index
        if index in keep:
            prepare(block)
            blocks.append(block)
    model = torch.nn.Sequential(*blocks)
    if args.meta and not meta:  # (the eager reference of a --meta run: the values meta_init gives)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(meta_value(name, param.shape))
    return model


def meta_value(name: str, shape) -> torch.Tensor:
    """--meta's initial value of the whole model's parameter ``name``: a function of the name alone, so that every
    system computes it where the parameter lives (each rank its own slice)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    scale = 0.5 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.01  # (a weight's outputs near its inputs' size)
    return torch.randn(tuple(shape), generator=generator) * scale


def meta_init(model: torch.nn.Module):
    """The init function for a model of meta blocks (FSDP2's after ``to_empty``, zinf's ``materialize``): fills
    a module's own parameters with :func:`meta_value` of their whole-model names, a DTensor (TP and/or FSDP2
    shards) with its local slice only."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = {}
    for block in model:
        for child_name, child in block.named_modules():
            names[id(child)] = f"{block.whole_index}.{child_name}".rstrip(".")

    @torch.no_grad()
    def init(module: torch.nn.Module) -> None:
        for name, param in module.named_parameters(recurse=False):
            full = meta_value(f"{names[id(module)]}.{name}", param.shape)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)

    return init


def materialized(model: torch.nn.Module, system: str, options: dict | None) -> torch.nn.Module:
    """A model of meta blocks given its memory: FSDP2's through ``to_empty`` and then its shards filled; zinf's
    by ``zinf.materialize`` (module by module, each parameter's shard straight to its tier)."""
    init = meta_init(model)
    if system == "fsdp2":
        model.to_empty(device="cpu")
        for module in model.modules():
            init(module)
    else:
        import zinf_compiler as zinf

        zinf.materialize(model, options, init_fn=init, progress=False)
    return model


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def batches(args, count: int) -> list:
    """The global batch of each step (every dp rank's rows): inputs and targets."""
    generator = torch.Generator().manual_seed(1234)
    rows = 2 * args.rows
    return [(torch.randn(rows, args.width, generator=generator), torch.randn(rows, args.width, generator=generator))
            for _ in range(count)]


def total_steps(args) -> int:
    return args.warmup + args.rounds * args.steps


def eager_losses(args, count: int) -> list[float]:
    """The reference: the whole model on the whole batch, one process, torch's AdamW."""
    model = build(args)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x, target in batches(args, count):
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# --- counting the functional collectives and the pipeline's sends ----------------------

FUNCTIONAL_BYTES: collections.Counter = collections.Counter()


def _functional_bytes(name: str, args) -> tuple[str, int]:
    """(kind, bytes) of one functional collective, by the rule of zero_traffic's counters."""
    def size(value) -> int:
        if isinstance(value, (list, tuple)):
            return sum(size(item) for item in value)
        return value.numel() * value.element_size()

    base = name.rstrip("_")
    if base.startswith("all_reduce"):
        return "tp_all_reduce", 2 * size(args[0])
    if base.startswith("all_gather_into_tensor"):
        return "tp_all_gather", size(args[0]) * int(args[1])
    if base.startswith("reduce_scatter_tensor"):
        return "tp_reduce_scatter", size(args[0])
    return f"tp_{base}", size(args[0]) if args and isinstance(args[0], (torch.Tensor, list, tuple)) else 0


def install_functional_counters() -> None:
    """Count every call of a ``_c10d_functional`` op: through its packet (DTensor in eager) or its overload
    (Dynamo/AOT graphs, zinf's).  Installed after the warm-up steps, so no compile traces the wrappers."""
    from torch._ops import OpOverload, OpOverloadPacket

    def counting(original, qualified_name):
        def call(self, /, *args, **kwargs):
            namespace, _, name = qualified_name(self).partition("::")
            if namespace in ("_c10d_functional", "_c10d_functional_autograd") and not name.startswith(("wait_", "_")):
                kind, nbytes = _functional_bytes(name.split(".")[0], args)
                FUNCTIONAL_BYTES[kind] += nbytes
            return original(self, *args, **kwargs)
        return call

    OpOverload.__call__ = counting(OpOverload.__call__, lambda op: op._name)
    OpOverloadPacket.__call__ = counting(OpOverloadPacket.__call__, lambda op: op._qualified_op_name)


def install_send_counter() -> None:
    """The pipeline schedules' point-to-point batches: count the bytes each rank sends."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def counted(p2p_ops, *args, **kwargs):
        for op in p2p_ops:
            if op.op is dist.isend:
                FUNCTIONAL_BYTES["pp_send"] += op.tensor.numel() * op.tensor.element_size()
        return original(p2p_ops, *args, **kwargs)

    schedules._batch_p2p = counted


# --- one rank ----------------------------------------------------------------------------


class PhasePeaks:
    """This process's RSS sampled every 5 ms on a thread, its peak kept per phase of the run (``phase`` is set by
    the worker: building, the warm-up steps, the measured steps): where a peak comes from, not only how high."""

    def __init__(self):
        import threading

        self.phase, self.peaks = "start", {}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = rss_now()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(0.005)


def rss_now() -> int:
    """This process's resident bytes now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _zinf_options(system: str, rank: int, args, mesh) -> dict:
    options = {"stage": 3, "mesh": mesh, "lower": args.lower}
    if system == "zinf_nvme":
        path = os.path.join(os.environ["TMPDIR"], f"swap{rank}")
        os.makedirs(path, exist_ok=True)
        options.update(offload_param="nvme", offload_optimizer="nvme", nvme_path=path, **json.loads(args.nvme_options))
    return options


def _tp_system(system: str, args, mesh, rank: int):
    """(step function, optimizer's module) of one TP x DP system."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch.distributed.fsdp import fully_shard

    def prepare(block):
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if system == "fsdp2":
            fully_shard(block, mesh=mesh["dp"])

    model = build(args, prepare=prepare, meta=args.meta)
    options = _zinf_options(system, rank, args, mesh["dp"]) if system != "fsdp2" else None
    if system == "fsdp2":
        fully_shard(model, mesh=mesh["dp"])
    if args.meta:
        materialized(model, system, options)
    if system == "fsdp2":
        forward, optimizer = model, torch.optim.AdamW(model.parameters(), **ADAMW)
    else:
        import zinf_compiler as zinf

        forward = torch.compile(model, backend="zinf", options=options)
        optimizer = zinf.optim.AdamW(model.parameters(), **ADAMW)
    rows = slice(mesh["dp"].get_local_rank() * args.rows, (mesh["dp"].get_local_rank() + 1) * args.rows)

    def step(x, target):
        loss = loss_fn(forward(x[rows]), target[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def _pp_system(system: str, args, mesh, rank: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_stage = args.blocks // 2
    from torch.distributed.fsdp import fully_shard

    def prepare(block):
        if system == "fsdp2":
            fully_shard(block, mesh=mesh["dp"])

    module = build(args, range(pp_rank * per_stage, (pp_rank + 1) * per_stage), prepare, meta=args.meta)
    options = _zinf_options(system, rank, args, mesh["dp"]) if system != "fsdp2" else None
    if system == "fsdp2":
        fully_shard(module, mesh=mesh["dp"])
    if args.meta:
        materialized(module, system, options)
    micro_rows = args.rows // args.micro_batches
    inputs = torch.empty(micro_rows, args.width, requires_grad=pp_rank > 0)
    outputs = torch.empty(micro_rows, args.width, requires_grad=True)
    if system == "fsdp2":
        stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs,
                              group=mesh["pp"].get_group())
        optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
    else:
        import zinf_compiler as zinf
        from zinf_compiler.pipeline_parallel import ZinfPipelineStage

        compiled = torch.compile(module, backend="zinf", options=options)
        stage_options = json.loads(args.nvme_stage_options) if system == "zinf_nvme" else {}
        stage = ZinfPipelineStage(compiled, pp_rank, 2, torch.device("cpu"), input_args=inputs,
                                  output_args=outputs, group=mesh["pp"].get_group(), **stage_options)
        optimizer = zinf.optim.AdamW(module.parameters(), **ADAMW)
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    rows = slice(dp_rank * args.rows, (dp_rank + 1) * args.rows)

    def step(x, target):
        micro_losses = []
        if pp_rank == 0:
            schedule.step(x[rows])
        else:
            schedule.step(target=target[rows], losses=micro_losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(micro_losses).mean().item() if micro_losses else None

    return step


def worker(args) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    zero_traffic._install_wire_counters()
    from zinf_compiler.api import RUNTIME

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = ("dp", "tp") if args.composition == "tp" else ("pp", "dp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    make = _tp_system if args.composition == "tp" else _pp_system
    data = batches(args, total_steps(args))
    result = {"rank": rank, "systems": {}}
    steps, errors = {}, {}
    phases = PhasePeaks()
    for system in args.systems:
        phases.phase = "build"
        try:
            steps[system] = make(system, args, mesh, rank)
        except Exception as err:  # recorded and reported; the other system still runs
            errors[system] = f"{type(err).__name__}: {err}"[:2000] + "\n" + traceback.format_exc()[-3000:]
    records = {system: {"times": [], "losses": [], "wire": [], "zinf": []} for system in steps}

    def one_step(system: str, index: int) -> None:
        record = records[system]
        RUNTIME.comm.reset_traffic()
        zero_traffic.WIRE_BYTES.clear()
        FUNCTIONAL_BYTES.clear()
        dist.barrier()
        started = time.perf_counter()
        record["losses"].append(steps[system](*data[index]))
        record["times"].append(time.perf_counter() - started)
        record["wire"].append({**{f"dp_{kind}": value for kind, value in zero_traffic.WIRE_BYTES.items()},
                               **FUNCTIONAL_BYTES})
        record["zinf"].append(dict(RUNTIME.comm.traffic_bytes))

    for system in list(steps):  # warm-up: compiles, shards, creates optimizer state
        phases.phase = "warm-up steps"
        try:
            for index in range(args.warmup):
                one_step(system, index)
        except Exception as err:
            errors[system] = f"{type(err).__name__}: {err}"[:2000] + "\n" + traceback.format_exc()[-3000:]
            del steps[system], records[system]
    install_functional_counters()
    install_send_counter()
    for system in records:  # the warm-up's figures are not measured ones
        records[system].update(times=[], wire=[], zinf=[])
    phases.phase = "measured steps"
    for round_index in range(args.rounds):
        for system in list(steps):
            for index in range(args.steps):
                one_step(system, args.warmup + round_index * args.steps + index)
    result["errors"] = errors
    result["systems"] = records
    result["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["phase_peaks"] = dict(phases.peaks)
    result["rss_now"] = rss_now()  # what the rank holds while it trains (the peak may be building)
    with open(f"{os.environ['PEERS_OUT']}.rank{rank}", "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


# --- launcher and report -----------------------------------------------------------------


def launch(args, composition: str, systems: list[str]) -> list[dict]:
    """One run of ``systems`` in the same WORLD rank processes; each rank's result."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="parallel-peers-", dir=args.tmp) as folder:
        out = os.path.join(folder, "result")
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", composition,
                   "--systems", ",".join(systems)]
        procs = []
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PEERS_OUT=out, OMP_NUM_THREADS="1",
                       TMPDIR=folder)
            handle = open(os.path.join(folder, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT), handle))
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc, handle in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    if other.poll() is None:
                        other.kill()
                codes.append("timeout")
            handle.close()
        if any(code != 0 for code in codes):
            tails = []
            for rank, code in enumerate(codes):
                with open(os.path.join(folder, f"rank{rank}.log")) as handle:
                    tails.append(f"rank {rank} (exit {code}): {handle.read()[-1500:]}")
            return [{"crash": "\n".join(tails)}]
        results = []
        for rank in range(WORLD):
            with open(f"{out}.rank{rank}") as handle:
                results.append(json.load(handle))
        return results


def global_losses(results: list[dict], system: str) -> list[float]:
    """Per step, the mean over the ranks that report a loss (tp: every rank; pp: the last stage's)."""
    per_rank = [r["systems"][system]["losses"] for r in results]
    return [statistics.fmean(v for v in values if v is not None) for values in zip(*per_rank)]


def loss_error(args, losses: list[float], reference: list[float]) -> str | None:
    for index, (mine, theirs) in enumerate(zip(losses, reference)):
        if abs(mine - theirs) > args.loss_rtol * abs(theirs) + 1e-6:
            return f"step {index}: loss {mine:.6g}, eager {theirs:.6g}"
    return None


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def per_step_bytes(results: list[dict], system: str) -> list[dict]:
    """Each rank's mean bytes per measured step, per kind."""
    means = []
    for r in results:
        wire = r["systems"][system]["wire"]
        total: collections.Counter = collections.Counter()
        for step in wire:
            total.update(step)
        means.append({kind: value / len(wire) for kind, value in total.items()})
    return means


def side_by_side(args, composition: str, reference: list[float]) -> None:
    results = launch(args, composition, ["fsdp2", "zinf"])
    print(f"\n### {COMPOSITIONS[composition]}: side by side, device tier\n")
    if "crash" in results[0]:
        print(f"crashed:\n```\n{results[0]['crash']}\n```")
        return
    head = results[0]
    for system, error in head["errors"].items():
        print(f"{SYSTEMS[system]} failed:\n```\n{error}\n```")
    rows = {}
    for system in head["systems"]:
        error = loss_error(args, global_losses(results, system), reference)
        times = head["systems"][system]["times"]
        means = per_step_bytes(results, system)
        totals = [sum(mean.values()) for mean in means]
        kinds: collections.Counter = collections.Counter()
        for mean in means:
            kinds.update({kind: value / WORLD for kind, value in mean.items()})
        zinf_own = [sum(sum(step.values()) for step in r["systems"][system]["zinf"]) / max(1, len(times))
                    for r in results]
        dist_part = [sum(v for k, v in mean.items() if k.startswith("dp_")) for mean in means]
        rows[system] = dict(error=error, step=statistics.median(times), total=statistics.fmean(totals),
                            max_total=max(totals), kinds=kinds, zinf_own=zinf_own, dist_part=dist_part)
    print("| system | losses vs eager | median step (s) | collective MiB/step/rank (mean; max rank) | by kind "
          "(MiB, mean over ranks) |")
    print("|---|---|---|---|---|")
    for system, row in rows.items():
        kinds = ", ".join(f"{kind} {mib(value)}" for kind, value in sorted(row["kinds"].items()) if value)
        print(f"| {SYSTEMS[system]} | {row['error'] or 'match'} | {row['step']:.3f} | {mib(row['total'])}; "
              f"{mib(row['max_total'])} | {kinds} |")
    if "fsdp2" in rows and "zinf" in rows:
        fsdp2, zinf = rows["fsdp2"], rows["zinf"]
        print(f"\nzinf / FSDP2: step {zinf['step'] / fsdp2['step']:.2f}x (target <= 1.10), collective bytes "
              f"{zinf['total'] / fsdp2['total']:.3f}x (target <= 1.05)")
    if "zinf" in rows:
        print("zinf's own counters vs the torch.distributed wrapper, MiB/step per rank: "
              + "; ".join(f"rank {rank} {mib(own)} vs {mib(wire)}"
                          for rank, (own, wire) in enumerate(zip(rows["zinf"]["zinf_own"], rows["zinf"]["dist_part"]))))
    print(f"(rank 0 step times, s: " + "; ".join(
        f"{SYSTEMS[s]} " + " ".join(f"{t:.3f}" for t in head["systems"][s]["times"]) for s in rows) + ")")


def own_processes(args, composition: str, reference: list[float]) -> None:
    print(f"\n### {COMPOSITIONS[composition]}: each system in its own processes (peak RSS)\n")
    print("| system | losses vs eager | median step (s, not interleaved) | peak RSS per rank (MiB) | max | RSS after "
          "the last step, max rank (MiB) |")
    print("|---|---|---|---|---|---|")
    peaks, phase_notes = {}, []
    for system in ("fsdp2", "zinf", "zinf_nvme"):
        results = launch(args, composition, [system])
        if "crash" in results[0]:
            print(f"| {SYSTEMS[system]} | crashed: {results[0]['crash'][-600:]!r} | | | | |")
            continue
        if system in results[0]["errors"]:
            print(f"| {SYSTEMS[system]} | failed: {results[0]['errors'][system][:600]!r} | | | | |")
            continue
        error = loss_error(args, global_losses(results, system), reference)
        rss = [r["maxrss"] for r in results]
        peaks[system] = max(rss)
        print(f"| {SYSTEMS[system]} | {error or 'match'} | {statistics.median(results[0]['systems'][system]['times']):.3f} "
              f"| {', '.join(mib(v) for v in rss)} | {mib(max(rss))} | {mib(max(r['rss_now'] for r in results))} |")
        phase_notes.append(f"{SYSTEMS[system]}: " + ", ".join(
            f"{phase} {mib(max(r['phase_peaks'].get(phase, 0) for r in results))}"
            for phase in results[0]["phase_peaks"]))
    print("\nPeak RSS by phase, max rank (MiB; sampled every 5 ms): " + "; ".join(phase_notes))
    if "fsdp2" in peaks:
        print("\n" + "; ".join(f"{SYSTEMS[s]} / FSDP2 peak RSS {peaks[s] / peaks['fsdp2']:.2f}x"
                               for s in peaks if s != "fsdp2"))
        states = 16 * parameter_count(args)
        print(f"model states (fp32 weight, gradient, two Adam moments: 16 B/param) {mib(states)} MiB = "
              f"{states / peaks['fsdp2']:.2f}x FSDP2's peak RSS per rank")


def parameter_count(args) -> int:
    return args.blocks * (8 * args.width * args.width + 5 * args.width)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compositions", default="tp,pp")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4, help="residual MLP blocks (pp: half per stage)")
    parser.add_argument("--rows", type=int, default=16, help="rows per dp rank per step")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per system per round")
    parser.add_argument("--lower", default="eager", choices=("eager", "inductor"), help="zinf's lowering")
    parser.add_argument("--loss-rtol", type=float, default=1e-4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one launch's ranks")
    parser.add_argument("--skip-rss", action="store_true", help="side by side only")
    parser.add_argument("--skip-side", action="store_true", help="own processes (peak RSS) only")
    parser.add_argument("--tmp", default=None, help="folder for the runs' files (zinf's NVMe swap files)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--systems", help=argparse.SUPPRESS)
    parser.add_argument("--meta", action="store_true",
                        help="build every system's model on the meta device and fill each parameter where it lives "
                             "(FSDP2: to_empty, then its shards; zinf: zinf.materialize), with values that depend on "
                             "the parameter's name: no rank ever holds the whole model")
    parser.add_argument("--nvme-options", default="{}",
                        help="more zinf options for the nvme system, as JSON (e.g. '{\"pinned_bytes\": 134217728}')")
    parser.add_argument("--nvme-stage-options", default="{}",
                        help="ZinfPipelineStage arguments for the nvme system, as JSON (e.g. '{\"gather_once\": true, "
                             "\"reduce_once\": true}': hold the stage for the step, as the device tier does)")
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.composition = args.worker
    args.systems = args.systems.split(",") if args.systems else []
    if args.rows % args.micro_batches or args.blocks % 2:
        parser.error("--rows must split into --micro-batches, --blocks into 2 stages")
    return args


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    if args.reference:
        print(json.dumps(eager_losses(args, total_steps(args))))
        return 0
    print("command: " + shlex.join(["python", os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    params = parameter_count(args)
    print(f"torch {torch.__version__}, zinf at {commit.stdout.strip()}, {os.cpu_count()} CPUs, load average "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}; world {WORLD} (gloo), 1 thread per rank; "
          f"{args.blocks} blocks of width {args.width}: {params:,} parameters; {args.rows} rows per dp rank, "
          f"zinf lower={args.lower}; {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up")
    started = time.monotonic()
    # In a process of its own: a child's ru_maxrss starts at its parent's peak, so the parent stays small.
    reference = json.loads(subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--reference"],
                                          capture_output=True, text=True, check=True).stdout)
    print(f"parent's peak RSS {mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)} MiB (a floor under "
          "each rank's figure)")
    for composition in args.compositions.split(","):
        if not args.skip_side:
            log(f"{composition}: side by side")
            side_by_side(args, composition, reference)
        if not args.skip_rss:
            log(f"{composition}: own processes")
            own_processes(args, composition, reference)
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
