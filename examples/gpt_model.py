"""A small character-level GPT: the model of the examples and benchmarks.

Pre-norm transformer blocks, causal self-attention, and an unembedding tied
to the token embedding (so pipelining must share one weight between the
first and the last stage). Plain PyTorch: no torch_mpmd code inside, the
stage boundaries are given from outside with split_points=["blocks.2", ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


class SelfAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections, written in
    heads of ``d_model // n_head`` without assuming how many heads a rank
    holds: under tensor parallelism (tensor_parallel_plan) each rank's
    column-parallel q, k, v produce whole heads of its own."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.head_dim = cfg.d_model // cfg.n_head

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None (causal), or a boolean ``(b, 1, t, t)`` mask (True: may
        attend), e.g. torch_mpmd.document_mask for packed documents."""
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (self.q(x), self.k(x), self.v(x)))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embedding / unembedding

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids ``idx`` (batch, time).
        Packed documents (torch_mpmd.pack): ``position_ids`` restart at each
        document and ``document_ids`` keep attention within each document."""
        if position_ids is None:
            position_ids = torch.arange(idx.shape[1], device=idx.device)
        mask = None
        if document_ids is not None:
            same = document_ids[:, :, None] == document_ids[:, None, :]
            mask = (same & torch.ones_like(same[0]).tril())[:, None]  # torch_mpmd.document_mask
        x = self.tok(idx) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def tensor_parallel_plan() -> dict:
    """torchtitan-style DTensor plan for one Block (apply with
    ``parallelize_module(block, mesh["tp"], tensor_parallel_plan())``): q, k, v
    and the MLP's first layer column-parallel, the projections row-parallel,
    so a block takes and returns whole (replicated) activations and only
    plain tensors cross pipeline stages."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
