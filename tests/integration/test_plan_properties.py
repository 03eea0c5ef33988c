"""Property-based: a model's plan (zinf_compiler/model_plan.py, the one source of byte counts) holds what the run
then holds, on drawn models and options (issue 53, acceptance 2).

A model is drawn from a small grammar (1-3 linear layers of drawn widths, with or without bias, one frozen,
two tied), and options: stage 1-3, the parameter and optimizer tiers, param_dtype, tiling, gradients on
NVMe in RAM or on disk, and a RAM cache budget over NVMe.  It is planned by ``zinf.plan`` from a copy on the
meta device (``plan_model`` underneath), then trained for real (``lower="eager"``: the byte rules do not
depend on the lowering; tests/integration/test_planner.py runs one under Inductor): after a step, zero_grad and
a further backward, every tier's params, grads and optimizer figures of ``memory_report`` equal the plan's
within the optimizer's step counters.

Examples: 3 by default (``quick``), 8 in the whole suite (``HYPOTHESIS_PROFILE=ci``, which run_tests.sh --all
sets), 60 with ``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import profiles
import torch
from hypothesis import given
from hypothesis import strategies as st

import zinf_compiler as zinf
from zinf_compiler.api import RUNTIME

profiles.load()  # (tests/support/profiles.py: 3 drawn cases, 8 with --all, 60 thorough)

SLACK = 64  # bytes per parameter: the optimizer's step counters, which the plan leaves out
TIERS = ("none", "cpu", "nvme")


@dataclasses.dataclass(frozen=True)
class Case:
    widths: tuple[int, ...]  # the input width, then each layer's output width
    bias: bool
    frozen: int | None  # this layer's weight does not train
    tied: bool  # the last layer's weight is the first's (both square, the same width)
    options: dict


class Drawn(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=case.bias)
                                          for a, b in zip(case.widths, case.widths[1:]))
        if case.frozen is not None:
            self.layers[case.frozen].weight.requires_grad_(False)
        if case.tied:
            self.layers[-1].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


@st.composite
def cases(draw) -> Case:
    depth = draw(st.integers(1, 3))
    tied = depth >= 2 and draw(st.booleans())
    if tied:
        width = draw(st.sampled_from([16, 24, 40]))
        widths = (width,) * (depth + 1)
    else:
        widths = tuple(draw(st.lists(st.sampled_from([8, 16, 24, 40, 64]), min_size=depth + 1, max_size=depth + 1)))
    frozen = draw(st.one_of(st.none(), st.integers(0, depth - 1))) if depth > 1 else None  # (something trains)
    if tied and frozen in (0, depth - 1):
        frozen = None  # (a tied weight is one parameter: frozen or not, once)
    stage = draw(st.integers(1, 3))
    offload_param = draw(st.sampled_from(TIERS)) if stage == 3 else "none"
    offload_optimizer = draw(st.sampled_from(TIERS))
    options = {"stage": stage, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
               "param_dtype": draw(st.sampled_from(["fp32", "fp32", "bf16"])), "lower": "eager"}
    if stage == 3 and draw(st.booleans()):
        options.update(tile_threshold=1024, tile_factor=2)
    if offload_optimizer == "nvme":
        options["nvme_grad_ram_bytes"] = draw(st.sampled_from([0, "auto"]))
    if "nvme" in (offload_param, offload_optimizer) and draw(st.booleans()):
        options["ram_cache_bytes"] = draw(st.sampled_from([0, 4 << 10, 16 << 10, 1 << 30]))  # none, some, all
    return Case(widths, draw(st.booleans()), frozen, tied, options)


@given(cases())
def test_the_plan_holds_what_the_run_then_holds(case):
    options = dict(case.options)
    if "nvme" in (options["offload_param"], options["offload_optimizer"]):
        options["nvme_path"] = os.environ.get("TMPDIR", "/tmp")
    x = torch.randn(4, case.widths[0], generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        blueprint = Drawn(case)
    predicted = zinf.plan(blueprint, (x,), options)

    torch._dynamo.reset()
    gc.collect()  # (the models of earlier examples, whose records would hold budget the plan does not see)
    RUNTIME.store.collect()
    torch.manual_seed(0)
    model = Drawn(case)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)  # (frozen parameters too, as users pass them)
    compiled(x).backward()
    opt.step()
    opt.zero_grad()
    compiled(x).backward()  # moments, this backward's gradients and the shards all held now
    report = zinf.memory_report(compiled)
    slack = SLACK * len(list(model.parameters()))
    for tier in ("device", "cpu", "nvme"):
        for kind in ("params", "grads", "optimizer"):
            assert abs(report[tier][kind] - predicted.memory[tier][kind]) <= slack, (
                case, tier, kind, report[tier][kind], predicted.memory[tier][kind])
    opt.zero_grad()
