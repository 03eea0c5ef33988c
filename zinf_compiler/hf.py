"""The Hugging Face ``Trainer`` with zinf underneath: :class:`ZinfTrainer`.

``Trainer`` assumes things zinf changes at stages 2-3: that ``param.grad``
holds the gradient (clipping, a ``torch.optim`` optimizer), that
``model.state_dict()`` holds the weights (saving), and that accelerate may
wrap the model.  ``ZinfTrainer`` keeps the Trainer's loop, arguments,
callbacks, logging and checkpoint folders, and replaces exactly those parts:

* the model is compiled in place (``model.compile(backend="zinf", options=...)``,
  so its module and parameter names do not change) and never wrapped;
* the optimizer is zinf's (``AdamW``/``Adam``/``SGD``, from the Trainer's
  ``optim``, ``learning_rate``, betas, epsilon and weight decay, with the
  Trainer's no-decay groups); the Trainer's LR schedulers drive it as usual;
* ``max_grad_norm`` clips through the optimizer (:meth:`clip_grad_norm_`
  over the sharded gradients, on every tier);
* gradient accumulation: the Trainer scales the loss; zinf adds each
  backward's reduced gradients into the shards until the optimizer steps;
* a checkpoint (``checkpoint-N/``) holds a zinf checkpoint (``zinf/``: fp32
  masters, optimizer state, every rank's shard, see :func:`zinf.save`) next
  to the scheduler, RNG and trainer state the Trainer writes itself;
  ``train(resume_from_checkpoint=...)`` loads it back;
* ``save_model()`` exports the weights as safetensors plus ``config.json``
  (:func:`zinf.export`), which ``from_pretrained`` loads.

One process per rank (``torchrun``), as zinf runs; ``transformers`` is only
imported by this module.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import checkpoint as zinf_checkpoint
from . import optim as zinf_optim

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("zinf_compiler.hf needs transformers: pip install transformers") from err

ZINF_FOLDER = "zinf"  # inside each checkpoint-N folder
SCHEDULER_FILE = "scheduler.pt"

# Trainer's ``optim`` names -> zinf's optimizer class (each steps sharded fp32 masters).
_OPTIMIZERS = {
    "adamw_torch": zinf_optim.AdamW, "adamw_torch_fused": zinf_optim.AdamW, "adamw_hf": zinf_optim.AdamW,
    "adamw": zinf_optim.AdamW, "adam": zinf_optim.Adam, "sgd": zinf_optim.SGD,
}


class ZinfTrainerError(ValueError):
    """A Trainer argument zinf cannot honour (said before training starts)."""


class ZinfTrainer(Trainer):
    """``transformers.Trainer`` training a zinf-compiled model (see the module docstring).

    ``zinf_options``: the backend's options (``stage``, ``offload_param``,
    ``nvme_path``, ...), as for ``torch.compile(..., backend="zinf")``.
    """

    def __init__(self, *args: Any, zinf_options: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if getattr(self.args, "torch_compile", False):
            raise ZinfTrainerError("ZinfTrainer compiles the model with zinf itself: leave torch_compile off")
        optim_name = str(getattr(self.args.optim, "value", self.args.optim))
        if optim_name not in _OPTIMIZERS:
            raise ZinfTrainerError(f"optim={optim_name!r} has no zinf equivalent; use one of {sorted(_OPTIMIZERS)}")
        self.zinf_options = dict(zinf_options or {})
        self.model.compile(backend="zinf", options=self.zinf_options)
        self._zinf_optimizer: zinf_optim.ZinfOptimizer | None = None
        # accelerate would wrap the model in DDP at world size > 1 (zinf reduces the
        # gradients itself, and DDP's hooks would wait for param.grad forever) and move
        # it: it gets the model as it is, for everything else it does (autocast).
        prepare_model = self.accelerator.prepare_model

        def prepare_model_as_it_is(model, device_placement=None, evaluation_mode=False):
            if model is self.model:
                return prepare_model(model, device_placement=False, evaluation_mode=True)
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        self.accelerator.prepare_model = prepare_model_as_it_is

    # --- the model: compiled once, never wrapped (zinf shards it; DDP/FSDP would not know) ---

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        return model

    # --- the optimizer ---

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Make (once) the zinf optimizer the Trainer's ``optim`` names, over ``model``'s trainable parameters.

        Grouped as the Trainer groups them: ``weight_decay`` on ``get_decay_parameter_names``, none on the rest
        (an empty group is dropped).  Clipping and the logged gradient norm go through this optimizer.
        """
        if self.optimizer is None:
            model = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(model))
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for name, p in named if name in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0},
            ]
            groups = [group for group in groups if group["params"]]
            optim_name = str(getattr(self.args.optim, "value", self.args.optim))
            cls = _OPTIMIZERS[optim_name]
            if cls is zinf_optim.SGD:
                self.optimizer = cls(groups, lr=self.args.learning_rate)
            else:
                self.optimizer = cls(groups, lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                                     betas=(self.args.adam_beta1, self.args.adam_beta2))
            self._zinf_optimizer = self.optimizer
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module):
        return self._zinf_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None:
            grad_norm = self._zinf_optimizer.clip_grad_norm_(float("inf"))  # the norm, nothing clipped
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    # --- checkpoints and export ---

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The weights as safetensors plus ``config.json`` (every rank takes part; rank 0 writes)."""
        if _internal_call:
            return  # a checkpoint: the weights are in its zinf checkpoint (see _save_optimizer_and_scheduler)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zinf_checkpoint.export(output_dir, self.model)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zinf_checkpoint.save(os.path.join(output_dir, ZINF_FOLDER), self.model, self._zinf_optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # The weights come with the optimizer state (see _load_optimizer_and_scheduler).
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZINF_FOLDER)):
            raise ZinfTrainerError(f"{resume_from_checkpoint} holds no zinf checkpoint ({ZINF_FOLDER}/); "
                                   f"was it written by ZinfTrainer?")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        zinf_checkpoint.load(os.path.join(checkpoint, ZINF_FOLDER), self.model, self._zinf_optimizer)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
