"""Train a model eagerly and under zinf on the same batches; compare losses and parameters."""

from __future__ import annotations

import copy
import dataclasses

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches


@dataclasses.dataclass
class Comparison:
    eager_losses: list[float]
    zinf_losses: list[float]
    # name -> max |eager - zinf| / max |eager|, per parameter tensor
    param_errors: dict[str, float]

    @property
    def max_loss_error(self) -> float:
        return max(abs(a - b) / abs(a) for a, b in zip(self.eager_losses, self.zinf_losses))

    @property
    def max_param_error(self) -> float:
        return max(self.param_errors.values())

    def describe(self) -> str:
        worst = max(self.param_errors, key=self.param_errors.get)
        return (f"losses eager={self.eager_losses} zinf={self.zinf_losses}; max loss error "
                f"{self.max_loss_error:.3e}; worst parameter {worst} {self.param_errors[worst]:.3e}")


# eps=1e-6: the attention key bias has an exactly-zero true gradient (softmax
# ignores a constant added to every key), so its computed gradient is rounding
# noise of ~1e-10 that Adam with eps=1e-8 would blow up into lr-sized steps of
# arbitrary sign.  A larger eps compares what matters.  fused=True: the kernel
# zinf's optimizer uses by default, so the reference runs the same arithmetic.
ADAMW = dict(lr=1e-2, eps=1e-6, fused=True)


def checkpoint_blocks(model: GPT) -> None:
    """Eager reference for block checkpointing: each block's forward under ``torch.utils.checkpoint``."""
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)


def compare_training(cfg: GPTConfig, options: dict | None, steps: int = 5, batch_size: int = 4, seed: int = 0,
                     reseed: bool = False, eager_checkpoint: bool = False) -> Comparison:
    """Train eager and compiled copies side by side.  ``options=None``: plain ``torch.compile`` (Inductor)
    with torch's fused AdamW, the yardstick for what compilation alone changes.

    ``reseed``: both forwards of step ``i`` start from ``manual_seed(1000 + i)``, so dropout draws the same
    masks in both (the compiled graph must then reproduce them when it recomputes).  ``eager_checkpoint``:
    the eager model checkpoints each block (:func:`checkpoint_blocks`)."""
    torch.manual_seed(seed)
    eager_model = GPT(cfg)
    zinf_model = copy.deepcopy(eager_model)
    if eager_checkpoint:
        checkpoint_blocks(eager_model)
    if options is None:
        compiled = torch.compile(zinf_model)
        zinf_opt = torch.optim.AdamW(zinf_model.parameters(), **ADAMW)
    else:
        compiled = torch.compile(zinf_model, backend="zinf", options=options)
        zinf_opt = zinf.optim.AdamW(zinf_model.parameters(), **ADAMW)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), **ADAMW)
    eager_losses, zinf_losses = [], []
    for step, (idx, targets) in enumerate(synthetic_batches(cfg, batch_size, steps, seed=seed)):
        if reseed:
            torch.manual_seed(1000 + step)
        loss = eager_model(idx, targets)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_losses.append(loss.item())

        if reseed:
            torch.manual_seed(1000 + step)
        loss = compiled(idx, targets)
        loss.backward()
        zinf_opt.step()
        zinf_opt.zero_grad()
        zinf_losses.append(loss.item())
    # zinf_model's own parameters hold no memory at stage 3: gather them.
    zinf_state = zinf.full_state_dict(compiled) if options is not None else dict(zinf_model.named_parameters())
    param_errors = {}
    for name, expected in eager_model.named_parameters():
        scale = expected.detach().abs().max().clamp_min(1e-12)
        param_errors[name] = ((expected.detach() - zinf_state[name]).abs().max() / scale).item()
    return Comparison(eager_losses, zinf_losses, param_errors)
