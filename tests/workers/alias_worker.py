"""One case of tests/integration/test_aliased_storage.py in a process of its own: a crash fails one test, not the suite.

Launched by tests/support/multirank.py (world size 1).  An eager model and its zinf
copy (stage 3) take the same steps; the case holds tensors that share a
parameter's storage (a ``state_dict()`` taken before compiling or inside
``zinf.gathered``, ``p.detach()``, ``p.data``, views) across the moment zinf
frees that storage, then uses them.  Writes what each use gave: its
relative error against the eager model's own alias, or the error it raised.
"""

import copy
import io
import json
import os
import pickle

import torch

import zinf_compiler as zinf
from multirank import start_rank

OPTIONS = {"stage": 3, "lower": "eager"}


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.detach().double(), actual.detach().double()
    return float((expected - actual).abs().max() / expected.abs().max().clamp_min(1e-12))


class Twins:
    """An eager model and its zinf copy, each with its own AdamW."""

    def __init__(self):
        torch.manual_seed(0)
        self.eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        self.model = copy.deepcopy(self.eager)
        self.eager_opt = torch.optim.AdamW(self.eager.parameters(), lr=0.05)
        self.opt = None
        self.compiled = None
        self.generator = torch.Generator().manual_seed(1)

    def step(self) -> tuple[float, float]:
        """One training step of both (the first compiles the zinf copy)."""
        if self.compiled is None:
            self.compiled = torch.compile(self.model, backend="zinf", options=OPTIONS)
            self.opt = zinf.optim.AdamW(self.model.parameters(), lr=0.05)
        batch = torch.randn(5, 8, generator=self.generator)
        losses = []
        for module, opt in ((self.eager, self.eager_opt), (self.compiled, self.opt)):
            loss = module(batch).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return tuple(losses)

    def param_errors(self) -> dict[str, float]:
        state = zinf.full_state_dict(self.compiled)
        return {name: relative_error(p, state[name]) for name, p in self.eager.named_parameters()}


def outcome(use) -> dict:
    """What ``use()`` gave: ``{"value": ...}`` or ``{"error": class name, "message": ...}``."""
    try:
        return {"value": use()}
    except Exception as err:  # noqa: BLE001  (the test checks which)
        return {"error": type(err).__name__, "message": str(err)}


def reads(tensor: torch.Tensor) -> dict:
    """Ways eager code reads a tensor, each on its own."""
    return {
        "sum": outcome(lambda: float(tensor.sum())),
        "repr": outcome(lambda: repr(tensor)[:40]),
        "clone": outcome(lambda: tensor.clone().shape[0]),
        "equal": outcome(lambda: torch.equal(tensor, tensor)),
        "tolist": outcome(lambda: len(tensor.tolist())),
        "torch.save": outcome(lambda: torch.save(tensor, io.BytesIO())),
    }


def errors_inside_gathered(twins: Twins, mine: dict, eager: dict) -> dict[str, float]:
    """Inside ``zinf.gathered`` each alias reads the parameter's current value: its error against eager's."""
    with zinf.gathered(twins.compiled):
        return {name: relative_error(eager[name], value) for name, value in mine.items()}


def state_dict_before_compiling_read_after_a_step(twins: Twins) -> dict:
    eager, mine = twins.eager.state_dict(), twins.model.state_dict()
    twins.step()
    result = {name: reads(value) for name, value in mine.items()}
    result["inside_gathered"] = errors_inside_gathered(twins, mine, eager)
    twins.step()  # eager's aliases follow its parameters: so must ours, read inside the block
    result["inside_gathered_after_another_step"] = errors_inside_gathered(twins, mine, eager)
    return result


def load_state_dict_taken_before_compiling(twins: Twins) -> dict:
    eager, mine = twins.eager.state_dict(), twins.model.state_dict()
    eager_copy = {name: value.clone() for name, value in eager.items()}
    copied = {name: value.clone() for name, value in mine.items()}
    losses = [twins.step()]
    # In eager the state dict holds the current values: loading it changes nothing.
    twins.eager.load_state_dict(eager)
    loaded = outcome(lambda: str(twins.model.load_state_dict(mine)))
    losses.append(twins.step())
    after_aliases = twins.param_errors()
    # A copy taken before compiling holds the initial values: loading it writes them into the shards.
    twins.eager.load_state_dict(eager_copy)
    twins.model.load_state_dict(copied)
    after_copy = twins.param_errors()
    losses.append(twins.step())
    return {"loaded": loaded, "losses": losses, "after_aliases": after_aliases, "after_copy": after_copy,
            "final": twins.param_errors()}


