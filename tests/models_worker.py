"""Ranks of tests/test_compiled_models.py: more model kinds through the
functional stage programs, with and without Inductor, on 2 gloo ranks.

The reference is one process stepping the same model over the same
microbatches in order (what a pipeline computes: BatchNorm sees each
microbatch, its running stats advance once per microbatch), loss divided by
m, gradients accumulated. Dropout models have no eager reference (compiled
random streams differ from eager's): their cases are compared across
schedules by the test.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import pipeline_worker
import torch_mpmd as mpmd
from pipeline_worker import _compare_grads, _diff, _error_text, _rank_world
from torch_mpmd.schedules import facts

M = 4
TOL = {False: (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}


class CheckpointedMLP(nn.Module):
    """Linear-GELU-Linear blocks under torch.utils.checkpoint."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                  nn.Linear(2 * d, d)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class HFLogits(nn.Module):
    """A Hugging Face causal LM returning its logits (the loss is the pipeline's)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


class TransposedCut(nn.Module):
    """A stage boundary right after a transpose: the value crossing it is not
    contiguous (as a q/k projection's heads are when a cut falls there)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).transpose(1, 2)
        mpmd.stage_boundary()
        return self.b(h.transpose(1, 2).reshape(x.shape[0], x.shape[1], 16))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any, dict]:
    """(model, x, y, loss_fn, {stage count: split points}) by name."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bn_cnn":
        return (models.ResCNN(), torch.randn(8, 3, 8, 8, generator=g),
                torch.randint(0, 5, (8,), generator=g), F.cross_entropy,
                {2: ["layers.1"], 4: ["layers.0", "layers.1", "layers.2"]})
    if name == "checkpointed":
        return (CheckpointedMLP(), torch.randn(8, 16, generator=g),
                torch.randn(8, 16, generator=g), F.mse_loss,
                {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]})
    if name == "transposed":
        return (TransposedCut(), torch.randn(8, 6, 8, generator=g),
                torch.randn(8, 6, 8, generator=g), F.mse_loss, {2: None})
    if name == "dropout":
        return (models.DropoutMLP(d=16), torch.randn(8, 16, generator=g),
                torch.randn(8, 16, generator=g), F.mse_loss, {2: None, 4: None})
    import transformers

    ids = torch.randint(0, 64, (8, 16), generator=g)
    tgt = torch.randint(0, 64, (8, 16), generator=g)
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                      n_head=4, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "eager"
        lm = transformers.GPT2LMHeadModel(cfg)
        layers = "lm.transformer.h"
    elif name == "hf_llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       bos_token_id=0, eos_token_id=0)
        lm = transformers.LlamaForCausalLM(cfg)
        layers = "lm.model.layers"
    else:
        raise ValueError(name)
    return (HFLogits(lm), ids, tgt, lm_loss,
            {2: [f"{layers}.2"], 4: [f"{layers}.1", f"{layers}.2", f"{layers}.3"]})


def run_case(case: dict[str, Any], group, timeout: float) -> dict[str, Any]:
    rank, _ = _rank_world()
    res: dict[str, Any] = dict(id=case["id"], rank=rank, error=None)
    try:
        model, x, y, loss_fn, splits = build(case["model"])
        ref = copy.deepcopy(model)
        ref_loss = sum(loss_fn(ref(xs), ys) / M for xs, ys in zip(x.chunk(M), y.chunk(M)))
        ref_loss.backward()
        stages = 2 * (facts(case["schedule"]).fixed_stages_per_rank
                      if facts(case["schedule"]).v_placement else 1)
        pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule=case["schedule"],
                             num_microbatches=M, split_points=splits[stages],
                             group=group, timeout=timeout,
                             compile=case["compile"])
        loss = pipe.step(x, target=y)
        tol = TOL[case["compile"]]
        res["loss"] = float(loss)
        res["functional"] = pipe.inspect().fallback_reason
        res["loss_diff"] = _diff(loss.reshape(()), ref_loss.detach(), *tol)
        res.update(_compare_grads(pipe.named_parameters(), model, ref, tol))
        res["grad_values"] = {n: p.grad.flatten()[:8].tolist() for n, p in pipe.named_parameters()
                              if p.grad is not None}
        ref_buffers = dict(ref.named_buffers())
        res["buffers"] = {n: _diff(b.float(), ref_buffers[n].float(), *tol)
                          for n, b in pipe.named_buffers()}
    except Exception:
        res["error"] = _error_text()
    return res


def grid(cases: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
    return pipeline_worker.grid(cases, timeout, task="models", run=run_case)
