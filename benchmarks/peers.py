"""zinf next to its peers: eager, Inductor, FSDP2, DeepSpeed ZeRO-3 (issue 17).

    python benchmarks/peers.py [--world-sizes 1,2 --rounds 3 --steps 2 --warmup 2]
    python benchmarks/peers.py --find-max [--step-budget-s 90 --time-limit 1500]

Needs DeepSpeed outside the project's environment: ``bash scripts/install_bench.sh``
(DeepSpeed and its torch-free dependencies into ``.bench/site``, libaio-dev
for its NVMe offload). Without it the DeepSpeed rows report the import error.

Default mode: the example GPT (``zinf_compiler/gpt.py``) trains under every
system at world sizes 1 and 2 (gloo on localhost, one process per rank):

* eager PyTorch and Inductor (``torch.compile``, default backend) with
  ``torch.optim.AdamW``; at world size 2 wrapped in DDP (data parallel, every
  state replicated);
* PyTorch FSDP2: ``fully_shard`` on every block and on the root, eager,
  ``torch.optim.AdamW``; with and without ``CPUOffloadPolicy``;
* DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on
  ``cpu`` and on ``nvme`` (its optimizer: DeepSpeedCPUAdam in AdamW mode);
* zinf at stage 3 with ``offload_param``/``offload_optimizer`` = none, cpu,
  nvme, ``zinf.optim.AdamW``, default options (Inductor lowering; at nvme,
  ``nvme_grad_ram_bytes="auto"`` keeps gradients in RAM within an eighth of
  the memory available, as DeepSpeed keeps them in RAM); nvme with
  ``nvme_grad_ram_bytes`` covering every gradient (``zinf_nvme_ram``) and with
  none (``zinf_nvme_disk``, every gradient in swap files);
  ``zinf_nvme_early`` and ``zinf_nvme_ram_early`` are the first two with
  ``overlap_optimizer=True`` (the optimizer stepped during backward, which
  "auto" also does since 2026-11-25), and ``zinf_nvme_late`` the default with
  ``overlap_optimizer=False`` (every step after backward); ``zinf_cache``,
  ``zinf_cache_1536m`` and ``zinf_cache_1g`` the default with ``host_memory``
  2.9 GiB, 1.5 GiB and 1 GiB (the RAM cache over the NVMe tier keeps the
  states that fit in RAM).

With nvme configurations, the disk's read and write rates are probed once at
the start (zinf's swap engine, 512 MiB each way), and a table puts each zinf
configuration's median step next to its physical limit: max(compute, disk
bytes / disk rate, collective bytes / link rate), with the bytes rank 0's
zinf counted per measured step (disk bytes times the world size: the ranks
share the disk), compute the eager step at the same world size, and the
collective rate zinf's cost model measured.

Same for all: fp32 everywhere, the same initial weights (``torch.manual_seed``
before building the GPT), the same global batches (rank r takes its slice of
each global batch, so every world size trains the same global batch), AdamW
with the same lr, betas, eps and weight decay, no gradient clipping, the same
number of compute threads per rank (cores / world size). One step = forward,
backward, optimizer step, zero_grad, timed on rank 0 after a barrier.

Each configuration runs in its own processes (one per rank) for the whole
run, so its peak RSS (``ru_maxrss``, max over its ranks) is its own. The
configurations of one group (by default those of one offload placement at
one world size: no offload, cpu, nvme; every target compares within one
group) are started one after the other (each compiles and takes
``--warmup`` steps alone), then take turns: in each of ``--rounds`` rounds
each runs ``--steps`` steps while the others wait idle on a pipe. Every
configuration runs the same sequence of batches.

Before any speed figure is printed, every configuration's loss trajectory
(warm-up and measured steps, the global-batch loss averaged over the ranks)
is compared with eager PyTorch's at world size 1: a configuration that
differs by more than ``--loss-atol + --loss-rtol * |loss|`` at any step is
reported as a mismatch and gets no speed figure. A configuration that cannot
run (an exception, a crash, a timeout) is reported with its error.

Bytes on disk: the parent samples the size (allocated blocks) of each
configuration's NVMe swap folder while it runs; the largest size is
reported.

``--find-max``: for each system, the largest GPT (``--ladder``: widths and
depths growing in steps) it trains on this machine, world size 1: each
attempt is a subprocess that builds the model the system's own way for large
models (eager: in RAM; FSDP2: on the meta device, then ``to_empty`` and
init; DeepSpeed: ``deepspeed.zero.Init`` with ``remote_device`` = the offload
device; zinf: ``zinf.materialize`` from the meta device), takes one warm-up
step (compilation) and one timed step; it succeeds when the timed step takes at
most ``--step-budget-s`` and its loss is finite. An attempt whose resident set
passes ``--mem-limit-gib`` (default: MemTotal less 1.5 GiB) is killed by the
parent, as is one past its time; like an OOM kill, that is a result, not a
crash, and so is an NVMe attempt whose swap files would leave less than
``--disk-margin-gib`` of free disk (not started). DeepSpeed runs with
``sub_group_size`` 1e8 there (its default, 1e9, holds 16 GB of optimizer
state in RAM during the step); zinf with ``nvme_copies=1`` (``--nvme-copies``;
DeepSpeed keeps one copy). Each system starts where the systems of its class
(RAM-bound, or NVMe) stopped, an NVMe system one rung above the best so far,
and climbs while it passes (down when its first try fails); the search stops
at ``--time-limit`` seconds, and what was not tried is reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_SITE = os.path.join(REPO, ".bench", "site")
TORCH_EXTENSIONS = os.path.join(REPO, ".bench", "torch_extensions")

PEAK_OF = "peak RSS of "  # a host_memory resolved in the run from another configuration's measured peak
# key -> (label, kind, settings). Placement: where parameters and optimizer state rest.
SYSTEMS = {
    "eager": ("eager PyTorch", "torch", {"compile": False, "placement": "none"}),
    "inductor": ("Inductor (torch.compile)", "torch", {"compile": True, "placement": "none"}),
    "fsdp2": ("FSDP2 fully_shard", "fsdp2", {"offload": False, "placement": "none"}),
    "fsdp2_cpu": ("FSDP2 + CPUOffloadPolicy", "fsdp2", {"offload": True, "placement": "cpu"}),
    "ds_cpu": ("DeepSpeed ZeRO-3, offload cpu", "deepspeed", {"device": "cpu", "placement": "cpu"}),
    "ds_nvme": ("DeepSpeed ZeRO-3, offload nvme", "deepspeed", {"device": "nvme", "placement": "nvme"}),
    "zinf": ("zinf stage 3, no offload", "zinf", {"device": "none", "placement": "none"}),
    # What a user whose model fits picks: parameters replicated, gradients and optimizer state sharded.
    "zinf_s2": ("zinf stage 2, no offload", "zinf", {"device": "none", "placement": "none", "stage": 2}),
    "zinf_cpu": ("zinf stage 3, offload cpu", "zinf", {"device": "cpu", "placement": "cpu"}),
    # Default options: nvme_grad_ram_bytes="auto" keeps gradients in RAM within an eighth of the memory
    # available (all of them for the default model here; at --find-max sizes, part of them).
    "zinf_nvme": ("zinf stage 3, offload nvme", "zinf", {"device": "nvme", "placement": "nvme"}),
    # Every gradient in swap files (nvme_grad_ram_bytes=0, the default before "auto").
    "zinf_nvme_disk": ("zinf stage 3, offload nvme, gradients on disk", "zinf",
                       {"device": "nvme", "placement": "nvme", "grads_in_ram": False}),
    # Like DeepSpeed, which keeps gradients in RAM: nvme_grad_ram_bytes covering every gradient.
    "zinf_nvme_ram": ("zinf stage 3, offload nvme, gradients in RAM", "zinf",
                      {"device": "nvme", "placement": "nvme", "grads_in_ram": True}),
    # The two above with the optimizer stepped during backward (overlap_optimizer=True; "auto", the default,
    # is the same since 2026-11-25), and the default with it off: what it changes, in the same run.
    "zinf_nvme_early": ("zinf stage 3, offload nvme, optimizer during backward", "zinf",
                        {"device": "nvme", "placement": "nvme", "overlap_optimizer": True}),
    "zinf_nvme_ram_early": ("zinf stage 3, offload nvme, gradients in RAM, optimizer during backward", "zinf",
                            {"device": "nvme", "placement": "nvme", "grads_in_ram": True,
                             "overlap_optimizer": True}),
    "zinf_nvme_late": ("zinf stage 3, offload nvme, optimizer after backward", "zinf",
                       {"device": "nvme", "placement": "nvme", "overlap_optimizer": False}),
    # The RAM cache over the NVMe tier (option host_memory, zinf_compiler/ram_cache.py): the states that fit
    # stay in RAM. 2.9 GiB is DeepSpeed NVMe's peak RSS for the default GPT (issue 38); at the default size the
    # smaller two keep part of the optimizer state on disk, the largest nothing.
    "zinf_cache": ("zinf stage 3, offload nvme, host_memory 2.9GiB", "zinf",
                   {"device": "nvme", "placement": "nvme", "host_memory": "2.9GiB"}),
    "zinf_cache_1g": ("zinf stage 3, offload nvme, host_memory 1GiB", "zinf",
                      {"device": "nvme", "placement": "nvme", "host_memory": "1GiB"}),
    "zinf_cache_1536m": ("zinf stage 3, offload nvme, host_memory 1.5GiB", "zinf",
                         {"device": "nvme", "placement": "nvme", "host_memory": "1536MiB"}),
    # Issue 38, acceptance 4, --find-max's largest model (states about 2x this machine's 23.6 GiB of RAM): the
    # cache over NVMe within 18 GiB of RSS (its quarter of headroom leaves about 6 GiB of states), and 11 GiB of
    # states cached (option ram_cache_bytes, as zinf.plan sizes it for a budget), against the all-NVMe run.
    "zinf_cache_18g": ("zinf stage 3, offload nvme, host_memory 18GiB", "zinf",
                       {"device": "nvme", "placement": "nvme", "host_memory": "18GiB"}),
    "zinf_cache_11g_states": ("zinf stage 3, offload nvme, ram_cache_bytes 11GiB", "zinf",
                              {"device": "nvme", "placement": "nvme", "ram_cache_bytes": 11 << 30}),
    # Issue 38, acceptance 4: host_memory = DeepSpeed NVMe's own peak RSS in this run (its ranks' VmHWM after its
    # warm-up, the largest over its ranks); list ds_nvme before it in --systems.
    "zinf_cache_ds": ("zinf stage 3, offload nvme, host_memory = DeepSpeed nvme's peak RSS", "zinf",
                      {"device": "nvme", "placement": "nvme", "host_memory": PEAK_OF + "ds_nvme"}),
}
ZINF_OF_PLACEMENT = {"none": "zinf", "cpu": "zinf_cpu", "nvme": "zinf_nvme"}
REFERENCE = ("eager", 1)
BASELINE_SUFFIX = "@baseline"  # --baseline: the same zinf configuration run from another checkout

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
DEFAULT_LADDER = "4x1024,12x2048,16x2304,20x2560,24x2816,28x3072"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def dir_bytes(path: str) -> int:
    """Allocated bytes of every file under ``path`` (st_blocks: what the disk holds)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal")


