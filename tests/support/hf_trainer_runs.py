"""The tiny Hugging Face models, data and Trainer runs that the ZinfTrainer tests compare against
(tests/integration/test_hf_trainer.py, tests/multirank/test_hf_trainer_ranks.py and its worker)."""

from __future__ import annotations

import torch
import transformers

STEPS = 4


def models():
    common = dict(vocab_size=64)
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=16, **common)),
    }


def dataset(count: int = 16, length: int = 16):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (count, length), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def arguments(output_dir):
    return transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)


_EAGER: dict = {}


def eager_run(family: str, tmp_path):
    """The plain Trainer on the eager model (once per family per session): the reference."""
    if family not in _EAGER:
        torch.manual_seed(0)
        eager = transformers.Trainer(model=models()[family](), args=arguments(tmp_path / "eager"),
                                     train_dataset=dataset())
        eager.train()
        _EAGER[family] = eager
    return _EAGER[family]


def logged(trainer):
    return [(entry["step"], entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history
            if "loss" in entry]


def assert_same(got, expected):
    assert [step for step, _, _ in got] == [step for step, _, _ in expected], (got, expected)
    for (step, loss, norm), (_, eager_loss, eager_norm) in zip(got, expected):
        assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss), (step, got, expected)
        assert abs(norm - eager_norm) <= 1e-4 * eager_norm, (step, got, expected)
