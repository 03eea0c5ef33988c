"""One rank of test_usage_patterns' uncaptured-parameter test: parameters that run outside every graph.

A graph break inside the loop over a model's blocks makes Dynamo run the rest
of the loop, and the code after it, eagerly: the head below is never in a
compiled graph, so zinf never shards it and no graph averages its gradient.
zinf's optimizer must average it over ranks (as DDP would) before clipping and
stepping.  Each configuration trains the model on this rank's half of each
global batch and eager PyTorch on the whole batch; the result is the largest
difference in loss and in final parameters.
"""

import copy
import json
import os

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from multirank import finish_rank, start_rank


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return x + self.b(h)


class Net(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(2)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def train(options: dict, max_norm: float | None, world: int, rank: int) -> float:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="zinf", options={"lower": "eager", **options})
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(3):
        x = torch.randn(world * 4, 16, generator=torch.Generator().manual_seed(step))
        loss = compiled(x[rank * 4 : (rank + 1) * 4])
        loss.backward()
        ref_loss = reference(x)
        ref_loss.backward()
        if max_norm is not None:
            opt.clip_grad_norm_(max_norm)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        worst = max(worst, abs(mean_loss.item() / world - ref_loss.item()))
    full = zinf.full_state_dict(compiled)
    for name, value in reference.state_dict().items():
        worst = max(worst, (full[name] - value).abs().max().item())
    return worst


def main() -> None:
    args, world, rank = start_rank()
    torch.set_num_threads(1)
    result = [train(case["options"], case["max_norm"], world, rank) for case in args["cases"]]
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    finish_rank()


if __name__ == "__main__":
    main()