def tree_rss_bytes(pid: int) -> int:
    """Resident set of ``pid`` and its descendants (from /proc)."""
    total, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{current}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    stack.extend(int(child) for child in children.read().split())
    return total


# ======================================================================================
# Worker: one rank of one configuration
# ======================================================================================



DISK_PROBE_BYTES = 512 << 20


def proc_peak_rss(pid: int) -> int:
    """A live process's peak resident set so far (VmHWM: what its ru_maxrss will report), bytes."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def proc_disk_bytes(pid: int) -> tuple[int, int]:
    """(read, written) bytes a process has sent to or fetched from storage (/proc/PID/io, all its threads).

    The OS's count, the same for every system: reads served from the page cache are not in it, and a
    buffered write counts when the page is dirtied."""
    fields = {}
    with open(f"/proc/{pid}/io") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            fields[name] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def probe_disk(folder: str) -> dict[str, float]:
    """The disk's read and write rates through zinf's swap engine (as the steps use it), before any system runs.

    One probe for the whole run, larger than the cost model's 32 MiB (whose per-process figures vary 2x
    here), so every configuration's limit uses the same rates.
    """
    import torch
    from zinf_compiler.runtime.aio import AioEngine
    from zinf_compiler.runtime.pinned import PinnedPool

    chunk = 32 << 20
    keys = [f"probe.{index}" for index in range(DISK_PROBE_BYTES // chunk)]
    with tempfile.TemporaryDirectory(prefix="disk-probe-", dir=folder) as probe_dir:
        pool = PinnedPool(4 * chunk)
        buffers = [pool.acquire(chunk) for _ in range(4)]
        for buffer in buffers:
            buffer.tensor(torch.uint8).fill_(7)
        with AioEngine(probe_dir) as engine:
            started = time.perf_counter()
            requests = [engine.write(key, buffers[index % 4], chunk) for index, key in enumerate(keys)]
            for request in requests:
                request.wait()
            write_rate = DISK_PROBE_BYTES / (time.perf_counter() - started)
            started = time.perf_counter()
            requests = [engine.read(key, buffers[index % 4], chunk) for index, key in enumerate(keys)]
            for request in requests:
                request.wait()
            read_rate = DISK_PROBE_BYTES / (time.perf_counter() - started)
        for buffer in buffers:
            buffer.release()
        pool.close()
    return {"disk_read": read_rate, "disk_write": write_rate}


def limit_seconds(compute_s: float, io: dict) -> dict[str, float]:
    """The physical limit of one step: compute, the disk's bytes, or the collectives' bytes, whichever is longest.

    ``io``: bytes per step (``disk_read``, ``disk_written``, ``collective``) and the cost model's rates
    (bytes/s) under ``rates``; reads and writes share one disk, so their times add up.
    """
    rates = io["rates"]
    disk_s = sum(io[name] / rates[rate] for name, rate in (("disk_read", "disk_read"), ("disk_written", "disk_write"))
                 if io[name] and rates.get(rate))
    collective_s = io["collective"] / rates["collective"] if io["collective"] and rates.get("collective") else 0.0
    return {"compute": compute_s, "disk": disk_s, "collective": collective_s,
            "bound": max(compute_s, disk_s, collective_s)}


def _print_limit_model(configs, comparable) -> None:
    """Each zinf configuration's median step next to max(compute, disk bytes / disk rate, collective bytes / link
    rate): bytes per step as rank 0 counted them, rates from zinf's cost model (its probes in that process),
    compute as the eager step at the same world size in this run (a step with nothing to move)."""
    eager = {c.world: c.median() for c in configs if c.key == "eager" and c.name in comparable}
    rows = [c for c in configs if c.io and c.name in comparable and c.world in eager]
    if not rows:
        return
    print("\n## The physical limit per step\n")
    print("bound = max(compute, disk, collective): compute is eager's step at the same world size; disk is rank 0's "
          "swap bytes read and written per step at the disk rates probed at the start of this run (read + write: "
          "one disk, shared by the ranks at world > 1, so their bytes add up); collective is its collective bytes "
          "per step at the all-gather rate zinf's cost model measured.\n")
    print("| configuration | disk read / written per step, all ranks (MiB) | collective per step (MiB) | compute (s) | disk (s) "
          "| collective (s) | bound (s) | median step (s) | step / bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in rows:
        steps = sum(round_io["steps"] for round_io in config.io)
        per_step = {name: sum(round_io[name] for round_io in config.io) / steps
                    for name in ("disk_read", "disk_written", "collective")}
        for name in ("disk_read", "disk_written"):
            per_step[name] *= config.world  # rank 0's bytes; the ranks are alike and share the disk
        rates = dict(config.io[-1]["rates"], **getattr(config.args, "disk_rates", {}))
        limit = limit_seconds(eager[config.world], dict(per_step, rates=rates))
        median = config.median()
        print(f"| {config.name} | {per_step['disk_read'] / 2**20:,.0f} / {per_step['disk_written'] / 2**20:,.0f} | "
              f"{per_step['collective'] / 2**20:,.0f} | {limit['compute']:.3f} | {limit['disk']:.3f} | "
              f"{limit['collective']:.3f} | {limit['bound']:.3f} | {median:.3f} | {median / limit['bound']:.2f} |")


def _print_os_disk_bytes(configs, comparable) -> None:
    """Storage bytes per measured step as the OS counted them (/proc/PID/io, summed over the ranks): the one count
    that is the same for zinf and DeepSpeed (issue 38, acceptance 5)."""
    rows = [c for c in configs if c.name in comparable and c.settings.get("placement") == "nvme" and c.os_io]
    if not rows:
        return
    print("\n## Disk bytes per step as the OS counted them\n")
    print("Each rank's /proc/PID/io read_bytes / write_bytes over the measured steps, summed over the ranks (reads "
          "the page cache served are not counted; a buffered write counts when it dirties the page).\n")
    print("| configuration | read per step (MiB) | written per step (MiB) | zinf's own count, read / written (MiB) |")
    print("|---|---|---|---|")
    for config in rows:
        steps = sum(r["steps"] for r in config.os_io)
        read = sum(r["read"] for r in config.os_io) / steps
        written = sum(r["written"] for r in config.os_io) / steps
        own = "-"
        if config.io:
            own_steps = sum(r["steps"] for r in config.io)
            own = (f"{sum(r['disk_read'] for r in config.io) * config.world / own_steps / 2**20:,.0f} / "
                   f"{sum(r['disk_written'] for r in config.io) * config.world / own_steps / 2**20:,.0f}")
        print(f"| {config.name} | {read / 2**20:,.0f} | {written / 2**20:,.0f} | {own} |")


def _zinf_io_counters() -> dict[str, int]:
    """Bytes this rank's zinf moved so far: swap reads and writes, collectives (for the limit model)."""
    from zinf_compiler.api import RUNTIME

    engines = RUNTIME.store.engines()
    return {"disk_read": sum(engine.bytes_read for engine in engines),
            "disk_written": sum(engine.bytes_written for engine in engines),
            "collective": sum(RUNTIME.comm.traffic_bytes.values())}


