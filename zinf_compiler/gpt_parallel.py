"""The GPT of ``zinf_compiler/gpt.py`` cut into pipeline stages and split over tensor-parallel ranks (issue 37,
acceptance 3: pp x tp x dp).

Plain PyTorch and torch's TP plan, shared by ``examples/train_gpt.py --tp N --pp N`` and the 3-D tests
(``tests/workers/three_d_worker.py``); zinf comes in when each stage is compiled over its ``mesh["dp"]`` and
wrapped in :class:`~zinf_compiler.pipeline_parallel.ZinfPipelineStage` (docs/notes/three_d.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPT


def untie_head(model: GPT) -> GPT:
    """Give the LM head its own weight, a copy of ``wte``'s (the GPT ties them).  Stages on different ranks
    cannot share one tensor: the first stage's embedding gradient and the last stage's head gradient would never
    be summed.  The eager reference of a pipelined run is the untied model too."""
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


class GPTStage(nn.Module):
    """Stage ``index`` of ``count`` of ``model``, cut by blocks (``n_layer / count`` each): the first stage
    also holds the embeddings (token ids in, activations out), the last the final LayerNorm and the LM head
    (activations in, logits out).  The modules are ``model``'s own; names keep their block numbers local
    (:meth:`whole_name` maps them back)."""

    def __init__(self, model: GPT, index: int, count: int):
        super().__init__()
        cfg = model.cfg
        if cfg.n_layer % count:
            raise ValueError(f"GPT pipeline: {cfg.n_layer} blocks do not split into {count} equal stages")
        if count > 1 and model.lm_head.weight is model.wte.weight:
            raise ValueError("GPT pipeline: the LM head is tied to the token embedding, which lies in another "
                             "stage; call untie_head(model) first (and train the reference untied too)")
        if cfg.frozen_scale:
            raise ValueError("GPT pipeline: frozen_scale is not supported in stages")
        self.index, self.count = index, count
        self.first_block = index * (cfg.n_layer // count)
        self.blocks = nn.ModuleList(model.blocks[self.first_block:self.first_block + cfg.n_layer // count])
        if index == 0:
            self.wte, self.wpe = model.wte, model.wpe
        if index == count - 1:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The first stage maps token ids to hidden states, the middle ones hidden states to hidden states, the
        last hidden states to logits."""
        if self.index == 0:
            # (positions made here, not read from the GPT's buffer: no buffer to agree on across ranks before
            # each call; docs/notes/three_d.md)
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.index == self.count - 1:
            x = self.lm_head(self.ln_f(x))
        return x

    def whole_name(self, name: str) -> str:
        """The whole model's name for this stage's parameter ``name`` (``blocks.0...`` of stage 1 of 2 at 4
        blocks is ``blocks.2...``)."""
        if not name.startswith("blocks."):
            return name
        _, number, rest = name.split(".", 2)
        return f"blocks.{int(number) + self.first_block}.{rest}"


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss of one micro-batch: the GPT's mean cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def parallelize_blocks(module: nn.Module, tp_mesh) -> None:
    """torch's TP plan over ``tp_mesh`` for every block of ``module`` (a GPT or a :class:`GPTStage`): colwise
    ``attn.q/k/v`` and ``mlp.fc``, rowwise ``attn.proj`` and ``mlp.proj`` (each tp rank computes its own heads);
    embeddings, LayerNorms and the LM head stay whole over tp.  Needs ``GPTConfig(separate_qkv=True)``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in module.blocks:
        if not hasattr(block.attn, "q"):
            raise ValueError("GPT tensor parallelism: build the GPT with GPTConfig(separate_qkv=True) (a colwise "
                             "split of the fused qkv would mix q, k and v across ranks)")
        parallelize_module(block, tp_mesh, {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
