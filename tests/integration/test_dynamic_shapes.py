"""Dynamic shapes under the default lowering (Inductor): zinf's passes never specialize a symbolic size.

Issue 35: ``passes/activations.py`` turned a symbolic byte count into an ``int``, which installed a
guard (``128*s0*s1 == 1280``) on every graph, so ``dynamic=True`` recompiled for every new batch size and
the 9th was a hard error at stage 3.  The suite's varying-length test ran ``lower="eager"`` only and
never saw it.  Here every configuration trains under Inductor on 12 batch sizes and then 12 sequence
lengths, against eager, and two things are checked besides the losses:

* compiles: at most 2 per Dynamo graph (one here: ``dynamic=True`` traces symbolic from the start);
* guards: no guard on a symbolic size was installed by a zinf source file (:class:`CompileRecorder` in tests/support: the
  ShapeEnv of each compile records the frame behind every guard, a specialization to a constant too).

The default run takes one configuration (stage 3, no offload, no checkpointing) and the check's negative
control (a planted specialization, which it must find) lowered eagerly; the whole suite (``run_tests.sh
--all``) runs the whole matrix: stages 2 and 3, tiers none/cpu/nvme, activation checkpointing
none/block/auto, and a tiled model, drawn models, and the negative control under Inductor.
"""

from __future__ import annotations

import copy
import pathlib
import tempfile
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig

from compiles import CompileRecorder

BATCH_SIZES = list(range(2, 14))  # 12 sizes at length 8
LENGTHS = list(range(3, 15))  # 12 lengths at batch 3
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
# Tiling: the MLP weights (64 x 16 fp32, 4 KiB) exceed this, so they split into 2 row tiles.
TILED = {"tile_threshold": 2048, "tile_factor": 2}

def _configs() -> dict[str, dict]:
    configs = {}
    for stage in (2, 3):
        for tier in ("none", "cpu", "nvme"):
            for checkpointing in ("none", "block", "auto"):
                options = {"stage": stage, "offload_optimizer": tier, "activation_checkpointing": checkpointing}
                if stage == 3:
                    options["offload_param"] = tier
                configs[f"stage{stage}-{tier}-ckpt_{checkpointing}"] = options
    configs["stage3-tiled"] = {"stage": 3, **TILED}
    configs["stage3-nvme-tiled-ckpt_auto"] = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                              "activation_checkpointing": "auto", **TILED}
    return configs


CONFIGS = _configs()
# The default run: one (suite time); --all runs every tier, checkpointing policy, tiling, stage 2 and 3.
DEFAULT = ("stage3-none-ckpt_none",)


def _params() -> list:
    return [pytest.param(name, id=name, marks=() if name in DEFAULT else pytest.mark.slow) for name in CONFIGS]


def _batches():
    generator = torch.Generator().manual_seed(0)
    shapes = [(batch, 8) for batch in BATCH_SIZES] + [(3, length) for length in LENGTHS]
    return [torch.randint(0, CFG.vocab_size, shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("name", _params())
def test_varying_batch_and_length_under_inductor(name, tmp_path, monkeypatch):
    options = dict(CONFIGS[name])
    if "nvme" in options.values():
        options["nvme_path"] = str(tmp_path)
    guards = CompileRecorder(monkeypatch)
    torch.manual_seed(0)
    eager = GPT(CFG)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="zinf", dynamic=True, options=options)
    # AdamW (the nvme tier steps Adam only); eps 1e-6: see equivalence.ADAMW.
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-6, fused=True)
    zinf_opt = zinf.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    for idx in _batches():
        losses = []
        for net, opt in ((eager, eager_opt), (compiled, zinf_opt)):
            loss = net(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), f"shape {tuple(idx.shape)}"
    assert not guards.guards_by_zinf(), "zinf specialized a symbolic size:\n" + "\n".join(guards.guards_by_zinf())
    assert guards.compiles <= 2, f"{guards.compiles} compiles of one graph"
    state = zinf.full_state_dict(compiled)
    for param_name, expected in eager.named_parameters():
        error = float((expected.detach() - state[param_name]).abs().max() / expected.detach().abs().max())
        assert error <= 1e-3, (param_name, error)  # Inductor's own rounding, through 24 Adam steps


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True)
@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2]), width=st.sampled_from([8, 16, 24]),
       name=st.sampled_from(sorted(CONFIGS)), sizes=st.lists(st.tuples(st.integers(2, 7), st.integers(8, 16)),
                                                              min_size=3, max_size=5, unique=True))
def test_drawn_models_are_never_specialized_by_zinf(layers, heads, width, name, sizes):
    # Drawn GPTs and options: whatever the model, no guard from a zinf file and one compile for all sizes.
    # (Batch sizes and lengths never coincide: Dynamo's duck sizing would give both one symbol, and plain
    # Inductor recompiles too when they part.)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=layers, n_head=heads, n_embd=width)
    with pytest.MonkeyPatch.context() as monkeypatch, tempfile.TemporaryDirectory() as swap:
        guards = CompileRecorder(monkeypatch)
        torch._dynamo.reset()
        options = dict(CONFIGS[name], nvme_path=swap)
        compiled = torch.compile(GPT(cfg), backend="zinf", dynamic=True, options=options)
        generator = torch.Generator().manual_seed(0)
        for batch, length in sizes:
            idx = torch.randint(0, cfg.vocab_size, (batch, length), generator=generator)
            compiled(idx, idx).backward()
        torch._dynamo.reset()
    assert not guards.guards_by_zinf(), "zinf specialized a symbolic size:\n" + "\n".join(guards.guards_by_zinf())
    assert guards.compiles <= 2, f"{guards.compiles} compiles of one graph"


# The negative control of the guard check above, in the default run: without it nothing shows that check can
# fail. The passes run (and a planted guard is installed) before lowering, so the default run lowers eagerly
# (seconds: no Inductor compile per size); --all lowers with Inductor too, as the test above does (about a minute).
@pytest.mark.parametrize("lower", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_shape_guards_find_a_planted_specialization(lower, monkeypatch):
    # The check above must be able to fail: a pass that calls int() on a symbolic size is caught. The plant is
    # compiled as if it were in zinf's passes/activations.py, so that the very check above (guards_by_zinf:
    # guards installed by zinf's files) is the one that finds it.
    from zinf_compiler.passes import activations

    real = activations.run
    plant = compile(textwrap.dedent("""
        def specializing(gm, ctx):
            for node in gm.graph.nodes:
                value = node.meta.get("val")
                if node.op == "placeholder" and isinstance(value, torch.Tensor):
                    for size in value.shape:
                        if isinstance(size, torch.SymInt):
                            int(size)  # the planted bug: guards the graph on this size
            return real(gm, ctx)
    """), activations.__file__, "exec")
    namespace = {"torch": torch, "real": real}
    exec(plant, namespace)
    monkeypatch.setattr(activations, "run", namespace["specializing"])
    guards = CompileRecorder(monkeypatch)
    model = GPT(CFG)
    compiled = torch.compile(model, backend="zinf", dynamic=True, options={"stage": 3, "lower": lower})
    sizes = 2 if lower == "eager" else 3
    for idx in _batches()[:sizes]:
        compiled(idx, idx).backward()
    planted = guards.guards_by_zinf()
    assert planted and all(str(pathlib.Path(activations.__file__).resolve()) in guard for guard in planted), planted
    assert guards.compiles >= sizes  # and every new batch size recompiled
