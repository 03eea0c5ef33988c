"""One rank of the two-models test (launched by tests/support/multirank.py; issue 36, acceptance 3).

Two models in one process, each with its own mesh (A: the default group; B: a
process group of its own), collective timeout, fp16 scaler (A computes its
reduction in fp16 and overflows once on purpose; B stays fp32) and device
budget.  The rank trains A, reports it, trains B, and records what each
model's group holds, what ``memory_report`` says of each before and after
the other trains or reports, and what a report over a container of both does.
Then it checkpoints both, loads each into a fresh instance, and records the
loaded scalers and one more step's losses.
"""

import json
import os

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from multirank import finish_rank
from zinf_compiler.api import RUNTIME

OPTIONS_A = {"stage": 3, "param_dtype": "fp16", "offload_param": "cpu", "offload_optimizer": "cpu",
             "collective_timeout": 45, "device_memory_limit": 64 << 20, "lower": "eager"}
OPTIONS_B = {"stage": 2, "collective_timeout": 90, "device_memory_limit": 32 << 20, "lower": "eager"}
# (lower="eager": what is under test is per-model state, which the lowering does not touch; it keeps the
# default test run short.)


def build(seed: int, width: int, options: dict):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4))
    compiled = torch.compile(model, backend="zinf", options=options)
    return model, compiled, zinf.optim.AdamW(model.parameters(), lr=1e-2)


def step(compiled, opt, batch, loss_scale: float = 1.0) -> float:
    loss = compiled(batch).pow(2).mean() * loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def group_of(model):
    """The model's one group (also before its first call adopts its parameters, as after a load)."""
    groups = RUNTIME.store.groups_of(model.parameters())
    assert len(groups) == 1, f"{len(groups)} groups for one model"
    return groups[0]


def own(report: dict) -> dict:
    """A model's own figures: everything but the process's shared pinned pools."""
    return {key: value for key, value in report.items() if key not in ("buffers", "pinned")}


def main() -> None:
    args = json.loads(os.environ["ZINFTEST_ARGS"])
    dist.init_process_group("gloo")
    group_b = dist.new_group([0, 1])  # B's mesh: the same ranks, a group of its own
    torch.manual_seed(1)
    batch = torch.randn(8, 16)
    result = {}

    model_a, a, opt_a = build(0, 32, OPTIONS_A)
    model_b, b, opt_b = build(1, 24, dict(OPTIONS_B, mesh=group_b))
    result["losses_a"] = [step(a, opt_a, batch), step(a, opt_a, batch, loss_scale=1e8)]  # the second overflows
    report_a = zinf.memory_report(model_a)
    result["losses_b"] = [step(b, opt_b, batch), step(b, opt_b, batch)]
    result["a_unchanged_by_b_training"] = own(zinf.memory_report(model_a)) == own(report_a)
    report_a_now = zinf.memory_report(model_a)
    report_b = zinf.memory_report(model_b)
    result["a_unchanged_by_b_report"] = zinf.memory_report(model_a) == report_a_now
    result["b_unchanged_by_a_report"] = zinf.memory_report(model_b) == report_b
    result["reports"] = {"a": own(report_a), "b": own(report_b)}
    # A report over a container of both adds them up and merges nothing.
    both = zinf.memory_report(torch.nn.ModuleList([model_a, model_b]))
    result["both_params_device"] = both["device"]["params"]
    result["sum_params_device"] = report_a["device"]["params"] + report_b["device"]["params"]

    model_group_a, model_group_b = group_of(model_a), group_of(model_b)
    result["separate_ledgers"] = model_group_a is not model_group_b and model_group_a.ledger is not model_group_b.ledger
    result["group_meshes"] = model_group_a.mesh is not None and model_group_a.mesh is not model_group_b.mesh
    result["timeouts"] = [model_group_a.collective_timeout, model_group_b.collective_timeout]
    result["limits"] = [model_group_a.device_memory_limit, model_group_b.device_memory_limit]
    result["scalers"] = [model_group_a.fp16_scaler.state(), model_group_b.fp16_scaler.state()]
    result["meshes_differ"] = (RUNTIME.store.lookup(next(model_a.parameters())).mesh
                               is not RUNTIME.store.lookup(next(model_b.parameters())).mesh)

    folders = [os.path.join(args["root"], name) for name in ("a", "b")]
    zinf.save(folders[0], a, opt_a)
    zinf.save(folders[1], b, opt_b)
    model_a2, a2, opt_a2 = build(2, 32, OPTIONS_A)
    model_b2, b2, opt_b2 = build(3, 24, dict(OPTIONS_B, mesh=group_b))
    zinf.load(folders[0], a2, opt_a2)
    zinf.load(folders[1], b2, opt_b2)
    result["loaded_scalers"] = [group_of(model_a2).fp16_scaler.state(), group_of(model_b2).fp16_scaler.state()]
    result["next_losses"] = [[step(a, opt_a, batch), step(a2, opt_a2, batch)],
                             [step(b, opt_b, batch), step(b2, opt_b2, batch)]]
    # (Options reach a model's group when its first call compiles it.)
    result["loaded_timeouts"] = [group_of(model_a2).collective_timeout, group_of(model_b2).collective_timeout]
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    finish_rank()


if __name__ == "__main__":
    main()
