"""One rank of the conv-net tests (launched by tests/support/multirank.py; world size 1 or more).

For each configuration: train a small conv net with BatchNorm under zinf on
this rank's slice of the batch, and next to it the reference: eager PyTorch
at world size 1, DistributedDataParallel (gloo) on the same slice at world
size > 1 (``broadcast_buffers`` as the configuration asks: DDP's default is
True).  ``hook``: a clamping gradient hook on one weight, in both.  Writes each step's losses, the worst parameter and buffer errors.
"""

import copy
import json
import os

import torch

import zinf_compiler as zinf
from multirank import finish_rank, start_rank

ADAMW = dict(lr=1e-2, eps=1e-6, fused=True)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)  # (BatchNorm follows: a bias would have no gradient)
        self.norm = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 4, stride=4)
        self.head = torch.nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv1(x)))
        return self.head(torch.relu(self.conv2(x)).flatten(1))


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.detach().double(), actual.detach().double()
    return float((expected - actual).abs().max() / expected.abs().max().clamp_min(1e-12))


def train(config: dict, world: int, rank: int, steps: int = 3, rows: int = 4) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = ConvNet()
    model = copy.deepcopy(reference)
    # Rank-dependent buffers, as a model built on each rank without a common seed would have them.
    with torch.no_grad():
        model.norm.running_mean.add_(rank)
        reference.norm.running_mean.add_(rank)
    if config.get("hook"):
        # A hook that is not linear (clamping): it must see this rank's own gradient, before averaging.
        for module in (model, reference):
            module.conv2.weight.register_hook(lambda grad: grad.clamp(-1e-3, 1e-3))
    options = {"stage": 3, **config.get("options", {})}
    if "nvme" in (options.get("offload_param"), options.get("offload_optimizer")):
        options["nvme_path"] = os.environ["TMPDIR"]
    broadcast_buffers = options.get("broadcast_buffers", True)
    if world > 1:
        reference = torch.nn.parallel.DistributedDataParallel(reference, broadcast_buffers=broadcast_buffers)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = torch.randn(rows * world, 3, 16, 16, generator=generator)
        mine = batch[rank * rows:(rank + 1) * rows]
        ref_loss = reference(mine).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = compiled(mine).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((ref_loss.item(), loss.item()))
    ref_module = reference.module if world > 1 else reference
    state = zinf.full_state_dict(compiled)
    param_errors = {name: relative_error(p, state[name]) for name, p in ref_module.named_parameters()}
    buffer_errors = {name: relative_error(b.float(), dict(model.named_buffers())[name].float())
                     for name, b in ref_module.named_buffers()}
    # What each rank's buffers hold, for comparing ranks with each other.
    return {"losses": losses, "param_errors": param_errors, "buffer_errors": buffer_errors,
            "running_mean": model.norm.running_mean.tolist()}


def main() -> None:
    args, world, rank = start_rank()
    results = [train(config, world, rank) for config in args["configs"]]
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(results, out)
    finish_rank()


if __name__ == "__main__":
    main()
