"""Ranks of tests/test_hf_calls.py: Hugging Face models called as users call
them (graph/hf.py). A tiny MoE causal LM (Mixtral, Qwen2-MoE) with
``output_router_logits=True``, trained with its own loss (cross entropy plus
the load-balancing loss, ``loss_fn=None``) and without ``use_cache=False``,
on 2 gloo ranks, through ``pipeline()`` and through
``torch.compile(backend="mpmd")``, against the same model in eager PyTorch
on the same microbatches: the loss and every gradient."""

from __future__ import annotations

import copy
from typing import Any

import torch

import torch_mpmd as mpmd
from dist_harness import run_grid

RTOL, ATOL = 1e-5, 1e-6


def _model(name: str) -> torch.nn.Module:
    import transformers as tf

    config = getattr(tf, f"{name}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, output_router_logits=True,
        num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, router_aux_loss_coef=0.1)
    assert config.use_cache  # the default a user leaves alone
    torch.manual_seed(0)
    return getattr(tf, f"{name}ForCausalLM")(config)


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


def moe_aux_loss(case: dict[str, Any]) -> dict[str, Any]:
    model = _model(case["model"])
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=None, schedule=case["schedule"], num_microbatches=2,
                         split_points=["model.layers.1"], timeout=60)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = pipe.step(input_ids=ids, labels=ids)
    outs = [ref(input_ids=c, labels=c, use_cache=False) for c in ids.chunk(2)]
    want = sum(o.loss for o in outs) / 2
    want.backward()
    ref_params = dict(ref.named_parameters())
    return {"loss": _diff(loss.reshape(()), want.detach()),
            "aux": float(sum(o.aux_loss for o in outs)),
            "grads": {n: _diff(p.grad, ref_params[n].grad) for n, p in pipe.named_parameters()}}


def moe_aux_loss_door(case: dict[str, Any]) -> dict[str, Any]:
    """The same model and loss through the compile door: the compiled function
    returns ``model(input_ids=ids, labels=ids).loss`` (the router's loss
    included); ``loss.backward()`` fills this rank's parameters' gradients."""
    model = _model(case["model"])
    ref = copy.deepcopy(model)
    options = dict(schedule=case["schedule"], num_microbatches=2,
                   split_points=["model.layers.1"], timeout=60)

    @torch.compile(backend="mpmd", options=options)
    def train_loss(ids):
        return model(input_ids=ids, labels=ids).loss

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = train_loss(ids)  # its first forward installs the recorders, as eager's does
    loss.backward()
    outs = [ref(input_ids=c, labels=c, use_cache=False) for c in ids.chunk(2)]
    want = sum(o.loss for o in outs) / 2
    want.backward()
    ref_params = dict(ref.named_parameters())
    owned = {n for n, _ in mpmd.pipeline_of(train_loss).named_parameters(remove_duplicate=False)}
    grads = {n: _diff(p.grad, ref_params[n].grad) for n, p in model.named_parameters()
             if n in owned}
    # A gradient on a parameter this rank does not hold is a failure too.
    grads.update({n: float("inf") for n, p in model.named_parameters()
                  if n not in owned and p.grad is not None})
    return {"loss": _diff(loss.detach().reshape(()), want.detach()),
            "aux": float(sum(o.aux_loss for o in outs)), "grads": grads}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, {"moe_aux_loss": moe_aux_loss, "moe_aux_loss_door": moe_aux_loss_door})
