"""zinf.plan predicts, before any run, the bytes memory_report then shows (issue 38, "a plan before the run").

For each option set a tiny GPT is planned from a copy built on the meta device (nothing allocated), then
trained for real: after a step and a further backward (moments, gradients and shards all present) each
tier's params, grads and optimizer figures of ``memory_report`` equal the prediction within the
optimizer's step counters (a few bytes per parameter, which the plan leaves out).  The byte rules do not
depend on the lowering: one option set lowers with Inductor (the default; in --all) and the rest with
``lower="eager"`` to keep the suite short.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
import sys

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.api import RUNTIME
from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.cost_model import nominal_profile

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SLACK = 64  # bytes per parameter: the optimizer's step counters, which the plan leaves out

CASES = {
    "stage3-device-inductor": {"stage": 3},
    "stage3-cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "lower": "eager"},
    "stage3-nvme": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "lower": "eager"},
    "stage3-nvme-tiled": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "lower": "eager",
                          "tile_threshold": 4096, "tile_factor": 2},
    "stage2-cpu": {"stage": 2, "offload_optimizer": "cpu", "lower": "eager"},
    "stage3-bf16-cpu": {"stage": 3, "param_dtype": "bf16", "offload_param": "cpu", "offload_optimizer": "cpu",
                        "lower": "eager"},
}


# The default run: the NVMe tiers with tiling; --all the rest (the default lowering among them).
DEFAULT = ("stage3-nvme-tiled",)


@pytest.mark.parametrize("case", [case if case in DEFAULT else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])
def test_the_plan_predicts_what_memory_report_then_shows(case, tmp_path):
    options = dict(CASES[case])
    if "nvme" in options.values():
        options["nvme_path"] = str(tmp_path)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        blueprint = GPT(CFG)
    predicted = zinf.plan(blueprint, (idx, idx), options)
    assert all(p.is_meta for p in blueprint.parameters())  # nothing was allocated for the plan

    torch.manual_seed(0)
    model = GPT(CFG)
    pool_before = RUNTIME.store.pinned  # (the process's: an earlier test's model may have made it)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    compiled(idx, idx).backward()
    opt.step()
    compiled(idx, idx).backward()  # moments, gradients and shards all held now
    report = zinf.memory_report(compiled)
    slack = SLACK * len(list(model.parameters()))
    for tier in ("device", "cpu", "nvme"):
        for kind in ("params", "grads", "optimizer"):
            assert abs(report[tier][kind] - predicted.memory[tier][kind]) <= slack, (
                tier, kind, report[tier][kind], predicted.memory[tier][kind])
    # The store's pinned pool (made once per process, at the first NVMe transfer) is the one predicted; one an
    # earlier model made is at least that (grown to fit this model, if it was smaller).
    if "nvme" in options.values():
        made = report["pinned"]["parameters"]["quota"]
        assert (made == predicted.pinned["parameters"] > 0 if pool_before is None else
                made >= predicted.pinned["parameters"] > 0), (made, predicted.pinned, pool_before)
        # And the optimizer's own: the early step's pool (the step after backward borrows it), or the late one's.
        nvme = opt._nvme
        own, consumer = (nvme.early.pool, "early_optimizer") if nvme.early is not None else (nvme.pool, "optimizer")
        assert own.capacity_bytes == predicted.pinned[consumer] > 0, (consumer, predicted.pinned)
    else:
        assert predicted.pinned["parameters"] == 0
    # The swap files on disk (one copy written so far per key at most) fit the predicted swap space.
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert on_disk <= predicted.swap_space + (1 << 20)
    opt.zero_grad()


def test_the_plan_counts_flops_and_saved_activations_and_refuses_nothing_to_backward_from():
    with torch.device("meta"):
        blueprint = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size))
    predicted = zinf.plan(blueprint, (idx, idx), {"stage": 3})
    numel = sum(p.numel() for p in blueprint.parameters())
    tokens = idx.numel()
    # Forward and backward of a transformer: about 6 FLOPs per parameter and token, attention on top.
    assert 5 * numel * tokens <= predicted.flops <= 12 * numel * tokens
    assert predicted.memory["device"]["activations"] > tokens * CFG.n_embd * 4 * CFG.n_layer
    with pytest.raises(ValueError, match="no tensor to run backward from"):
        zinf.plan(torch.nn.Identity(), (None,), {"stage": 3})


def test_the_plan_counts_attention_flops_and_the_other_ops_bytes():
    """The CPU's attention kernels are FLOPs torch's counter leaves out; the non-matmul ops move bytes."""
    from zinf_compiler.blueprint import blueprint

    batch, heads, seq, head_dim = 2, 4, 32, 16

    class Attention(torch.nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).relu().sum()

    query = torch.randn(batch, heads, seq, head_dim, requires_grad=True)
    counted = blueprint(Attention(), (query,))
    # Two matmuls of 2 x B x H x T x T x D FLOPs forward, four backward.
    assert counted.flops == 6 * 2 * batch * heads * seq * seq * head_dim
    # relu and its backward, sum and its backward each read and write at least one tensor of the query's size.
    assert counted.moved >= 4 * query.numel() * 4
    with torch.device("meta"):
        gpt = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size))
    profile = nominal_profile()
    step = zinf.plan(gpt, (idx, idx), {"stage": 3}, profile=profile).step
    assert step["compute"] > blueprint(gpt, (idx, idx)).flops / profile.matmul_flops
    # On a CPU device the optimizer over the device tier costs time too.
    assert step["optimizer"] > 0


def test_the_plan_counts_what_tiling_moves():
    """A tiled weight's matmuls move more bytes than the untiled ones (the products concatenated, the
    gradient's slices copied, the input gradient summed over tiles): predicted as more compute."""
    from zinf_compiler.blueprint import blueprint
    from zinf_compiler.planner import _tiling_bytes, plan_blueprint

    with torch.device("meta"):
        gpt = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size))
    counted = blueprint(gpt, (idx, idx))
    tokens = idx.numel()
    # Each block's MLP input layer, as x @ W.T: inputs tokens x n_embd, outputs tokens x 4 n_embd.
    assert counted.weight_matmuls["blocks.0.mlp.fc.weight"] == (tokens * CFG.n_embd, tokens * 4 * CFG.n_embd)
    profile = nominal_profile()
    untiled = plan_blueprint(counted, {"stage": 3}, profile=profile).step["compute"]
    # The MLP's two weights (4 n_embd x n_embd fp32) are the only ones over the threshold: two tiles each.
    threshold = 4 * CFG.n_embd * CFG.n_embd * 4 - 1
    tiled = plan_blueprint(counted, {"stage": 3, "tile_threshold": threshold, "tile_factor": 2},
                           profile=profile).step["compute"]
    extra = sum(_tiling_bytes(*counted.weight_matmuls[f"blocks.{layer}.mlp.{name}.weight"], 2, 4)
                for layer in range(CFG.n_layer) for name in ("fc", "proj"))
    assert extra > 0
    assert tiled == pytest.approx(untiled + extra / profile.memory_bandwidth, rel=1e-9)


