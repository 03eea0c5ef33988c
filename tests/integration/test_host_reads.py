"""A training step reads no tensor value on the host: no ``.item()``, ``.tolist()``, ``bool(tensor)``...

On a GPU each such read waits for the device to finish everything queued before it, so one in the runtime's
hot path (a gather, a reduction, the optimizer step) serializes the host with the device every step.  The CUDA
side of the same promise (no stream or event synchronize, no blocking copy to the host) shows only on a GPU:
benchmarks/scale.py runs a step under ``torch.cuda.set_sync_debug_mode`` and records each sync's line.  Here,
on the CPU, the Python-level reads are counted by wrapping them for one step after the compiling ones; the
control, ``clip_grad_norm_`` (which reads the norm to decide whether it clipped, as documented), proves the
wrapping sees them.
"""

from __future__ import annotations

import collections
import contextlib
import traceback

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")
CFG = GPTConfig(n_layer=2, n_embd=64)


@contextlib.contextmanager
def counting_host_reads(found: collections.Counter):
    """Count each host read of a tensor by the zinf line that made it (torch's own are counted as "torch")."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            ours = [frame for frame in traceback.extract_stack()[:-1]
                    if "zinf_compiler" in frame.filename or "/runtime/" in frame.filename]
            where = f"{'/'.join(ours[-1].filename.rsplit('/', 2)[-2:])}:{ours[-1].lineno}" if ours else "torch"
            found[(name, where)] += 1
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_in_a_step(options: dict, clip: bool = False) -> collections.Counter:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(CFG)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_batches(CFG, 2, 3)

    def step(idx, targets):
        loss = compiled(idx, targets)
        loss.backward()
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for idx, targets in batches[:2]:  # compile, and the optimizer's first step (its state made)
        step(idx, targets)
    found = collections.Counter()
    with counting_host_reads(found):
        step(*batches[2])
    return found


def test_a_stage3_step_with_cpu_tiers_reads_nothing_on_the_host():
    assert reads_in_a_step({"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}) == {}


def test_the_count_sees_a_host_read_clip_grad_norm_makes():
    found = reads_in_a_step({"stage": 3, "lower": "eager"}, clip=True)
    assert sum(found.values()) >= 1 and all(where.startswith("optim/step.py:") for _, where in found), found


@pytest.mark.slow  # four more compiles
@pytest.mark.parametrize("options", [{"stage": 3}, {"stage": 2}, {"stage": 3, "param_dtype": "bf16"},
                                     {"stage": 0}], ids=["stage3", "stage2", "stage3-bf16", "stage0"])
def test_other_configurations_read_nothing_on_the_host(options):
    assert reads_in_a_step(options) == {}
