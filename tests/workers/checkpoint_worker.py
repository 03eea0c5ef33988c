"""One rank of the checkpoint tests (launched by tests/support/multirank.py).

Trains the small GPT on fixed batches (each rank its slice of the global
batch), saving a checkpoint every ``save_every`` steps under ``root``.
``resume``: start from ``zinf.latest(root)``.  ``n_embd``: the GPT's width instead of ``CFG``'s.
``threads``: torch's intra-op threads (multirank starts ranks with one).  ``kill``: SIGKILL this
process in the middle of step ``at`` (after backward, before the optimizer
step) or in the middle of the save after step ``at`` (data and manifest
written, nothing committed).  Rank 0 writes the losses and the final
``full_state_dict`` to ``out`` (a torch file).
"""

import dataclasses
import json
import os
import signal

import torch
import torch.distributed as dist

import zinf_compiler as zinf
import zinf_compiler.checkpoint.saving as checkpoint_saving
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from multirank import finish_rank, start_rank

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1)  # eps: as test_zero, so near-zero gradients do not amplify reduction-order noise


def main() -> None:
    args, world, rank = start_rank()
    if args.get("threads"):
        torch.set_num_threads(args["threads"])  # multirank starts ranks with OMP_NUM_THREADS=1
    options = {"lower": "eager", **args["options"]}
    if "nvme" in (options.get("offload_param"), options.get("offload_optimizer")):
        options["nvme_path"] = os.environ["TMPDIR"]
    config = dataclasses.replace(CFG, n_embd=args.get("n_embd", CFG.n_embd))
    torch.manual_seed(0)
    model = GPT(config)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    kill = args.get("kill")
    first = 0
    loaded_state = None
    if args.get("resume"):
        path = zinf.latest(args["root"])
        first = zinf.load(path, compiled, opt)["step"] + 1
        loaded_state = {k: v.clone() for k, v in zinf.full_state_dict(compiled).items()}
    batches = synthetic_batches(config, args["batch"], args["steps"])
    local = args["batch"] // world
    losses = {}
    for step in range(first, args["steps"]):
        idx, targets = batches[step]
        loss = compiled(idx[rank * local : (rank + 1) * local], targets[rank * local : (rank + 1) * local])
        loss.backward()
        if kill == {"at": step, "where": "step"}:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses[step] = mean.item()
        if rank == 0:
            with open(args["out"] + ".losses", "a") as log:  # survives a later SIGKILL
                log.write(f"{step} {mean.item()!r}\n")
        if (step + 1) % args.get("save_every", 10**9) == 0:
            if kill == {"at": step, "where": "save"}:
                write = checkpoint_saving.write_json_atomic

                def write_then_die(path, obj):
                    crc = write(path, obj)
                    if os.path.basename(path).startswith("rank-"):
                        os.kill(os.getpid(), signal.SIGKILL)  # data and manifest on disk, nothing committed
                    return crc

                checkpoint_saving.write_json_atomic = write_then_die
            zinf.save(os.path.join(args["root"], f"step-{step:04d}"), compiled, opt, extra={"step": step})
    state = zinf.full_state_dict(compiled)
    if rank == 0:
        torch.save({"losses": losses, "state": state, "loaded_state": loaded_state, "first": first}, args["out"])
    early = getattr(getattr(opt, "_nvme", None), "early", None)  # the NVMe optimizer's steps during backward
    with open(os.environ["ZINFTEST_OUT"], "w") as handle:
        json.dump({"first": first, "early_committed": early.stats["committed"] if early is not None else 0}, handle)
    finish_rank()


if __name__ == "__main__":
    main()
