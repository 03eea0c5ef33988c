"""zinf.materialize: a meta-device model built straight into offloaded shards trains like eager."""

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime import swap_layout
from zinf_compiler.api import RUNTIME


@pytest.fixture
def small_sub_groups():
    # Several optimizer sub-groups (and gradient swap files) per parameter,
    # as a billion-parameter model has with the real 16M-element groups.
    saved = swap_layout.sub_groups.__defaults__
    swap_layout.sub_groups.__defaults__ = (1000,)
    yield
    swap_layout.sub_groups.__defaults__ = saved


# The untiled tiers run in --all (suite time): the tiled ones materialize the same tiers, tiles besides.
@pytest.mark.parametrize("tier", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("nvme", marks=pytest.mark.slow),
                                  "cpu-tiled", "nvme-tiled"])
def test_materialized_model_trains_like_eager(tier, tmp_path, small_sub_groups):
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, frozen_scale=True)
    tiled = tier.endswith("-tiled")
    tier = tier.removesuffix("-tiled")
    options = {"stage": 3, "offload_param": tier, "offload_optimizer": tier, "lower": "eager"}
    if tiled:
        # Weights over 16 KiB in 3 row tiles, laid out at materialize time: qkv, the MLP's,
        # and the tied embedding / head (32 KiB), which the embedding gathers whole.
        options.update(tile_threshold=16 * 1024, tile_factor=3)
    if tier == "nvme":
        options.update(nvme_path=str(tmp_path), nvme_copies=1)
    # Eager reference: the same per-module initializer, from the same seed.
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(1)
    reference.apply(reference.init_weights)
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(1)
    zinf.materialize(model, options, init_fn=model.init_weights, progress=False)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters()), "full parameters were freed"
    initial = zinf.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(initial[name], value, rtol=0, atol=0, msg=name)
    assert initial["lm_head.weight"].data_ptr() == initial["wte.weight"].data_ptr(), "still tied"

    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6, fused=True)
    for x, y in synthetic_batches(cfg, 4, 4):
        loss = compiled(x, y)
        loss.backward()
        norm = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        reference_loss = reference(x, y)
        reference_loss.backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_opt.step()
        reference_opt.zero_grad()
        assert norm.item() > 0.5, "clipping clips"
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(norm, reference_norm, rtol=1e-5, atol=0)
    final = zinf.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-5, msg=name)
    if tiled:
        tiled_names = {name for name, p in model.named_parameters() if RUNTIME.store.lookup(p).tile_rows}
        assert tiled_names == {"wte.weight"} | {f"blocks.{i}.{w}.weight" for i in (0, 1)
                                                for w in ("attn.qkv", "mlp.fc", "mlp.proj")}, tiled_names
    report = zinf.memory_report(model)
    if tiled and tier == "nvme":
        # Each tile of an nvme-tier parameter is its own swap key.
        record = RUNTIME.store.lookup(model.blocks[0].mlp.fc.weight)
        assert [key for key, _, _ in record.swap_layout()] == [f"param.{record.uid}.t{t}" for t in range(3)]
    if tier == "nvme":
        # fp32 master and two moments of every trainable parameter; none for the frozen one.  A master
        # that is also the parameter's only copy (params_in_master) counts as parameters.
        records = [RUNTIME.store.lookup(p) for p in model.parameters() if p.requires_grad]
        assert any(r.params_in_master for r in records) and (tiled or not all(r.params_in_master for r in records))
        assert report["nvme"]["optimizer"] == sum((2 if r.params_in_master else 3) * 4 * r.local_numel
                                                  for r in records)


def test_materialize_refuses_a_model_already_in_memory():
    with pytest.raises(ValueError, match="meta-device"):
        zinf.materialize(GPT(GPTConfig()), {"stage": 3})


def test_materialize_needs_stage_3():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    with pytest.raises(ValueError, match="stage=3"):
        zinf.materialize(model, {"stage": 2})
