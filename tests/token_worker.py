"""Ranks of tests/test_token_weighted.py: a token-weighted loss (``loss_fn``
returns ``(sum of token losses, token count)``) against one process computing
the token mean of the whole batch.

A small language model (embedding, four tanh layers, head) on token batches
whose labels mask a different number of positions per sample (-100), so the
microbatches count different numbers of tokens and a mean of per-microbatch
means would differ from the token mean. Per case: a step (loss and every
gradient against one process), the same step again without zero_grad (the
gradients double: what the first held is kept), and eval_step's loss. With
``dp=2`` (4 ranks, a ("dp", "pp") mesh) each replica steps on its own batch
and the reference is the token mean over both.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid
from optim_replay import full

V, D, BATCH, SEQ, M = 32, 16, 8, 6, 4
RTOL, ATOL = 1e-5, 1e-6


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    return total, (labels != -100).sum()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (BATCH, SEQ), generator=g)
    y = torch.randint(0, V, (BATCH, SEQ), generator=g)
    for i in range(BATCH):  # sample i keeps (i * 5 + seed) % SEQ + 1 labelled positions
        keep = (i * 5 + seed) % SEQ + 1
        y[i, keep:] = -100
    return x, y


def reference_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    total = sum(token_loss(model(x), y)[0] for x, y in batches)
    count = sum(int((y != -100).sum()) for _, y in batches)
    return total / count


def _diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| scaled so that <= 1 is within tolerance; inf when missing."""
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    got, want = got.detach().double(), want.detach().double()
    return float(((got - want).abs() / (ATOL + RTOL * want.abs())).max())


def train(case: dict[str, Any]) -> dict[str, Any]:
    dp = case.get("dp", 1)
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp),
                                mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else 0
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    batches = [batch(seed) for seed in range(1, dp + 1)]
    want = reference_loss(ref, batches)
    want.backward()
    splits = ["layers.2"] if case.get("spr", 1) == 1 else ["layers.1", "layers.2", "layers.3"]
    pipe = mpmd.pipeline(model, loss_fn=token_loss, schedule=case["schedule"],
                         num_microbatches=M, split_points=splits, mesh=mesh,
                         compile=case.get("compile", False),
                         data_parallel=case.get("data_parallel", "replicate"))
    x, y = batches[dp_rank]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    res: dict[str, Any] = {"local": [n for n, _ in pipe.named_parameters()]}
    loss = pipe.step(x, target=y)
    res["loss"] = _diff(loss, want)
    res["grads"] = {n: _diff(full(p.grad), ref_grads[n]) for n, p in pipe.named_parameters()}
    pipe.step(x, target=y)  # no zero_grad: the first step's gradients are kept
    res["accumulated"] = {n: _diff(full(p.grad), 2 * ref_grads[n])
                          for n, p in pipe.named_parameters()}
    res["functional"] = pipe.inspect().uses_programs
    with torch.no_grad():
        res["eval"] = _diff(pipe.eval_step(x, target=y), want)
    return res


def errors(case: dict[str, Any]) -> dict[str, Any]:
    """A count below zero, and scalars and pairs mixed in one step: each a
    ValueError on every rank."""
    out: dict[str, Any] = {}
    x, y = batch(1)
    for name, loss_fn in (
            ("negative", lambda o, t: (token_loss(o, t)[0], -1)),
            ("mixed", lambda o, t: token_loss(o, t) if int(t[0, 0]) % 2 else
             token_loss(o, t)[0])):
        torch.manual_seed(0)
        pipe = mpmd.pipeline(LM(), loss_fn=loss_fn, schedule="1f1b", num_microbatches=M,
                             split_points=["layers.2"], timeout=30)
        yy = y.clone()
        yy[:, 0] = torch.arange(BATCH) // 2  # microbatch k's first label: k (mixed: odd ones pairs)
        try:
            pipe.step(x, target=yy)
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _packed_result(pipe: Any, ref: nn.Module, rows: int, loss: torch.Tensor,
                   total: torch.Tensor, count: int) -> dict[str, Any]:
    """A packed step against the documents one by one (``total / count``, the
    reference's gradients)."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"local": [n for n, _ in pipe.named_parameters()], "rows": rows,
            "all": [n for n, _ in ref.named_parameters()],
            "loss": _diff(loss, total / count), "tokens": [pipe.last_token_count, count],
            "grads": {n: _diff(full(p.grad), ref_grads[n]) for n, p in pipe.named_parameters()},
            "functional": pipe.inspect().uses_programs}


def tiny_gpt_and_documents() -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """The example GPT (4 layers of width 16, seeded), a copy of it for the
    reference, and ten documents of 2 to 12 tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=4, n_head=2, d_model=16))
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, V, (n,), generator=g) for n in (5, 9, 3, 7, 12, 2, 6, 4, 11, 5)]
    return model, copy.deepcopy(model), docs


def packed(case: dict[str, Any]) -> dict[str, Any]:
    """Documents of many lengths packed into rows (mpmd.pack), the example
    GPT attending within each document (its document_ids mask), a
    token-weighted loss: the step equals the documents run one by one in one
    process (loss over all their tokens, every gradient)."""
    model, ref, docs = tiny_gpt_and_documents()
    rows = mpmd.pack(docs, tokens_per_microbatch=16)
    batch_ = rows.batch(16)
    total = sum(F.cross_entropy(ref(d[None, :-1])[0], d[1:], reduction="sum") for d in docs)
    count = sum(len(d) - 1 for d in docs)
    (total / count).backward()
    spr = case.get("spr", 1)
    splits = ["blocks.2"] if spr == 1 else ["blocks.1", "blocks.2", "blocks.3"]
    pipe = mpmd.pipeline(model, loss_fn=token_loss, schedule=case["schedule"],
                         num_microbatches=len(rows), split_points=splits,
                         compile=case.get("compile", False))
    loss = pipe.step(batch_["input_ids"], position_ids=batch_["position_ids"],
                     document_ids=batch_["document_ids"], target=batch_["labels"])
    return _packed_result(pipe, ref, len(rows), loss, total, count)


def tiny_llama() -> nn.Module:
    """A four-layer Hugging Face Llama of width 32 (vocabulary 64), seeded."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def packed_hf(case: dict[str, Any]) -> dict[str, Any]:
    """The same documents packed for a Hugging Face Llama: its position_ids
    restart per document and a 4-D attention mask (mpmd.document_mask) keeps
    each document to itself; the step equals the documents one by one."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 64, (n,), generator=g) for n in (5, 9, 3, 7, 12, 2, 6, 4, 11, 5)]
    rows = mpmd.pack(docs, tokens_per_microbatch=16)
    batch_ = rows.batch(16)
    total = sum(F.cross_entropy(ref(input_ids=d[None, :-1], use_cache=False).logits[0], d[1:],
                                reduction="sum") for d in docs)
    count = sum(len(d) - 1 for d in docs)
    (total / count).backward()

    def loss_fn(out: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss(out.logits, labels)

    pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule=case["schedule"],
                         num_microbatches=len(rows), split_points=["model.layers.2"])
    loss = pipe.step(input_ids=batch_["input_ids"], position_ids=batch_["position_ids"],
                     attention_mask=mpmd.document_mask(batch_["document_ids"]),
                     use_cache=False, target=batch_["labels"])
    return _packed_result(pipe, ref, len(rows), loss, total, count)


HANDLERS = {"train": train, "errors": errors, "packed": packed, "packed_hf": packed_hf}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, HANDLERS)
