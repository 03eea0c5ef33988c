"""One rank of the tensor-parallel spike (issue 37): tp 2 x dp 2 at world 4 on gloo.

A 2-block MLP whose blocks go through torch's ``parallelize_module`` (fc1 colwise, fc2 rowwise) on
``mesh["tp"]``, compiled with zinf at the stage and mesh the arguments name, against the same model in
eager (parallelized the same way, its gradients all-reduced over dp by hand).  Records the losses and
gradients of each, or the error the compile raised.
"""

import json
import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from multirank import finish_rank, start_rank


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def build(mesh, width: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(width), Block(width))
    for block in model:
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def batch_of(dp_rank: int, width: int):
    """This dp rank's micro-batch (the tp ranks of one dp rank see the same one, as TP requires)."""
    torch.manual_seed(100 + dp_rank)
    return torch.randn(8, width)


def eager_run(mesh, width, steps):
    model = build(mesh, width)
    x = batch_of(mesh["dp"].get_local_rank(), width)
    losses, grads = [], {}
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    for name, param in model.named_parameters():
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grad = grad.clone()
        dist.all_reduce(grad, group=mesh["dp"].get_group())
        grads[name] = (grad / mesh["dp"].size()).tolist()
    return losses, grads


def main():
    args, world, rank = start_rank()
    width = 8
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result = {"rank": rank}
    result["eager_losses"], result["eager_grads"] = eager_run(mesh, width, args.get("steps", 1))
    model = build(mesh, width)
    zinf_mesh = {"mesh": mesh, "dp": mesh["dp"]}[args["mesh"]]
    options = {"stage": args.get("stage", 3), "mesh": zinf_mesh, "lower": args.get("lower", "eager")}
    try:
        compiled = torch.compile(model, backend="zinf", options=options)
        x = batch_of(mesh["dp"].get_local_rank(), width)
        losses = []
        for _ in range(args.get("steps", 1)):
            loss = compiled(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        result["zinf_losses"] = losses
        import zinf_compiler as zinf
        with zinf.gathered(model):  # full grads? record local shards instead
            pass
    except Exception as err:  # the spike records the failure
        result["error"] = f"{type(err).__name__}: {err}"[:3000]
        result["trace"] = traceback.format_exc()[-6000:]
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    finish_rank()


if __name__ == "__main__":
    main()
