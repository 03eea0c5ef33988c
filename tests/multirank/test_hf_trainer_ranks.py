"""The Hugging Face Trainer at world 2 trains a zinf model (ZinfTrainer) like its own eager run on one process."""

from __future__ import annotations

import pytest
import transformers

from hf_trainer_runs import assert_same, dataset, eager_run, logged
from multirank import run_ranks


@pytest.mark.slow  # world 2 under zinf is in the default run elsewhere (test_zero.py::test_zero_stages_match_eager[2])
def test_trainer_at_world_2_equals_eager_trainer(tmp_path):
    """Two ranks (torchrun's environment variables, gloo), one sample each per micro-batch: the same
    global batches as the eager Trainer on one process, so the same losses; accelerate does not wrap
    the model in DDP (zinf reduces the gradients)."""
    transformers.logging.set_verbosity_error()
    eager = eager_run("gpt2", tmp_path)
    results = run_ranks(2, "hf_trainer_worker", {})
    for result in results:
        assert result["wrapped"] == "GPT2LMHeadModel", result
    assert_same([tuple(entry) for entry in results[0]["logged"]], logged(eager))
    prompt = dataset()[0]["input_ids"][None, :4]
    expected = eager.model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    assert [result["generated"] for result in results] == [expected, expected]  # gathered on both ranks
