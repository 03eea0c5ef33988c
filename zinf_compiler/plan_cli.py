"""``python -m zinf_compiler.plan_cli``: what a model needs under each option set, before any run.

The model is built on the meta device (no weights are allocated): zinf's GPT
from its sizes (``--n-layer --n-embd --n-head --vocab --block-size``) or a
Hugging Face causal LM from its ``config.json`` (``--hf-config``).  Each
option set (``--options '{"stage": 3, ...}'``, repeatable; default: a table of
the usual ones) is planned with :func:`zinf_compiler.planner.plan` at
``--world-size`` ranks, and one line per option set is printed: bytes per tier,
pinned pools, swap space, disk and collective bytes per step and, with
``--probe`` (this machine's matmul, memory and disk rates, about a second; on
a CPU at ``--world-size`` N, with one rank's share of the cores and the
collective rate of N local processes), the predicted step.  The disk is probed in ``--nvme-path``.

With ``--host-memory`` (and/or ``--device-memory``; bytes such as ``4GiB``, a
fraction of the memory available such as ``0.5``, or ``auto``), zinf chooses
the options instead (zinf_compiler/budget.py): every option set it weighed is
listed with its predicted peak RSS and step, and the chosen options are printed
as JSON, ready for ``torch.compile(..., options=...)`` (``--options`` then fixes
some of them).

Examples::

    python -m zinf_compiler.plan_cli --n-layer 12 --n-embd 768 --batch 8 --seq 512 --world-size 2 --probe
    python -m zinf_compiler.plan_cli --host-memory 3GiB --nvme-path /mnt/nvme --probe
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile

import torch

from .budget import choose, describe_choice
from .blueprint import compute_device, default_device
from .planner import describe, plan

# The usual option sets, from everything on the device to everything on NVMe.
CANDIDATES = (
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    {"stage": 3, "offload_optimizer": "nvme"},
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "activation_checkpointing": "block"},
)


def _model_and_batch(args) -> tuple[torch.nn.Module, tuple]:
    """The model on the meta device and one batch of ``--batch`` x ``--seq`` token ids (with labels)."""
    if args.hf_config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.hf_config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        vocab = config.vocab_size
    else:
        from .gpt import GPT, GPTConfig

        config = GPTConfig(vocab_size=args.vocab, block_size=max(args.block_size, args.seq), n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd)
        with torch.device("meta"):
            model = GPT(config)
        vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq))
    if args.hf_config:
        return model, _hf_batch(model, tokens)
    return model, (tokens, tokens)


def _hf_batch(model: torch.nn.Module, tokens: torch.Tensor) -> tuple:
    """``tokens`` as a Hugging Face causal LM's ``input_ids`` and ``labels``, positionally (the planner calls the
    model with positional arguments): each argument between them at its default (``model(tokens, tokens)``
    would pass the labels as the attention mask, and plan a forward without its loss)."""
    names = list(inspect.signature(model.forward).parameters.values())
    at = {parameter.name: index for index, parameter in enumerate(names)}
    if at.get("input_ids") != 0 or "labels" not in at:
        raise ValueError(f"{type(model).__name__}.forward takes no input_ids first and labels: not a causal LM "
                         f"zinf can plan from --hf-config")
    batch = [parameter.default for parameter in names[: at["labels"] + 1]]
    batch[0], batch[at["labels"]] = tokens, tokens
    return tuple(batch)


def probe_rates(nvme_path: str | None, dtype: torch.dtype, world_size: int = 1,
                device: torch.device | None = None):
    """This machine's rates on ``device`` (zinf_compiler/cost_model.py's probes; default: the GPU if there is
    one, else the CPU), for this process alone; at ``world_size`` > 1 on a CPU with the collective rate of that
    many ranks on this machine (:func:`probe_collective`)."""
    import dataclasses

    from .cost_model import profile_machine
    from .runtime.comm import Comm
    from .runtime.copy_engine import CopyEngine
    from .runtime.trace import Tracer

    tracer = Tracer()
    device = default_device() if device is None else device
    profile = profile_machine(device, dtype, nvme_path, Comm(copier=CopyEngine(tracer), tracer=tracer))
    if world_size > 1 and device.type == "cpu" and not torch.distributed.is_initialized():
        profile = dataclasses.replace(profile, collective=probe_collective(world_size))
    return profile


def probe_collective(world_size: int) -> float:
    """The all-gather rate (bytes/s) of ``world_size`` ranks on this machine (gloo on localhost, each rank with
    its share of the cores), measured by cost_model's probe in that many spawned processes: what a plan from one
    process lacks (its own group has one rank)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock, tempfile.TemporaryDirectory(prefix="zinf-probe-") as scratch:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        sock.close()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        mp.start_processes(_probe_rank, args=(world_size, address, threads, scratch), nprocs=world_size,
                           start_method="spawn")
        with open(os.path.join(scratch, "rate")) as handle:
            return float(handle.read())


