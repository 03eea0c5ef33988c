"""One rank of the interleaved NVMe models test (launched by tests/support/multirank.py).

Two models in one process, both with their parameters and optimizer state on
NVMe, trained the way a GAN or a teacher-student loop does: A's backward,
then B's forward and backward, then both optimizer steps.  A's early
optimizer steps (runtime/optim/early_adam.py) are in flight while B's graphs run,
and may move on inside B's waits on gloo and the disk (ParamStore._wait_working).
The rank runs this twice, with the steps during backward and without, and
steps an eager copy of each model beside it.
"""

import copy
import json
import os

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from multirank import finish_rank

STEPS = 3
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}


def build(seed: int, width: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 8))


def train(root: str, overlap: bool) -> dict:
    """Both models trained interleaved; each one's final state, losses and early steps, and the eager copies'."""
    torch._dynamo.reset()
    eager = [build(1, 1024), build(2, 64)]  # A large enough that its steps are in flight in B's waits
    models = [copy.deepcopy(model) for model in eager]
    compiled, opts = [], []
    for name, model in zip("ab", models):
        folder = os.path.join(root, f"{name}-{overlap}-rank{dist.get_rank()}")
        os.makedirs(folder)
        options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "overlap_optimizer": overlap,
                   "nvme_path": folder, "lower": "eager"}
        compiled.append(torch.compile(model, backend="zinf", options=options))
        opts.append(zinf.optim.AdamW(model.parameters(), **ADAMW))
    eager_opts = [torch.optim.AdamW(model.parameters(), **ADAMW) for model in eager]
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        batch = torch.randn(16, 32)  # the same on every rank: the averaged gradient is eager's
        step_losses = []
        for model in compiled:  # A's backward, then B's forward and backward, A's steps still in flight
            loss = model(batch).pow(2).mean()
            loss.backward()
            step_losses.append(loss.item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for model, opt in zip(eager, eager_opts):
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        losses.append(step_losses)
    states = [zinf.full_state_dict(model) for model in compiled]
    errors = []
    for state, model in zip(states, eager):
        errors.append(max(((value - state[name]).abs().max() / value.abs().max().clamp_min(1e-12)).item()
                          for name, value in model.state_dict().items()))
    return {"losses": losses, "errors": errors,
            "early": [dict(opt._nvme.early.stats) if opt._nvme is not None and opt._nvme.early else None
                      for opt in opts],
            "bytes": [{name: value.numpy().tobytes().hex() for name, value in state.items()} for state in states]}


def main() -> None:
    args = json.loads(os.environ["ZINFTEST_ARGS"])
    dist.init_process_group("gloo")
    result = {"early": train(args["root"], True), "late": train(args["root"], False)}
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    finish_rank()


if __name__ == "__main__":
    main()