def test_a_plan_for_a_gpu_keeps_the_device_apart_from_the_host_and_counts_the_copies_between():
    """The device a model trains on changes its plan: on a GPU the device tier is not host memory, the
    offloaded tiers copy parameters and gradients over the host link, and the CPU optimizer runs at the host
    memory's rate.  A meta-device model is planned for this machine's GPU if it has one (found on the first
    GPU run: every plan from a meta-device blueprint described a CPU device), else for the CPU, and the example
    inputs may sit anywhere (meta, CPU, the GPU)."""
    from zinf_compiler.blueprint import blueprint

    with torch.device("meta"):
        gpt = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size))
    options = {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}
    on_cpu = zinf.plan(gpt, (idx, idx), options, device="cpu", profile=nominal_profile("cpu"))
    gpu_rates = nominal_profile("cuda")
    on_gpu = zinf.plan(gpt, (idx, idx), options, device="cuda", profile=gpu_rates)
    assert (on_cpu.options["device"], on_gpu.options["device"]) == ("cpu", "cuda")
    assert "device" not in on_gpu.compile_options()
    assert on_cpu.memory == on_gpu.memory
    assert on_cpu.host_bytes() == on_gpu.host_bytes() + on_gpu.tier_total("device")
    # Each parameter (fp32, world 1) fetched for forward and backward, each trained one's gradient sent back.
    numel = {name: p.numel() for name, p in gpt.named_parameters()}
    trained = sum(n for name, n in numel.items() if dict(gpt.named_parameters())[name].requires_grad)
    assert on_cpu.host_device == 0
    assert on_gpu.host_device == 4 * (2 * sum(numel.values()) + trained)
    assert on_gpu.step["transfer"] == pytest.approx(on_gpu.host_device / gpu_rates.host_to_device)
    # Stage 2, optimizer on the cpu tier, 2 ranks: each rank sends its slice of the gradient to the host and
    # its stepped slice back (the gathers run on the device): twice its half of the model.
    stage2 = zinf.plan(gpt, (idx, idx), {"stage": 2, "offload_optimizer": "cpu"}, world_size=2, device="cuda")
    assert stage2.host_device == sum(2 * 4 * -(-n // 2) for n in numel.values())
    # Beside a GPU the host-memory optimizer steps during backward ("auto"), copying its state first: its
    # pass moves the copies' bytes too, and runs from the start of backward (after the forward's third).
    from zinf_compiler.planner import ADAM_BYTES_PER_ELEMENT, EARLY_COPY_BYTES_PER_ELEMENT

    early_bytes = (ADAM_BYTES_PER_ELEMENT + EARLY_COPY_BYTES_PER_ELEMENT) / ADAM_BYTES_PER_ELEMENT
    assert on_gpu.step["optimizer"] == pytest.approx(on_cpu.step["optimizer"] * nominal_profile("cpu").memory_bandwidth
                                                     / gpu_rates.host_memory_bandwidth * early_bytes)
    parts = on_gpu.step
    assert parts["predicted"] == pytest.approx(max(parts["compute"], parts["transfer"],
                                                   parts["compute"] / 3 + parts["optimizer"]))
    late = zinf.plan(gpt, (idx, idx), {**options, "overlap_optimizer": False}, device="cuda", profile=gpu_rates).step
    assert late["predicted"] == pytest.approx(max(late["compute"], late["transfer"]) + late["optimizer"])
    # Where the model will train, by default: its parameters' device, or this machine's GPU for a meta model.
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert zinf.plan(gpt, (idx, idx), options).options["device"] == expected
    assert zinf.plan(GPT(CFG), (idx, idx), options).options["device"] == "cpu"
    # The inputs' own device does not matter to the fake run.
    on_meta = blueprint(gpt, (idx.to("meta"), idx.to("meta")))
    on_host = blueprint(gpt, (idx, idx))
    assert (on_meta.flops, on_meta.saved, on_meta.moved) == (on_host.flops, on_host.saved, on_host.moved)


def _probe_rank_recording(record_folder: str, rank: int, *args) -> None:
    """plan_cli._probe_rank in a spawned rank, with what its collective probe gathered and how long the timed
    all-gathers took written to ``record_folder``/rank-<rank>.json."""
    from zinf_compiler import cost_model, plan_cli
    from zinf_compiler.runtime.comm import Comm

    gathers, seconds = [], []
    real_gather, real_timed = Comm.start_all_gather_uncounted, cost_model.best_seconds

    def gather(self, output, shard):
        gathers.append({"output": output.numel() * output.element_size(), "shard": shard.numel() * shard.element_size(),
                        "world": self.world_size})
        return real_gather(self, output, shard)

    def timed(fn, *timed_args, **kwargs):
        before = len(gathers)
        best = real_timed(fn, *timed_args, **kwargs)
        if len(gathers) > before:  # the collective's timing, not another probe's
            seconds.append(best)
        return best

    Comm.start_all_gather_uncounted, cost_model.best_seconds = gather, timed
    plan_cli._probe_rank(rank, *args)
    with open(os.path.join(record_folder, f"rank-{rank}.json"), "w") as handle:
        json.dump({"gathers": gathers, "seconds": seconds}, handle)


@pytest.mark.slow  # spawns two processes (about 10 s)
def test_planning_world_size_2_from_one_process_measures_the_collective_rate(tmp_path, monkeypatch):
    # The rate is derived, not bounded: each rank's probe gathers world x its shard and reports the gathered
    # output's bytes over its best time; the plan gets the ranks' average (cost_model's docstring). What the
    # spawned ranks did is recorded there (the ranks run plan_cli's own _probe_rank, wrapped) and recomputed here.
    import functools

    import torch.multiprocessing as mp

    from zinf_compiler.plan_cli import probe_rates

    real_start = mp.start_processes
    monkeypatch.setattr(mp, "start_processes", lambda fn, args, **kwargs: real_start(
        functools.partial(_probe_rank_recording, str(tmp_path)), args=args, **kwargs))
    profile = probe_rates(None, torch.float32, world_size=2)
    rates = []
    for rank in range(2):
        recorded = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        (best,) = recorded["seconds"]
        assert recorded["gathers"] and all(gather == {"output": 2 * gather["shard"], "shard": gather["shard"], "world": 2}
                                           and gather["shard"] > 0 for gather in recorded["gathers"])
        rates.append(recorded["gathers"][0]["output"] / best)
    assert profile.collective == pytest.approx(sum(rates) / 2, rel=1e-12)


_CACHE_RUN = """
import json, sys, torch
import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig
cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
options = json.loads(sys.argv[1])
idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=torch.Generator().manual_seed(0))
with torch.device("meta"):
    blueprint = GPT(cfg)
predicted = zinf.plan(blueprint, (idx, idx), options)
torch.manual_seed(0)
model = GPT(cfg)
compiled = torch.compile(model, backend="zinf", options=options)
opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
compiled(idx, idx).backward()
opt.step()
compiled(idx, idx).backward()
report = zinf.memory_report(compiled)
print(json.dumps({"predicted": predicted.memory, "report": {t: report[t] for t in ("cpu", "nvme")},
                  "params": len(list(model.parameters()))}))
"""


@pytest.mark.slow  # a process of its own (about 10 s)
def test_the_plan_follows_the_ram_cache_under_host_memory(tmp_path):
    # A budget that keeps some parameters' states in RAM and leaves the rest on NVMe: the predicted split
    # between the cpu and nvme tiers is the one the run makes (same choice function, same budget rule).
    # In a process of its own: the planner predicts a fresh process, whose pinned pool (part of the budget)
    # is made by this run with this size (in this one an earlier test may have made it already).
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path),
               "lower": "eager", "pinned_bytes": 256 << 10, "host_memory": 550 << 10}
    done = subprocess.run([sys.executable, "-c", _CACHE_RUN, json.dumps(options)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    predicted, report = result["predicted"], result["report"]
    assert predicted["cpu"]["optimizer"] > 0 and predicted["nvme"]["optimizer"] > 0  # a mix
    for tier in ("cpu", "nvme"):
        for kind in ("params", "grads", "optimizer"):
            assert abs(report[tier][kind] - predicted[tier][kind]) <= SLACK * result["params"], (
                tier, kind, report[tier][kind], predicted[tier][kind])


def test_a_model_built_in_memory_counts_until_it_is_adopted(tmp_path):
    """torch.compile(GPT(cfg)) holds the model as built until the first call moves its states to NVMe: the peak
    is at least that; a model zinf.materialize makes is never whole in RAM."""
    from zinf_compiler.planner import COMPILE_BYTES

    cfg = GPTConfig(vocab_size=1024, block_size=16, n_layer=4, n_head=4, n_embd=512)  # parameters >> activations
    with torch.device("meta"):
        blueprint = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path),
               "nvme_grad_ram_bytes": 0, "overlap_optimizer": False}
    # (the gradients in swap files too, and no step during backward holding them: little of the model rests in RAM)
    predicted = zinf.plan(blueprint, (idx, idx), options)
    built = sum(p.numel() * 4 for p in blueprint.parameters())
    assert predicted.built_bytes == built
    process = 300 << 20
    materialized = predicted.peak_rss(process, built_in_memory=False)
    assert predicted.peak_rss(process) == max(materialized,
                                              process + built + sum(predicted.pinned.values()) + COMPILE_BYTES)
    assert predicted.peak_rss(process) > materialized


