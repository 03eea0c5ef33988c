"""One checkpoint for a pipeline (issue 52, acceptances 1 and 5): pp x dp and pp x tp x dp GPTs and a Hugging Face
Llama train equal to eager, save, load and export.

The worker (tests/workers/pipeline_checkpoint_worker.py) trains a small GPT cut into 2 pipeline stages, saves it
with ``zinf.save`` (every rank passing its stage), trains on, and a second pipeline in the same processes loads
the checkpoint and trains the same steps: bit for bit the straight run's.  The folder is one checkpoint of the
whole pipeline (zinf_compiler/checkpoint/pipeline_layout.py): it loads at another dp within the suite's
tolerances, is refused naming both layouts at another number of stages, stays the latest when a later save's
stage fails as on a full disk, and its export (a file per stage and an index) loads into the eager model (the
Llama's through ``from_pretrained``).
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from multirank import run_ranks
from usage import LOSS_RTOL, PARAM_RTOL, relative_error

from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.gpt_parallel import untie_head

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, separate_qkv=True)  # (the worker's)


def _assert_resumed_bit_for_bit(results):
    for result in results:
        assert "error" not in result, result.get("trace")
        # The straight run equals eager on the whole batch (the key bias's gradient is rounding noise: three_d).
        for step, (eager, zinf) in enumerate(zip(result["eager_losses"],
                                                 result["before_losses"] + result["straight_losses"], strict=True)):
            assert abs(eager - zinf) <= LOSS_RTOL * abs(eager), (result["rank"], step, eager, zinf)
        for name, values in result["straight_params"].items():
            expected, got = torch.tensor(result["eager_params"][name]), torch.tensor(values)
            if name.endswith(("attn.k.bias", "k_proj.bias")):
                assert (expected - got).abs().max() <= 1e-7, (result["rank"], name)
            else:
                assert relative_error(expected, got) <= PARAM_RTOL, (result["rank"], name, relative_error(expected, got))
        assert result["extra"] == {"step": 2}
        assert len(result["resumed_losses"]) == 3 and all(math.isfinite(loss) for loss in result["resumed_losses"])
        assert result["resumed_losses"] == result["straight_losses"], result["rank"]
        assert result["resumed_params"] == result["straight_params"], result["rank"]
        assert len(result["resumed_params"]) >= 10  # (a block, and the embeddings or the head)


def _assert_export_loads_into_eager(folder, results):
    index = json.loads((folder / "export" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    exported = {}
    for name in files:
        exported.update(load_file(str(folder / "export" / name)))
    eager = untie_head(GPT(CONFIG))
    eager.load_state_dict(exported, strict=True)  # every parameter, under the whole model's names
    trained = {name: value for result in results for name, value in result["resumed_params"].items()}
    for name, param in eager.named_parameters():
        assert param.detach().reshape(-1).tolist() == trained[name], name


@pytest.mark.slow  # three launches at world 4 and 2 on gloo: about a minute on 2 cores
def test_pp2_dp2_saves_loads_bit_for_bit_reshards_over_dp_and_exports(tmp_path):
    saved = run_ranks(4, "pipeline_checkpoint_worker", {"mode": "save", "pp": 2, "dir": str(tmp_path),
                                                        "fail_save": True}, timeout=600)
    _assert_resumed_bit_for_bit(saved)
    for result in saved:
        assert result["latest"] == str(tmp_path / "ckpt" / "step-2")
        # A later save whose stage 1 meets a full disk: refused on every rank, naming the stage and the cause;
        # the previous checkpoint stays the latest.
        assert "stage 1" in result["failed_save"] and "No space left on device" in result["failed_save"], result
        assert "pp 2 x (tp 1 x dp 2)" in result["failed_save"]
        assert result["latest_after_failure"] == str(tmp_path / "ckpt" / "step-2")
    assert not (tmp_path / "ckpt" / "step-9").exists() and not (tmp_path / "ckpt" / "step-9.partial").exists()
    _assert_export_loads_into_eager(tmp_path, saved)

    # At pp 2 x dp 1 (world 2): each stage's folder reshards into one rank; the next steps equal the saving run's
    # within the suite's tolerance (the whole batch is the same, summed in another order).
    resharded = run_ranks(2, "pipeline_checkpoint_worker", {"mode": "load", "pp": 2, "dir": str(tmp_path)},
                          timeout=600)
    straight = saved[0]["straight_losses"]
    for result in resharded:
        assert "error" not in result and "load_error" not in result, result
        assert result["extra"] == {"step": 2}
        for step, (expected, got) in enumerate(zip(straight, result["resumed_losses"], strict=True)):
            assert abs(got - expected) <= LOSS_RTOL * abs(expected), (step, expected, got)

    # At pp 1 x dp 2: refused before anything changes, naming both layouts.
    refused = run_ranks(2, "pipeline_checkpoint_worker", {"mode": "load", "pp": 1, "dir": str(tmp_path)},
                        timeout=600)
    for result in refused:
        assert "error" not in result, result.get("trace")
        message = result["load_error"]
        assert "pp 2 x (tp 1 x dp 2)" in message and "pp 1 x (tp 1 x dp 2)" in message, message


@pytest.mark.slow  # world 8 on gloo: about a minute and a half on 2 cores
def test_pp2_tp2_dp2_nvme_saves_loads_bit_for_bit_and_exports(tmp_path):
    (tmp_path / "swap").mkdir()
    saved = run_ranks(8, "pipeline_checkpoint_worker", {"mode": "save", "pp": 2, "tp": 2, "dir": str(tmp_path),
                                                        "nvme": str(tmp_path / "swap")}, timeout=900)
    _assert_resumed_bit_for_bit(saved)
    _assert_export_loads_into_eager(tmp_path, saved)
    meta = json.loads((tmp_path / "ckpt" / "step-2" / "meta.json").read_text())
    assert meta["pipeline"]["stages"] == 2 and meta["pipeline"]["tp"] == [2, 2] and meta["pipeline"]["dp"] == [2, 2]


@pytest.mark.slow  # world 8, then world 4, on gloo: about two minutes on 2 cores
def test_hf_llama_pp2_tp2_dp2_equals_eager_resumes_bit_for_bit_reshards_and_exports(tmp_path):
    """A LlamaForCausalLM cut by decoder layers (the worker's LlamaStage), its layers, embedding and LM head under
    torch's TP plan: equal to eager, resumed to the bit, loaded at pp 2 x tp 1 x dp 2, and ``from_pretrained``
    reads the export (a file per stage, the index, the first stage's config.json) as the trained weights."""
    import transformers

    saved = run_ranks(8, "pipeline_checkpoint_worker", {"mode": "save", "pp": 2, "tp": 2, "dir": str(tmp_path),
                                                        "model": "llama"}, timeout=900)
    _assert_resumed_bit_for_bit(saved)
    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
    trained = {name: value for result in saved for name, value in result["resumed_params"].items()}
    assert {name for name, _ in exported.named_parameters()} == set(trained)
    for name, param in exported.named_parameters():
        assert param.detach().reshape(-1).tolist() == trained[name], name

    resharded = run_ranks(4, "pipeline_checkpoint_worker", {"mode": "load", "pp": 2, "tp": 1, "dir": str(tmp_path),
                                                            "model": "llama"}, timeout=600)
    for result in resharded:
        assert "error" not in result and "load_error" not in result, result
        for step, (expected, got) in enumerate(zip(saved[0]["straight_losses"], result["resumed_losses"],
                                                   strict=True)):
            assert abs(got - expected) <= LOSS_RTOL * abs(expected), (step, expected, got)
