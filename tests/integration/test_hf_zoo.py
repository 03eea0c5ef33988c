"""Issue 25 point 5: a zoo of tiny Hugging Face causal LMs trains under zinf like eager, one block per layer.

Each architecture is built from a config in code (no downloads; float32,
dropout off, 2 layers), trained 3 AdamW steps at stage 3 with parameters and
optimizer state on NVMe and ``activation_checkpointing="block"``, beside the
eager model under ``torch.optim.AdamW``: losses and parameters agree within
the equivalence suite's tolerances, and checkpointing recomputes exactly one
region per decoder layer.  Most of these models' forwards are wrapped in
``def wrapper(*args, **kwargs)`` (``@can_return_tuple``), which once made
the whole model one block.  Llama runs by default; the others are marked
slow (suite time) and run with ``pytest -m slow tests/integration/test_hf_zoo.py`` or, with step times beside
eager's, ``python benchmarks/hf_zoo.py`` (which runs this same check).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler import recompute
from zinf_compiler.module_paths import module_classes, repeated_blocks
from usage import LOSS_RTOL, PARAM_RTOL, relative_error

transformers = pytest.importorskip("transformers")

LAYERS = 2
COMMON = dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=128, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
# model_type -> what the common keys do not set (head_dim defaults to 256 in Gemma, 128 in Qwen3).  The default
# run: the 11 (one block ".0" for the whole model) and gpt2, whose layers were always found.
ARCHITECTURES = {
    "llama": {}, "qwen3": {"head_dim": 8}, "gemma": {"head_dim": 8}, "phi": {}, "falcon": {}, "bloom": {},
    "mamba": {"state_size": 4, "conv_kernel": 4}, "mistral": {}, "qwen2": {}, "phi3": {}, "olmo": {},
    "gpt2": {"n_positions": 64},
}
# More of the zoo (marked slow; benchmarks/hf_zoo.py runs them).
MORE_ARCHITECTURES = {
    "gpt_neox": {}, "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "gemma2": {"head_dim": 8}, "olmo2": {}, "starcoder2": {}, "stablelm": {},
    "gptj": {"n_positions": 64, "rotary_dim": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
}
# eps=1e-4: plain torch.compile (aot_eager) differs from eager by rounding in the gradients (~1e-6 relative),
# which Adam with a smaller eps turns into parameter differences of up to 9e-4 in OLMo's embedding after 3 steps
# (gradients of ~1e-6 are normalized to lr-sized steps); with 1e-4 it stays under 4e-5 (Qwen3) across the zoo.
ADAMW = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)
STEPS = 3


def build(model_type: str) -> torch.nn.Module:
    extra = {**ARCHITECTURES, **MORE_ARCHITECTURES}[model_type]
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra)
    for key, value in config.to_dict().items():  # every dropout off: eager and zinf draw different masks
        if ("dropout" in key or "pdrop" in key or key == "layerdrop") and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def layer_paths(model: torch.nn.Module) -> set[str]:
    """The decoder layers: the children of the one ModuleList of ``LAYERS`` modules."""
    (lists,) = [[f"{name}.{index}" for index in range(len(child))] for name, child in model.named_modules()
                if isinstance(child, torch.nn.ModuleList) and len(child) == LAYERS]
    return set(lists)


def record_checkpoint_plans(monkeypatch) -> list:
    """(captured graph, plan) for every checkpointing plan recompute.py makes from now on."""
    plans = []
    original = recompute.apply_policy

    def recording(graph, captured):
        original(graph, captured)
        plans.append((captured, captured.activation_plan))

    monkeypatch.setattr(recompute, "apply_policy", recording)
    return plans


@pytest.fixture
def checkpoint_plans(monkeypatch):
    return record_checkpoint_plans(monkeypatch)


# The default run: a decoder with RoPE and GQA (llama); the other architectures (GPT-2's learned positions
# and Conv1D, a state-space model, ...: the same paths, other shapes) with --all.
DEFAULT_ARCHITECTURES = ("llama",)


@pytest.mark.parametrize("model_type", [
    *(name if name in DEFAULT_ARCHITECTURES else pytest.param(name, marks=pytest.mark.slow) for name in ARCHITECTURES),
    *(pytest.param(name, marks=pytest.mark.slow) for name in MORE_ARCHITECTURES)])
def test_hf_model_trains_like_eager_with_one_block_per_layer(model_type, tmp_path, checkpoint_plans):
    check_architecture(model_type, str(tmp_path), checkpoint_plans)


def check_architecture(model_type: str, nvme_path: str, checkpoint_plans: list) -> dict:
    """Train ``model_type`` eagerly and under zinf side by side and assert the issue's points; returns the
    step times (seconds per step after the first, each) for benchmarks/hf_zoo.py."""
    eager = build(model_type)
    layers = layer_paths(eager)
    assert repeated_blocks(module_classes(eager)) >= layers  # the module tree's blocks: the layers (and inner lists)
    zinf_model = copy.deepcopy(eager)
    options = {"stage": 3, "lower": "eager", "offload_param": "nvme", "offload_optimizer": "nvme",
               "nvme_path": nvme_path, "activation_checkpointing": "block"}
    compiled = torch.compile(zinf_model, backend="zinf", options=options)
    eager_opt = torch.optim.AdamW(eager.parameters(), **ADAMW, fused=True)  # zinf's AdamW runs the fused kernel
    zinf_opt = zinf.optim.AdamW(zinf_model.parameters(), **ADAMW)
    generator = torch.Generator().manual_seed(1)
    losses, times = [], {"eager": [], "zinf": []}
    for step in range(STEPS):
        ids = torch.randint(3, 128, (2, 16), generator=generator)
        started = time.perf_counter()
        eager_loss = eager(input_ids=ids, labels=ids).loss
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        middle = time.perf_counter()
        zinf_loss = compiled(input_ids=ids, labels=ids).loss
        zinf_loss.backward()
        zinf_opt.step()
        zinf_opt.zero_grad()
        if step:  # the first step compiles
            times["eager"].append(middle - started)
            times["zinf"].append(time.perf_counter() - middle)
        losses.append((eager_loss.item(), zinf_loss.item()))
    for step, (eager_loss, zinf_loss) in enumerate(losses):
        assert abs(eager_loss - zinf_loss) <= LOSS_RTOL * abs(eager_loss), f"{model_type} step {step}: {losses}"
    state = zinf.full_state_dict(zinf_model)
    errors = {name: relative_error(param, state[name]) for name, param in eager.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= PARAM_RTOL, f"{model_type}: parameter {worst} differs from eager by {errors[worst]:.2e}"

    # One recompute region per layer, in the graph that runs the layers (where transformers logs that
    # ``loss_type=None``, a graph break leaves the loss a graph of its own, without blocks).
    recomputed = set()
    for captured, plan in checkpoint_plans:
        layers_in_graph = set()
        # The partition pass buckets by the same blocks: every parameter of a layer is in that layer's block.
        for info in captured.params:
            block = captured.module_blocks.block_of(info.name)
            expected = next((layer for layer in layers if info.name.startswith(layer + ".")), None)
            assert block == expected, f"{model_type}: {info.name} is in block {block}, expected {expected}"
            layers_in_graph |= {expected} - {None}
        assert set(plan["blocks"]) == layers_in_graph, f"{model_type}: recomputed {plan['blocks']}, layers {layers}"
        recomputed |= set(plan["blocks"])
    assert recomputed == layers, f"{model_type}: recomputed regions {recomputed}, layers {layers}"
    return {"losses": losses, "worst_param_error": errors[worst], "times": times}
