"""Train a GPT whose model states exceed this machine's RAM, with every state on NVMe.

    python benchmarks/beyond_ram.py --nvme-path DIR [--n-layer 40 --n-embd 2560]
                                    [--steps 3] [--nvme-copies 1] [--skip-eager]

The zinf run builds the model on the meta device and materializes it module
by module straight into NVMe shards (``zinf.materialize``), then trains
``--steps`` steps at stage 3 with ``offload_param="nvme"`` and
``offload_optimizer="nvme"`` (fp32 master, Adam moments and gradients in
swap files; parameters stored as ``--param-dtype``).  It reports, per step,
the time and the loss, then peak RSS (``resource.getrusage``), the swap
bytes on disk, the runtime's own per-tier accounting and the model-state
bytes (16 per parameter: fp32 weight, gradient and two Adam moments).

Baseline, in the same run: eager PyTorch with ``torch.optim.AdamW`` at a
size that fits (``--eager-layers``, same width), in a subprocess; its peak
RSS per parameter gives the largest model eager training can hold in this
machine's RAM (MemTotal).  Eager is not run at the big size: it would be
killed by the kernel's OOM killer (or take the machine down with it).

Disk: the default model (3.28B parameters) needs about 59 GB of swap with
``--nvme-copies 1`` (each swap file once); the default of zinf,
``nvme_copies=2`` (the last good step survives a failed write), doubles it.
``df -h`` first; the swap folder is removed at exit.

Activations beyond RAM (``--activations``):

    python benchmarks/beyond_ram.py --activations --nvme-path DIR [--act-ram-multiple 1.15]
                                    [--act-layers 16 --act-embd 512 --act-vocab 8192 --act-seq 2048]

A GPT at a long sequence whose saved activations alone exceed this
machine's RAM, trained with everything on NVMe: parameters, optimizer
states *and* every saved activation (``offload_activations="nvme"``, no
checkpointing, so all of what autograd keeps goes to disk).  First, in a
subprocess, eager PyTorch measures what autograd saves per token (saved
tensor hooks, parameters aside) on a one-sequence batch; the batch is then
the smallest whose saved activations reach ``--act-ram-multiple`` x RAM.
Eager cannot train that batch in one piece, so the reference (same
subprocess) accumulates the gradient over one-sequence micro-batches,
takes one ``torch.optim.AdamW`` step and evaluates the loss again: zinf's
two losses (full batch, same initial weights) must match it.  zinf reports
the saved-activation bytes per tier from its ledger (``memory_report``
between forward and backward), peak RSS, and the RAM left over
(MemTotal - peak RSS), which the activations must exceed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def config(args, n_layer: int):
    from zinf_compiler.gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab_size, block_size=args.seq, n_layer=n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)


def count_params(cfg) -> int:
    from zinf_compiler.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def run_eager(args) -> dict:
    """Child process: eager AdamW training of the small baseline model; prints one JSON line."""
    from zinf_compiler.gpt import GPT, synthetic_batches

    cfg = config(args, args.eager_layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for x, y in synthetic_batches(cfg, args.batch, 2):
        started = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
    return {"params": params, "peak_rss": peak_rss_bytes(), "step_seconds": times, "loss": loss.item()}


def act_config(args):
    from zinf_compiler.gpt import GPTConfig

    return GPTConfig(vocab_size=args.act_vocab, block_size=args.act_seq, n_layer=args.act_layers,
                     n_head=args.act_heads, n_embd=args.act_embd)


def run_eager_activations(args) -> dict:
    """Child process: what eager autograd saves per token; the batch that exceeds RAM; its reference losses.

    The reference accumulates the full batch's gradient over one-sequence
    micro-batches (mean of equal-size means = the full mean), so it needs
    the activations of one sequence only.
    """
    from zinf_compiler.gpt import GPT, synthetic_batches

    cfg = act_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    x, y = synthetic_batches(cfg, 1, 1, seed=1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        probe_loss = model(x, y)
    probe_loss.backward()
    model.zero_grad(set_to_none=True)
    per_token = sum(saved.values()) / args.act_seq
    batch = args.act_batch or math.ceil(args.act_ram_multiple * mem_total_bytes() / (per_token * args.act_seq))
    print(f"eager: autograd saves {per_token / 1024:.0f} KiB per token; batch {batch} x {args.act_seq} tokens "
          f"saves {gib(per_token * batch * args.act_seq)} (RAM {gib(mem_total_bytes())})", file=sys.stderr,
          flush=True)

    x, y = synthetic_batches(cfg, batch, 1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=args.act_lr)
    started = time.perf_counter()
    losses = []
    total = 0.0
    for row in range(batch):  # one sequence at a time: its activations fit
        loss = model(x[row: row + 1], y[row: row + 1]) / batch
        loss.backward()
        total += loss.item()
    losses.append(total)
    opt.step()
    with torch.no_grad():
        losses.append(sum(model(x[row: row + 1], y[row: row + 1]).item() for row in range(batch)) / batch)
    return {"saved_bytes_per_token": per_token, "batch": batch, "losses": losses,
            "seconds": time.perf_counter() - started, "peak_rss": peak_rss_bytes(),
            "params": sum(p.numel() for p in model.parameters())}


def run_zinf_activations(args, batch: int) -> dict:
    """Full-batch training with parameters, optimizer states and every saved activation on NVMe."""
    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, synthetic_batches
    from zinf_compiler.api import RUNTIME

    cfg = act_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)  # small weights (the activations are what does not fit): built as eager builds them
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": args.nvme_path,
               "offload_activations": "nvme", "nvme_copies": args.nvme_copies, "lower": args.lower}
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=args.act_lr)
    x, y = synthetic_batches(cfg, batch, 1)[0]
    steps = []
    for step in range(2):
        started = time.perf_counter()
        loss = compiled(x, y)
        forward_done = time.perf_counter()
        report = zinf.memory_report(compiled)  # between forward and backward: every saved value is held
        saved = {tier: report[tier]["activations"] for tier in ("device", "cpu", "nvme")}
        loss.backward()
        backward_done = time.perf_counter()
        opt.step()
        opt.zero_grad()
        done = time.perf_counter()
        steps.append({"loss": loss.item(), "seconds": done - started, "forward": forward_done - started,
                      "backward": backward_done - forward_done, "optimizer": done - backward_done,
                      "saved_activations": saved, "peak_rss": peak_rss_bytes()})
        print(f"zinf: step {step}: loss {loss.item():.5f}, {done - started:.1f} s (forward "
              f"{forward_done - started:.1f}, backward {backward_done - forward_done:.1f}, optimizer "
              f"{done - backward_done:.1f}); saved activations on nvme {gib(saved['nvme'])}, on the device "
              f"{gib(saved['device'])}; peak RSS {gib(peak_rss_bytes())}", flush=True)
    engines = RUNTIME.activations.engines()
    return {"steps": steps, "peak_rss": peak_rss_bytes(), "staging_pool": RUNTIME.activations.pool_bytes,
            "activation_bytes_written": sum(e.bytes_written for e in engines),
            "activation_bytes_read": sum(e.bytes_read for e in engines), "options": options}


def activations_main(args) -> None:
    ram = mem_total_bytes()
    results = {"ram": ram, "load_before": os.getloadavg()}
    child = subprocess.run([sys.executable, __file__, "--child", "eager-activations", *sys.argv[1:]],
                           stdout=subprocess.PIPE, text=True, check=True)
    eager = results["eager"] = json.loads(child.stdout.strip().splitlines()[-1])
    batch, tokens = eager["batch"], eager["batch"] * args.act_seq
    print(f"eager reference: {eager['params']:,} parameters, {tokens:,} tokens per step ({batch} x {args.act_seq}); "
          f"autograd would save {gib(eager['saved_bytes_per_token'] * tokens)} in one piece; accumulated over "
          f"{batch} micro-batches in {eager['seconds']:.0f} s: losses {[round(v, 5) for v in eager['losses']]}",
          flush=True)
    zinf_result = results["zinf"] = run_zinf_activations(args, batch)
    results["load_after"] = os.getloadavg()
    saved = zinf_result["steps"][-1]["saved_activations"]
    left_over = ram - zinf_result["peak_rss"]
    losses = [step["loss"] for step in zinf_result["steps"]]
    error = max(abs(a - b) for a, b in zip(losses, eager["losses"]))
    results["summary"] = {"saved_activation_bytes": saved, "ram_left_over": left_over, "loss_error": error}
    print(f"\nzinf: {tokens:,} tokens per step; saved activations {gib(saved['nvme'])} on NVMe "
          f"({saved['nvme'] / ram:.2f}x RAM, {saved['nvme'] / max(left_over, 1):.2f}x the {gib(left_over)} left "
          f"over beside zinf's peak RSS of {gib(zinf_result['peak_rss'])}), {gib(saved['device'])} on the device; "
          f"losses {[round(v, 5) for v in losses]} vs eager {[round(v, 5) for v in eager['losses']]} "
          f"(max difference {error:.2e}); step times {[round(s['seconds'], 1) for s in zinf_result['steps']]} s")
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    if saved["nvme"] <= left_over:
        raise SystemExit("the saved activations fit in the RAM left over: raise --act-ram-multiple")
    if error > 1e-3:
        raise SystemExit(f"zinf's losses differ from eager's by {error:.2e} (> 1e-3)")


def run_zinf(args) -> dict:
    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, synthetic_batches
    from zinf_compiler.api import RUNTIME

    cfg = config(args, args.n_layer)
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": args.nvme_path,
               "param_dtype": args.param_dtype, "nvme_copies": args.nvme_copies, "lower": args.lower}
    started = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"zinf: {params:,} parameters, model states {gib(16 * params)} (16 B/param), RAM {gib(mem_total_bytes())}",
          flush=True)
    torch.manual_seed(0)
    zinf.materialize(model, options, init_fn=model.init_weights)
    build_seconds = time.perf_counter() - started
    print(f"zinf: built into NVMe shards in {build_seconds:.0f} s, peak RSS so far {gib(peak_rss_bytes())}",
          flush=True)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-4)
    steps = []
    batches = synthetic_batches(cfg, args.batch, args.steps)
    if args.repeat_batch:
        # One batch over and over: a loss that falls step after step shows the
        # updates are right (fresh random batches at lr 1e-4 from a random init
        # move the loss by noise only in 3 steps).
        batches = [batches[0]] * args.steps
    for step, (x, y) in enumerate(batches):
        step_started = time.perf_counter()
        loss = compiled(x, y)
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        opt.step()
        opt.zero_grad()
        done = time.perf_counter()
        steps.append({"loss": loss.item(), "seconds": done - step_started, "forward": forward_done - step_started,
                      "backward": backward_done - forward_done, "optimizer": done - backward_done,
                      "peak_rss": peak_rss_bytes()})
        print(f"zinf: step {step}: loss {loss.item():.4f}, {done - step_started:.1f} s (forward "
              f"{forward_done - step_started:.1f}, backward {backward_done - forward_done:.1f}, optimizer "
              f"{done - backward_done:.1f}; the first includes compilation), peak RSS {gib(peak_rss_bytes())}",
              flush=True)
    # Read before zero_grad would delete the gradient files: one more backward, then report.
    report = zinf.memory_report(model)
    engines = RUNTIME.store.engines()
    on_disk = sum(engine.bytes_on_disk() for engine in engines)
    return {"params": params, "build_seconds": build_seconds, "steps": steps, "peak_rss": peak_rss_bytes(),
            "swap_bytes_on_disk": on_disk, "bytes_read": sum(e.bytes_read for e in engines),
            "bytes_written": sum(e.bytes_written for e in engines), "memory_report": report,
            "options": options}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".zinf_swap"))
    parser.add_argument("--n-layer", type=int, default=40)
    parser.add_argument("--n-embd", type=int, default=2560)
    parser.add_argument("--n-head", type=int, default=20)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--nvme-copies", type=int, default=1, choices=(1, 2))
    parser.add_argument("--lower", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--fresh-batches", dest="repeat_batch", action="store_false",
                        help="a new batch every step (default: the same batch, so the loss must fall)")
    parser.add_argument("--eager-layers", type=int, default=4, help="layers of the eager baseline model")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--activations", action="store_true",
                        help="the activations-beyond-RAM run instead (see the module docstring)")
    parser.add_argument("--act-layers", type=int, default=16)
    parser.add_argument("--act-embd", type=int, default=512)
    parser.add_argument("--act-heads", type=int, default=8)
    parser.add_argument("--act-vocab", type=int, default=8192)
    parser.add_argument("--act-seq", type=int, default=2048)
    parser.add_argument("--act-batch", type=int, default=0, help="default: chosen from --act-ram-multiple")
    parser.add_argument("--act-ram-multiple", type=float, default=1.15,
                        help="saved activations (as eager measures them) to reach, in multiples of RAM")
    parser.add_argument("--act-lr", type=float, default=1e-3)
    parser.add_argument("--child", choices=("eager", "eager-activations"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "eager":
        print(json.dumps(run_eager(args)))
        return
    if args.child == "eager-activations":
        print(json.dumps(run_eager_activations(args)))
        return
    if args.activations:
        os.makedirs(args.nvme_path, exist_ok=True)
        activations_main(args)
        return

    os.makedirs(args.nvme_path, exist_ok=True)
    ram = mem_total_bytes()
    results = {"ram": ram, "load_before": os.getloadavg()}
    if not args.skip_eager:
        child = subprocess.run([sys.executable, __file__, "--child", "eager", *sys.argv[1:]], capture_output=True,
                               text=True, check=True)
        eager = json.loads(child.stdout.strip().splitlines()[-1])
        # The process's fixed cost (torch itself) is measured apart, so the
        # per-parameter figure is eager's cost per parameter.
        baseline = subprocess.run([sys.executable, "-c", "import resource, torch; import zinf_compiler.gpt; "
                                   "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                                  capture_output=True, text=True, check=True)
        fixed = int(baseline.stdout.strip())
        per_param = (eager["peak_rss"] - fixed) / eager["params"]
        eager["fixed_rss"] = fixed
        eager["rss_bytes_per_param"] = per_param
        eager["max_params_in_ram"] = int((ram - fixed) / per_param)
        results["eager"] = eager
        print(f"eager AdamW: {eager['params']:,} parameters, peak RSS {gib(eager['peak_rss'])} "
              f"({per_param:.1f} B/param over the {gib(fixed)} of an idle torch process): at most "
              f"{eager['max_params_in_ram'] / 1e9:.2f}B parameters fit in {gib(ram)} of RAM", flush=True)
    zinf_result = run_zinf(args)
    results["zinf"] = zinf_result
    results["load_after"] = os.getloadavg()
    params = zinf_result["params"]
    print(f"\nzinf: {params / 1e9:.2f}B parameters trained {args.steps} steps; model states "
          f"{gib(16 * params)} = {16 * params / ram:.2f}x RAM; peak RSS {gib(zinf_result['peak_rss'])}; swap on "
          f"disk {gib(zinf_result['swap_bytes_on_disk'])}; losses "
          f"{[round(s['loss'], 4) for s in zinf_result['steps']]}; step times "
          f"{[round(s['seconds'], 1) for s in zinf_result['steps']]} s")
    print("memory_report:", json.dumps(zinf_result["memory_report"]))
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