def _zinf_rates() -> dict[str, float | None]:
    """The rates zinf's cost model measured in this process (disk read and write, collective)."""
    from zinf_compiler.cost_model import measured_profiles

    rates = {"disk_read": None, "disk_write": None, "collective": None}
    for profile in measured_profiles():
        for name in rates:
            rates[name] = rates[name] or getattr(profile, name)
    return rates


def _training_step(model, opt):
    """One plain PyTorch training step (forward, backward, step, zero_grad); returns the loss."""

    def step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step

class Worker:
    """Builds one system's training step; the parent drives it through stdin."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.result_fd = int(os.environ["PEERS_FD"])
        self.cleanups: list = []

    def send(self, **message) -> None:
        os.write(self.result_fd, (json.dumps(message) + "\n").encode())

    # --- model and data ---------------------------------------------------------------

    def config(self):
        from zinf_compiler.gpt import GPTConfig

        s = self.spec
        return GPTConfig(vocab_size=s["vocab"], block_size=s["seq"], n_layer=s["n_layer"], n_head=s["n_head"],
                         n_embd=s["n_embd"])

    def batches(self, count: int):
        from zinf_compiler.gpt import synthetic_batches

        per_rank = self.spec["batch"] // self.world
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return [(idx[mine].contiguous(), tgt[mine].contiguous())
                for idx, tgt in synthetic_batches(self.config(), self.spec["batch"], count, seed=1)]

    def build_model(self):
        """The GPT with the same initial weights in every system and process."""
        import torch
        from zinf_compiler.gpt import GPT

        torch.manual_seed(0)
        return GPT(self.config())

    # --- systems ------------------------------------------------------------------------

    def setup(self):
        """Returns ``step(idx, targets) -> loss``; each system's own training step."""
        import torch

        kind, settings = self.spec["kind"], self.spec["settings"]
        big = self.spec.get("find_max", False)
        if kind == "torch":
            model = self.build_model()
            module = model
            if self.world > 1:
                model = torch.nn.parallel.DistributedDataParallel(model)
            if settings["compile"]:
                model = torch.compile(model)
            opt = torch.optim.AdamW(module.parameters(), **ADAMW)

            return _training_step(model, opt)
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            mesh = init_device_mesh("cpu", (self.world,))
            policy = CPUOffloadPolicy(pin_memory=False) if settings["offload"] else OffloadPolicy()
            if big:  # sharded initialization: built on meta, each rank allocates its shards only
                from zinf_compiler.gpt import GPT

                with torch.device("meta"):
                    model = GPT(self.config())
            else:
                model = self.build_model()
            for block in model.blocks:
                fully_shard(block, mesh=mesh, offload_policy=policy)
            fully_shard(model, mesh=mesh, offload_policy=policy)
            if big:
                torch.manual_seed(0)
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for module in model.modules():
                        model.init_weights(module)
            opt = torch.optim.AdamW(model.parameters(), **ADAMW)

            return _training_step(model, opt)
        if kind == "deepspeed":
            return self.setup_deepspeed(settings["device"], big)
        if kind == "zinf":
            return self.setup_zinf(settings["device"], big, settings.get("grads_in_ram"),
                                   settings.get("stage", 3), settings.get("overlap_optimizer", "auto"),
                                   settings.get("host_memory"), settings.get("ram_cache_bytes"))
        raise ValueError(kind)

    def setup_deepspeed(self, device: str, big: bool):
        import deepspeed
        import torch
        from zinf_compiler.gpt import GPT

        cfg = self.config()
        nvme = device == "nvme"
        with torch.device("meta"):
            numels = [p.numel() for p in GPT(cfg).parameters()]
        largest = max(numels)
        offload_param = {"device": device, "pin_memory": False}
        offload_opt = {"device": device, "pin_memory": False}
        zero = {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_opt}
        if big:
            # --find-max: optimizer sub-groups of 1e8 elements instead of the default 1e9, whose
            # step holds 16 GB of fp32 master, moments and gradients in RAM at once (DeepSpeed's
            # documented knob for CPU memory in the optimizer step; zinf streams 16M at a time).
            zero["sub_group_size"] = 10**8
        if nvme:
            swap = self.spec["swap_dir"]
            # buffer_size: at least the largest parameter (DeepSpeed's default, 1e8
            # elements x 5 buffers, would pin 2 GB for this model); buffer_count: default.
            offload_param.update(nvme_path=swap, buffer_count=5, buffer_size=largest)
            offload_opt.update(nvme_path=swap)
            if not big:
                # Overlap the optimizer's swap-in/out with its step (DeepSpeed's faster path). With
                # several sub-groups (--find-max) 0.19.8's pipelined swapper runs out of its
                # default 4 buffers ("assert new_alloc_buffers is not None"), so there it keeps
                # its default, no pipelining.
                offload_opt.update(pipeline_read=True, pipeline_write=True)
            # Without these two, 0.19.8 fails with "param already assigned swap buffer
            # id", then "Not enough buffers".
            zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
        config = {
            "train_micro_batch_size_per_gpu": self.spec["batch"] // self.world,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # 0.19.8 clips at 1.0 unless told
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if nvme:
            config["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                             "single_submit": False, "overlap_events": True}
        deepspeed.init_distributed(dist_backend="gloo")
        # ZeRO-3's way to build a model: partitioned (and offloaded) as it is constructed.
        # Given the config, it keeps fp32 parameters; a model converted by initialize()
        # alone gets DeepSpeed's default dtype on this accelerator for its NVMe swap
        # buffers (fp16 or bf16), so its fp32 NVMe offload rounds the parameters.
        with deepspeed.zero.Init(remote_device=device, pin_memory=False, config_dict_or_path=config):
            model = self.build_model()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        # The tied head: lm_head uses wte's parameter, which ZeRO-3 otherwise gathers
        # only around wte.
        deepspeed.zero.register_external_parameter(engine.module.lm_head, engine.module.wte.weight)
        self.cleanups.append(engine.destroy)

        def step(idx, targets):
            loss = engine(idx, targets)
            engine.backward(loss)
            engine.step()  # DeepSpeed's step zeroes the gradients itself
            return loss

        return step

    def setup_zinf(self, device: str, big: bool, grads_in_ram: bool | None = None, stage: int = 3,
                   overlap_optimizer: bool | str = "auto", host_memory: str | None = None,
                   ram_cache_bytes: int | None = None):
        import torch
        import zinf_compiler as zinf
        from zinf_compiler.gpt import GPT

        options = {"stage": stage, "offload_param": device, "offload_optimizer": device}
        if device == "nvme":
            options["nvme_path"] = self.spec["swap_dir"]
            options["nvme_copies"] = self.spec["nvme_copies"]
            if grads_in_ram is not None:  # None: the default ("auto")
                options["nvme_grad_ram_bytes"] = 1 << 40 if grads_in_ram else 0
            options["overlap_optimizer"] = overlap_optimizer
            options["host_memory"] = host_memory
            options["ram_cache_bytes"] = ram_cache_bytes
        if self.spec.get("trace_dir"):
            options.update(dump_dir=self.spec["trace_dir"], trace_step=self.spec["trace_step"])
        if big:
            with torch.device("meta"):
                model = GPT(self.config())
            torch.manual_seed(0)
            zinf.materialize(model, options, init_fn=model.init_weights)
        else:
            model = self.build_model()
        compiled = torch.compile(model, backend="zinf", options=options)
        opt = zinf.optim.AdamW(model.parameters(), **ADAMW)

        return _training_step(compiled, opt)

    # --- the protocol -------------------------------------------------------------------

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(self.spec["threads"])
        if self.spec.get("find_max"):
            # If the kernel's OOM killer must act, it takes this attempt, not another process.
            with contextlib.suppress(OSError):
                with open("/proc/self/oom_score_adj", "w") as handle:
                    handle.write("1000")
        distributed = self.world > 1 or self.spec["kind"] in ("fsdp2", "deepspeed")
        if distributed:
            dist.init_process_group("gloo")
        total = self.spec["warmup"] + self.spec["rounds"] * self.spec["steps"]
        batches = self.batches(total)
        position = 0

        def one_step():
            nonlocal position
            idx, targets = batches[position]
            position += 1
            if self.world > 1:
                dist.barrier()
            started = time.perf_counter()
            loss = step(idx, targets)
            seconds = time.perf_counter() - started
            value = loss.detach().float().reshape(1).clone()
            if self.world > 1:
                dist.all_reduce(value)  # the global batch's loss: the mean of the ranks' halves
                value /= self.world
            return seconds, float(value)

        try:
            started = time.perf_counter()
            step = self.setup()
            setup_seconds = time.perf_counter() - started
            warm = [one_step() for _ in range(self.spec["warmup"])]
            self.send(event="ready", setup_seconds=setup_seconds, times=[t for t, _ in warm],
                      losses=[v for _, v in warm])
            for line in sys.stdin:
                command = line.split()
                if not command:
                    continue
                if command[0] == "steps":
                    before = _zinf_io_counters() if self.spec["kind"] == "zinf" else None
                    done = [one_step() for _ in range(int(command[1]))]
                    io = None
                    if before is not None:
                        after = _zinf_io_counters()
                        io = {name: after[name] - before[name] for name in before}
                        io["rates"] = _zinf_rates()
                    self.send(event="done", times=[t for t, _ in done], losses=[v for _, v in done], io=io)
                elif command[0] == "finish":
                    break
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            for cleanup in self.cleanups:
                cleanup()
            self.send(event="final", peak_rss=peak)
        except BaseException as err:  # reported as this configuration's result
            text = f"{type(err).__name__}: {err}"
            frames = traceback.extract_tb(err.__traceback__)
            if frames and len(str(err)) < 40:  # a bare assert: name the line that raised it
                where = frames[-1]
                text += f" (at {'/'.join(where.filename.split('/')[-3:])}:{where.lineno}: {where.line})"
            traceback.print_exc()
            self.send(event="error", error=text[:2000])
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)  # do not wait on the other rank's collectives
        if distributed:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# ======================================================================================
# Parent: launching and driving configurations
# ======================================================================================


class Config:
    """One system at one world size: its rank processes and what they reported."""

    def __init__(self, key: str, world: int, args, workdir: str, settings_override: dict | None = None):
        self.key, self.world, self.args = key, world, args
        self.label, self.kind, settings = SYSTEMS[key]
        self.settings = dict(settings, **(settings_override or {}))
        self.folder = tempfile.mkdtemp(prefix=f"{key}-w{world}-", dir=workdir)
        self.swap_dir = os.path.join(args.nvme_path, os.path.basename(self.folder))
        self.procs: list[subprocess.Popen] = []
        self.readers: list = []
        self.error: str | None = None
        self.times: list[float] = []
        self.losses: list[float] = []
        self.io: list[dict] = []  # zinf: bytes moved over each round's measured steps (rank 0), and the rates
        self.os_io: list[dict] = []  # every system: storage bytes over each round's measured steps, all ranks
        self.warm_times: list[float] = []
        self.setup_seconds: float | None = None
        self.peak_rss: int | None = None
        self.disk_peak = 0
        self.rss_peak_tree = 0

    @property
    def name(self) -> str:
        ddp = " + DDP" if self.kind == "torch" and self.world > 1 else ""
        return f"{self.label}{ddp} @ world {self.world}"

    def spec(self, extra: dict | None = None) -> dict:
        a = self.args
        spec = {"kind": self.kind, "settings": self.settings, "n_layer": a.n_layer, "n_embd": a.n_embd,
                "n_head": a.n_head, "vocab": a.vocab, "seq": a.seq, "batch": a.batch, "warmup": a.warmup,
                "rounds": a.rounds, "steps": a.steps, "threads": max(1, a.threads // self.world),
                "swap_dir": self.swap_dir, "nvme_copies": a.nvme_copies}
        spec.update(extra or {})
        return spec

    def interpreter(self) -> tuple[str, str, str]:
        """(python, this script, checkout) a rank runs: this checkout's, or --baseline's for a baseline twin."""
        checkout = self.settings.get("checkout")
        if checkout is None:
            return sys.executable, os.path.abspath(__file__), REPO
        venv_python = os.path.join(checkout, ".venv", "bin", "python")
        python = venv_python if os.path.exists(venv_python) else sys.executable
        return python, os.path.join(checkout, "benchmarks", "peers.py"), checkout

    def start(self, extra: dict | None = None) -> None:
        if self.settings["placement"] == "nvme" or self.kind == "deepspeed":
            os.makedirs(self.swap_dir, exist_ok=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        spec = json.dumps(self.spec(extra))
        for rank in range(self.world):
            read_fd, write_fd = os.pipe()
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PEERS_FD=str(write_fd), OMP_NUM_THREADS=str(max(1, self.args.threads // self.world)),
                       TMPDIR=self.folder, PYTHONUNBUFFERED="1")
            if self.kind == "deepspeed":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [BENCH_SITE, env.get("PYTHONPATH")]))
                env["PATH"] = os.pathsep.join([os.path.join(BENCH_SITE, "bin"), env.get("PATH", "")])
                env["TORCH_EXTENSIONS_DIR"] = TORCH_EXTENSIONS
                env.setdefault("DS_ACCELERATOR", "cpu")
            out = open(os.path.join(self.folder, f"rank{rank}.log"), "w")
            python, script, checkout = self.interpreter()
            proc = subprocess.Popen([python, script, "--worker", spec], env=env,
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    pass_fds=(write_fd,), cwd=checkout, start_new_session=True)
            os.close(write_fd)
            out.close()
            self.procs.append(proc)
            self.readers.append(os.fdopen(read_fd, "r"))

    def disk_bytes_now(self) -> tuple[int, int] | None:
        """(read, written) storage bytes of all ranks so far, as the OS counts them; None once a rank is gone."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            totals = [proc_disk_bytes(proc.pid) for proc in self.procs]
            return sum(t[0] for t in totals), sum(t[1] for t in totals)
        return None

    def resolve_budget(self, configs: list["Config"]) -> None:
        """A host_memory of PEAK_OF + key: that configuration's peak RSS so far (max over its ranks)."""
        budget = self.settings.get("host_memory")
        if not (isinstance(budget, str) and budget.startswith(PEAK_OF)):
            return
        peer_key = budget.removeprefix(PEAK_OF)
        peer = next((c for c in configs if c.key == peer_key and c.error is None and c.procs), None)
        if peer is None:
            self.error = f"host_memory is {peer_key}'s peak RSS, but {peer_key} did not run before it in this group"
            return
        peak = max(proc_peak_rss(proc.pid) for proc in peer.procs)
        self.settings["host_memory"] = peak
        self.label = f"{self.label} ({gib(peak)} GiB)"
        log(f"world {self.world}: {self.key}: host_memory = {peer.label}'s peak RSS after its warm-up, {gib(peak)} GiB")

    def _sample(self, rss: bool) -> None:
        with contextlib.suppress(Exception):
            if os.path.isdir(self.swap_dir):
                self.disk_peak = max(self.disk_peak, dir_bytes(self.swap_dir))
            if rss:  # --find-max only: the default mode reads each rank's own ru_maxrss
                self.rss_peak_tree = max(self.rss_peak_tree, sum(tree_rss_bytes(p.pid) for p in self.procs))

    def receive(self, event: str, timeout: float, mem_limit: int | None = None) -> list[dict] | None:
        """The next message of every rank (``event`` expected); None and ``self.error`` on failure."""
        deadline = time.monotonic() + timeout
        messages: list[dict | None] = [None] * self.world
        import selectors

        selector = selectors.DefaultSelector()
        for rank, reader in enumerate(self.readers):
            selector.register(reader, selectors.EVENT_READ, rank)
        try:
            while any(m is None for m in messages):
                self._sample(rss=mem_limit is not None)
                if mem_limit is not None and self.rss_peak_tree > mem_limit:
                    self.fail(f"killed by the benchmark: resident set {gib(self.rss_peak_tree)} GiB passed the "
                              f"limit of {gib(mem_limit)} GiB (would not fit in this machine's RAM)")
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self.fail(f"timeout: no '{event}' within {timeout:.0f} s")
                    return None
                for key, _ in selector.select(timeout=min(left, 0.25)):
                    rank = key.data
                    line = key.fileobj.readline()
                    if not line:  # the rank exited without a word: a crash or a kill
                        code = self.procs[rank].wait(timeout=30)
                        why = f"signal {-code}" if code and code < 0 else f"exit {code}"
                        if code == -signal.SIGKILL:
                            why += " (SIGKILL: the kernel's OOM killer?)"
                        self.fail(f"rank {rank} died ({why}); log tail: {self.log_tail(rank)}")
                        return None
                    message = json.loads(line)
                    if message["event"] == "error":
                        self.fail(f"rank {rank}: {message['error']}")
                        return None
                    messages[rank] = message
                    selector.unregister(key.fileobj)
        finally:
            selector.close()
        return messages  # type: ignore[return-value]

    def log_tail(self, rank: int, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            with open(os.path.join(self.folder, f"rank{rank}.log"), errors="replace") as handle:
                return " | ".join(handle.read()[-chars:].strip().splitlines()[-6:])
        return ""

    def send(self, command: str) -> None:
        for proc in self.procs:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.write(command + "\n")
                proc.stdin.flush()

    def fail(self, error: str) -> None:
        if self.error is None:
            self.error = error
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)
        self.cleanup()

    def cleanup(self) -> None:
        for reader in self.readers:
            with contextlib.suppress(Exception):
                reader.close()
        self.readers = []
        shutil.rmtree(self.swap_dir, ignore_errors=True)

    def finish(self, timeout: float) -> None:
        if self.error is not None:
            return
        self.send("finish")
        final = self.receive("final", timeout)
        if final is not None:
            self.peak_rss = max(m["peak_rss"] for m in final)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.cleanup()

    # --- figures ----------------------------------------------------------------------

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def quartiles(self) -> tuple[float, float]:
        if len(self.times) < 2:
            return (self.times[0], self.times[0])
        low, _, high = statistics.quantiles(self.times, n=4, method="inclusive")
        return low, high


# ======================================================================================
# Default mode: all systems, interleaved rounds
# ======================================================================================


def model_params(args) -> int:
    import torch
    from zinf_compiler.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def run_world(args, world: int, workdir: str) -> list[Config]:
    """All configurations of one world size, one co-resident group after the other."""
    configs = []
    if args.groups == "placement":
        groups = [[k for k in args.systems if SYSTEMS[k][2]["placement"] == placement]
                  for placement in ("none", "cpu", "nvme")]
    else:
        groups = [list(args.systems)]
    for group in groups:
        if group:
            log(f"world {world}: group {', '.join(group)} (started one by one, then interleaved)")
            configs.extend(run_group(args, world, group, workdir))
    order = {key: i for i, key in enumerate(args.systems)}
    return sorted(configs, key=lambda c: order[c.key])


def run_group(args, world: int, keys: list[str], workdir: str) -> list[Config]:
    configs = [Config(key, world, args, workdir) for key in keys]
    step_timeout = args.step_timeout
    for config in configs:
        log(f"world {world}: starting {config.label} ({args.warmup} warm-up steps, compilation included)")
        started = time.monotonic()
        extra = None
        config.resolve_budget(configs)
        if config.error is not None:
            log(f"world {world}: {config.label} FAILED: {config.error}")
            continue
        if args.trace_zinf and config.kind == "zinf":
            extra = {"trace_dir": os.path.join(os.path.abspath(args.trace_zinf), f"{config.key}-w{world}"),
                     "trace_step": args.warmup}
        config.start(extra)
        ready = config.receive("ready", args.setup_timeout + args.warmup * step_timeout)
        if ready is None:
            log(f"world {world}: {config.label} FAILED: {config.error}")
            continue
        config.setup_seconds = ready[0]["setup_seconds"]
        config.warm_times = ready[0]["times"]
        config.losses.extend(ready[0]["losses"])
        log(f"world {world}: {config.label} ready in {time.monotonic() - started:.0f} s; warm-up steps "
            f"{', '.join(f'{t:.2f}' for t in config.warm_times)} s; losses "
            f"{', '.join(f'{v:.4f}' for v in ready[0]['losses'])}")
    for round_index in range(args.rounds):
        live = [c for c in configs if c.error is None]
        # Rotate the order every round so no system always follows the same one.
        shift = round_index % max(1, len(live))
        for config in live[shift:] + live[:shift]:
            disk_before = config.disk_bytes_now()
            config.send(f"steps {args.steps}")
            done = config.receive("done", args.steps * step_timeout)
            if done is None:
                log(f"world {world} round {round_index + 1}: {config.label} FAILED: {config.error}")
                continue
            disk_after = config.disk_bytes_now()
            if disk_before is not None and disk_after is not None:
                config.os_io.append({"read": disk_after[0] - disk_before[0], "written": disk_after[1] - disk_before[1],
                                     "steps": len(done[0]["times"])})
            config.times.extend(done[0]["times"])
            config.losses.extend(done[0]["losses"])
            if done[0].get("io"):
                config.io.append(dict(done[0]["io"], steps=len(done[0]["times"])))
            log(f"world {world} round {round_index + 1}/{args.rounds}: {config.label}: steps "
                f"{', '.join(f'{t:.2f}' for t in done[0]['times'])} s")
    for config in configs:
        config.finish(args.setup_timeout)
        if config.error is None:
            log(f"world {world}: {config.label} done: peak RSS {gib(config.peak_rss)} GiB, "
                f"disk {gib(config.disk_peak)} GiB")
        if args.trace_zinf and config.kind == "zinf":
            print_trace(os.path.join(os.path.abspath(args.trace_zinf), f"{config.key}-w{world}"), config.name)
    return configs


def print_trace(folder: str, name: str) -> None:
    """The traced step's breakdown (zinf's trace.json summary, rank 0)."""
    paths = [os.path.join(folder, "trace.json"), os.path.join(folder, "rank0", "trace.json")]
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None:
        print(f"trace of {name}: no trace.json under {folder}")
        return
    with open(path) as handle:
        summary = json.load(handle)["otherData"]["summary"]
    parts = [f"trace of {name} ({os.path.relpath(path, REPO)}): step {summary['step_seconds']:.3f} s = compute "
             f"{summary['compute_seconds']:.3f} + stall {summary['stall_seconds']:.3f}; transfers (union) "
             f"{summary['transfer_seconds']:.3f} s"]
    for window in ("graphs", "optimizer"):
        if window in summary:
            w = summary[window]
            parts.append(f"{window}: {w['step_seconds']:.3f} s (compute {w['compute_seconds']:.3f}, stall "
                         f"{w['stall_seconds']:.3f}, transfers {w['transfer_seconds']:.3f})")
    tracks = ", ".join(f"{track} {seconds:.3f} s / {summary['track_bytes'][track] / 2**20:.0f} MiB"
                       for track, seconds in summary["track_seconds"].items() if seconds)
    parts.append(f"per track: {tracks}")
    print("; ".join(parts), flush=True)


def loss_check(args, configs: list[Config]) -> tuple[dict[str, str], list[str]]:
    """Per configuration: 'ok' or why not. Reference: eager at world 1 (else the first that ran)."""
    by_key = {(c.key, c.world): c for c in configs}
    reference = by_key.get(REFERENCE)
    if reference is None or reference.error is not None:
        reference = next((c for c in configs if c.error is None), None)
    verdicts, lines = {}, []
    if reference is None:
        return verdicts, ["no configuration ran"]
    ref = reference.losses
    lines.append(f"reference: {reference.name}; {len(ref)} steps; tolerance |loss - ref| <= "
                 f"{args.loss_atol:g} + {args.loss_rtol:g} x |ref| at every step")
    for config in configs:
        if config.error is not None:
            continue
        count = min(len(ref), len(config.losses))
        if count < len(ref):
            verdicts[config.name] = f"only {len(config.losses)} of {len(ref)} steps"
            continue
        worst = max(abs(a - b) for a, b in zip(config.losses[:count], ref[:count]))
        worst_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(config.losses[:count], ref[:count]))
        ok = all(abs(a - b) <= args.loss_atol + args.loss_rtol * abs(b)
                 for a, b in zip(config.losses[:count], ref[:count]))
        verdicts[config.name] = "ok" if ok else f"MISMATCH (max |diff| {worst:.3g})"
        config.loss_diff = (worst, worst_rel)
    return verdicts, lines


def _print_before_after(configs: list[Config], comparable: set[str]) -> None:
    """--baseline: each zinf configuration against its twin from the other checkout, same group, same turns."""
    by_key = {(c.key, c.world): c for c in configs}
    pairs = [(c, by_key.get((c.key + BASELINE_SUFFIX, c.world))) for c in configs
             if not c.key.endswith(BASELINE_SUFFIX)]
    pairs = [(now, before) for now, before in pairs if before is not None]
    if not pairs:
        return
    print("\n## Before and after (--baseline)\n")
    print("| configuration | step, this checkout (s) | step, baseline (s) | this / baseline | "
          "peak RSS this / baseline |")
    print("|---|---|---|---|---|")
    for now, before in pairs:
        if now.name not in comparable or before.name not in comparable:
            print(f"| {now.name} | {'-' if now.name not in comparable else f'{now.median():.3f}'} | "
                  f"{'-' if before.name not in comparable else f'{before.median():.3f}'} | not comparable | |")
            continue
        rss = f"{now.peak_rss / before.peak_rss:.2f}" if now.peak_rss and before.peak_rss else "-"
        print(f"| {now.name} | {now.median():.3f} | {before.median():.3f} | {now.median() / before.median():.2f} "
              f"| {rss} |")


def report(args, configs: list[Config], params: int, wall: float) -> None:
    tokens = args.batch * args.seq
    print("\n## Loss trajectories (checked before any speed figure)\n")
    verdicts, lines = loss_check(args, configs)
    for line in lines:
        print(line)
    ran = [c for c in configs if c.error is None]
    steps = max((len(c.losses) for c in ran), default=0)
    header = "| configuration | " + " | ".join(f"step {i + 1}" for i in range(steps)) + " | max abs diff | check |"
    print("\n" + header + "\n|" + "---|" * (steps + 3))
    for config in configs:
        if config.error is not None:
            print(f"| {config.name} | " + " | ".join("-" for _ in range(steps)) + " | - | did not run |")
            continue
        diff = getattr(config, "loss_diff", (float("nan"), 0))[0]
        print(f"| {config.name} | " + " | ".join(f"{v:.5f}" for v in config.losses)
              + " | -" * (steps - len(config.losses)) + f" | {diff:.2e} | {verdicts.get(config.name)} |")
    comparable = {c.name for c in ran if verdicts.get(c.name) == "ok"}
    bad = [c.name for c in ran if c.name not in comparable]
    if bad:
        print(f"\nNot comparable (no speed figures): {', '.join(bad)}")
    else:
        print(f"\nAll {len(ran)} configurations that ran follow the reference trajectory within the tolerance.")

    print(f"\n## Speed and memory ({args.rounds} rounds x {args.steps} measured steps per configuration after "
          f"{args.warmup} warm-up steps; global batch {args.batch} x {args.seq} = {tokens} tokens per step)\n")
    print("| configuration | median step (s) | quartiles (s) | tokens/s | peak RSS (GiB, max over ranks) "
          "| bytes on disk (GiB) | zinf (same placement) throughput / this | this peak RSS / zinf's |")
    print("|---|---|---|---|---|---|---|---|")
    by_key = {(c.key, c.world): c for c in configs}
    for config in configs:
        if config.error is not None:
            print(f"| {config.name} | FAILED: {config.error.replace('|', '/')} | | | | | | |")
            continue
        if config.name not in comparable:
            print(f"| {config.name} | loss {verdicts.get(config.name)} | | | {gib(config.peak_rss)} | "
                  f"{gib(config.disk_peak)} | | |")
            continue
        median = config.median()
        low, high = config.quartiles()
        zinf = by_key.get((ZINF_OF_PLACEMENT[config.settings["placement"]], config.world))
        ratio = rss_ratio = "-"
        if zinf is not None and zinf.error is None and zinf.name in comparable:
            ratio = f"{median / zinf.median():.2f}"
            rss_ratio = f"{config.peak_rss / zinf.peak_rss:.2f}" if config.peak_rss and zinf.peak_rss else "-"
        print(f"| {config.name} | {median:.3f} | {low:.3f} - {high:.3f} | {tokens / median:,.0f} | "
              f"{gib(config.peak_rss)} | {gib(config.disk_peak)} | {ratio} | {rss_ratio} |")
    print("\nzinf (same placement) throughput / this: this configuration's median step time over that of zinf "
          "with the same offload placement at the same world size (> 1: zinf is faster). eager, Inductor and "
          "FSDP2 without offload compare with zinf without offload; FSDP2 + CPUOffloadPolicy and DeepSpeed cpu "
          "with zinf cpu; DeepSpeed nvme with zinf nvme.")

    _print_limit_model(configs, comparable)
    _print_os_disk_bytes(configs, comparable)
    _print_before_after(configs, comparable)

    print("\n## Targets\n")
    for world in sorted({c.world for c in configs}):
        def get(key):
            c = by_key.get((key, world))
            return c if c is not None and c.error is None and c.name in comparable else None

        def target(name: str, zkey: str, peer_key: str, factor: float, rss_share: float | None = None) -> None:
            z, p = get(zkey), get(peer_key)
            if z is None or p is None:
                missing = by_key.get((zkey if z is None else peer_key, world))
                why = missing.error if missing is not None and missing.error else "no comparable figure"
                print(f"- world {world}: {name}: cannot be judged: {SYSTEMS[zkey if z is None else peer_key][0]}: {why}")
                return
            speed = p.median() / z.median()
            met = speed >= factor
            text = f"- world {world}: {name}: {speed:.2f}x (target >= {factor}x)"
            if rss_share is not None:
                rss_ok = z.peak_rss <= rss_share * p.peak_rss
                met = met and rss_ok
                text += (f", peak RSS {gib(z.peak_rss)} vs {gib(p.peak_rss)} GiB "
                         f"({z.peak_rss / p.peak_rss:.2f}x, target <= {rss_share}x)")
            print(text + (": met" if met else ": MISSED"))

        # Issue 26's targets (issue 17's, for world size 1 without offload).
        nvme_factor = 2.0 if world == 1 else 1.6
        target("zinf nvme vs DeepSpeed nvme throughput", "zinf_nvme", "ds_nvme", nvme_factor, rss_share=0.5)
        target("zinf nvme, gradients in RAM, vs DeepSpeed nvme throughput", "zinf_nvme_ram", "ds_nvme", nvme_factor,
               rss_share=0.5)
        if ("zinf_cache_ds", world) in by_key:  # issue 38, acceptance 4: the RAM cache at DeepSpeed's own RSS
            target("zinf nvme, host_memory = DeepSpeed nvme's peak RSS, vs DeepSpeed nvme throughput", "zinf_cache_ds",
                   "ds_nvme", 2.0, rss_share=1.0)
        target("zinf cpu vs DeepSpeed cpu", "zinf_cpu", "ds_cpu", 1.3)
        target("zinf cpu vs FSDP2 + CPUOffloadPolicy", "zinf_cpu", "fsdp2_cpu", 1.1)
        peers = [c for c in (get(k) for k in SYSTEMS if not k.startswith("zinf")) if c is not None]
        for zkey, limit in (("zinf", 1.25), ("zinf_s2", 1.10)):
            z = get(zkey)
            if z is None and zkey == "zinf_s2" and (zkey, world) not in by_key:
                continue  # not asked for
            name = f"{SYSTEMS[zkey][0].removeprefix('zinf ')}: zinf without offload"
            if world > 1:  # issue 26: against Inductor + DDP
                reference = get("inductor")
            else:  # issue 17: within 10% of the fastest peer
                reference, limit = (min(peers, key=lambda c: c.median()) if peers else None), 1.10
            if z is None or reference is None:
                print(f"- world {world}: {name}: cannot be judged")
                continue
            over = z.median() / reference.median()
            print(f"- world {world}: {name} vs {reference.label}{' + DDP' if world > 1 else ''}: step time "
                  f"{over:.2f}x of it (target <= {limit:.2f}x): {'met' if over <= limit else 'MISSED'}")
    failed = [c for c in configs if c.error is not None]
    if failed:
        print("\n## Configurations that could not run\n")
        for config in failed:
            print(f"- {config.name}: {config.error}")
    print(f"\nwall time {wall:.0f} s; load average at the end "
          f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}; parameters {params:,}")


# ======================================================================================
# --find-max: largest model per system within a step budget
# ======================================================================================

FIND_MAX_SYSTEMS = "eager,zinf_nvme,ds_nvme,fsdp2_cpu,ds_cpu,zinf_cpu"


def ladder(args) -> list[tuple[int, int]]:
    rungs = []
    for item in args.ladder.split(","):
        layers, width = item.lower().split("x")
        rungs.append((int(layers), int(width)))
    return rungs


def rung_params(args, rung: tuple[int, int]) -> int:
    import torch
    from zinf_compiler.gpt import GPT, GPTConfig

    layers, width = rung
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=max(1, width // 128),
                    n_embd=width)
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def attempt(args, key: str, rung: tuple[int, int], workdir: str, deadline: float) -> dict:
    """One subprocess attempt: build, one warm-up step, one timed step."""
    layers, width = rung
    sub = argparse.Namespace(**vars(args))
    sub.n_layer, sub.n_embd, sub.n_head = layers, width, max(1, width // 128)
    sub.warmup, sub.rounds, sub.steps = 1, 1, 1
    config = Config(key, 1, sub, workdir)
    # What this machine has for the attempt now: MemAvailable less a margin for the
    # sampling interval (the parent reads the attempt's resident set every 0.25 s).
    mem_limit = args.mem_limit if args.mem_limit is not None else mem_available_bytes() - 2 * 2**30
    result = {"setup_s": None, "warm_s": None, "step_s": None, "loss": None, "mem_limit": mem_limit}
    need = disk_need(key, rung_params(args, rung), args)
    free = shutil.disk_usage(args.nvme_path).free
    if need and need > free - args.disk_margin_gib * 2**30:
        result.update(error=f"not tried: needs about {gib(need)} GiB of disk, {gib(free)} GiB free (less a "
                            f"{args.disk_margin_gib:g} GiB margin)", peak_rss=None, disk=0, wall_s=0.0, skipped=True)
        return result
    config.start({"find_max": True})
    budget_left = max(10.0, deadline - time.monotonic())
    setup_timeout = min(args.attempt_timeout, budget_left)
    started = time.monotonic()
    ready = config.receive("ready", setup_timeout, mem_limit=mem_limit)
    if ready is not None:
        result.update(setup_s=ready[0]["setup_seconds"], warm_s=ready[0]["times"][0])
        config.send("steps 1")
        left = max(10.0, min(deadline - time.monotonic(), args.step_budget_s * 1.5 + 30))
        done = config.receive("done", left, mem_limit=mem_limit)
        if done is not None:
            result.update(step_s=done[0]["times"][0], loss=done[0]["losses"][0])
            config.finish(120)
        if config.error and "timeout" in config.error:
            config.error = f"timed step over {left:.0f} s (budget {args.step_budget_s:g} s)"
    result.update(error=config.error, peak_rss=config.peak_rss or config.rss_peak_tree, disk=config.disk_peak,
                  wall_s=time.monotonic() - started)
    if result["error"] is None:
        if not math.isfinite(result["loss"]):
            result["error"] = f"loss {result['loss']}"
        elif result["step_s"] > args.step_budget_s:
            result["error"] = f"step {result['step_s']:.1f} s over the budget of {args.step_budget_s:g} s"
    config.stop()
    shutil.rmtree(config.folder, ignore_errors=True)
    return result


def disk_need(key: str, params: int, args) -> int:
    """Swap bytes an NVMe attempt will write (estimate, to refuse one that would fill the disk)."""
    if key == "zinf_nvme" or key.startswith("zinf_cache"):  # fp32 master (the parameter is read from it), two moments, gradient; nvme_copies of each
        return 16 * params * args.nvme_copies
    if key == "ds_nvme":  # fp32 parameters, master, two moments (gradients stay in RAM)
        return 16 * params
    return 0


def find_max(args, workdir: str) -> None:
    rungs = ladder(args)
    params = [rung_params(args, rung) for rung in rungs]
    deadline = time.monotonic() + args.time_limit
    keys = args.systems
    print(f"ladder (layers x width, heads = width / 128, vocab {args.vocab}, seq {args.seq}, batch {args.batch}): "
          + ", ".join(f"{l}x{w} = {p / 1e6:,.0f}M" for (l, w), p in zip(rungs, params)))
    limit = (f"{gib(args.mem_limit)} GiB" if args.mem_limit is not None
             else "MemAvailable at its start less 2 GiB")
    print(f"step budget {args.step_budget_s:g} s per timed step; time limit {args.time_limit:g} s; resident-set "
          f"limit per attempt: {limit}; zinf nvme_copies={args.nvme_copies}; free disk under --nvme-path "
          f"{gib(shutil.disk_usage(args.nvme_path).free)} GiB\n", flush=True)
    attempts: list[tuple[str, int, dict]] = []
    best: dict[str, int | None] = {}

    def start_rung(key: str) -> int:
        """Where a system's search starts: the best rung of the systems of its class so far
        (RAM-bound: no offload or cpu; or nvme), else one above the best of any so far for
        an NVMe system (made to go past RAM), else the bottom."""
        nvme = SYSTEMS[key][2]["placement"] == "nvme"
        same = [b for k, b in best.items() if b is not None and (SYSTEMS[k][2]["placement"] == "nvme") == nvme]
        if same:
            return min(max(same), len(rungs) - 1)
        other = [b for b in best.values() if b is not None]
        if other:
            return min(max(other) + (1 if nvme else 0), len(rungs) - 1)
        return 0

    for key in keys:
        label = SYSTEMS[key][0]
        passed: int | None = None
        failed_at: int | None = None
        index = start_rung(key)
        # Climb while it passes; if the first try fails, descend until one passes.
        while 0 <= index < len(rungs):
            if time.monotonic() > deadline - 30:
                log(f"{label}: time limit reached, search stopped")
                attempts.append((key, index, {"error": "not tried: --time-limit reached", "setup_s": None,
                                              "warm_s": None, "step_s": None, "peak_rss": None, "disk": 0}))
                break
            log(f"{label}: trying {rungs[index][0]}x{rungs[index][1]} ({params[index] / 1e6:,.0f}M parameters)")
            result = attempt(args, key, rungs[index], workdir, deadline)
            attempts.append((key, index, result))
            if result["error"] is None:
                log(f"{label}: {params[index] / 1e6:,.0f}M trains: step {result['step_s']:.1f} s, peak RSS "
                    f"{gib(result['peak_rss'])} GiB, disk {gib(result['disk'])} GiB")
                passed = index
                if failed_at is not None and index + 1 >= failed_at:
                    break
                index += 1
            else:
                log(f"{label}: {params[index] / 1e6:,.0f}M fails: {result['error'][:300]}")
                failed_at = index
                if passed is not None:
                    break
                index -= 1
        best[key] = passed
    print("\n## Largest model each system trains (world size 1)\n")
    print("| system | largest that trains | step (s) | peak RSS (GiB) | disk (GiB) | next rung up: result |")
    print("|---|---|---|---|---|---|")
    for key in keys:
        mine = [(i, r) for k, i, r in attempts if k == key]
        good = best.get(key)
        above = [(i, r) for i, r in mine if good is None or i == good + 1]
        above_text = "; ".join(f"{rungs[i][0]}x{rungs[i][1]}: {r['error'][:200]}" for i, r in above if r["error"])
        if good is not None and good == len(rungs) - 1:
            above_text = "top of the ladder (--ladder)"
        if good is None:
            print(f"| {SYSTEMS[key][0]} | none of those tried | | | | {above_text or 'not tried'} |")
            continue
        r = next(r for i, r in mine if i == good and r["error"] is None)
        print(f"| {SYSTEMS[key][0]} | {rungs[good][0]}x{rungs[good][1]}, {params[good] / 1e6:,.0f}M "
              f"| {r['step_s']:.1f} | {gib(r['peak_rss'])} | {gib(r['disk'])} | {above_text or 'not tried'} |")
    print("\nEvery attempt:\n")
    print("| system | model | setup (s) | warm-up step (s) | timed step (s) | peak RSS (GiB) | disk (GiB) | result |")
    print("|---|---|---|---|---|---|---|---|")
    for key, index, r in attempts:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {SYSTEMS[key][0]} | {rungs[index][0]}x{rungs[index][1]} ({params[index] / 1e6:,.0f}M) | "
              f"{fmt(r['setup_s'])} | {fmt(r['warm_s'])} | {fmt(r['step_s'])} | {gib(r['peak_rss'])} | "
              f"{gib(r['disk'])} | {(r['error'] or 'trains').replace('|', '/')[:300]} |")


# ======================================================================================


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, from {','.join(SYSTEMS)} (default: all; --find-max: "
                             f"{FIND_MAX_SYSTEMS})")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 64; --find-max: 32)")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch, sequences per step split over the ranks (default 2; --find-max: 1)")
    parser.add_argument("--nvme-copies", type=int, choices=(1, 2), default=None,
                        help="zinf's nvme_copies (default: zinf's own default, 2; --find-max: 1, the disk "
                             "DeepSpeed's single copy needs)")
    parser.add_argument("--disk-margin-gib", type=float, default=10.0,
                        help="--find-max: free disk an NVMe attempt must leave (estimated from its swap bytes)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration per round")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="compute threads per configuration (divided among its ranks)")
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".bench", "swap"))
    parser.add_argument("--loss-rtol", type=float, default=1e-4)
    parser.add_argument("--loss-atol", type=float, default=1e-5)
    parser.add_argument("--groups", choices=("placement", "all"), default="placement",
                        help="which configurations are resident and interleaved together: those of one offload "
                             "placement (default; every target compares within one) or all of a world size "
                             "(needs about 1.5 GiB per rank process)")
    parser.add_argument("--setup-timeout", type=float, default=600)
    parser.add_argument("--step-timeout", type=float, default=300)
    parser.add_argument("--trace-zinf", metavar="DIR", help="trace zinf's configurations (dump_dir DIR/<name>, "
                        "trace_step = the last warm-up step) and print each trace's breakdown")
    parser.add_argument("--find-max", action="store_true")
    parser.add_argument("--ladder", default=DEFAULT_LADDER, help="--find-max: layers x width rungs")
    parser.add_argument("--step-budget-s", type=float, default=90.0)
    parser.add_argument("--time-limit", type=float, default=1500.0, help="--find-max: seconds for the search")
    parser.add_argument("--attempt-timeout", type=float, default=600.0,
                        help="--find-max: seconds for an attempt's build and warm-up step")
    parser.add_argument("--mem-limit-gib", type=float, default=None,
                        help="--find-max: resident set at which an attempt is killed (default: MemAvailable at "
                             "the attempt's start less 2 GiB)")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="another checkout of zinf (with its own .venv, or sharing this interpreter): each zinf "
                             "configuration also runs from it, in the same group and turns, for a same-run "
                             "before/after comparison")
    parser.add_argument("--baseline-first", action="store_true",
                        help="with --baseline: start each twin before this checkout's configuration (the first "
                             "started can be the slower one: run both orders)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.systems is None:
        args.systems = FIND_MAX_SYSTEMS if args.find_max else ",".join(SYSTEMS)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    if args.baseline:
        if args.find_max:
            parser.error("--baseline compares step times at one size; it does not combine with --find-max")
        args.systems = add_baseline_twins(args.systems, os.path.abspath(args.baseline), parser, args.baseline_first)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    args.mem_limit = None if args.mem_limit_gib is None else int(args.mem_limit_gib * 2**30)
    for name, default, find_max_default in (("seq", 64, 32), ("batch", 2, 1), ("nvme_copies", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, find_max_default if args.find_max else default)
    if args.find_max:
        args.world_sizes = [1]
    for world in args.world_sizes:
        if args.batch % world:
            parser.error(f"--batch {args.batch} does not split over world size {world}")

    return args


def add_baseline_twins(systems: list[str], checkout: str, parser, twin_first: bool = False) -> list[str]:
    """Each zinf system followed (``twin_first``: preceded) by its twin run from ``checkout`` (key
    ``<key>@baseline``)."""
    script = os.path.join(checkout, "benchmarks", "peers.py")
    if not os.path.exists(script):
        parser.error(f"--baseline {checkout}: no benchmarks/peers.py there; give a checkout of zinf")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    with_twins = []
    for key in systems:
        label, kind, settings = SYSTEMS[key]
        if kind != "zinf":
            with_twins.append(key)
            continue
        twin = f"{key}{BASELINE_SUFFIX}"
        SYSTEMS[twin] = (f"{label} [baseline {commit.stdout.strip() or checkout}]", kind,
                         dict(settings, checkout=checkout))
        with_twins.extend([twin, key] if twin_first else [key, twin])
    return with_twins


def versions() -> str:
    import torch

    ds = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                        env=dict(os.environ, PYTHONPATH=BENCH_SITE, DS_ACCELERATOR="cpu"),
                        capture_output=True, text=True)
    ds_version = ds.stdout.strip().splitlines()[-1] if ds.returncode == 0 else "not installed (run scripts/install_bench.sh)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return (f"torch {torch.__version__}, deepspeed {ds_version}, zinf at {commit.stdout.strip()}"
            f"{' + uncommitted changes' if dirty.stdout.strip() else ''}, {os.cpu_count()} CPUs, "
            f"{gib(mem_total_bytes())} GiB RAM")


