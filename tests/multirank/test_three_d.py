"""pp x tp x dp (issue 37, acceptance 3): pp 2 x dp 2 x tp 2 at world 8 on gloo trains equal to eager, clipped too.

The worker (tests/workers/three_d_worker.py) cuts a small GPT into 2 pipeline stages, splits each stage's blocks
over 2 tp ranks (torch's TP plan), compiles each stage with zinf at stage 3 over its 2 dp ranks and drives them
with Schedule1F1B, 4 micro-batches; 3 AdamW steps against the same (untied) model in eager on the whole batch.
World 8 on a few cores: slow.
"""

import pytest

from multirank import run_ranks
from usage import LOSS_RTOL, PARAM_RTOL


def _assert_equals_eager(results):
    for result in results:
        assert "error" not in result, result.get("trace")
        if result["stage"] == 1:  # (the last stage computes the loss)
            for step, (eager, zinf) in enumerate(zip(result["eager_losses"], result["zinf_losses"], strict=True)):
                assert abs(eager - zinf) <= LOSS_RTOL * abs(eager) + 1e-8, (result["rank"], step, result)
        # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by every key): both
        # runs hold rounding noise there (~1e-9), so it is held to an absolute bound (as test_tensor_parallel).
        noise = {name for name in result["param_errors"] if name.endswith("attn.k.bias")}
        for name in noise:
            assert result["param_abs_errors"][name] <= 1e-7, (result["rank"], name, result["param_abs_errors"][name])
        errors = {name: error for name, error in result["param_errors"].items() if name not in noise}
        assert len(errors) >= 10, errors  # (this stage's whole parameters: 1 block, and embeddings or the head)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= PARAM_RTOL, (result["rank"], worst, errors[worst])
        assert result["graphs"] == 1, result["graphs"]  # one Dynamo graph per stage, reused by every micro-batch
    # Every parameter of the whole model is on some stage.
    names = set().union(*(result["param_errors"] for result in results))
    assert {"wte.weight", "lm_head.weight", "blocks.0.attn.q.weight", "blocks.1.mlp.proj.weight"} <= names, names


@pytest.mark.slow  # world 8 on gloo: about 75 s with lower="eager" on 2 cores
def test_pp2_tp2_dp2_equals_eager():
    _assert_equals_eager(run_ranks(8, "three_d_worker", {"lower": "eager", "steps": 3}, timeout=900))


@pytest.mark.slow  # Inductor at world 8: several minutes on 2 cores
def test_pp2_tp2_dp2_inductor_equals_eager():
    _assert_equals_eager(run_ranks(8, "three_d_worker", {"lower": "inductor", "steps": 3}, timeout=900))


@pytest.mark.slow  # world 8 on gloo, as above
def test_pp2_tp2_dp2_clips_by_the_whole_models_norm_as_eager_does():
    """torch's clip_grad_norm_ on every rank over its stage's parameters: zinf takes the norm over the whole model
    (the other dp ranks' shards, the other tp ranks' slices of Shard parameters with the Replicate ones once, the
    other pipeline stage's parameters), the norm eager computes on the whole model.  A max_norm under it clips
    every step, and the clipped training equals eager's."""
    results = run_ranks(8, "three_d_worker", {"lower": "eager", "steps": 3, "clip": 0.05}, timeout=900)
    _assert_equals_eager(results)
    for result in results:
        eager, zinf = result["eager_norms"], result["zinf_norms"]
        assert len(zinf) == 3 and all(norm > 0.05 for norm in eager), eager  # (it clipped every step)
        for step, (expected, got) in enumerate(zip(eager, zinf, strict=True)):
            assert abs(got - expected) <= 1e-6 * expected, (result["rank"], step, expected, got)
