"""Gradient hooks on parameters at stages 2-3 (issue 25, point 3).

Before: at stages 2-3 the gradient goes into zinf's shards, autograd called a
``param.register_hook`` hook with ``None`` and dropped what it returned, and a
post-accumulate hook saw ``param.grad is None``.  Now zinf runs tensor hooks on
the full local gradient before the reduce (as eager and DDP do) and refuses
the hooks it cannot honour with an error naming the parameter.  (World size 2
against DDP: tests/multirank/test_conv.py.)
"""

from __future__ import annotations

import pytest
import torch

from usage import Pair, seeded, train_interleaved
from zinf_compiler.runtime.grad_hooks import ZinfHookError


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def batches(count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(5, 8, generator=generator) for _ in range(count)]


def clamp(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-0.01, 0.01)  # not linear: it must see the gradient as eager does


@pytest.mark.parametrize("options", [{"stage": 2}, {"stage": 3}, {"stage": 3, "offload_param": "cpu"}],
                         ids=["stage2", "stage3", "stage3-cpu"])
def test_register_hook_changes_the_gradient_as_in_eager(options):
    pair = Pair(seeded(mlp, 0), {"lower": "eager", **options})
    seen = []
    handles = []
    for model in (pair.eager, pair.zinf_model):
        handles.append(model[0].weight.register_hook(clamp))
        model[2].bias.register_hook(lambda grad: seen.append(grad.clone()))  # observes, returns None
    losses = train_interleaved([pair], batches(), steps=2)[0]
    pair.assert_equal(losses, f"with hooks, {options}")
    # Each backward called the observer once per model, with the full gradient, in eager and zinf alike.
    assert len(seen) == 4 and all(grad.shape == (4,) for grad in seen)
    torch.testing.assert_close(seen[1], seen[0])
    # A removed hook is gone in both.
    for handle in handles:
        handle.remove()
    losses += train_interleaved([pair], batches()[::-1], steps=2)[0]
    pair.assert_equal(losses, f"after handle.remove(), {options}")


def test_a_hook_registered_after_the_first_step_runs_too():
    pair = Pair(seeded(mlp, 1), {"lower": "eager", "stage": 3})
    losses = train_interleaved([pair], batches(), steps=1)[0]
    for model in (pair.eager, pair.zinf_model):
        model[2].weight.register_hook(clamp)
    losses += train_interleaved([pair], batches(), steps=2)[0]
    pair.assert_equal(losses, "hook added after step 1")


def test_post_accumulate_grad_hook_is_refused_naming_the_parameter():
    model = seeded(mlp, 0)
    model[2].weight.register_post_accumulate_grad_hook(lambda param: None)
    compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager"})
    with pytest.raises(ZinfHookError, match=r"2\.weight has a register_post_accumulate_grad_hook"):
        compiled(torch.randn(2, 8))


def test_a_hook_on_a_tiled_parameter_is_refused():
    model = seeded(mlp, 0)
    model[0].weight.register_hook(clamp)
    compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager", "tile_threshold": 256,
                                                             "tile_factor": 2})
    with pytest.raises(ZinfHookError, match=r"0\.weight has a gradient hook .* but zinf tiles it"):
        compiled(torch.randn(2, 8))


def test_stage_1_keeps_torch_hooks_as_they_are():
    # Stage 1 keeps full gradients in param.grad: autograd runs both kinds of hooks itself.
    pair = Pair(seeded(mlp, 0), {"lower": "eager", "stage": 1})
    accumulated = []
    for model in (pair.eager, pair.zinf_model):
        model[0].weight.register_hook(clamp)
        model[2].weight.register_post_accumulate_grad_hook(lambda param: accumulated.append(param.grad.clone()))
    pair.assert_equal(train_interleaved([pair], batches(), steps=2)[0], "stage 1 hooks")
    assert len(accumulated) == 4
    torch.testing.assert_close(accumulated[1], accumulated[0])


class TiedAcrossABreak(torch.nn.Module):
    """One Linear used twice, with a graph break between the uses when ``split``."""

    def __init__(self, split: bool):
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)
        self.split = split

    def forward(self, x):
        x = torch.tanh(self.shared(x))
        if self.split:
            torch._dynamo.graph_break()
        return self.shared(x)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hook_on_a_weight_used_in_one_graph_twice_sees_the_sum_as_in_eager(stage):
    pair = Pair(seeded(lambda: TiedAcrossABreak(split=False), 0), {"lower": "eager", "stage": stage})
    for model in (pair.eager, pair.zinf_model):
        model.shared.weight.register_hook(clamp)
    pair.assert_equal(train_interleaved([pair], [b[:, :8] for b in batches()], steps=3)[0], f"tied, stage {stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hook_on_a_weight_used_across_a_graph_break_is_refused(stage):
    # Before: the hook ran on each graph's piece of the gradient (clamp(a) + clamp(b), not clamp(a + b)).
    model = seeded(lambda: TiedAcrossABreak(split=True), 0)
    model.shared.weight.register_hook(clamp)
    compiled = torch.compile(model, backend="zinf", options={"stage": stage, "lower": "eager"})
    with pytest.raises(ZinfHookError, match=r"shared\.weight has a gradient hook .* through two compiled graphs"):
        compiled(torch.randn(2, 8)).sum().backward()
