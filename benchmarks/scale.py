"""The GPU at scale: a ladder of bf16 GPT sizes, zinf beside its peers on the same model and batch, in one command.

    python benchmarks/scale.py [--rungs 1b,10b] [--systems compile,zinf,zinf_cpu,...] [--budget-s 470]
                               [--out DIR] [--steps 3] [--trace-rung 1b --trace-system zinf_cpu]

What a lent GPU session runs first (``scripts/gpu_check.sh scale``), sized to end within its window; on the CPU
(``GPU_CHECK_DEVICE=cpu``) the same code runs at toy sizes in the test suite, so GPU time is never spent on a
broken script (tests/integration/test_scale_script.py).

The parent process measures this machine once (the same run's rates):
  * matmul: bf16 matrix products on the device (FLOP/s);
  * link: pinned host->device and device->host copies (bytes/s);
  * host AdamW: zinf's host optimizer kernel (torch's fused AdamW on fp32 CPU tensors) in parameters/s;
  * disk: O_DIRECT write then read under ``--nvme`` (bytes/s).
Then every (rung, system) trains in a child process of its own (its memory freed after, a crash one row):
the model is built on the meta device and materialized (zinf.materialize for zinf; ``to_empty`` + the same
initialization for the peers), trains ``--warmup`` steps (compiles) and ``--steps`` measured ones under bf16
autocast with AdamW, and reports per step the time and loss, the peak device memory
(``torch.cuda.max_memory_allocated``), the peak RSS (``getrusage``), zinf's ``memory_report`` and
``zinf.plan``'s predicted step.  A system that cannot run (a peer not installed, a model that does not fit
the device) gets a row saying why.  The children run smallest rung first and stop when the time budget
(``--budget-s``) would be overrun; each row is printed and written to ``DIR/scale.json`` as it lands, the
children's output to ``DIR/children.log`` and one profiler trace (``--trace-rung``, ``--trace-system``) to
``DIR/trace_<rung>_<system>.json.gz``: three files, within what the device tool brings back.

Per row: the step (median), model TFLOP/s (6 x parameters x tokens plus attention: 12 x layers x sequence x
width per token, PaLM's count; recomputation not counted) and its share of the probed matmul rate, and the
step's bound: the largest of compute (the FLOPs the system runs, recomputation included, at the matmul rate),
host<->device bytes at the link rate (each direction on its own: PCIe is full duplex), the host optimizer's
parameters at its probed rate, and the disk's bytes at the disk's rates.  The bound assumes the parts overlap
perfectly; ``step / bound`` says how far from that a system is.

Systems (each absent from a rung where it cannot fit; ``--systems`` chooses):
  compile       torch.compile (Inductor), fp32 parameters, torch AdamW (fused) on the device: no offload
  zinf          zinf stage 3, everything on the device (world size 1: the runtime's own cost)
  zinf_cpu      zinf stage 3, parameters (bf16 shards) and optimizer (fp32 masters and moments) on the cpu tier
  zinf_opt_cpu  zinf stage 3, parameters on the device, optimizer on the cpu tier (ZeRO-Offload)
  zinf_nvme     zinf stage 3, parameters on the device, optimizer on the NVMe tier behind the RAM cache
                (host_memory): ZeRO-Infinity, for models whose states exceed the device and the RAM
  fsdp2_cpu     FSDP2 fully_shard per block and root, CPUOffloadPolicy, bf16 MixedPrecisionPolicy, torch AdamW
  ds_cpu        DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU (where deepspeed imports)
  ds_nvme       DeepSpeed ZeRO-3, offloaded to NVMe (where its async_io op builds)
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pathlib
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from zinf_compiler.cost_model import best_seconds as _best

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

# name -> the GPT's sizes, the batch, activation checkpointing.  Sized for one H200 (139 GiB, 128 GiB of RAM,
# 64 GiB of disk): 1b fits every system; 5b's host states (80 GB) fit the RAM; 10b's states (16 bytes a
# parameter, 158 GB) exceed the GPU, and with fp32 gradients on the host (18 bytes a parameter in all) need
# most of the RAM and the disk together (see _nvme_options).
RUNGS: dict[str, dict] = {
    "1b": dict(n_layer=20, n_embd=2048, n_head=16, vocab=50304, seq=2048, batch=16, checkpointing="none"),
    "3b": dict(n_layer=26, n_embd=3072, n_head=24, vocab=50304, seq=2048, batch=16, checkpointing="block"),
    "5b": dict(n_layer=24, n_embd=4096, n_head=32, vocab=50304, seq=2048, batch=16, checkpointing="block"),
    "10b": dict(n_layer=48, n_embd=4096, n_head=32, vocab=50304, seq=2048, batch=32, checkpointing="block"),
    # The same code paths at sizes the 2-core CPU machine trains in seconds (GPU_CHECK_DEVICE=cpu).
    "toy": dict(n_layer=2, n_embd=64, n_head=4, vocab=256, seq=32, batch=4, checkpointing="none"),
    "toy-ckpt": dict(n_layer=3, n_embd=64, n_head=4, vocab=256, seq=32, batch=4, checkpointing="block"),
}
# In the order they run on a rung: the pairs the acceptance figures compare first (the time budget may end a
# rung early): zinf beside torch.compile, the cpu tiers beside FSDP2's and DeepSpeed's CPU offload, then NVMe.
SYSTEMS = ("compile", "zinf", "zinf_cpu", "fsdp2_cpu", "ds_cpu", "zinf_nvme", "ds_nvme", "zinf_opt_cpu")
ZINF_OPTIONS = {
    "zinf": {"stage": 3},
    "zinf_cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "param_dtype": "bf16"},
    "zinf_opt_cpu": {"stage": 3, "offload_optimizer": "cpu", "param_dtype": "bf16"},
    "zinf_nvme": {"stage": 3, "offload_optimizer": "nvme", "param_dtype": "bf16"},
}
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GiB = 1 << 30


def check_device() -> torch.device:
    # (Not ZINF_*: zinf reads every ZINF_<NAME> variable as an option.)
    return torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))


def param_count(rung: dict) -> int:
    """Parameters of the rung's GPT (tied embeddings, LayerNorms and biases included)."""
    width, layers = rung["n_embd"], rung["n_layer"]
    per_block = 12 * width * width + 13 * width  # qkv, proj, fc, fc2 (+ biases) and two LayerNorms
    return layers * per_block + rung["vocab"] * width + rung["seq"] * width + 2 * width


