"""The optimizer's state interface that zinf.save / zinf.load use (issue 27), in-process.

No compile: parameters zinf did not shard are stepped as given, which is
enough to check that ``save_state`` reads and ``load_state`` puts back
what continues training exactly, and that a slot left out starts fresh.
"""

from __future__ import annotations

import pytest
import torch

from zinf_compiler.optim import AdamW


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _train(model: torch.nn.Module, optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=generator)).square().sum().backward()
        optimizer.step()


def test_restored_state_continues_training_exactly_and_left_out_slots_start_fresh():
    trained = _model(0)
    trained_opt = AdamW(trained.parameters(), lr=0.05)
    assert not trained_opt.bound and trained_opt.slots() == []
    _train(trained, trained_opt, steps=3, seed=1)
    assert trained_opt.bound and len(trained_opt.slots()) == 4
    saved = {id(slot.param): {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in trained_opt.save_state(slot)}
             for slot in trained_opt.slots()}
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} for state in saved.values())

    resumed = _model(0)
    resumed.load_state_dict(trained.state_dict())
    resumed_opt = AdamW(resumed.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="not bound"):
        resumed_opt.load_state([])
    resumed_opt.bind()
    by_param = {id(slot.param): slot for slot in resumed_opt.slots()}
    names = dict(zip(map(id, trained.parameters()), map(id, resumed.parameters())))
    resumed_opt.load_state((by_param[names[pid]], state) for pid, state in saved.items())

    _train(trained, trained_opt, steps=2, seed=2)
    _train(resumed, resumed_opt, steps=2, seed=2)
    for expected, actual in zip(trained.parameters(), resumed.parameters()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    # A slot left out of the restore starts fresh: its step count begins again at the next step.
    fresh_opt = AdamW(resumed.parameters(), lr=0.05)
    fresh_opt.bind()
    first, *rest = fresh_opt.slots()
    fresh_opt.load_state((slot, dict(resumed_opt.save_state(resumed_opt.slots()[i + 1])))
                         for i, slot in enumerate(rest))
    assert dict(fresh_opt.save_state(first)) == {}
    assert all(dict(fresh_opt.save_state(slot))["step"].item() == 5 for slot in rest)
    assert not first.state_on_nvme
