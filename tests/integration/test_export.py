"""zinf.export to safetensors (plain torch and transformers load it) and zinf.materialize(weights=...).

Memory claims are measured in a fresh process (tests/workers/weights_worker.py):
peak RSS over each call's own window.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig
from repo_paths import worker_script

transformers = pytest.importorskip("transformers")  # a dev extra: present in CI
safetensors_torch = pytest.importorskip("safetensors.torch")


def _tiny(kind: str):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("kind", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_export_of_a_trained_transformers_model_loads_with_from_pretrained(kind, tmp_path):
    """Acceptance 4: trained under zinf with parameters and optimizer on NVMe, exported, reloaded eagerly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _tiny(kind)
    model.config.use_cache = False
    compiled = torch.compile(model, backend="zinf", options=dict(
        stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), lower="eager"))
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()  # GPT-2 has dropout; from_pretrained returns a model in eval mode
    with torch.no_grad():
        zinf_loss = compiled(input_ids=ids, labels=ids).loss.item()
    zinf.export(tmp_path / "export", compiled)
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "model.safetensors"]
    loaded = type(model).from_pretrained(tmp_path / "export")
    with torch.no_grad():
        assert loaded(input_ids=ids, labels=ids).loss.item() == zinf_loss
    # Plain torch too: the file holds every state-dict tensor but the tied head, which it re-ties.
    weights = safetensors_torch.load_file(tmp_path / "export" / "model.safetensors")
    full = zinf.full_state_dict(compiled)
    assert set(full) - set(weights) <= {"lm_head.weight"}
    assert all(torch.equal(weights[name], full[name]) for name in weights)


@pytest.mark.slow  # export in the default run: the gpt2 case above
def test_materialize_from_sharded_safetensors_and_export_within_memory_bounds(tmp_path):
    """Acceptances 4 and 5: a 160 MiB GPT built from a 3-file sharded folder (written by the reference
    safetensors library) into NVMe shards, then exported; each measured in a fresh process."""
    config = dict(vocab_size=8192, block_size=64, n_layer=12, n_head=8, n_embd=512)
    torch.manual_seed(0)
    state = {k: v for k, v in GPT(GPTConfig(**config)).state_dict().items() if k != "lm_head.weight"}  # tied
    folder = tmp_path / "weights"
    folder.mkdir()
    names, weight_map = list(state), {}
    for index in range(3):
        file = f"model-{index + 1:05d}-of-00003.safetensors"
        part = {name: state[name] for name in names[index::3]}
        safetensors_torch.save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    largest = max(v.numel() * v.element_size() for v in state.values())
    pinned = 32 << 20  # two of the largest fp32 tensors in flight
    args = {"config": config, "weights": str(folder), "nvme_path": str(tmp_path), "pinned_bytes": pinned,
            "export": str(tmp_path / "export")}
    done = subprocess.run([sys.executable, worker_script("weights_worker"), json.dumps(args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "not in" not in done.stderr  # every persistent tensor came from the file
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    # materialize: far below the model (160 MiB); beyond the pinned pool, about two of its largest tensors.
    assert peaks["materialize_peak"] < model_bytes / 2, peaks
    assert peaks["materialize_peak"] - pinned < 3 * largest, peaks
    # export: at most two copies of the largest parameter (the gathered one, and its shard on the way).
    assert peaks["export_peak"] < 2 * largest, peaks
    exported = safetensors_torch.load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[name], state[name]) for name in state)


def test_materialize_refuses_a_weights_file_that_does_not_fit(tmp_path):
    torch.manual_seed(0)
    small = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    safetensors_torch.save_file({k: v for k, v in small.state_dict().items() if k != "lm_head.weight"},
                                tmp_path / "model.safetensors")
    with torch.device("meta"):
        wider = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=48))
    with pytest.raises(zinf.ZinfCheckpointError, match=r"wte.weight: \(64, 32\) in the file, \(64, 48\) in the model"):
        zinf.materialize(wider, {"stage": 3}, weights=tmp_path, progress=False)
    assert all(p.is_meta for p in wider.parameters())  # refused before anything was allocated