def model_flops(rung: dict) -> float:
    """FLOPs of one step as models count them: 6 x parameters x tokens, plus attention (PaLM's 12 L s d per
    token); no recomputation."""
    tokens = rung["batch"] * rung["seq"]
    return 6 * param_count(rung) * tokens + 12 * rung["n_layer"] * rung["seq"] * rung["n_embd"] * tokens


# --- the parent: probes, children, bounds, the table --------------------------------------------------------


def probe(device: torch.device, nvme: str | None, big: bool) -> dict:
    """This machine's rates, measured now (see the module docstring)."""
    rates = {"device": str(device), "threads": torch.get_num_threads()}
    size = 8192 if big else 256
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    rates["matmul_flops"] = 2 * size**3 / _best(lambda: torch.mm(a, b), device)
    del a, b
    numel = (256 << 20) // 4 if big else (16 << 20) // 4
    host = torch.ones(numel, pin_memory=device.type == "cuda")
    on_device = torch.empty(numel, device=device)
    rates["host_to_device"] = numel * 4 / _best(lambda: on_device.copy_(host, non_blocking=True), device)
    rates["device_to_host"] = numel * 4 / _best(lambda: host.copy_(on_device, non_blocking=True), device)
    del host, on_device
    # zinf's host optimizer: torch's fused AdamW on fp32 CPU tensors, in 16M-element pieces (its sub-groups).
    pieces = 8 if big else 1
    adam_numel = pieces * (16 << 20) if big else 1 << 20
    master = [torch.randn(adam_numel // pieces) for _ in range(pieces)]
    grads = [torch.randn_like(t) * 1e-3 for t in master]
    exp_avg = [torch.zeros_like(t) for t in master]
    exp_avg_sq = [torch.zeros_like(t) for t in master]
    steps = [torch.tensor(0.0) for _ in master]

    def adam_step():
        for s in steps:
            s += 1
        torch._fused_adamw_(master, grads, exp_avg, exp_avg_sq, [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    rates["host_adam_params"] = adam_numel / _best(adam_step, torch.device("cpu"))
    del master, grads, exp_avg, exp_avg_sq
    rates["disk_write"] = rates["disk_read"] = None
    if nvme:
        rates["disk_write"], rates["disk_read"] = _probe_disk(nvme, (1 * GiB) if big else (64 << 20))
    return rates


def _probe_disk(folder: str, nbytes: int) -> tuple[float | None, float | None]:
    """O_DIRECT write (fsynced) then read of ``nbytes`` in 8 MiB requests; buffered where O_DIRECT is refused."""
    import mmap

    chunk = 8 << 20
    buffer = mmap.mmap(-1, chunk)
    buffer.write(b"\x5a" * chunk)
    path = os.path.join(folder, "scale-disk-probe")
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            started = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                os.pwrite(fd, buffer, offset)
            os.fsync(fd)
            write = nbytes / (time.perf_counter() - started)
            started = time.perf_counter()
            for offset in range(0, nbytes, chunk):
                os.preadv(fd, [buffer], offset)
            read = nbytes / (time.perf_counter() - started)
        finally:
            os.close(fd)
        return write, read
    except OSError:
        return None, None
    finally:
        buffer.close()
        if os.path.exists(path):
            os.unlink(path)


def bound(rung: dict, system: str, rates: dict, row: dict) -> dict:
    """The step's lower bound for ``system`` on ``rung`` at the probed rates (see the module docstring)."""
    params = param_count(rung)
    recompute = rung["checkpointing"] == "block" and system != "compile"
    flops = model_flops(rung) * (8 / 6 if recompute else 1)
    parts = {"compute": flops / rates["matmul_flops"]}
    h2d = d2h = 0.0
    host_params = 0
    disk_bytes = (0.0, 0.0)
    if system == "zinf_cpu":
        h2d, d2h, host_params = 2 * 2 * params, 2 * params, params  # bf16 gathered in forward and backward
    elif system in ("zinf_opt_cpu", "zinf_nvme"):
        h2d, d2h, host_params = 2 * params, 2 * params, params  # bf16 gradients out, stepped parameters back
        if system == "zinf_nvme":
            on_disk = row.get("nvme_state_bytes") or 0  # the states the RAM cache left on the NVMe tier
            disk_bytes = (on_disk, on_disk)  # read, stepped and written back every step
    elif system in ("fsdp2_cpu", "ds_cpu", "ds_nvme"):
        h2d, d2h, host_params = 2 * 4 * params, 4 * params, params  # fp32 shards gathered twice, fp32 grads out
        if system == "ds_nvme":
            disk_bytes = (12 * params + 4 * params, 12 * params + 4 * params)
    if h2d or d2h:
        parts["host_to_device"] = h2d / rates["host_to_device"]
        parts["device_to_host"] = d2h / rates["device_to_host"]
    if host_params:
        parts["host_optimizer"] = host_params / rates["host_adam_params"]
    if any(disk_bytes) and rates.get("disk_read") and rates.get("disk_write"):
        parts["disk"] = disk_bytes[0] / rates["disk_read"] + disk_bytes[1] / rates["disk_write"]
    return {"parts": parts, "seconds": max(parts.values()), "bound_by": max(parts, key=parts.get)}


def parent(args) -> int:
    device = check_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        print("scale.py needs a CUDA device (GPU_CHECK_DEVICE=cpu runs it on the CPU at toy sizes)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nvme = args.nvme or tempfile.mkdtemp(prefix="zinf_scale_")
    rungs = args.rungs.split(",") if args.rungs else (["1b", "10b"] if device.type == "cuda" else ["toy", "toy-ckpt"])
    systems = args.systems.split(",") if args.systems else list(SYSTEMS)
    for name in rungs:
        if name not in RUNGS:
            raise SystemExit(f"unknown rung {name!r}; choose from {', '.join(RUNGS)}")
    for name in systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    print(f"command: python benchmarks/scale.py {' '.join(sys.argv[1:])}", flush=True)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / GiB:.0f} GiB)"
             if device.type == "cuda" else "") + f", {os.cpu_count()} cpus, nvme {nvme}", flush=True)
    rates = probe(device, nvme, big=device.type == "cuda")
    print("rates: " + ", ".join(f"{k} {_rate(k, v)}" for k, v in rates.items() if k not in ("device", "threads")),
          flush=True)
    result = {"command": sys.argv, "torch": torch.__version__, "device": str(device), "rates": rates, "rows": []}
    # (Out of ``out``: the device tool brings back 8 files at most; the children's logs go into one.)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="zinf_scale_run_"))
    rates_path = scratch / "rates.json"
    rates_path.write_text(json.dumps(rates))
    for rung_name in rungs:
        rung = RUNGS[rung_name]
        print(f"\n== rung {rung_name}: {param_count(rung) / 1e9:.2f}B parameters ({param_count(rung) * 16 / 1e9:.0f} GB "
              f"of states at 16 B each), batch {rung['batch']}x{rung['seq']}, checkpointing {rung['checkpointing']}",
              flush=True)
        for system in systems:
            left = args.budget_s - (time.perf_counter() - started)
            if left < 20:
                row = {"rung": rung_name, "system": system, "skipped": f"the time budget ({args.budget_s} s) is spent"}
            else:
                row = _run_child(rung_name, system, args, nvme, rates_path, out, scratch,
                                 timeout=min(left, args.child_s))
            if "step_s" in row:
                row["bound"] = bound(rung, system, rates, row)
                row["model_tflops"] = model_flops(rung) / row["step_s"] / 1e12
                row["matmul_share"] = model_flops(rung) / row["step_s"] / rates["matmul_flops"]
                row["step_over_bound"] = row["step_s"] / row["bound"]["seconds"]
            result["rows"].append(row)
            print(_line(row), flush=True)
            (out / "scale.json").write_text(json.dumps(result, indent=1, default=str))
    _summary(result)
    (out / "scale.json").write_text(json.dumps(result, indent=1, default=str))
    shutil.rmtree(scratch, ignore_errors=True)
    if not args.nvme:
        shutil.rmtree(nvme, ignore_errors=True)
    failed = [row for row in result["rows"] if "error" in row]
    return 1 if failed else 0


def _rate(key: str, value) -> str:
    if value is None:
        return "not measured"
    if key == "matmul_flops":
        return f"{value / 1e12:.1f} TFLOP/s"
    if key == "host_adam_params":
        return f"{value / 1e9:.2f} G params/s"
    return f"{value / 1e9:.1f} GB/s"


def _run_child(rung: str, system: str, args, nvme: str, rates_path: pathlib.Path, out: pathlib.Path,
               scratch: pathlib.Path, timeout: float) -> dict:
    """One (rung, system) in a child process: its row, its log appended to ``out``/children.log."""
    result_path = str(scratch / f"{rung}_{system}.json")
    command = [sys.executable, __file__, "child", "--rung", rung, "--system", system, "--json", result_path,
               "--nvme", nvme, "--rates", str(rates_path), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.trace_rung == rung and args.trace_system == system:
        command += ["--trace", str(out / f"trace_{rung}_{system}.json.gz")]  # (one trace: one file back)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if system.startswith("ds_") and os.environ.get("SCALE_DS_SITE"):
        # DeepSpeed where it was carried (scripts/gpu_check.sh): on its children's path only; its ops built here.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["SCALE_DS_SITE"], env.get("PYTHONPATH")]))
        env.setdefault("TORCH_EXTENSIONS_DIR", str(scratch / "torch_extensions"))
        if check_device().type == "cpu":
            env.setdefault("DS_ACCELERATOR", "cpu")
    log_path = scratch / f"{rung}_{system}.log"
    started = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        returncode = done.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    try:
        row = json.loads(pathlib.Path(result_path).read_text() or "{}")
    except (OSError, ValueError):
        row = {}
    finally:
        if os.path.exists(result_path):
            os.unlink(result_path)
    row.update(rung=rung, system=system, seconds=time.perf_counter() - started)
    if returncode is None:
        row.setdefault("error", f"timed out after {timeout:.0f} s")
    elif returncode != 0 and "skipped" not in row and "error" not in row:
        row["error"] = f"exited {returncode} without a result"
    log = log_path.read_text()
    if "error" in row:
        row["log_tail"] = log[-3000:]
    with open(out / "children.log", "a") as children:
        children.write(f"===== {rung} {system} =====\n{log}\n")
    return row


def _line(row: dict) -> str:
    head = f"{row['rung']:8s} {row['system']:13s}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    if "error" in row:
        return f"{head} FAILED ({row['seconds']:.0f} s): {row['error'].strip().splitlines()[-1][:300]}"
    b = row["bound"]
    text = (f"{head} step {row['step_s']:.3f} s  {row['model_tflops']:.1f} TFLOP/s ({row['matmul_share']:.0%} of matmul)  "
            f"bound {b['seconds']:.3f} s ({b['bound_by']}), step/bound {row['step_over_bound']:.2f}  "
            f"device peak {row['peak_device_bytes'] / GiB:.1f} GiB  RSS peak {row['peak_rss_bytes'] / GiB:.1f} GiB  "
            f"losses {' '.join(f'{loss:.3f}' for loss in row['losses'])}")
    if row.get("predicted_step_s"):
        text += f"  plan {row['predicted_step_s']:.3f} s ({row['predicted_step_s'] / row['step_s']:.2f}x)"
    if row.get("syncs") is not None:
        text += f"  host syncs in a step: {len(row['syncs'])}"
    return text


def _summary(result: dict) -> None:
    rows = [row for row in result["rows"] if "step_s" in row]
    print("\n| rung | system | step s | TFLOP/s | of matmul | bound s (by) | step/bound | device GiB | RSS GiB | plan/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        plan = f"{row['predicted_step_s'] / row['step_s']:.2f}" if row.get("predicted_step_s") else ""
        print(f"| {row['rung']} | {row['system']} | {row['step_s']:.3f} | {row['model_tflops']:.1f} | "
              f"{row['matmul_share']:.0%} | {row['bound']['seconds']:.3f} ({row['bound']['bound_by']}) | "
              f"{row['step_over_bound']:.2f} | {row['peak_device_bytes'] / GiB:.1f} | {row['peak_rss_bytes'] / GiB:.1f} | {plan} |")
    by_key = {(row["rung"], row["system"]): row for row in rows}
    for rung in dict.fromkeys(row["rung"] for row in rows):
        def ratio(a, b):
            if (rung, a) in by_key and (rung, b) in by_key:
                return by_key[(rung, b)]["step_s"] / by_key[(rung, a)]["step_s"]
            return None
        for a, b in (("zinf", "compile"), ("zinf_cpu", "fsdp2_cpu"), ("zinf_cpu", "ds_cpu"), ("zinf_nvme", "ds_nvme")):
            value = ratio(a, b)
            if value is not None:
                print(f"{rung}: {a} throughput {value:.2f}x {b}'s")
        if (rung, "zinf") in by_key and (rung, "compile") in by_key:
            first = by_key[(rung, "zinf")]["losses"][0], by_key[(rung, "compile")]["losses"][0]
            print(f"{rung}: first loss zinf {first[0]:.6f}, torch.compile {first[1]:.6f} "
                  f"(relative difference {abs(first[0] - first[1]) / abs(first[1]):.2e})")


# --- a child: one system on one rung -------------------------------------------------------------------------


def child(args) -> int:
    device = check_device()
    rung = RUNGS[args.rung]
    rates = json.loads(pathlib.Path(args.rates).read_text())
    row: dict = {"params": param_count(rung)}
    try:
        why_not = _cannot_run(args.system, rung, device, rates)
        if why_not:
            row["skipped"] = why_not
        else:
            row.update(_train(args, rung, device, rates))
    except Exception:
        row["error"] = traceback.format_exc()
    pathlib.Path(args.json).write_text(json.dumps(row, default=str))
    return 0


def _cannot_run(system: str, rung: dict, device: torch.device, rates: dict) -> str | None:
    """Why ``system`` does not run on ``rung`` here, or None."""
    params = param_count(rung)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if system == "compile" and 16 * params > 0.8 * total:
            return f"its fp32 states ({16 * params / 1e9:.0f} GB) do not fit the GPU ({total / 1e9:.0f} GB)"
        if system == "compile" and rung["checkpointing"] != "none":
            return "the rung checkpoints activations, which the plain torch.compile peer does not"
        if system in ("zinf", "zinf_cpu") and 16 * params > 0.8 * total and system == "zinf":
            return "zinf's device tier holds 16 B a parameter, more than the GPU"
        host = _host_memory_bytes()
        if system in ("zinf_cpu", "zinf_opt_cpu", "fsdp2_cpu", "ds_cpu") and 16 * params > 0.85 * host:
            return f"its host states ({16 * params / 1e9:.0f} GB) do not fit the RAM ({host / 1e9:.0f} GB)"
    if system == "zinf_nvme":
        why_not = _nvme_options(params, os.environ.get("SCALE_NVME", tempfile.gettempdir()), device)[1]
        if why_not:
            return why_not
    if system.startswith("ds_"):
        try:
            import deepspeed  # noqa: F401
        except Exception as err:  # (ImportError, or a dependency built for another Python)
            return f"deepspeed does not import here: {type(err).__name__}: {err}"
    if system == "ds_nvme":
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            return "DeepSpeed's async_io op cannot build here (libaio missing)"
    return None


def _nvme_options(params: int, nvme: str, device: torch.device) -> tuple[dict, str | None]:
    """zinf_nvme's options beyond the tiers, sized to this machine's RAM and disk, or why it cannot run.

    Parameters rest on the device (bf16); the fp32 master and moments (12 bytes a parameter) on NVMe, with two
    copies on disk where the early step's held writes fit (``nvme_copies``); where the disk cannot hold them
    all, the RAM cache keeps what the disk cannot (``ram_cache_bytes``), and the fp32 gradients (4 bytes a
    parameter) stay in RAM up to a quarter of the usable RAM (``nvme_grad_ram_bytes``), the rest on disk.
    Usable: 70% of the RAM (the rest: the process, pinned pools, page cache), 80% of the free disk.
    """
    if device.type != "cuda":
        return {}, None  # toy sizes: the defaults
    states, grads = 12 * params, 4 * params
    usable_ram, usable_disk = 0.70 * _host_memory_bytes(), 0.80 * shutil.disk_usage(nvme).free
    if 2 * states + grads <= usable_disk:
        return {}, None  # everything on NVMe, as DeepSpeed's nvme offload puts it
    grad_ram = min(grads, usable_ram / 4)
    cached = usable_ram - grad_ram
    for copies in (2, 1):
        if copies * max(states - cached, 0) + (grads - grad_ram) <= usable_disk:
            return {"ram_cache_bytes": int(min(cached, states)), "nvme_grad_ram_bytes": int(grad_ram),
                    "nvme_copies": copies}, None
    return {}, (f"its host states ({(states + grads) / 1e9:.0f} GB: fp32 master, moments and gradients) exceed "
                f"the usable RAM and disk together ({usable_ram / 1e9:.0f} + {usable_disk / 1e9:.0f} GB)")


def _host_memory_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _train(args, rung: dict, device: torch.device, rates: dict) -> dict:
    from zinf_compiler.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=rung["vocab"], block_size=rung["seq"], n_layer=rung["n_layer"], n_head=rung["n_head"],
                    n_embd=rung["n_embd"])
    batches = _batches(rung, args.warmup + args.steps + 1)
    with torch.device("meta"):
        model = GPT(cfg)
    report: dict = {}
    started = time.perf_counter()
    torch.manual_seed(0)
    system = args.system
    finish = None  # what the system reports of itself after training (zinf: its memory_report)
    if system.startswith("zinf"):
        step, extra, finish = _setup_zinf(model, system, rung, device, rates, args.nvme, batches[0])
    elif system == "compile":
        step, extra = _setup_compile(model, device)
    elif system == "fsdp2_cpu":
        step, extra = _setup_fsdp2(model, device)
    else:
        step, extra = _setup_deepspeed(model, system, rung, device, args.nvme)
    report.update(extra)
    report["setup_s"] = time.perf_counter() - started
    print(f"set up in {report['setup_s']:.1f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for index in range(args.warmup + args.steps):
        idx, targets = (t.to(device, non_blocking=True) for t in batches[index])
        _sync(device)
        begun = time.perf_counter()
        loss = step(idx, targets)
        _sync(device)
        seconds = time.perf_counter() - begun
        value = float(loss)
        print(f"step {index}: {seconds:.3f} s, loss {value:.4f}", flush=True)
        losses.append(value)
        if index >= args.warmup:
            times.append(seconds)
    report.update(step_s=statistics.median(times), step_times=times, losses=losses,
                  all_finite=all(math.isfinite(loss) for loss in losses),
                  peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if finish is not None:
        report.update(finish())
    idx, targets = (t.to(device) for t in batches[-1])
    if device.type == "cuda" and system in ("zinf", "zinf_cpu", "zinf_opt_cpu"):
        report["syncs"] = _host_syncs(lambda: step(idx, targets), device)
    if args.trace:
        _trace(args.trace, lambda: step(idx, targets), device)
    return report


def _batches(rung: dict, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable token batches (a noisy counting sequence; zinf_compiler/gpt.py's), the same in every system."""
    from zinf_compiler.gpt import GPTConfig, synthetic_batches

    cfg = GPTConfig(vocab_size=rung["vocab"], block_size=rung["seq"])
    return synthetic_batches(cfg, rung["batch"], count)


def _init_like_materialize(model: torch.nn.Module, device: torch.device) -> None:
    """``to_empty`` on ``device`` and the GPT's initialization module by module in ``modules()`` order, as
    zinf.materialize does it: the same weights as zinf's where the device's generator is the same."""
    model.to_empty(device=device)
    model.lm_head.weight = model.wte.weight  # (to_empty gives each module a parameter of its own: tie again)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            model.init_weights(module)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _setup_compile(model, device):
    _init_like_materialize(model, device)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    return _plain_step(compiled, opt, device), {}


def _plain_step(model, opt, device):
    def step(idx, targets):
        with _autocast(device):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _setup_zinf(model, system, rung, device, rates, nvme, first_batch):
    import zinf_compiler as zinf
    from zinf_compiler.cost_model import MachineProfile

    zinf.register()
    options = dict(ZINF_OPTIONS[system])
    if rung["checkpointing"] != "none":
        options["activation_checkpointing"] = rung["checkpointing"]
    if system == "zinf_nvme":
        options.update(nvme_path=nvme, **_nvme_options(param_count(rung), nvme, device)[0])
    extra = {"options": {k: v for k, v in options.items() if k != "nvme_path"}}
    profile = MachineProfile(device=str(device), dtype="bfloat16", matmul_flops=rates["matmul_flops"],
                             memory_bandwidth=rates["host_to_device"] * 20 if device.type == "cuda" else 12e9,
                             host_to_device=rates["host_to_device"], host_memory_bandwidth=12e9,
                             disk_read=rates.get("disk_read"), disk_write=rates.get("disk_write"))
    try:
        idx, targets = (t.to(device) for t in first_batch)
        predicted = zinf.plan(model, (idx, targets), options, profile=profile, built_in_memory=False, device=device)
        extra["predicted_step_s"] = predicted.step["predicted"]
        extra["predicted_parts"] = predicted.step
    except Exception as err:  # a prediction that fails is a finding, not a reason to skip the measurement
        extra["plan_error"] = f"{type(err).__name__}: {err}"
    torch.manual_seed(0)
    zinf.materialize(model, options, init_fn=model.init_weights, device=device)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)

    def finish() -> dict:
        report = zinf.memory_report(compiled)
        return {"memory_report": report, "nvme_state_bytes": report["nvme"]["optimizer"]}

    return _plain_step(compiled, opt, device), extra, finish


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _setup_fsdp2(model, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _init_process_group(device)
    mesh = init_device_mesh(device.type, (1,))
    cuda = device.type == "cuda"
    policy = CPUOffloadPolicy(pin_memory=cuda)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=precision)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=precision)
    # Sharded parameters live on the CPU under CPUOffloadPolicy; buffers on the compute device.
    _init_like_materialize(model, torch.device("cpu"))
    for module in model.modules():
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return _plain_step(model, opt, device), {}


def _setup_deepspeed(model, system, rung, device, nvme):
    import deepspeed

    _init_process_group(device)
    nvme_tier = system == "ds_nvme"
    largest = max(p.numel() for p in model.parameters())
    offload_param = {"device": "nvme" if nvme_tier else "cpu", "pin_memory": device.type == "cuda"}
    offload_opt = dict(offload_param)
    if nvme_tier:
        offload_param.update(nvme_path=nvme, buffer_count=5, buffer_size=largest)
        offload_opt.update(nvme_path=nvme)
    config = {
        "train_micro_batch_size_per_gpu": rung["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_opt,
                              "stage3_prefetch_bucket_size": 0 if nvme_tier else 5e7,
                              "stage3_max_reuse_distance": 0 if nvme_tier else 1e9},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        from zinf_compiler.gpt import GPT

        torch.manual_seed(0)
        built = GPT(model.cfg)
    engine, _, _, _ = deepspeed.initialize(model=built, model_parameters=built.parameters(), config=config)

    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step, {"deepspeed": deepspeed.__version__}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_syncs(step, device) -> list[str]:
    """Where one step blocks the host on the device: torch's sync debug mode's warnings, each with the line of
    zinf (or the caller) that caused it."""
    import warnings

    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = []
    for warning in caught:
        if "synchroniz" in str(warning.message):
            found.append(f"{warning.filename}:{warning.lineno}")
    return found


def _trace(path: str, step, device) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=activities) as profiler:
        step()
        _sync(device)
    with tempfile.TemporaryDirectory() as scratch:
        raw = os.path.join(scratch, "trace.json")
        profiler.export_chrome_trace(raw)
        with open(raw, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)
    print(f"trace: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="parent", choices=["parent", "child"])
    parser.add_argument("--rungs", default="", help=f"comma-separated, from {', '.join(RUNGS)}")
    parser.add_argument("--systems", default="", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--budget-s", type=float, default=470.0, help="stop starting children after this long")
    parser.add_argument("--child-s", type=float, default=240.0, help="the most one child may take")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "scale_out"))
    parser.add_argument("--nvme", default="", help="folder for the NVMe tier and the disk probe (default: a temporary one)")
    parser.add_argument("--trace-rung", default="1b")
    parser.add_argument("--trace-system", default="zinf_cpu")
    # (child only)
    parser.add_argument("--rung", default="")
    parser.add_argument("--system", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--rates", default="")
    parser.add_argument("--trace", default="")
    args = parser.parse_args()
    return child(args) if args.mode == "child" else parent(args)


if __name__ == "__main__":
    sys.exit(main())
