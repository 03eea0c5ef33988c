"""A small GPT (tied embeddings, LayerNorm, causal SDPA, GELU MLP).

Shared by ``examples/train_gpt.py``, the tests and the benchmarks so that all
of them exercise the same model.  Plain PyTorch: nothing zinf-specific.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    """Sizes of a :class:`GPT`, and extras that switch on corner cases (frozen parameter, graph break, dropout)."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    # Extras that exercise the ZeRO corner cases: a frozen parameter and a
    # buffer both take part in forward.
    frozen_scale: bool = False
    graph_break: bool = False  # a data-dependent branch in forward splits the Dynamo graph
    dropout: float = 0.0  # residual dropout after attention and MLP (GPT-2's resid_pdrop), in training mode
    # Attention's q, k and v as three Linears (``attn.q``, ``attn.k``, ``attn.v``) instead of the fused ``attn.qkv``:
    # what tensor parallelism's colwise plan splits by heads (a colwise ``qkv`` would split [q|k|v] across ranks).
    separate_qkv: bool = False


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # No op at all for p=0: the traced graphs stay free of random ops.
    return F.dropout(x, p, training) if p > 0 else x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused ``qkv`` projection (or ``q``, ``k``, ``v``: ``separate_qkv``),
    SDPA, then the output projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        if cfg.separate_qkv:
            self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        else:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj.residual_projection = True  # scaled init (GPT-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, seq, n_embd) attended causally along its sequence, same shape (dropout after ``proj``)."""
        batch, seq, width = x.shape
        if hasattr(self, "qkv"):
            if any(placement.is_shard() for placement in getattr(self.qkv.weight, "placements", ())):
                # (checked before any op: under torch.compile the graph breaks here, with no TP op traced yet)
                raise ValueError(
                    "GPT attention: the fused qkv projection is sharded over tensor-parallel ranks (a DTensor "
                    f"placed {tuple(self.qkv.weight.placements)}), which would mix q, k and v across ranks; build "
                    "the GPT with GPTConfig(separate_qkv=True) and parallelize attn.q, attn.k, attn.v colwise")
            q, k, v = self.qkv(x).split(width, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # The heads this rank computes: all of them, or under tensor parallelism its share (its q/k/v columns).
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)), self.dropout,
                        self.training)


class MLP(nn.Module):
    """The feed-forward layer: ``fc`` to 4 * n_embd, GELU, ``proj`` back to n_embd."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.proj.residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``proj(gelu(fc(x)))``, then residual dropout in training mode."""
        return _dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """One transformer layer: pre-LayerNorm attention, then a pre-LayerNorm MLP, each added to the residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus attention over ``ln1(x)``, then plus the MLP of ``ln2`` of that."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and an LM head tied to ``wte``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor under two names
        self.register_buffer("positions", torch.arange(cfg.block_size), persistent=False)
        if cfg.frozen_scale:
            self.embed_scale = nn.Parameter(torch.full((cfg.n_embd,), 1.5), requires_grad=False)
        self.apply(self.init_weights)

    @torch.no_grad()
    def init_weights(self, module: nn.Module) -> None:
        """Initialize ``module``'s own parameters and buffers (one module: ``zinf.materialize`` uses it)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif module is self:
            self.positions.copy_(torch.arange(self.cfg.block_size))
            if self.cfg.frozen_scale:
                self.embed_scale.fill_(1.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab_size) for token ids ``idx``; with ``targets``: their mean cross-entropy."""
        seq = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.positions[:seq])
        if self.cfg.frozen_scale:
            x = x * self.embed_scale
        if self.cfg.graph_break and x.abs().amax() > 1e4:
            # A branch on a tensor's value: Dynamo cannot trace it and splits
            # the graph here (the branch itself never fires).
            x = x / 2
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def synthetic_batches(cfg: GPTConfig, batch_size: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic token batches with learnable structure (a noisy counting sequence)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
        tokens = (start + stride * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
        noise = torch.rand(tokens.shape, generator=generator) < 0.05
        tokens = torch.where(noise, torch.randint(0, cfg.vocab_size, tokens.shape, generator=generator), tokens)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches
