"""Ranks of tests/test_activation_checkpoint.py: activation checkpointing
(torch.utils.checkpoint, non-reentrant) around SDPA attention and dropout,
through the functional stage programs (FX and Inductor) on 2 gloo ranks.

The reference is one eager process over the same microbatches with the same
random numbers: the pipeline seeds each (stage, microbatch) forward with
runner.stage_seed(seed, step, stage, microbatch), so the reference seeds its
stage-0 and stage-1 halves of each microbatch the same way (eager
checkpointing replays the forward's generator state in its recompute, as
the programs must). Each rank also reports where its programs compute the
attention and dropout: F, B, I, W, with the random ops the partitioner
wrapped (``run_and_save_rng_state`` in F, ``run_with_rng_state`` in the
recompute) named by the op they run.
"""

from __future__ import annotations

import collections
import copy
import operator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import pipeline_worker
import torch_mpmd as mpmd
from pipeline_worker import _compare_grads, _diff, _error_text, _rank_world
from torch_mpmd.runtime.runner import _seed_rng, stage_seed

M = 4
SEED = 1234
TOL = {False: (1e-5, 1e-6), True: (1e-4, 1e-5)}


class AttnBlock(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention, with
    dropout on its output (inside the checkpointed region)."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.25) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))


class CheckpointedAttention(nn.Module):
    """Two attention blocks, each under torch.utils.checkpoint."""

    def __init__(self, d: int = 16, n: int = 2, p: float = 0.25) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AttnBlock(d, p=p) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _reference(model: CheckpointedAttention, x: torch.Tensor, y: torch.Tensor
               ) -> torch.Tensor:
    """One process, microbatch by microbatch, each stage's half under the
    pipeline's seed for it (split at layers.1: stage 0 = layers.0)."""
    loss = 0.0
    for mb, (xs, ys) in enumerate(zip(x.chunk(M), y.chunk(M))):
        h = xs
        for stage, layer in enumerate(model.layers):
            _seed_rng(stage_seed(SEED, 0, stage, mb))
            h = checkpoint(layer, h, use_reentrant=False)
        loss = loss + F.mse_loss(h, ys) / M
    return loss


def _op_name(node: torch.fx.Node) -> str:
    name = str(node.target)
    if name in ("run_and_save_rng_state", "run_with_rng_state"):
        inner = node.args[0] if name == "run_and_save_rng_state" else node.args[1]
        return f"{name}({inner})"
    return name


def program_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The ops a program computes, a random op the partitioner wrapped named
    with the op it runs (getitem left out)."""
    return dict(collections.Counter(
        _op_name(n) for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem))


def _hf_qwen3() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    import transformers

    from models_worker import HFLogits

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    lm = transformers.Qwen3ForCausalLM(cfg)
    assert lm.config._attn_implementation == "sdpa", lm.config._attn_implementation
    lm.gradient_checkpointing_enable()
    lm.train()
    g = torch.Generator().manual_seed(1)
    return (HFLogits(lm), torch.randint(0, 64, (8, 8), generator=g),
            torch.randint(0, 64, (8, 8), generator=g))


def run_case(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    rank, _ = _rank_world()
    res: dict[str, Any] = dict(id=case["id"], rank=rank, error=None)
    try:
        compile_ = case["compile"]
        tol = TOL[compile_]
        if case["model"] == "attention":
            torch.manual_seed(0)
            model = CheckpointedAttention()
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 6, 16, generator=g), torch.randn(8, 6, 16, generator=g)
            ref = copy.deepcopy(model)
            ref_loss = _reference(ref, x, y)
            with torch.no_grad():  # dropout off: the step's loss must differ from it
                res["eval_loss"] = float(sum(F.mse_loss(copy.deepcopy(model).eval()(xs), ys) / M
                                             for xs, ys in zip(x.chunk(M), y.chunk(M))))
            loss_fn, split = F.mse_loss, ["layers.1"]
        else:
            model, x, y = _hf_qwen3()
            ref = copy.deepcopy(model)
            from models_worker import lm_loss

            loss_fn, split = lm_loss, ["lm.model.layers.1"]
            ref_loss = sum(loss_fn(ref(xs), ys) / M for xs, ys in zip(x.chunk(M), y.chunk(M)))
        ref_loss.backward()
        pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule=case["schedule"],
                             num_microbatches=M, split_points=split, group=group,
                             timeout=timeout, compile=compile_, seed=SEED)
        loss = pipe.step(x, target=y)
        view = pipe.inspect()
        res["functional"] = view.fallback_reason
        res["loss"] = float(loss)
        res["loss_diff"] = _diff(loss.reshape(()), ref_loss.detach(), *tol)
        res.update(_compare_grads(pipe.named_parameters(), model, ref, tol))
        res["all_params"] = sorted(n for n, _ in model.named_parameters())
        res["programs"] = {str(s): {k: program_ops(gm) for k, gm in prog.graphs.items()}
                           for s, prog in view.programs.items()}
    except Exception:
        res["error"] = _error_text()
    return res


def grid(cases: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
    return pipeline_worker.grid(cases, timeout, task="ac", run=run_case)
