"""Issue 2 acceptance 3: dumps are readable per-pass graphs plus an index a test can read back."""

import ast
import json
import subprocess
import sys
import types

import pytest
import torch

from equivalence import compare_training
from zinf_compiler.context import CapturedGraph, GraphContext
from zinf_compiler.dump import GraphDumper, read_index
from zinf_compiler.gpt import GPTConfig
from zinf_compiler.inspect import main as inspect_main
from zinf_compiler.options import parse_options
from zinf_compiler.passes import PIPELINE
from zinf_compiler.pipeline import run_passes
from zinf_compiler.verify import ZinfVerifyError

TINY = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _python_body(path):
    """The dumped file minus its comment header must parse as Python."""
    text = path.read_text()
    ast.parse(text)
    return text


def test_dump_dir_writes_every_stage_and_index(tmp_path):
    compare_training(GPTConfig(**TINY), {"lower": "eager", "dump_dir": str(tmp_path)}, steps=1)
    index = read_index(str(tmp_path))
    (entry,) = index["graphs"]
    folder = tmp_path / entry["folder"]
    assert "dynamo.py" == entry["dynamo_file"] and (folder / "dynamo.py").exists()
    names = {p["name"] for p in entry["params"]}
    assert {"wte.weight", "blocks.0.attn.qkv.weight", "ln_f.bias"} <= names
    assert "lm_head.weight" not in names  # tied to wte.weight: one tensor, adopted once
    for kind in ("forward", "backward"):
        stages = entry["graphs"][kind]
        applicable = [p.NAME for p in PIPELINE if kind in p.KINDS]
        assert [s["stage"] for s in stages] == ["capture"] + applicable
        for stage in stages:
            text = _python_body(folder / stage["file"])
            assert text.startswith(f"# zinf dump: graph {entry['graph_id']} {kind}, after {stage['stage']!r}")
            assert f"{stage['ops']} ops" in text.splitlines()[1]
            assert "parameter bytes per tier" in text
    forward = (folder / entry["graphs"]["forward"][0]["file"]).read_text()
    assert "torch.ops.aten.mm.default" in forward or "torch.ops.aten.addmm.default" in forward


