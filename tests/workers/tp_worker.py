"""One rank of the tensor-parallel tests (issue 37): tp 2 x dp 2 at world 4 on gloo (the GPT and a Llama:
``tp_model_worker.py``).

A 2-block MLP whose blocks go through torch's ``parallelize_module`` (fc1 colwise, fc2 rowwise) on
``mesh["tp"]``, compiled with zinf at the stage and mesh the arguments name, against the same model in
eager (parallelized the same way, its gradients all-reduced over dp by hand).  Records the losses and
gradients of each, or the error the compile raised.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from multirank import finish_rank, record_error, start_rank, write_result


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


LR = 0.05


def eager_run(mesh, width, steps):
    """The reference: the TP model in eager, its gradients averaged over dp by hand, plain SGD."""
    model = build(mesh, width)
    x = batch_of(mesh["dp"].get_local_rank(), width)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for param in model.parameters():
                grad = param.grad.to_local().clone()
                dist.all_reduce(grad, group=mesh["dp"].get_group())
                param.to_local().sub_(LR * grad / mesh["dp"].size())
                param.grad = None
    full = {name: param.full_tensor().tolist() for name, param in model.named_parameters()}
    return losses, {name: param.to_local().tolist() for name, param in model.named_parameters()}, full


def main():
    args, world, rank = start_rank()
    width = 8
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result = {"rank": rank}
    result["eager_losses"], result["eager_params"], result["eager_full"] = eager_run(mesh, width, args.get("steps", 1))
    model = build(mesh, width)
    zinf_mesh = {"mesh": mesh, "dp": mesh["dp"]}[args["mesh"]]
    options = {"stage": 3, "mesh": zinf_mesh, "lower": "eager", **args.get("options", {})}
    try:
        if "nvme" in (options.get("offload_param"), options.get("offload_optimizer")):
            options["nvme_path"] = os.path.join(os.environ["TMPDIR"], f"swap{rank}")
            os.makedirs(options["nvme_path"], exist_ok=True)
        compiled = torch.compile(model, backend="zinf", options=options)
        x = batch_of(mesh["dp"].get_local_rank(), width)
        import zinf_compiler as zinf

        optimizer = zinf.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for _ in range(args.get("steps", 1)):
            loss = compiled(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result["zinf_losses"] = losses
        with zinf.gathered(model):  # each rank's TP-local parameters, whole over dp
            result["zinf_params"] = {name: (param.to_local() if isinstance(param, DTensor) else param).tolist()
                                     for name, param in model.named_parameters()}
        result["zinf_full"] = {name: value.tolist() for name, value in zinf.full_state_dict(model).items()}
        # One model, one group: the optimizer claimed the DTensor parameters before the compile adopted their
        # local tensors (a claim keyed by the DTensor put each graph's records in a group of their own).
        view = zinf.api.store_of(model)
        result["model_groups"] = len(view.groups)
        result["unfound"] = [name for name, param in model.named_parameters() if view.lookup(param) is None]
        report = zinf.memory_report(model)
        result["memory_params"] = report["device"]["params"] + report["cpu"]["params"]
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())  # (global sizes)
    except Exception as err:
        record_error(result, err)
    write_result(result)
    finish_rank()


if __name__ == "__main__":
    main()
