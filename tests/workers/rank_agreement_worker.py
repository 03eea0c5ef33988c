"""One rank of the rank-agreement tests (issue 25, points 4 and 6; launched by tests/support/multirank.py).

Each case trains a small model under zinf at world size 2 next to DDP (gloo)
on the same per-rank batches, with something that may differ between ranks:

* ``options``: per-rank options (``{"0": {...}, "1": {...}}``) merged into the
  shared ones;
* ``hidden``: per-rank hidden sizes (a model that differs between ranks);
* ``branch``: the model takes one of two Linear layers by the sign of its
  input's sum (a data-dependent branch: a graph break), and ``signs`` gives
  each rank's input sign per step, so the ranks may run different graphs.

Writes, per case: the error (type of the innermost zinf error, its message)
or the losses and the worst parameter error against DDP.  The process then
ends normally (no ``os._exit``): a rank that raised must be able to exit.
"""

import copy
import json
import os

import torch

import zinf_compiler as zinf
from multirank import finish_rank, start_rank


class Branchy(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.inp = torch.nn.Linear(8, hidden)
        self.up = torch.nn.Linear(hidden, hidden)
        self.down = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 4)

    def forward(self, x, branch: bool):
        h = torch.relu(self.inp(x))
        if branch and x.sum() < 0:  # data-dependent: Dynamo breaks the graph here
            h = self.down(h)
        else:
            h = self.up(h)
        return self.out(h)


def innermost_zinf_error(err: BaseException) -> BaseException:
    """Dynamo wraps a backend's error (BackendCompilerFailed): the zinf error inside, else ``err``."""
    seen = err
    while seen is not None:
        if type(seen).__name__.startswith("Zinf"):
            return seen
        seen = seen.__cause__ or seen.__context__
    return err


def run_case(case: dict, rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    hidden = case.get("hidden", {}).get(str(rank), 16)
    reference = Branchy(hidden)
    model = copy.deepcopy(reference)
    options = {"stage": 3, "lower": "eager", "collective_timeout": 20, **case.get("shared", {}),
               **case.get("options", {}).get(str(rank), {})}
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.SGD(model.parameters(), lr=0.1)
    # (DDP refuses models that differ between ranks itself: then zinf runs alone.)
    ddp = None if "hidden" in case else torch.nn.parallel.DistributedDataParallel(reference,
                                                                                  find_unused_parameters=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    signs = case.get("signs", [[1, 1, 1], [1, 1, 1]])[rank]
    branch = "signs" in case
    generator = torch.Generator().manual_seed(10 + rank)
    losses = []
    try:
        for sign in signs:
            x = torch.rand(4, 8, generator=generator) * sign
            ref_loss = torch.zeros(())
            if ddp is not None:
                ref_loss = ddp(x, branch).pow(2).mean()
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
            loss = compiled(x, branch).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((ref_loss.item(), loss.item()))
    except Exception as err:  # noqa: BLE001  (the test reads which error, on every rank)
        inner = innermost_zinf_error(err)
        return {"error": type(inner).__name__, "message": str(inner)}
    state = zinf.full_state_dict(compiled)
    errors = {name: float((p.detach() - state[name]).abs().max() / p.detach().abs().max())
              for name, p in reference.named_parameters()}
    return {"error": None, "losses": losses, "param_error": max(errors.values())}


def main() -> None:
    args, world, rank = start_rank()
    results = [run_case(case, rank, world) for case in args["cases"]]
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(results, out)
    finish_rank()


if __name__ == "__main__":
    main()
