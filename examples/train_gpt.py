"""Train a small byte-level GPT with zinf: the README's main job.

    python examples/train_gpt.py                       # CPU, a few minutes
    python examples/train_gpt.py --steps 50 --lower eager
    python examples/train_gpt.py --offload cpu         # state in CPU memory instead of NVMe swap files
    torchrun --nproc-per-node 2 examples/train_gpt.py  # 2 ranks, gloo on CPU
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 2 --pp 2   # pipeline x tensor x data parallel
    python examples/train_gpt.py --checkpoint-dir ckpt --save-every 100     # then again with --resume
    torchrun --nproc-per-node 2 --max-restarts 3 examples/train_gpt.py --checkpoint-dir ckpt --resume auto
                                                       # a restart continues from the newest checkpoint

The text is generated here (seeded sentences from a fixed vocabulary), so the
run needs no download. The model, the optimizer and the loop are plain
PyTorch; zinf comes in through ``torch.compile(backend="zinf")`` and its
optimizer, which steps the sharded state.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig

WORDS = (
    "the a one every some model memory layer tensor shard rank gradient optimizer disk cache graph "
    "compiler kernel device host stream buffer parameter weight bias token batch step loss learns "
    "trains moves gathers releases reduces writes reads fetches overlaps splits scales fits grows "
    "fast slow large small whole partial quietly early late again across between before after"
).split()


def make_corpus(n_bytes: int, seed: int) -> bytes:
    """Sentences of 4-12 words with simple structure a small model can learn."""
    rng = random.Random(seed)
    sentences = []
    total = 0
    while total < n_bytes:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        sentence = " ".join(words).capitalize() + rng.choice([". ", ". ", "! ", "? "])
        sentences.append(sentence)
        total += len(sentence)
    return "".join(sentences).encode()


def batch_at(data: torch.Tensor, step: int, rank: int, world: int, batch: int, block: int, seed: int):
    """This rank's share of step ``step``'s batch: ``batch`` random windows of the text and their next bytes.

    A function of the step and the rank's place in the world, not of what this
    process has run before: a run resumed from a checkpoint sees the batches an
    uninterrupted run would.  Every world size draws from the same stream per
    step, so at world 1 a step's batch is rank 0's share of it at world 2.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - block - 1, (world * batch,), generator=generator)
    windows = torch.stack([data[s : s + block + 1] for s in starts[rank * batch : (rank + 1) * batch].tolist()])
    return windows[:, :-1].long(), windows[:, 1:].long()


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: bytes, n_new: int, block: int, device: torch.device) -> bytes:
    """Greedy decoding through the compiled model, always on a full window.

    A constant input shape keeps Dynamo from recompiling for every length
    (at stage 3 the uncompiled module cannot run: its parameters hold no memory).
    """
    tokens = torch.tensor(list(b" " * block + prompt), dtype=torch.long, device=device)[None]
    for _ in range(n_new):
        logits = model(tokens[:, -block:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return bytes(tokens[0, block:].tolist())


def resume(args, model, opt, schedule, world: int, say) -> int | None:
    """The first step to train: after the newest complete checkpoint in ``--checkpoint-dir`` (loaded into ``model``,
    ``opt`` and ``schedule``) with ``--resume``, else 1; None: ``--resume always`` found none (said on stderr)."""
    checkpoint = zinf.latest(args.checkpoint_dir) if args.checkpoint_dir and args.resume != "never" else None
    if args.resume == "always" and checkpoint is None:
        print(f"error: --resume: no complete checkpoint in --checkpoint-dir {args.checkpoint_dir!r}", file=sys.stderr)
        return None
    if checkpoint is None:
        return 1
    # zinf.load reshards: the checkpoint may come from another world size (an elastic restart), and a pipeline's
    # stages each over their dp and tp ranks (the number of stages must be the saved one).
    extra = zinf.load(checkpoint, model, opt)
    schedule.load_state_dict(extra["schedule"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")  # set by torchrun
    say(f"resumed from {checkpoint} at step {extra['step'] + 1}, world {world} (saved at world {extra['world']}"
        f"{f'; torchrun restart {restart}' if restart else ''})", flush=True)
    return extra["step"] + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage 0-3")
    parser.add_argument("--lower", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--offload", choices=["none", "cpu", "nvme"], default="nvme",
                        help="where parameter shards and optimizer state rest (default: NVMe swap files)")
    parser.add_argument("--nvme-path", default=".zinf_swap",
                        help="folder for swap files (created; zinf makes a private subfolder it removes at exit)")
    parser.add_argument("--nvme-grad-ram-bytes", default="auto",
                        help="with --offload nvme: reduced gradients kept in RAM up to this many bytes, the rest in "
                             "swap files (auto: an eighth of the memory available; 0: every gradient on NVMe)")
    parser.add_argument("--param-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--sample-tokens", type=int, default=60, help="bytes to generate after training")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save a checkpoint here every --save-every steps (zinf.save: each rank its shards)")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--resume", nargs="?", const="always", default="never", choices=["never", "auto", "always"],
                        help="start from the newest complete checkpoint in --checkpoint-dir; --resume auto: if there "
                             "is one (a torchrun restart continues where the last checkpoint left off)")
    parser.add_argument("--loss-file", default=None, help="rank 0 appends 'step loss' lines here, the loss exact")
    parser.add_argument("--export", default=None,
                        help="after training, write consolidated weights here (model.safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torch's TP plan on each block)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (blocks cut evenly, Schedule1F1B); "
                        "data parallel takes the remaining ranks: world / (tp * pp)")
    parser.add_argument("--micro-batches", type=int, default=4, help="per step, with --pp above 1")
    args = parser.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        # One GPU per process: streams, events and pinned-memory registration default to it.
        torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)

    data = torch.frombuffer(bytearray(make_corpus(400_000, args.seed)), dtype=torch.uint8)
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    options = {"stage": args.stage, "lower": args.lower, "param_dtype": args.param_dtype,
               "offload_param": args.offload, "offload_optimizer": args.offload}
    if args.offload == "nvme":
        try:
            os.makedirs(args.nvme_path, exist_ok=True)
        except OSError as err:
            print(f"error: cannot use --nvme-path {args.nvme_path!r}: {err}", file=sys.stderr)
            return 2
        options["nvme_path"] = args.nvme_path
        options["nvme_grad_ram_bytes"] = args.nvme_grad_ram_bytes
    if args.dump_dir:
        options["dump_dir"] = args.dump_dir
    try:
        zinf.parse_options(options)  # fail before training, with the option's name
    except zinf.ZinfOptionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.tp > 1 or args.pp > 1:
        return train_parallel(args, cfg, options, data, world, device, say)
    torch.manual_seed(args.seed)
    if args.stage == 3 and args.offload != "none":
        # Offloaded: build the model as shapes only and let zinf fill and
        # shard it module by module, so the whole model is never in memory.
        with torch.device("meta"):
            model = GPT(cfg)
        zinf.materialize(model, options, init_fn=model.init_weights, device=device, progress=rank == 0)
    else:
        model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    zinf.register()  # "zinf" by name also from a source tree that is not pip-installed
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 20))
    say(f"zinf example: GPT {n_params / 1e6:.2f}M params, world {world}, options {options}")

    first_step = resume(args, compiled, opt, schedule, world, say)
    if first_step is None:
        return 2
    first_loss = loss_value = None
    started = last_log = time.perf_counter()
    tokens_since_log = 0
    for step in range(first_step, args.steps + 1):
        idx, targets = batch_at(data, step, rank, world, args.batch_size, args.block_size, args.seed)
        loss = compiled(idx.to(device), targets.to(device))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        schedule.step()
        tokens_since_log += idx.numel() * world
        loss_value = loss.item()
        first_loss = loss_value if first_loss is None else first_loss
        if args.loss_file and rank == 0:
            with open(args.loss_file, "a") as losses:
                losses.write(f"{step} {loss_value!r}\n")
        if args.checkpoint_dir and step % args.save_every == 0:
            zinf.save(os.path.join(args.checkpoint_dir, f"step-{step:06d}"), compiled, opt,
                      extra={"step": step, "world": world, "schedule": schedule.state_dict()})
        if step == first_step:
            say(f"first step (includes compiling) took {time.perf_counter() - started:.1f}s")
            last_log, tokens_since_log = time.perf_counter(), 0
        elif step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            rate = tokens_since_log / max(now - last_log, 1e-9)
            bar = "#" * int(30 * step / args.steps)
            line = f"step {step:>5}/{args.steps} [{bar:<30}] loss {loss_value:.4f}  {rate:,.0f} tok/s"
            if sys.stdout.isatty():  # one updating line in a terminal, one line per report in a log
                say("\r" + line, end="", flush=True)
            else:
                say(line, flush=True)
            last_log, tokens_since_log = now, 0
    if sys.stdout.isatty():
        say()
    report = zinf.memory_report(compiled)
    for tier in ("device", "cpu", "nvme"):
        held = report[tier]
        say(f"{tier:>6} tier on this rank: params {held['params']:,} B, grads {held['grads']:,} B, "
            f"optimizer {held['optimizer']:,} B")
    say(f"runtime peak of this model: device {report['peak']['device']:,} B, cpu {report['peak']['cpu']:,} B; "
        f"pinned staging pools (the process's) {report['buffers']['cpu']:,} B")
    # Every rank decodes: at stages 2-3 each forward gathers parameters collectively.
    text = sample(compiled, b"The model ", args.sample_tokens, args.block_size, device)
    say(f"sample: {text.decode(errors='replace')!r}")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    say(f"peak RSS {peak_rss:,} B; model states {16 * n_params:,} B (16 B/param: fp32 weight, gradient, "
        f"two Adam moments)")
    if loss_value is not None:  # None: resumed from a checkpoint of the last step
        say(f"final loss {loss_value:.4f} after {args.steps} steps (first step {first_loss:.4f}), "
            f"{time.perf_counter() - started:.0f}s in all")
    if args.export:
        zinf.export(args.export, compiled)
        say(f"weights written to {args.export}/model.safetensors")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def train_parallel(args, cfg: GPTConfig, options: dict, data: torch.Tensor, world: int, device: torch.device,
                   say) -> int:
    """``--tp`` / ``--pp``: the GPT cut into ``--pp`` pipeline stages of blocks (Schedule1F1B), each stage's blocks
    split over ``--tp`` ranks by torch's TP plan, each stage compiled with zinf (stage 3) over its data-parallel
    ranks, which take the rest of the world (docs/notes/three_d.md).  ``--batch-size`` rows per dp rank.

    Gradients are clipped at 1.0 by the whole model's norm, as in the data-parallel path (zinf's
    ``clip_grad_norm_`` spans the dp, tp and pipeline ranks).  Checkpoints, ``--resume`` and ``--export`` take
    the whole pipeline (every rank passes its stage: one folder, a stage folder each; ``--export`` writes a file per
    stage and an index).  Left out here: the sample (decoding through a pipeline).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from zinf_compiler.gpt_parallel import GPTStage, parallelize_blocks, stage_loss, untie_head
    from zinf_compiler.pipeline_parallel import ZinfPipelineStage

    tp, pp, micro_batches = args.tp, args.pp, args.micro_batches if args.pp > 1 else 1
    problems = [f"world {world} is not a multiple of --tp {tp} x --pp {pp}" if world % (tp * pp) else None,
                f"--n-layer {args.n_layer} does not split into --pp {pp} stages" if args.n_layer % pp else None,
                f"--n-head {args.n_head} does not split over --tp {tp}" if args.n_head % tp else None,
                f"--batch-size {args.batch_size} does not split into --micro-batches {micro_batches}"
                if args.batch_size % micro_batches else None,
                "--tp/--pp train at --stage 3" if args.stage != 3 else None]
    if any(problems):
        print(f"error: {'; '.join(p for p in problems if p)}", file=sys.stderr)
        return 2
    dp = world // (tp * pp)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(args.seed)
    model = GPT(dataclasses.replace(cfg, separate_qkv=True)).to(device)
    if pp > 1:
        untie_head(model)  # (the embedding and the LM head lie in different stages)
    n_params = sum(p.numel() for p in model.parameters())
    module = GPTStage(model, pp_rank, pp)
    if tp > 1:
        parallelize_blocks(module, mesh["tp"])
    zinf.register()
    compiled = torch.compile(module, backend="zinf", options={**options, "mesh": mesh["dp"]})
    first, last = pp_rank == 0, pp_rank == pp - 1
    if pp > 1:
        rows = args.batch_size // micro_batches
        boundary = torch.empty(rows, args.block_size, args.n_embd, device=device, requires_grad=True)
        ids = torch.zeros(rows, args.block_size, dtype=torch.long, device=device)
        logits = torch.empty(rows, args.block_size, cfg.vocab_size, device=device, requires_grad=True)
        stage = ZinfPipelineStage(compiled, pp_rank, pp, device, input_args=ids if first else boundary,
                                  output_args=logits if last else boundary, group=mesh["pp"].get_group())
        pipeline = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=stage_loss)
    opt = zinf.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 20))
    say(f"zinf example: GPT {n_params / 1e6:.2f}M params, world {world} = pp {pp} x dp {dp} x tp {tp}"
        f"{f', {micro_batches} micro-batches' if pp > 1 else ''}, options {options}")
    saved_model = stage if pp > 1 else compiled  # (a pipeline's checkpoint: every rank passes its stage)
    first_step = resume(args, saved_model, opt, schedule, world, say)
    if first_step is None:
        return 2
    first_loss = loss_value = None
    started = last_log = time.perf_counter()
    tokens_since_log = 0
    for step in range(first_step, args.steps + 1):
        idx, targets = batch_at(data, step, dp_rank, dp, args.batch_size, args.block_size, args.seed)
        idx, targets = idx.to(device), targets.to(device)
        micro_losses = []
        if pp == 1:
            loss = stage_loss(compiled(idx), targets)
            loss.backward()
            micro_losses.append(loss.detach())
        elif first:
            pipeline.step(idx)
        elif last:
            pipeline.step(target=targets, losses=micro_losses)
        else:
            pipeline.step()
        opt.clip_grad_norm_(1.0)  # (the whole model's norm: every stage's and tp rank's gradients)
        opt.step()
        opt.zero_grad()
        schedule.step()
        # The whole batch's loss on every rank: the last stage's, averaged over dp (the other stages add 0).
        loss = torch.stack(micro_losses).mean().detach() if last else torch.zeros((), device=device)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        if pp > 1:
            dist.all_reduce(loss, group=mesh["pp"].get_group())
        loss_value = loss.item()
        first_loss = loss_value if first_loss is None else first_loss
        tokens_since_log += idx.numel() * dp
        if args.loss_file and dist.get_rank() == 0:
            with open(args.loss_file, "a") as losses:
                losses.write(f"{step} {loss_value!r}\n")
        if args.checkpoint_dir and step % args.save_every == 0:
            zinf.save(os.path.join(args.checkpoint_dir, f"step-{step:06d}"), saved_model, opt,
                      extra={"step": step, "world": world, "schedule": schedule.state_dict()})
        if step == first_step:
            say(f"first step (includes compiling) took {time.perf_counter() - started:.1f}s")
            last_log, tokens_since_log = time.perf_counter(), 0
        elif step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            say(f"step {step:>5}/{args.steps} loss {loss_value:.4f}  {tokens_since_log / max(now - last_log, 1e-9):,.0f} "
                f"tok/s", flush=True)
            last_log, tokens_since_log = now, 0
    report = zinf.memory_report(compiled)
    for tier in ("device", "cpu", "nvme"):
        held = report[tier]
        say(f"{tier:>6} tier on rank 0 (stage 0): params {held['params']:,} B, grads {held['grads']:,} B, "
            f"optimizer {held['optimizer']:,} B")
    if args.export:
        zinf.export(args.export, saved_model)
        say(f"weights written to {args.export}/model.safetensors.index.json (a file per pipeline stage)" if pp > 1
            else f"weights written to {args.export}/model.safetensors")
    if loss_value is not None:  # None: resumed from a checkpoint of the last step
        say(f"final loss {loss_value:.4f} after {args.steps} steps (first step {first_loss:.4f}), "
            f"{time.perf_counter() - started:.0f}s in all")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
