"""One rank of a ZinfTrainer run under torchrun-style environment variables (test_hf_trainer_ranks.py)."""

from __future__ import annotations

import json
import os

import torch
import transformers

import zinf_compiler as zinf
from zinf_compiler.hf import ZinfTrainer
from hf_trainer_runs import STEPS, dataset, logged, models


def main() -> None:
    transformers.logging.set_verbosity_error()
    world = int(os.environ["WORLD_SIZE"])
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.environ["TMPDIR"], "out"), per_device_train_batch_size=2 // world,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    options = {"stage": 3, "offload_param": "cpu", "lower": "eager"}
    torch.manual_seed(0)
    trainer = ZinfTrainer(model=models()["gpt2"](), args=args, train_dataset=dataset(), zinf_options=options)
    trainer.train()
    prompt = dataset()[0]["input_ids"][None, :4]
    with zinf.gathered(trainer.model):  # every rank gathers (a collective)
        generated = trainer.model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
    with open(os.environ["ZINFTEST_OUT"], "w") as handle:
        json.dump({"logged": logged(trainer), "wrapped": type(trainer.model_wrapped).__name__,
                   "generated": generated}, handle)


if __name__ == "__main__":
    main()