def test_the_gradients_a_step_during_backward_holds_count_in_the_peak(tmp_path):
    """With the gradients on NVMe, the optimizer's step during backward holds a RAM copy of each until it has
    stepped it (runtime/optim/early_adam.py): the peak counts them, at most all at once; none with the gradients in
    RAM (the step reads those) or without the step during backward."""
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64)
    with torch.device("meta"):
        blueprint = GPT(cfg)
    nvme = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}
    grads = 4 * sum({id(p): p.numel() for p in blueprint.parameters()}.values())
    on_disk = zinf.plan(blueprint, None, {**nvme, "nvme_grad_ram_bytes": 0})
    assert on_disk.early_step_grads == grads
    late = zinf.plan(blueprint, None, {**nvme, "nvme_grad_ram_bytes": 0, "overlap_optimizer": False})
    assert late.early_step_grads == 0
    # (the early step's pool, which the late step borrows, in place of the late step's own)
    assert late.pinned["early_optimizer"] == 0 and on_disk.pinned["optimizer"] == 0
    pools = on_disk.pinned["early_optimizer"] - late.pinned["optimizer"]
    assert on_disk.peak_rss(0, built_in_memory=False) == late.peak_rss(0, built_in_memory=False) + grads + pools
    in_ram = zinf.plan(blueprint, None, {**nvme, "nvme_grad_ram_bytes": 1 << 40})
    assert in_ram.early_step_grads == 0 and in_ram.memory["cpu"]["grads"] == grads


