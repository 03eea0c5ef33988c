"""Train models eagerly and under zinf side by side, for the usage-pattern tests.

Unlike ``equivalence.py`` (one GPT), these helpers take any model factory,
several models at once and any sequence of batches, because the patterns
under test are about *how* users call models: several instances, graph
breaks, varying shapes.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

import zinf_compiler as zinf

# Tolerances of the equivalence suite (tests/multirank/test_zero.py): relative to the largest magnitude.
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.detach().double(), actual.detach().double()
    return float((expected - actual).abs().max() / expected.abs().max().clamp_min(1e-12))


def loss_of(output) -> torch.Tensor:
    return output.float().pow(2).mean()


class Pair:
    """One eager model and its zinf copy, each with its own optimizer."""

    def __init__(self, model: torch.nn.Module, options: dict, lr: float = 0.05, compile_fn=None,
                 optimizer: str = "SGD", param_groups: Callable[[torch.nn.Module], list] | None = None,
                 **optimizer_kwargs):
        self.eager = model
        self.zinf_model = copy.deepcopy(model)
        compile_fn = compile_fn or (lambda m: torch.compile(m, backend="zinf", options=options))
        self.compiled = compile_fn(self.zinf_model)
        param_groups = param_groups or (lambda m: list(m.parameters()))
        self.eager_opt = getattr(torch.optim, optimizer)(param_groups(self.eager), lr=lr, **optimizer_kwargs)
        self.zinf_opt = getattr(zinf.optim, optimizer)(param_groups(self.zinf_model), lr=lr, **optimizer_kwargs)

    def step(self, *inputs) -> tuple[float, float]:
        eager_loss = loss_of(self.eager(*inputs))
        eager_loss.backward()
        self.eager_opt.step()
        self.eager_opt.zero_grad()
        zinf_loss = loss_of(self.compiled(*inputs))
        zinf_loss.backward()
        self.zinf_opt.step()
        self.zinf_opt.zero_grad()
        return eager_loss.item(), zinf_loss.item()

    def param_errors(self) -> dict[str, float]:
        # Blocks compiled one by one are OptimizedModules: their names gain ``_orig_mod.``.
        state = {name.replace("_orig_mod.", ""): value for name, value in zinf.full_state_dict(self.zinf_model).items()}
        return {name: relative_error(p, state[name]) for name, p in self.eager.named_parameters()}

    def assert_equal(self, losses: Sequence[tuple[float, float]], what: str = "") -> None:
        for step, (eager_loss, zinf_loss) in enumerate(losses):
            assert abs(eager_loss - zinf_loss) <= LOSS_RTOL * abs(eager_loss) + 1e-8, (
                f"{what} step {step}: eager loss {eager_loss:.7f}, zinf {zinf_loss:.7f}; all: {losses}")
        errors = self.param_errors()
        worst = max(errors, key=errors.get)
        assert errors[worst] <= PARAM_RTOL, f"{what}: parameter {worst} differs from eager by {errors[worst]:.2e}"


def train_interleaved(pairs: Sequence[Pair], batches: Sequence, steps: int) -> list[list[tuple[float, float]]]:
    """Step every pair in turn, ``steps`` times: the way two models in one process are used."""
    losses = [[] for _ in pairs]
    for step in range(steps):
        for index, pair in enumerate(pairs):
            inputs = batches[step % len(batches)]
            losses[index].append(pair.step(*(inputs if isinstance(inputs, tuple) else (inputs,))))
    return losses


def seeded(factory: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return factory()