def main() -> int:
    args = parse()
    if args.worker:
        Worker(json.loads(args.worker)).run()
        return 0
    print("command: " + shlex.join(["python", os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]))
    print(versions())
    print(f"load average at start: {', '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    os.makedirs(args.nvme_path, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peers-") as workdir:
        if args.find_max:
            find_max(args, workdir)
            print(f"\nwall time {time.monotonic() - started:.0f} s")
            return 0
        params = model_params(args)
        print(f"GPT: {args.n_layer} layers, width {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, "
              f"seq {args.seq}, global batch {args.batch}: {params:,} parameters, model states "
              f"{gib(16 * params)} GiB (fp32 weight, gradient, two Adam moments); AdamW {ADAMW}", flush=True)
        if any(SYSTEMS[key][2].get("placement") == "nvme" for key in args.systems):
            args.disk_rates = probe_disk(args.nvme_path)
            print(f"disk under {args.nvme_path} (zinf's swap engine, O_DIRECT, {gib(DISK_PROBE_BYTES)} GiB each way): "
                  f"read {args.disk_rates['disk_read'] / 1e9:.2f} GB/s, write "
                  f"{args.disk_rates['disk_write'] / 1e9:.2f} GB/s", flush=True)
        configs = []
        for world in args.world_sizes:
            configs.extend(run_world(args, world, workdir))
        report(args, configs, params, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