def state_dict_inside_gathered_read_after_the_block(twins: Twins) -> dict:
    twins.step()
    with zinf.gathered(twins.compiled):
        mine = twins.model.state_dict()
        inside = {name: relative_error(value, mine[name]) for name, value in twins.eager.state_dict().items()}
    eager = twins.eager.state_dict()
    result = {name: reads(value) for name, value in mine.items()}
    result["inside"] = inside
    result["inside_gathered_again"] = errors_inside_gathered(twins, mine, eager)
    twins.step()
    result["inside_gathered_after_another_step"] = errors_inside_gathered(twins, mine, eager)
    return result


def state_dict_inside_gathered_saved_after_the_block(twins: Twins) -> dict:
    twins.step()
    saved_inside = io.BytesIO()
    with zinf.gathered(twins.compiled):
        mine = twins.model.state_dict()
        torch.save(mine, saved_inside)  # inside the block: the values, as in eager
    result = {
        "torch.save": outcome(lambda: torch.save(mine, io.BytesIO())),
        "pickle": outcome(lambda: len(pickle.dumps(mine))),
        "deepcopy": outcome(lambda: len(copy.deepcopy(mine))),
    }
    saved_inside.seek(0)
    loaded = torch.load(saved_inside)
    eager = twins.eager.state_dict()
    result["saved_inside"] = {name: relative_error(value, loaded[name]) for name, value in eager.items()}
    result["saved_inside_types"] = sorted({type(value).__name__ for value in loaded.values()})
    with zinf.gathered(twins.compiled):
        saved_again = io.BytesIO()
        torch.save(mine, saved_again)  # in a later block the same tensors save again
        copied = copy.deepcopy(mine)
    saved_again.seek(0)
    again = torch.load(saved_again)
    result["saved_again"] = {name: relative_error(value, again[name]) for name, value in eager.items()}
    result["deepcopy_again"] = {name: relative_error(value, copied[name]) for name, value in eager.items()}
    result["deepcopy_types"] = sorted({type(value).__name__ for value in copied.values()})
    return result


def aliases(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    weight, bias = module[0].weight, module[0].bias
    return {"detach": weight.detach(), "data": weight.data, "view": weight.view(-1), "t": weight.t(),
            "row": weight[3], "bias_view": bias.view(2, 8)}


def aliases_taken_before_compiling(twins: Twins) -> dict:
    eager, mine = aliases(twins.eager), aliases(twins.model)
    twins.step()
    result = {name: reads(value) for name, value in mine.items()}
    result["inside_gathered"] = errors_inside_gathered(twins, mine, eager)
    return result


def autograd_graph_from_before_compiling(twins: Twins) -> dict:
    # An eager forward whose graph saved views of the weights (addmm saves weight.t()): only
    # C++ holds those views, so they cannot be guarded.  Their storage must stay whole.
    before = {name: value.clone() for name, value in twins.model.state_dict().items()}
    pending = twins.model(torch.randn(5, 8)).sum()
    losses = [twins.step(), twins.step()]
    node, saved = pending.grad_fn, None
    while saved is None and node is not None:
        saved = getattr(node, "_saved_mat2", None)
        node = node.next_functions[0][0] if node.next_functions else None
    weight = "2.weight" if saved.shape == before["2.weight"].t().shape else "0.weight"
    return {"losses": losses, "final": twins.param_errors(),
            "saved_view_error": relative_error(before[weight].t(), saved),
            "param_storage_bytes": twins.model[0].weight.untyped_storage().nbytes()}


def parameter_sharing_the_storage(twins: Twins) -> dict:
    # Another module whose weight is a parameter of its own on the same storage (weights shared through .data).
    def sharer(module):
        linear = torch.nn.Linear(8, 16, bias=False)
        linear.weight = torch.nn.Parameter(module[0].weight.data)
        return linear

    eager, mine = sharer(twins.eager), sharer(twins.model)
    twins.step()
    batch = torch.randn(3, 8)
    result = {"forward": outcome(lambda: float(mine(batch).sum())), "type": type(mine.weight).__name__}
    with zinf.gathered(twins.compiled):
        result["inside_gathered"] = relative_error(eager(batch), mine(batch))
    return result


CASES = {case.__name__: case for case in (
    state_dict_before_compiling_read_after_a_step, load_state_dict_taken_before_compiling,
    state_dict_inside_gathered_read_after_the_block, state_dict_inside_gathered_saved_after_the_block,
    aliases_taken_before_compiling, autograd_graph_from_before_compiling, parameter_sharing_the_storage,
)}


def main() -> None:
    args, _, _ = start_rank()
    result = CASES[args["case"]](Twins())
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