def test_plan_cli_plans_a_hugging_face_config_with_its_labels(tmp_path, capsys):
    """``zinf plan --hf-config``: the batch gives the token ids as ``input_ids`` and as ``labels`` (each
    argument between them at its default; the labels passed as the attention mask, as ``model(tokens,
    tokens)`` did, plan a forward without its loss), and the plan counts what the loss saves for backward."""
    import inspect as pyinspect

    from transformers import LlamaConfig

    from zinf_compiler import plan_cli

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path)
    args = types.SimpleNamespace(hf_config=str(tmp_path), batch=2, seq=16)
    model, batch = plan_cli._model_and_batch(args)
    names = list(pyinspect.signature(model.forward).parameters)
    assert batch[0].shape == (2, 16) and batch[names.index("labels")] is batch[0], batch
    assert batch[names.index("attention_mask")] is None and len(batch) == names.index("labels") + 1
    with_loss, without = zinf.plan(model, batch, {"stage": 3}), zinf.plan(model, batch[:1], {"stage": 3})
    saved = with_loss.memory["device"]["activations"] - without.memory["device"]["activations"]
    assert saved >= 2 * 16 * 128 * 4, saved  # (at least the log-softmax of the logits the loss saves)
    assert plan_cli.main(["--hf-config", str(tmp_path), "--batch", "2", "--seq", "16"]) == 0
    assert "stage" in capsys.readouterr().out
