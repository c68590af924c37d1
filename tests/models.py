"""Test model zoo for capture and partitioning (tests/test_partition.py, test_backend.py).

Small, CPU-fast models, each exercising something the stage split must keep:
markers, tied weights, BatchNorm buffers, a skip connection over several
stages, several inputs with a keyword attention mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd


class TwoLinear(nn.Module):
    """Base of the small error-case models: two d x d layers ``a`` and ``b``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)


class MLP(nn.Module):
    """``depth`` blocks of Linear+GELU; with ``markers`` a stage ends after each block."""

    def __init__(self, d: int = 16, depth: int = 4, markers: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(d, 4)
        self.markers = markers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.markers and i < len(self.blocks) - 1:
                mpmd.stage_boundary()
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """GPT-style character model with the unembedding tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 32, n_layer: int = 4, n_head: int = 4,
                 block_size: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()  # a Constant
        for block in self.blocks:
            x = block(x, mask)  # every stage recomputes the mask instead of receiving it
        return self.lm_head(self.ln_f(x))


def meta_gpt_pipeline(init_fn, timeout: float):
    """A CharGPT built on the meta device, pipelined over 2 ranks at
    ``blocks.2`` with ``init_fn`` (its tied weight spans both ranks: the
    materialized value is broadcast), and a batch for it."""
    with torch.device("meta"):
        model = CharGPT(vocab=32, d=16, n_layer=4, n_head=2, block_size=8)
    pipe = mpmd.pipeline(model, loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1),
                                                                     t.flatten()),
                         num_microbatches=2, split_points=["blocks.2"], init_fn=init_fn,
                         timeout=timeout)
    return pipe, torch.randint(0, 32, (8, 8))


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(x + y)


class ResCNN(nn.Module):
    """Conv stem, residual blocks with BatchNorm (running stats are buffers), linear head."""

    def __init__(self, c: int = 8, n_blocks: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.layers = nn.Sequential(*(ResBlock(c) for _ in range(n_blocks)))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


class SkipNet(nn.Module):
    """Four stages; the output of stage 0 is read again by stage 3 (a skip over three
    boundaries), and stage 2 reads stage 0's value too."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.d = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h0 = torch.tanh(self.a(x))
        mpmd.stage_boundary()
        h1 = torch.tanh(self.b(h0))
        mpmd.stage_boundary()
        h2 = torch.tanh(self.c(h1)) * h0
        mpmd.stage_boundary()
        out = self.d(h2) + h0
        return out, h1


class MultiInputAttention(nn.Module):
    """Two inputs plus a keyword attention mask and a keyword float; returns a dict."""

    def __init__(self, vocab: int = 20, d: int = 16, n_layer: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.feature_proj = nn.Linear(6, d)
        self.layers = nn.ModuleList(nn.MultiheadAttention(d, 2, batch_first=True)
                                    for _ in range(n_layer))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.out = nn.Linear(d, 3)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, *,
                attention_mask: torch.Tensor | None = None, scale: float = 1.0) -> dict:
        x = self.embed(tokens) + self.feature_proj(features)
        pad = None if attention_mask is None else attention_mask == 0
        for attn, norm in zip(self.layers, self.norms):
            y, _ = attn(x, x, x, key_padding_mask=pad, need_weights=False)
            x = norm(x + y)
        logits = self.out(x) * scale
        return {"logits": logits, "pooled": x.mean(dim=1)}


class DataDependentBranch(TwoLinear):
    """A stage boundary inside data-dependent control flow: Dynamo cannot capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:  # BRANCH-LINE: data-dependent
            mpmd.stage_boundary()
            x = x * 2
        return self.b(x)


class AdjacentMarkers(TwoLinear):
    """Two markers with nothing between them: an empty stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        mpmd.stage_boundary()
        mpmd.stage_boundary()
        return self.b(x)


class IndependentStages(nn.Module):
    """The first stage only counts calls in a buffer; the second reads nothing it
    computes: no value crosses the boundary."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        mpmd.stage_boundary()
        return self.b(x)


class UnevenLayers(nn.Module):
    """Linear layers of very different widths, for the balanced partitioner."""

    def __init__(self, widths: tuple[int, ...] = (8, 64, 8, 8, 128, 8, 16, 8)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) if w == 8 else
                                    nn.Sequential(nn.Linear(8, w), nn.ReLU(), nn.Linear(w, 8))
                                    for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


# A module-level tensor named like GlobalTensorAndInput's argument minus its
# trailing underscore: Dynamo names their placeholders G_x_ and L_x_.
x = torch.full((8,), 10.0)


class GlobalTensorAndInput(TwoLinear):
    """Reads a global tensor `x` and an argument `x_` (both strip to "x")."""

    def forward(self, x_: torch.Tensor) -> torch.Tensor:
        h = self.a(x_)
        mpmd.stage_boundary()
        return self.b(h) + x


class ReusedArgumentName(TwoLinear):
    """Rebinds an argument name (`mask`) to a value that crosses the boundary,
    while the original argument is read after it too (as in Hugging Face code)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m2 = mask
        mask = self.a(x) * m2
        mpmd.stage_boundary()
        return self.b(mask) + m2


class OptionalArguments(TwoLinear):
    """An optional tensor argument and a float argument with defaults."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        h = h * scale
        mpmd.stage_boundary()
        return self.b(h)


class BoundaryInCond(TwoLinear):
    """A stage boundary inside a torch.cond branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(x):
            h = self.a(x)
            mpmd.stage_boundary()
            return self.b(h)

        def false_fn(x):
            return self.b(x)

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


class BoundaryInCheckpoint(nn.Module):
    """A stage boundary inside a torch.utils.checkpoint region."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mpmd.stage_boundary()
        return self.b(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return self.c(checkpoint(self.block, x, use_reentrant=False))


class CheckpointedLayers(nn.Module):
    """Every layer runs under torch.utils.checkpoint."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


class ViewOfConstantBeforeWrite(nn.Module):
    """A view of a constant buffer is taken before an in-place write through
    the buffer; a later stage reads the view and must see the write."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        buf = torch.zeros(2, 4)
        head = buf[0]              # view taken before the write
        tail = buf[1:].t()         # a view of the base in another shape
        h = self.a(x)
        tail.copy_(h[1:].t())      # write through one view
        buf[0] = h.sum(0)          # write through the base
        mpmd.stage_boundary()
        return self.b(h) + head + tail.t()


class ViewOfValueBeforeWrite(nn.Module):
    """A view of a computed value taken on one stage, the value written in
    place on the next; the view must see the write."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        v = h[:, :2]
        mpmd.stage_boundary()
        h.mul_(2)
        return self.b(h) + v.sum()


class SkipChain(nn.Module):
    """``depth`` Linear+tanh layers with no markers (stages come from split points
    ``layers.k``): the first layer's output skips to the middle layer and to the
    head, so it crosses several stage boundaries whatever the stage count."""

    def __init__(self, d: int = 16, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = h0 = x
        for i, layer in enumerate(self.layers):  # no slicing: Dynamo traces this fast
            h = torch.tanh(layer(h))
            if i == 0:
                h0 = h
            elif i == len(self.layers) // 2:
                h = h * h0
        return self.head(h) + h0


class DropoutMLP(nn.Module):
    """Dropout on both sides of a marker: two stages whose outputs depend on the RNG."""

    def __init__(self, d: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        mpmd.stage_boundary()
        return self.b(self.drop(h))


class TPAttention(nn.Module):
    """Causal self-attention with separate ``q``, ``k``, ``v`` projections, so
    that a column-parallel plan on each splits the heads over tensor-parallel
    ranks as a unit (a fused qkv under ColwiseParallel would hand rank 0 all
    of q and half of k); the head count comes from the local width
    (``view(b, t, -1, head_dim)``), so the same code runs on a shard."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.head_dim = d // n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class TPBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = TPAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TPGPT(nn.Module):
    """A GPT whose blocks take torchtitan's tensor-parallel plan (q/k/v and
    fc column-parallel, attn.proj and proj row-parallel; tests/tp_worker.py):
    embeddings, LayerNorms and the head stay plain, and the unembedding is
    tied to the token embedding (stages 0 and last)."""

    def __init__(self, vocab: int = 32, d: int = 32, n_layer: int = 4, n_head: int = 4,
                 block_size: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(TPBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
