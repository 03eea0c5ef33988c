"""Issue 2 acceptance: the backend trains like eager PyTorch, with and without graph breaks."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from equivalence import compare_training
from zinf_compiler.gpt import GPT, GPTConfig

from repo_paths import REPO

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.parametrize("graph_break", [False, True], ids=["one-graph", "graph-break"])
def test_eager_lowering_matches_eager_pytorch(graph_break):
    result = compare_training(GPTConfig(**TINY, graph_break=graph_break), {"lower": "eager", "stage": 0})
    assert result.max_loss_error <= 1e-6, result.describe()
    assert result.max_param_error <= 1e-5, result.describe()


@pytest.mark.parametrize("graph_break", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one-graph", "graph-break"])
def test_inductor_lowering_matches_eager_pytorch(graph_break):
    # Inductor fuses and reorders reductions, and 5 AdamW steps at lr 1e-2
    # turn that rounding into parameter differences of ~1e-4 of each
    # tensor's largest magnitude (measured 5.8e-5 to 1.2e-4 depending on the
    # initial values).  So zinf is held to plain torch.compile's own
    # distance from eager, measured in the same test, with 1e-4 as a floor;
    # the default run (one graph) skips that second compile (suite time) and
    # holds zinf to 2.5x the largest distance measured, 3e-4 (a wrong
    # gradient or step is off by 1e-2 and more).
    cfg = GPTConfig(**TINY, graph_break=graph_break)
    result = compare_training(cfg, {"lower": "inductor", "stage": 0})
    assert result.max_loss_error <= 1e-4, result.describe()
    if not graph_break:
        assert result.max_param_error <= 3e-4, result.describe()
        return
    inductor = compare_training(cfg, None)
    assert result.max_param_error <= max(1e-4, 1.5 * inductor.max_param_error), (
        result.describe(), inductor.max_param_error)


@pytest.mark.slow
def test_inductor_with_comprehensive_padding_as_on_a_gpu():
    # On a GPU Inductor pads strides ("comprehensive padding"; off for CPU inputs) and walks back from
    # every output it recorded as user-visible before zinf's rewrite, which returns None for the
    # gradients it keeps in shards: the first GPU run failed every stage-2/3 config there.
    cfg = GPTConfig(**TINY)
    with torch._inductor.config.patch(disable_padding_cpu=False):
        result = compare_training(cfg, {"stage": 3}, steps=2)
    assert result.max_loss_error <= 1e-4, result.describe()
    assert result.max_param_error <= 1e-3, result.describe()


def test_graph_break_gives_several_compiled_graphs(tmp_path):
    cfg = GPTConfig(**TINY, graph_break=True)
    compare_training(cfg, {"lower": "eager", "dump_dir": str(tmp_path)}, steps=1)
    index = json.loads((tmp_path / "index.json").read_text())
    assert len(index["graphs"]) == 2
    assert all({"forward", "backward"} <= set(entry["graphs"]) for entry in index["graphs"])


def test_backend_registered_by_entry_point_in_fresh_process():
    """`backend="zinf"` resolves through the entry point, before anything imports zinf_compiler."""
    script = textwrap.dedent(
        f"""
        import copy, importlib.util, json, sys
        import torch
        # Load the model file directly: importing zinf_compiler.gpt would import the package.
        spec = importlib.util.spec_from_file_location("gpt_model", {str(REPO / "zinf_compiler" / "gpt.py")!r})
        gpt = importlib.util.module_from_spec(spec); sys.modules["gpt_model"] = gpt; spec.loader.exec_module(gpt)
        cfg = gpt.GPTConfig(**{TINY!r})
        torch.manual_seed(0)
        eager_model = gpt.GPT(cfg); zinf_model = copy.deepcopy(eager_model)
        assert "zinf_compiler" not in sys.modules
        compiled = torch.compile(zinf_model, backend="zinf", options={{"lower": "eager", "stage": 0}})
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (eager_model, zinf_model)]
        losses = []
        for idx, targets in gpt.synthetic_batches(cfg, 4, 5):
            pair = []
            for model, opt in ((eager_model, opts[0]), (compiled, opts[1])):
                loss = model(idx, targets); loss.backward(); opt.step(); opt.zero_grad(); pair.append(loss.item())
            losses.append(pair)
        param_error = max(((a - b).abs().max() / a.abs().max()).item()
                          for a, b in zip(eager_model.parameters(), zinf_model.parameters()))
        print(json.dumps({{"imported_by_backend": "zinf_compiler" in sys.modules,
                           "losses": losses, "param_error": param_error}}))
        """
    )
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported_by_backend"], "the zinf backend did not run"
    for eager_loss, zinf_loss in report["losses"]:
        assert abs(eager_loss - zinf_loss) <= 1e-6 * abs(eager_loss)
    assert report["param_error"] <= 1e-5


def test_inference_under_no_grad_matches_eager():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    compiled = torch.compile(model, backend="zinf", options={"lower": "eager"})
    with torch.no_grad():
        expected = model(idx)
        actual = compiled(idx)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_bad_option_surfaces_through_torch_compile():
    """The error reaches the user at the first call, naming the option."""
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="zinf", options={"lower": "fast"})
    with pytest.raises(Exception) as err:
        compiled(torch.randn(2, 4))
    assert "lower" in str(err.value) and "'fast'" in str(err.value)