def _probe_rank(rank: int, world_size: int, address: str, threads: int, scratch: str) -> None:
    torch.set_num_threads(threads)
    torch.distributed.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    try:
        rate = probe_rates(None, torch.float32, device=torch.device("cpu")).collective
        if rank == 0:
            with open(os.path.join(scratch, "rate"), "w") as handle:
                handle.write(repr(rate))
    finally:
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None, prog: str = "python -m zinf_compiler.plan_cli") -> int:
    """Plan the model ``argv`` describes under each option set and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config", help="a Hugging Face config.json (or its folder): plan that causal LM")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks; with --probe on a CPU, all on this machine: each probed with its share of the "
                             "cores, and the collective rate measured with that many local processes")
    parser.add_argument("--options", action="append", type=json.loads,
                        help="a JSON object of zinf options (repeat for several rows; default: the usual sets)")
    parser.add_argument("--nvme-path", default=None, help="the folder NVMe tiers use (default: a temporary one)")
    parser.add_argument("--probe", action="store_true", help="measure this machine's rates and predict the step")
    parser.add_argument("--host-memory", help="a host RAM budget (peak RSS per rank): zinf chooses the options")
    parser.add_argument("--device-memory", help="a device memory budget per rank: zinf chooses the options")
    parser.add_argument("--device", help="where the model will train: cpu or cuda (default: cuda if this machine "
                                         "has a GPU, else cpu)")
    args = parser.parse_args(argv)
    on_cpu = (torch.device(args.device) if args.device else default_device()).type == "cpu"
    if args.probe and not on_cpu and not torch.cuda.is_available():
        parser.error(f"--probe measures this machine's {args.device}, which it does not have (leave out --probe "
                     "to plan without a step time, or run on the machine that will train)")
    if args.probe and on_cpu:  # one rank's share of the cores, as each rank will have
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    if args.host_memory or args.device_memory:
        return _choose(args)
    model, batch = _model_and_batch(args)
    device = compute_device(model, args.device)
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with tempfile.TemporaryDirectory(prefix="zinf-plan-") as scratch:
        nvme_path = args.nvme_path or scratch
        profile = probe_rates(nvme_path, torch.float32, args.world_size, device) if args.probe else None
        predictions = []
        for options in args.options or CANDIDATES:
            options = dict(options)
            if "nvme" in options.values():
                options.setdefault("nvme_path", nvme_path)
            predictions.append(plan(model, batch, options, world_size=args.world_size, profile=profile, device=device))
    print(f"{type(model).__name__}: {numel:,} parameters, batch {args.batch} x {args.seq} tokens, "
          f"world size {args.world_size}, on {device.type}; per rank (the one holding the most), MiB:\n")
    print(describe(predictions).replace(f", nvme_path={nvme_path}", ""))
    if profile is not None:
        print("\nrates: " + "; ".join(profile.describe()))
    return 0


def _choose(args) -> int:
    """--host-memory / --device-memory: the options zinf chooses under the budgets, and every set it weighed."""
    model, batch = _model_and_batch(args)
    device = compute_device(model, args.device)
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    fixed = {key: value for options in args.options or [] for key, value in options.items()}
    budgets = {"host_memory": args.host_memory, "device_memory": args.device_memory}
    with tempfile.TemporaryDirectory(prefix="zinf-plan-") as scratch:
        if args.nvme_path:
            fixed.setdefault("nvme_path", args.nvme_path)
        profile = probe_rates(args.nvme_path or scratch, torch.float32, args.world_size, device) if args.probe else None
        chosen = choose(model, batch, {**fixed, **budgets}, world_size=args.world_size, profile=profile,
                        device=device)
    given = ", ".join(f"{name} {value}" for name, value in budgets.items() if value)
    print(f"{type(model).__name__}: {numel:,} parameters, batch {args.batch} x {args.seq} tokens, world size "
          f"{args.world_size}, on {device.type}; under {given} ({', '.join(f'{k} {v:,} bytes' for k, v in chosen.budget.items() if v)}),"
          f" per rank, the process's own RSS included; step at {'probed' if profile else 'nominal'} rates:\n")
    print(describe_choice(chosen))
    print("\nchosen options: " + json.dumps(chosen.compile_options()))
    print("\n" + describe([chosen]))
    if profile is not None:
        print("\nrates: " + "; ".join(profile.describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
