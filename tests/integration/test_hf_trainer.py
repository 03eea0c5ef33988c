"""Issue 17 acceptance 4: the Hugging Face Trainer trains a zinf model (ZinfTrainer) like its own eager run.

Tiny GPT-2 and Llama built from configs in code (no downloads), stage 3 with
parameters and optimizer state on NVMe, gradient accumulation 2, clipping,
a linear LR schedule, a checkpoint at step 2 and a resume from it in a fresh
trainer: the logged losses and gradient norms equal the plain Trainer's on
the eager model, and the exported folder loads with ``from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import zinf_compiler as zinf
from zinf_compiler.hf import ZinfTrainer, ZinfTrainerError
from hf_trainer_runs import STEPS, arguments, assert_same, dataset, eager_run, logged, models

@pytest.mark.slow  # Hugging Face models in the default run: test_hf_zoo.py (llama)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trainer_with_zinf_equals_eager_trainer_and_resumes(tmp_path, family):
    transformers.logging.set_verbosity_error()
    build = models()[family]
    eager = eager_run(family, tmp_path)
    expected = logged(eager)
    assert [step for step, _, _ in expected] == list(range(1, STEPS + 1))
    assert max(norm for _, _, norm in expected) > 0.5, "clipping must clip in this test"

    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path),
               "lower": "eager"}
    torch.manual_seed(0)
    trainer = ZinfTrainer(model=build(), args=arguments(tmp_path / "zinf"), train_dataset=dataset(),
                          zinf_options=options)
    trainer.train()
    assert_same(logged(trainer), expected)

    # A fresh trainer resumes from the step-2 checkpoint and lands on the same steps 3 and 4.
    torch.manual_seed(1)  # another initialisation: the checkpoint must overwrite it
    resumed = ZinfTrainer(model=build(), args=arguments(tmp_path / "zinf"), train_dataset=dataset(),
                          zinf_options=options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "zinf" / "checkpoint-2"))
    assert_same([entry for entry in logged(resumed) if entry[0] > 2], expected[2:])

    if family != "gpt2":
        return  # evaluation, generation and export are the same code for every family (suite time)

    # Evaluation through the same trainer: the inference graph, equal to the eager model's.
    eval_data = dataset(count=4)
    assert abs(resumed.evaluate(eval_data)["eval_loss"] - eager.evaluate(eval_data)["eval_loss"]) <= 1e-5 * 4

    # Generation is eager code (HF's loop calls the module itself): on stage-3 parameters it runs
    # inside zinf.gathered, greedily, to the same tokens as the eager model's.
    prompt = dataset()[0]["input_ids"][None, :4]
    with zinf.gathered(resumed.model):
        ours = resumed.model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, eager.model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0))

    resumed.save_model(str(tmp_path / "export"))
    loaded = type(eager.model).from_pretrained(str(tmp_path / "export"))
    batch = dataset()[0]
    with torch.no_grad():
        ours = loaded(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.item()
        theirs = eager.model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.item()
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


def test_trainer_refuses_what_zinf_cannot_honour(tmp_path):
    model = models()["gpt2"]()
    args = arguments(tmp_path)
    args.optim = "adafactor"
    with pytest.raises(ZinfTrainerError, match="adafactor"):
        ZinfTrainer(model=model, args=args, train_dataset=dataset(), zinf_options={"stage": 3})
