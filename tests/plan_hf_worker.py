"""Ranks of tests/test_plan_hf.py: ``mpmd.plan`` and ``pipeline(plan=...)`` on
tiny Hugging Face causal LMs of different module layouts, 2 gloo ranks.

Per architecture (``build``; "moe_list" is a user-written mixture of
experts with an ``nn.ModuleList`` of experts per block, "sequential" a
model whose blocks are an ``nn.Sequential``): the model (seeded
alike on every rank and for the reference), its units (``find_units``), a
plan (profiled into a fresh cache directory, with the keyword input
``use_cache=False``), a pipeline with that plan, and two training steps
with an SGD step between, each against one process: the loss and the
gradient of every parameter the rank holds (a missing one is a failure).
A case may narrow the search (``schedules``, ``num_microbatches``), plan
with ``plan="auto"`` (``auto``), recompute every stage (``recompute``),
or pass a padded batch's ``attention_mask`` (``mask``).
"""

from __future__ import annotations

import collections
import dataclasses
import shutil
from typing import Any

import torch
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid
from plan_worker import _MADE, _cache, _diff  # one cache per case; <= 1: within tolerance
from torch_mpmd.planning import profile as profiling

V = 64
# Width 32, 4 heads of 8, 2 key/value heads where the model has them.
_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def _config(arch: str, layers: int) -> tuple[Any, Any]:
    """(model class, config) of a tiny ``arch``, dropout off everywhere."""
    import transformers as tf

    c = dict(_COMMON, num_hidden_layers=layers)
    if arch == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**c, bos_token_id=0, eos_token_id=0)
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**c, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**c, head_dim=8)
    if arch == "mistral":
        return tf.MistralForCausalLM, tf.MistralConfig(**c, sliding_window=None)
    if arch == "phi3":
        return tf.Phi3ForCausalLM, tf.Phi3Config(**c, pad_token_id=0, bos_token_id=0,
                                                 eos_token_id=0)
    if arch == "gemma2":  # soft-capped attention and logits, tied embeddings
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **c, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0)
    if arch == "gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**c, head_dim=8, sliding_window=4)
    if arch == "olmo2":
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**c, pad_token_id=0, bos_token_id=0,
                                                   eos_token_id=0)
    if arch == "stablelm":
        return tf.StableLmForCausalLM, tf.StableLmConfig(**c)
    if arch == "gpt_neox":  # gpt_neox.layers, embed_out
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5)
    if arch == "opt":  # model.decoder.layers, tied embeddings, learned positions
        return tf.OPTForCausalLM, tf.OPTConfig(
            vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
            pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if arch == "gpt2":  # transformer.h, tied embeddings, Conv1D
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if arch == "falcon":
        return tf.FalconForCausalLM, tf.FalconConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    if arch == "bloom":  # ALiBi, word_embeddings_layernorm before the blocks
        return tf.BloomForCausalLM, tf.BloomConfig(
            vocab_size=V, hidden_size=32, n_layer=layers, n_head=4, hidden_dropout=0.0,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    raise ValueError(f"unknown architecture {arch!r}")


class _Expert(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(h)))


class _MoEBlock(torch.nn.Module):
    """A norm, a mixing projection and a dense mixture of 8 experts, each in
    an ``nn.ModuleList`` (the layout of transformers 4's Mixtral and
    Qwen-MoE, and of MoEs users write): more experts per block than blocks."""

    def __init__(self, d: int, experts: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mix = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(_Expert(d) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.mix(self.norm(h))
        weights = self.gate(h).softmax(-1)
        return h + sum(weights[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))


_Output = collections.namedtuple("_Output", "logits")


class TinyMoE(torch.nn.Module):
    """model.embed_tokens, model.layers (blocks of 8 experts), model.norm,
    lm_head; returns its logits as ``.logits`` like Hugging Face's models."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(V, 32)
        self.model.layers = torch.nn.ModuleList(_MoEBlock(32) for _ in range(layers))
        self.model.norm = torch.nn.LayerNorm(32)
        self.lm_head = torch.nn.Linear(32, V, bias=False)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        return _Output(self.lm_head(self.model.norm(h)))


class _SeqBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class TinySequential(torch.nn.Module):
    """Blocks in an ``nn.Sequential`` (as timm's ViT holds them) and a head
    that is a longer ``nn.Sequential`` of few parameters; no ModuleList."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, 32)
        self.blocks = torch.nn.Sequential(*(_SeqBlock(32) for _ in range(layers)))
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 8),
                                        torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.GELU(),
                                        torch.nn.Linear(8, V))

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        return _Output(self.head(self.blocks(self.embed(input_ids))))


def build(arch: str, layers: int = 2) -> torch.nn.Module:
    if arch in ("moe_list", "sequential"):
        torch.manual_seed(0)
        return (TinyMoE if arch == "moe_list" else TinySequential)(layers)
    cls, cfg = _config(arch, layers)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg)


def hf_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _abs(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    return float((got.detach().double() - want.detach().double()).abs().max())


def _batch(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (case.get("batch", 8), case.get("seq", 8))
    return torch.randint(0, V, shape, generator=g), torch.randint(0, V, shape, generator=g)


def arch(case: dict[str, Any]) -> dict[str, Any]:
    name, layers = case["arch"], case.get("layers", 2)
    cache = _cache()
    x, y = _batch(case)
    model, ref = build(name, layers), build(name, layers)
    res: dict[str, Any] = {"units_found": profiling.find_units(model)}
    kw: dict[str, Any] = {"use_cache": False}
    if case.get("mask"):  # a padded batch: row i's first i % 3 positions are padding
        mask = torch.ones_like(x)
        for i in range(x.shape[0]):
            mask[i, :i % 3] = 0
        kw["attention_mask"] = mask
    narrow = {k: case[k] for k in ("schedules", "num_microbatches", "stages_per_rank")
              if k in case}
    if case.get("auto"):  # planned at the first step, the settings beside it kept
        beside = {"num_microbatches": case["num_microbatches"]} \
            if "num_microbatches" in case else {}
        if "schedules" in case:
            beside["schedule"] = case["schedules"][0]
        pipe = mpmd.pipeline(model, loss_fn=hf_loss, plan="auto", **beside)
        plan = None
    else:
        plan = mpmd.plan(model, (x,), kw, loss_fn=hf_loss, target=y, cache_dir=cache,
                         **narrow)
        if case.get("recompute"):  # every stage recomputes its units' activations
            plan = dataclasses.replace(plan, recompute=(True,) * len(plan.recompute))
        pipe = mpmd.pipeline(model, loss_fn=hf_loss, plan=plan)
    opt = None  # (plan="auto": the rank's parameters are known after the first step)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = []
    for _ in range(case.get("steps", 2)):
        ref_opt.zero_grad()
        want = hf_loss(ref(x, **kw), y)
        want.backward()
        got = pipe.step(x, target=y, **kw)
        ref_grads = dict(ref.named_parameters(remove_duplicate=False))
        held = dict(pipe.named_parameters(remove_duplicate=False))
        steps.append({
            "loss": _diff(got, want), "loss_values": [float(got), float(want)],
            "grads": {n: _diff(p.grad, ref_grads[n].grad) for n, p in held.items()},
            "abs": {n: _abs(p.grad, ref_grads[n].grad) for n, p in held.items()}})
        opt = opt or torch.optim.SGD(pipe.parameters(), lr=0.1)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    plan = plan if plan is not None else pipe.config.plan
    res.update(steps=steps, units=[u.name for u in plan.sheet.units] if plan.sheet else None,
               plan=plan.to_dict() | {"search": None}, describe=plan.describe(),
               stages=[pipe.config.schedule, pipe.config.num_microbatches,
                       pipe.config.stages_per_rank, list(pipe.config.split_points)],
               held=sorted(n for n, _ in pipe.named_parameters(remove_duplicate=False)),
               all_params=sorted(n for n, _ in model.named_parameters(remove_duplicate=False)))
    return res


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return run_grid(cases, {"arch": arch})
    finally:
        for path in _MADE:  # rank 0 made them
            shutil.rmtree(path, ignore_errors=True)
