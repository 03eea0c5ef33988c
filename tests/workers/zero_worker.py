"""One rank of the ZeRO equivalence test (launched by tests/support/multirank.py).

For each configuration: train the GPT under zinf on this rank's slice of the
batch; rank 0 also trains eager PyTorch on the whole batch and compares.
Clipping (through zinf's optimizer and through torch.nn.utils, on alternate
steps) and an LR schedule are on in every configuration, unless it says
``"max_norm": None``; ``"accumulate": k`` splits each rank's batch into k
micro-batches, their gradients accumulated before the step.
"""

import copy
import json
import os

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.api import RUNTIME
from multirank import finish_rank, start_rank

ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1, fused=True)
MAX_NORM = 0.5


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


def train(config: dict, cfg: GPTConfig, world: int, rank: int, steps: int, batch: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = GPT(cfg)
    model = copy.deepcopy(reference)
    options = {"lower": "eager", **config}
    max_norm = options.pop("max_norm", MAX_NORM)  # the test's, not zinf options
    accumulate = options.pop("accumulate", 1)
    if "mesh" in config:  # [replicas, shards] (HSDP) or [shards]: a DeviceMesh over every rank
        from torch.distributed.device_mesh import init_device_mesh

        names = ("replicate", "shard") if len(config["mesh"]) == 2 else ("shard",)
        options["mesh"] = init_device_mesh("cpu", tuple(config["mesh"]), mesh_dim_names=names)
    if "nvme" in (config.get("offload_param"), config.get("offload_optimizer"), config.get("offload_activations")):
        options["nvme_path"] = os.environ["TMPDIR"]
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    zinf_losses, eager_losses, norms, ref_norms = [], [], [], []
    RUNTIME.comm.reset_traffic()
    for step, (idx, targets) in enumerate(synthetic_batches(cfg, batch * world, steps)):
        if step == 1:
            calls_after_first = dict(RUNTIME.comm.calls)  # the first step also broadcasts at adoption
        micro = batch // accumulate
        loss = 0.0
        for first in range(rank * batch, (rank + 1) * batch, micro):
            micro_loss = compiled(idx[first : first + micro], targets[first : first + micro]) / accumulate
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        # Both ways users clip: zinf's optimizer, and torch's function on the model's
        # parameters (which zinf hands to that optimizer; param.grad alone misses the shards).
        if max_norm is None:
            pass
        elif step % 2:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        else:
            norms.append(opt.clip_grad_norm_(max_norm).item())
        opt.step()
        # Accounting while gradients and optimizer state are both alive,
        # next to the storage the store and the optimizer actually hold.
        report = zinf.memory_report(compiled)
        held = {kind: sum(t.untyped_storage().nbytes() for t in tensors)
                for kind, tensors in RUNTIME.store.held_tensors(model.parameters()).items()}
        held["optimizer"] = sum(t.untyped_storage().nbytes() for state in opt._inner.state.values()
                                for t in state.values() if isinstance(t, torch.Tensor))
        opt.zero_grad()
        sched.step()
        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        zinf_losses.append(mean_loss.item())
        if rank == 0:
            ref_loss = reference(idx, targets)
            ref_loss.backward()
            if max_norm is not None:
                ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item())
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            eager_losses.append(ref_loss.item())
    calls_per_step = {kind: (calls - calls_after_first.get(kind, 0)) / (steps - 1)
                      for kind, calls in RUNTIME.comm.calls.items()}
    grads_are_none = all(p.grad is None for p in model.parameters())
    state = zinf.full_state_dict(compiled)
    param_numels = {name: p.numel() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    result = {"config": config, "zinf_losses": zinf_losses, "norms": norms, "report": report, "held": held,
              "param_numels": param_numels, "trainable": sorted(trainable),
              "grads_are_none": grads_are_none, "traffic": dict(RUNTIME.comm.traffic_bytes),
              "calls_per_step": calls_per_step,
              "early_steps": dict(opt._nvme.early.stats) if opt._nvme is not None and opt._nvme.early else None}
    if rank == 0:
        errors = {}
        for name, expected in reference.state_dict().items():
            if expected.is_floating_point():
                scale = expected.abs().max().clamp_min(1e-12)
                errors[name] = ((expected - state[name]).abs().max() / scale).item()
        result.update(eager_losses=eager_losses, ref_norms=ref_norms, param_errors=errors)
    return result


def mesh_refusals(cfg: GPTConfig, world: int) -> dict:
    """What zinf refuses about option mesh, each as the error's type and message."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager", "mesh": mesh})
    idx, targets = next(iter(synthetic_batches(cfg, 1, 1)))
    compiled(idx, targets).backward()
    refusals = {}

    def save_mixed():  # one model on the mesh, one over every rank, saved as one
        plain = torch.nn.Linear(8, 8)  # small: compiled on four ranks sharing two cores
        torch.compile(plain, backend="zinf", options={"stage": 3, "lower": "eager"})(torch.ones(2, 8)).sum().backward()
        zinf.save(os.path.join(os.environ["TMPDIR"], "mixed"), torch.nn.ModuleDict({"mesh": model, "plain": plain}))

    attempts = {
        "stage 0": lambda: torch.compile(GPT(cfg), backend="zinf", options={"stage": 0, "mesh": mesh})(idx, targets),
        "3-D mesh": lambda: zinf.parse_options({"mesh": init_device_mesh("cpu", (1, 2, world // 2))}),
        "environment": lambda: zinf.parse_options({}, environ={"ZINF_MESH": "2x2"}),
        "save mixed": save_mixed,
    }
    for what, attempt in attempts.items():
        torch._dynamo.reset()
        try:
            attempt()
            refusals[what] = None
        except Exception as err:  # noqa: BLE001  (the test reads which error)
            while not type(err).__name__.startswith("Zinf") and (err.__cause__ or err.__context__):
                err = err.__cause__ or err.__context__  # (Dynamo wraps a backend's error)
            refusals[what] = [type(err).__name__, str(err)]
    return refusals


def mesh_checkpoint(cfg: GPTConfig, world: int) -> dict:
    """zinf.save of a model on a 2 x (world/2) mesh (HSDP) with its optimizer, loaded into a new model on the
    same mesh and into one sharded over every rank without a mesh: the saved weights, and the next two steps."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    folder = os.path.join(os.environ["TMPDIR"], "mesh-checkpoint")  # one folder: every rank's TMPDIR
    batches = list(synthetic_batches(cfg, world, 4))

    def build(seed: int, options: dict):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        model = GPT(cfg)
        compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager", **options})
        return compiled, zinf.optim.AdamW(model.parameters(), **ADAMW)

    def step(compiled, opt, index: int) -> float:
        idx, targets = batches[index]
        loss = compiled(idx[rank : rank + 1], targets[rank : rank + 1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    def same_state(compiled, expected) -> bool:
        state = zinf.full_state_dict(compiled)
        return set(state) == set(expected) and all(torch.equal(state[name], expected[name]) for name in expected)

    compiled, opt = build(0, {"mesh": mesh, "offload_optimizer": "cpu"})
    step(compiled, opt, 0)
    step(compiled, opt, 1)
    zinf.save(folder, compiled, opt)
    saved = zinf.full_state_dict(compiled)
    result = {"files": sorted(name for name in os.listdir(folder) if name.startswith("rank-")),
              "mesh": json.load(open(os.path.join(folder, "meta.json")))["mesh"],
              "next_losses": [step(compiled, opt, 2), step(compiled, opt, 3)]}
    for name, options in (("same mesh", {"mesh": mesh, "offload_optimizer": "cpu"}), ("no mesh", {})):
        compiled, opt = build(1, options)
        step(compiled, opt, 0)  # a step of its own first: the load must replace weights and moments
        zinf.load(folder, compiled, opt)
        # The second loss follows a step from the loaded moments: it checks them too.
        result[name] = {"state_equal": same_state(compiled, saved),
                        "next_losses": [step(compiled, opt, 2), step(compiled, opt, 3)]}
    return result


def main() -> None:
    args, world, rank = start_rank()
    cfg = GPTConfig(**args["model"], frozen_scale=True)
    results = [train(config, cfg, world, rank, args["steps"], args["batch"]) for config in args["configs"]]
    if args.get("mesh_refusals"):
        results.append({**mesh_refusals(cfg, world), "checkpoint": mesh_checkpoint(cfg, world)})
    with open(os.environ["ZINFTEST_OUT"], "w") as handle:
        json.dump(results, handle)
    finish_rank()


if __name__ == "__main__":
    main()
