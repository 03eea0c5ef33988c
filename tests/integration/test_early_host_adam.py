"""The host-memory optimizer's step taken during backward (runtime/optim/early_host_adam.py): bit-equal to the step after
backward, whatever voids it.

Two runs of the same GPT with the optimizer state on the cpu tier, one with ``overlap_optimizer=True`` (each
parameter stepped by a worker thread as its gradient lands, put in place at ``opt.step()``), one with False:
their parameters and Adam states must be byte-equal after every step, through steps whose early steps count
and steps where something voids them (clipping that clips, a gradient accumulated over two micro-batches, a
learning rate changed before ``opt.step()``, ``zero_grad`` with no step).  On a CPU device "auto" leaves it off
(the backward needs the cores), so it is asked for here.
"""

from __future__ import annotations

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.api import RUNTIME
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches

CFG = GPTConfig(n_layer=2, n_embd=64, vocab_size=128, block_size=32)
# What each step does: (micro-batches, clip max_norm or None, lr set between backward and step or None).
EARLY_STATS = ("started", "committed", "dropped", "over_budget")
PLAN = [(1, None, None), (1, None, None), (1, 1e-3, None), (1, None, None), (2, None, None), (2, None, None),
        (1, None, 5e-3), (1, None, None)]


def train(options: dict, overlap: bool):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(CFG)
    compiled = torch.compile(model, backend="zinf", options={**options, "overlap_optimizer": overlap})
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(synthetic_batches(CFG, 2, 2 * len(PLAN) + 1))
    stats = []  # per step, what the early step did from its backward to its opt.step()

    def early_stats() -> dict:  # (the optimizer binds, and makes its early step, at its first step)
        early = opt._early_host
        return dict(early.stats) if early is not None else dict.fromkeys(EARLY_STATS, 0)

    for micro_batches, clip, lr in PLAN:
        before = early_stats()
        for _ in range(micro_batches):
            compiled(*next(batches)).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step()
        opt.zero_grad()
        stats.append({key: value - before[key] for key, value in early_stats().items()})
    compiled(*next(batches)).backward()
    opt.zero_grad()  # a backward whose early steps are dropped with no step
    state = {f"param {name}": value for name, value in zinf.full_state_dict(compiled).items()}
    for slot in opt.slots():
        for key, value in opt.save_state(slot):
            state[f"{slot.record.name if slot.record else id(slot)} {key}"] = value
    return state, stats, opt


@pytest.mark.parametrize("options", [
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "lower": "eager"},
    {"stage": 2, "offload_optimizer": "cpu", "lower": "eager", "param_dtype": "bf16"},
], ids=["stage3-cpu", "stage2-opt-cpu-bf16"])
def test_steps_taken_in_backward_equal_the_steps_after_it_bit_for_bit(options):
    late, late_stats, _ = train(options, overlap=False)
    early, stats, opt = train(options, overlap=True)
    assert all(not any(step.values()) for step in late_stats)  # no early step without the option
    assert late.keys() == early.keys()
    for key, value in late.items():
        other = early[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{key} differs"
        else:
            assert value == other, key
    params = len([p for p in opt.slots() if p.record is not None])
    # Step 0 has no moments to step from (torch makes them in its first step): nothing early.
    assert stats[0]["started"] == 0
    assert stats[1] == {"started": params, "committed": params, "dropped": 0, "over_budget": 0}
    assert stats[2]["committed"] == 0  # clipping clipped: every early step is void
    assert stats[3]["started"] == 0  # the step after one that clipped steps nothing early
    assert stats[4]["committed"] == 0 and stats[4]["dropped"] > 0  # the second micro-batch voided the first's
    assert stats[5]["committed"] == params  # then the second arrival is the one stepped
    assert stats[6]["committed"] == 0  # the learning rate changed after the early steps
    assert stats[7]["committed"] == params
    assert RUNTIME.store.transient["cpu"] == 0, "the stepped copies are counted until their verdict"


def test_auto_steps_host_memory_state_early_beside_an_accelerator_only():
    from zinf_compiler.runtime.param_plan import plan_param

    def plan(device, overlap):
        return plan_param(uid=0, shape=(4, 4), dtype=torch.float32, device=device, param_dtype=torch.float32,
                          stage=3, partition="allgather", world_size=1, rank=0, param_tier="cpu",
                          opt_tier="cpu", step_in_backward=overlap)

    assert plan("cpu", "auto").step_in_backward is False  # the backward needs the cores
    assert plan("cuda", "auto").step_in_backward is True
    assert plan("cpu", True).step_in_backward is True
    assert plan("cuda", False).step_in_backward is False