def test_inspect_cli_summarises_and_prints_a_graph(tmp_path, capsys):
    compare_training(GPTConfig(**TINY), {"lower": "eager", "dump_dir": str(tmp_path)}, steps=1)
    # The module's command line once (``python -m``), then its main() in-process (suite time: no new interpreter).
    done = subprocess.run([sys.executable, "-m", "zinf_compiler.inspect", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "1 compiled graph(s)" in done.stdout and "forward:" in done.stdout and "backward:" in done.stdout
    graph_id = read_index(str(tmp_path))["graphs"][0]["graph_id"]
    assert inspect_main([str(tmp_path), "--graph", str(graph_id), "--kind", "backward"]) == 0
    assert "def forward(" in capsys.readouterr().out
    assert inspect_main([str(tmp_path / "nope")]) == 2
    assert "index.json" in capsys.readouterr().err


# --- the pass manager, with passes defined here ---------------------------------

def _toy_graph():
    def f(x, w):
        return (torch.relu(x @ w),)

    return torch.fx.symbolic_trace(f)


def _ctx(options):
    captured = CapturedGraph(graph_id=99, options=parse_options(options, environ={}), inputs=[], param_tensors={})
    return GraphContext(captured=captured, kind="forward", params={}), GraphDumper(captured)


def _pass(name, run, kinds=("forward",)):
    return types.SimpleNamespace(NAME=name, KINDS=kinds, run=run)


def _relu_to_sigmoid(gm, ctx):
    for node in gm.graph.nodes:
        if node.target is torch.relu:
            node.target = torch.sigmoid
    ctx.facts["rewrote"] = True
    return gm


def test_pass_manager_runs_dumps_and_disables_by_name(tmp_path):
    ctx, dumper = _ctx({"dump_dir": str(tmp_path)})
    gm = run_passes(_toy_graph(), ctx, dumper, pipeline=[_pass("sigmoid", _relu_to_sigmoid)])
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    torch.testing.assert_close(gm(x, w)[0], torch.sigmoid(x @ w))
    stages = read_index(str(tmp_path))["graphs"][0]["graphs"]["forward"]
    assert [s["stage"] for s in stages] == ["capture", "sigmoid"]
    assert "-1 relu, +1 sigmoid" in stages[1]["change"]

    ctx, dumper = _ctx({"disable_passes": "sigmoid"})
    gm = run_passes(_toy_graph(), ctx, dumper, pipeline=[_pass("sigmoid", _relu_to_sigmoid)])
    torch.testing.assert_close(gm(x, w)[0], torch.relu(x @ w))
    assert "rewrote" not in ctx.facts


def test_verifier_rejects_a_pass_that_breaks_the_graph():
    def use_before_definition(gm, ctx):
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        with gm.graph.inserting_before(relu.args[0]):
            early = gm.graph.call_function(torch.neg, (relu,))
        relu.args[0].replace_input_with(relu.args[0].args[0], early)
        return gm

    def drop_an_input(gm, ctx):
        placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "w")
        with gm.graph.inserting_before(placeholder):
            ones = gm.graph.call_function(torch.ones, (3, 3))
        placeholder.replace_all_uses_with(ones)
        gm.graph.erase_node(placeholder)
        return gm

    for bad_pass, words in ((use_before_definition, "lint"), (drop_an_input, "calling convention")):
        ctx, dumper = _ctx({})
        with pytest.raises(ZinfVerifyError, match=words) as err:
            run_passes(_toy_graph(), ctx, dumper, pipeline=[_pass("bad", bad_pass)])
        assert "after 'bad'" in str(err.value)


def test_verifier_requires_one_wait_per_start_and_one_release_per_gather():
    from zinf_compiler import ops

    def orphan_start(gm, ctx):
        placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(placeholder):
            gm.graph.call_function(ops.REDUCE_GRAD_START, (placeholder, 0))
        return gm

    ctx, dumper = _ctx({})
    with pytest.raises(ZinfVerifyError, match="has 0 waits"):
        run_passes(_toy_graph(), ctx, dumper, pipeline=[_pass("orphan", orphan_start)])


@pytest.mark.parametrize("stage, offload", [(3, "none"), (3, "cpu"), (3, "nvme"), (2, "none")])
def test_dump_header_bytes_per_tier_match_memory_report(tmp_path, stage, offload):
    """Issue 13 acceptance 3: the header's parameter bytes per tier are what memory_report counts."""
    import re

    import zinf_compiler as zinf
    from zinf_compiler.gpt import GPT, synthetic_batches

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, frozen_scale=True))
    options = {"lower": "eager", "stage": stage, "offload_param": offload, "dump_dir": str(tmp_path / "dump")}
    if offload == "nvme":
        options["nvme_path"] = str(tmp_path)
    compiled = torch.compile(model, backend="zinf", options=options)
    idx, targets = synthetic_batches(model.cfg, 2, 1)[0]
    with torch.no_grad():
        compiled(idx, targets)
    (entry,) = read_index(str(tmp_path / "dump"))["graphs"]
    kind, stages = next(iter(entry["graphs"].items()))
    header = (tmp_path / "dump" / entry["folder"] / stages[-1]["file"]).read_text()
    line = re.search(r"parameter bytes per tier[^:]*: device ([\d,]+), cpu ([\d,]+), nvme ([\d,]+)", header)
    in_header = dict(zip(("device", "cpu", "nvme"), (int(x.replace(",", "")) for x in line.groups())))
    report = zinf.memory_report(compiled)
    assert in_header == {tier: report[tier]["params"] for tier in ("device", "cpu", "nvme")}, (in_header, report)
    assert in_header[{"none": "device"}.get(offload, offload)] > 0
