"""Ranks of tests/test_compile_door.py: ``torch.compile(fn, backend="mpmd")``
as a user writes it, the loss inside the compiled function.

Each case compiles ``train_loss(x, y)`` (or a variant) over a model held in
its closure, calls it on the batch, calls ``backward()`` on the result and
reports the loss and every local gradient against one eager process on the
full batch (mean-reduced losses over equal microbatches: the same loss and
gradients). Results are per rank; the test checks every rank.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipeline_worker
from pipeline_worker import _diff, _error_text, _rank_world

TOL = (1e-5, 1e-6)
BATCH = 8
LAYERS = {"hf_gpt2": "transformer.h", "hf_llama": "model.layers", "hf_mistral": "model.layers",
          "hf_qwen2": "model.layers", "hf_qwen2_tied": "model.layers",
          "hf_llama_tied": "model.layers"}


class ScaledMLP(nn.Module):
    """Reads a plain tensor attribute shaped like a small batch (not an input)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.scale = torch.tensor([[1.0], [2.0]])  # an attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = (h.view(-1, 2, h.shape[-1]) * self.scale).flatten(0, 1)
        return self.b(h)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name in ("gpt", "skip", "skipnet"):
        return pipeline_worker.build_model(name)
    if name == "scaled":
        return ScaledMLP()
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0)
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                      n_head=4, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "hf_llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if name == "hf_mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    if name in ("hf_qwen2", "hf_qwen2_tied"):
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            tie_word_embeddings=name.endswith("_tied"), **common))
    if name == "hf_llama_tied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            tie_word_embeddings=True, **common))
    raise ValueError(name)


def batch(name: str, size: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name.startswith("hf_") or name == "gpt":
        vocab = 64 if name.startswith("hf_") else 32
        return (torch.randint(0, vocab, (size, 8), generator=g),
                torch.randint(0, vocab, (size, 8), generator=g))
    return torch.randn(size, 16, generator=g), torch.randn(size, 16, generator=g)


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss as a user writes it (what gets compiled)."""
    if name.startswith("hf_"):
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if name == "gpt":
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    if name == "skipnet":
        return pipeline_worker.skipnet_loss(model(x), y)
    return F.mse_loss(model(x), y)


def split_points(name: str, stages: int) -> list[str] | None:
    if name.startswith("hf_"):
        layers = LAYERS[name]
        return {2: [f"{layers}.2"], 4: [f"{layers}.1", f"{layers}.2", f"{layers}.3"]}[stages]
    if name == "skipnet":
        return None  # markers
    if name == "scaled":
        return {2: ["b"]}[stages]
    return pipeline_worker.split_points_for(name, stages)


def _options(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    _, world = _rank_world()
    stages = world * (2 if case["schedule"] in ("zbv", "interleaved_1f1b") else 1)
    opts = dict(schedule=case["schedule"], num_microbatches=case["m"], group=group,
                timeout=timeout)
    sp = split_points(case["model"], stages)
    if sp is not None:
        opts["split_points"] = sp
    opts.update(case.get("options", {}))
    return opts


def _grads(model: nn.Module, ref: nn.Module, scale: float = 1.0, *, fn: Any
           ) -> dict[str, Any]:
    """Every parameter this rank's pipeline (``mpmd.pipeline_of(fn)``) holds
    against the reference's gradient times ``scale`` (a missing gradient is a
    failure), and every other parameter must have none."""
    import torch_mpmd as mpmd

    ref_params = dict(ref.named_parameters())
    owned = {n for n, _ in mpmd.pipeline_of(fn).named_parameters(remove_duplicate=False)}
    out = {n: _diff(p.grad, ref_params[n].grad * scale, *TOL)
           for n, p in model.named_parameters() if n in owned}
    out.update({n: dict(ok=False, max_abs=None, why="a gradient on a rank that does not hold "
                        "the parameter")
                for n, p in model.named_parameters() if n not in owned and p.grad is not None})
    if not owned:
        out["<no parameter on this rank>"] = dict(ok=False, max_abs=None, why="")
    return out


def _logging_ignored():
    # transformers adds Logger.warning_once, which Dynamo would break the graph at.
    once = getattr(logging.Logger, "warning_once", None)
    ignore = torch._dynamo.config.ignore_logging_functions | ({once} if once else set())
    return torch._dynamo.config.patch(ignore_logging_functions=ignore)


def run_case(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    rank, _ = _rank_world()
    res: dict[str, Any] = dict(id=case["id"], rank=rank, error=None)
    try:
        res.update(KINDS[case.get("kind", "train")](case, group, timeout))
    except Exception:
        res["error"] = _error_text()
    return res


def train(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """The five lines: compile forward + loss, call, backward."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = batch(name)
    want = loss_of(name, ref, x, y)
    want.backward()

    @torch.compile(backend="mpmd", options=_options(case, group, timeout))
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    with _logging_ignored():
        loss = train_loss(x, y)
    out = dict(loss=float(loss), loss_diff=_diff(loss.detach(), want.detach(), *TOL),
               requires_grad=loss.requires_grad)
    loss.backward()
    out["grads"] = _grads(model, ref, fn=train_loss)
    out["with_grad"] = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    out["all_params"] = sorted(n for n, _ in model.named_parameters())
    return out


def token_pair(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """A compiled function returning (sum of token losses, token count), the
    labels masking a different number of positions per sample: the call
    returns the batch's sum and count, and (s / n).backward() trains on the
    token mean, as one eager process does."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = batch(name)
    for i in range(y.shape[0]):  # sample i keeps i % 8 + 1 labelled positions
        y[i, i % y.shape[1] + 1:] = -100

    def pair(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        total = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                reduction="sum")
        return total, (y != -100).sum()

    want_sum, want_count = pair(ref, x, y)
    (want_sum / want_count).backward()

    @torch.compile(backend="mpmd", options=_options(case, group, timeout))
    def train_pair(x, y):
        return pair(model, x, y)

    s, n = train_pair(x, y)
    (s / n).backward()
    out = dict(sum=_diff(s.detach(), want_sum.detach(), *TOL),
               count=[int(n), int(want_count), str(n.dtype)],
               grads=_grads(model, ref, fn=train_pair))
    with torch.no_grad():  # validation: the same function, no grad
        s, n = train_pair(x, y)
    out["eval_sum"] = _diff(s, want_sum.detach(), *TOL)
    out["eval_count"] = [int(n), int(want_count), str(n.dtype)]
    import torch_mpmd as mpmd
    out["steps"] = mpmd.pipeline_of(train_pair).step_count  # still the training pipeline's
    return out


def explicit(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """mpmd.over_microbatches: a compiled function (the model passed as an
    argument) called on four microbatches of different lengths, returning
    the mean loss or (sum, count): what one eager process computes over the
    same microbatches, and its gradients."""
    import torch_mpmd as mpmd

    model = build("gpt")
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    mbs = []
    for n in (7, 3, 12, 5):
        x = torch.randint(0, 32, (2, n), generator=g)
        y = torch.randint(0, 32, (2, n), generator=g)
        y[:, -1] = -100
        mbs.append(((model, x, y), {}))
    pair = case["loss"] == "pair"

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        total = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                reduction="sum" if pair else "mean")
        return (total, (y != -100).sum()) if pair else total

    if pair:
        pairs = [loss(ref, x, y) for (_, x, y), _ in mbs]
        want = sum(p[0] for p in pairs) / sum(int(p[1]) for p in pairs)
    else:
        want = sum(loss(ref, x, y) for (_, x, y), _ in mbs) / len(mbs)
    want.backward()
    opts = {**_options(case, group, timeout), "dynamic": True}
    train = torch.compile(loss, backend="mpmd", options=opts)
    out = mpmd.over_microbatches(train, mbs)
    got = out[0] / out[1] if pair else out
    got.backward()
    res = dict(loss=_diff(got.detach(), want.detach(), *TOL), grads=_grads(model, ref, fn=train))
    try:  # a function not compiled with the mpmd backend takes no microbatches
        mpmd.over_microbatches(lambda *a: loss(*a), mbs)
        res["uncompiled"] = None
    except RuntimeError as e:
        res["uncompiled"] = str(e)
    return res


def replaced_parameter(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """A parameter replaced after compiling is what the next call uses."""
    name = case["model"]
    model = build(name)
    x, y = batch(name)

    @torch.compile(backend="mpmd", options=_options(case, group, timeout))
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    train_loss(x, y).backward()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    model.layers[5].weight = nn.Parameter(torch.randn_like(model.layers[5].weight))
    ref = copy.deepcopy(model)
    want = loss_of(name, ref, x, y)
    want.backward()
    loss = train_loss(x, y)
    loss.backward()
    return dict(loss_diff=_diff(loss.detach(), want.detach(), *TOL),
                grads=_grads(model, ref, fn=train_loss),
                with_grad=sorted(n for n, p in model.named_parameters() if p.grad is not None))


def input_grad(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """An input that requires grad gets its gradient on every rank."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = batch(name)
    x_ref = x.clone().requires_grad_(True)
    loss_of(name, ref, x_ref, y).backward()
    x = x.clone().requires_grad_(True)

    @torch.compile(backend="mpmd", options=_options(case, group, timeout))
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    calls: list[str] = []  # the step runs under autograd here: hooks must still run once
    for n, p in model.named_parameters():
        p.register_hook(lambda g, n=n: calls.append(n))
    train_loss(x, y).backward()
    return dict(input_grad=_diff(x.grad, x_ref.grad, *TOL),
                grads=_grads(model, ref, fn=train_loss),
                hook_calls=sorted(calls),
                with_grad=sorted(n for n, p in model.named_parameters() if p.grad is not None))


def autograd_grad(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """torch.autograd.grad, a scaled loss (GradScaler's way) and the sum reduction."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = batch(name)
    want = loss_of(name, ref, x, y)
    want.backward()
    opts = _options(case, group, timeout)

    @torch.compile(backend="mpmd", options=opts)
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    params = [p for p in model.parameters()]
    loss = train_loss(x, y)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    out: dict[str, Any] = dict(
        dot_grad_untouched=all(p.grad is None for p in params),
        autograd=[_diff(g, r.grad, *TOL) for g, r in zip(grads, ref.parameters())
                  if g is not None],
        autograd_count=sum(g is not None for g in grads))
    calls: list[str] = []
    for n, p in model.named_parameters():  # hooks run once, in backward, as in eager
        p.register_hook(lambda g, n=n: calls.append(n))
    (train_loss(x, y) * 3.0).backward()
    out["scaled"] = _grads(model, ref, 3.0, fn=train_loss)
    out["hook_calls"] = sorted(calls)
    out["with_grad"] = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()

    @torch.compile(backend="mpmd", options={**opts, "reduction": "sum"})
    def summed(x, y):
        return loss_of(name, model, x, y)

    total = summed(x, y)
    total.backward()
    out["sum_loss"] = _diff(total.detach(), want.detach() * case["m"], *TOL)
    out["sum_grads"] = _grads(model, ref, float(case["m"]), fn=summed)
    return out


def batch_change(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """A new batch size mid-run (recompiled, or symbolic with dynamic=True):
    every rank captures again in step."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    opts = _options(case, group, timeout)
    dynamic = case.get("dynamic")

    @torch.compile(backend="mpmd", options=opts, dynamic=dynamic)
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    out: dict[str, Any] = {}
    for size in (8, 4, 12, 8):
        x, y = batch(name, size, seed=size)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        want = loss_of(name, ref, x, y)
        want.backward()
        if case.get("mark_dynamic"):
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        loss = train_loss(x, y)
        loss.backward()
        out[f"b{size}"] = dict(loss=_diff(loss.detach(), want.detach(), *TOL),
                               grads=_grads(model, ref, fn=train_loss))
    return out


def forward_only(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """A compiled module without grad: its output on every rank."""
    name = case["model"]
    model = build(name)
    x, _ = batch(name)
    kwargs = {"use_cache": False} if name.startswith("hf_") else {}
    want = model(x, **kwargs)
    compiled = torch.compile(model, backend="mpmd", options=_options(case, group, timeout))
    with torch.no_grad(), _logging_ignored():
        got = compiled(x, **kwargs)
    if name.startswith("hf_"):
        got, want = got.logits, want.logits
    return dict(output=_diff(got, want, *TOL))


KINDS = {"train": train, "replaced_parameter": replaced_parameter, "input_grad": input_grad,
         "autograd_grad": autograd_grad, "batch_change": batch_change,
         "forward_only": forward_only, "token_pair": token_pair, "explicit": explicit}


def grid(cases: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
    return pipeline_worker.grid(cases, timeout, task="door", run=run_case)


def four_ranks() -> dict[str, Any]:
    """On 4 ranks: the door over a ("dp", "pp") mesh of 2 x 2 (each replica on
    its own batch: the loss is the global mean, gradients averaged over dp)
    and over a 4-stage pipeline."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {"rank": dist.get_rank()}
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        dp_rank = mesh.get_local_rank("dp")
        model = build("gpt")
        ref = copy.deepcopy(model)
        batches = [batch("gpt", seed=1 + r) for r in range(2)]
        want = sum(loss_of("gpt", ref, x, y) for x, y in batches) / 2
        want.backward()

        @torch.compile(backend="mpmd", options=dict(schedule="1f1b", num_microbatches=4,
                                                    split_points=["blocks.1"], mesh=mesh))
        def train_loss(x, y):
            return loss_of("gpt", model, x, y)

        x, y = batches[dp_rank]
        x = x.clone()
        loss = train_loss(x, y)
        loss.backward()
        out["dp"] = dict(loss_diff=_diff(loss.detach(), want.detach(), *TOL),
                         grads=_grads(model, ref, fn=train_loss), error=None)
    except Exception:
        out["dp"] = {"error": _error_text()}
    try:
        # A compiled module (outputs, then backward outside): the backward part
        # of the schedule posts the dp reductions and must wait for them.
        torch._dynamo.reset()
        model = build("gpt")
        ref = copy.deepcopy(model)
        want = sum(loss_of("gpt", ref, x, y) for x, y in batches) / 2
        want.backward()
        compiled = torch.compile(model, backend="mpmd", options=dict(
            schedule="1f1b", num_microbatches=4, split_points=["blocks.1"], mesh=mesh))
        x, y = batches[dp_rank]
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        loss.backward()
        out["dp_outputs"] = dict(grads=_grads(model, ref, fn=compiled), error=None,
                                 with_grad=sorted(n for n, p in model.named_parameters()
                                                  if p.grad is not None))
    except Exception:
        out["dp_outputs"] = {"error": _error_text()}
    try:
        torch._dynamo.reset()
        out["dp_shard"] = _sharded_door(mesh, batches, dp_rank)
    except Exception:
        out["dp_shard"] = {"error": _error_text()}
    try:
        torch._dynamo.reset()
        case = dict(model="hf_llama", schedule="1f1b", m=4)
        out["pp4"] = train(case, None, 60.0)  # split points: 4 stages on 4 ranks
        out["pp4"]["error"] = None
    except Exception:
        out["pp4"] = {"error": _error_text()}
    return out


def _sharded_door(mesh: Any, batches: list[Any], dp_rank: int) -> dict[str, Any]:
    """data_parallel="shard" through the door (pp2 x dp2): two training calls
    with an SGD step on the pipeline's DTensor shards between them, against
    one process stepping the whole model on both replicas' batches. The
    second call must run without a recompile (NOTE [Parked parameters]) and
    the module's own parameters hold no memory between calls."""
    from torch.distributed.tensor import DTensor

    import torch_mpmd as mpmd
    from optim_replay import full

    model = build("gpt")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    @torch.compile(backend="mpmd", options=dict(schedule="1f1b", num_microbatches=4,
                                                split_points=["blocks.1"], mesh=mesh,
                                                data_parallel="shard"))
    def train_loss(x, y):
        return loss_of("gpt", model, x, y)

    res: dict[str, Any] = {"error": None, "steps": []}
    x, y = batches[dp_rank]
    opt = None
    for step in range(2):
        want = sum(loss_of("gpt", ref, bx, by) for bx, by in batches) / 2
        want.backward()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        loss = train_loss(x, y)
        loss.backward()
        pipe = mpmd.pipeline_of(train_loss)
        ref_params = dict(ref.named_parameters())
        shards = dict(pipe.named_parameters())
        res["steps"].append(dict(
            loss_diff=_diff(loss.detach(), want.detach(), *TOL),
            # _diff fails a missing gradient (the shard's owner must have one).
            grads={n: _diff(full(p.grad), ref_params[n].grad, *TOL) for n, p in shards.items()},
            dtensors=all(isinstance(p, DTensor) for p in shards.values()),
            new_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
            module_bytes=sum(p.untyped_storage().nbytes() for p in model.parameters()
                             if p.numel() > 1)))
        if opt is None:
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return res


def dynamic_compiled(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """``torch.compile(dynamic=True)`` with Inductor stage programs
    (``options={"compile": True}``) on a Hugging Face model whose loss reads
    the target, an input of the compiled function with sizes of its own (issue
    23): the first call, then new batch and sequence sizes on the same capture."""
    import transformers

    name = case["model"]
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0)
    if name == "hf_qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    elif name == "hf_phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **common))
    else:
        raise ValueError(name)
    ref = copy.deepcopy(model)
    opts = dict(schedule=case["schedule"], num_microbatches=case["m"], group=group,
                timeout=timeout, split_points=["model.layers.1"], compile=True)

    @torch.compile(backend="mpmd", dynamic=True, options=opts)
    def train_loss(x, y):
        return loss_of(name, model, x, y)

    out: dict[str, Any] = {}
    for size, seq in ((8, 8), (12, 6)):
        g = torch.Generator().manual_seed(size)
        x, y = (torch.randint(0, 64, (size, seq), generator=g) for _ in range(2))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        want = loss_of(name, ref, x, y)
        want.backward()
        with _logging_ignored():
            loss = train_loss(x, y)
        loss.backward()
        out[f"b{size}s{seq}"] = dict(loss=_diff(loss.detach(), want.detach(), *TOL),
                                     grads=_grads(model, ref, fn=train_loss),
                                     with_grad=sorted(n for n, p in model.named_parameters()
                                                      if p.grad is not None))
    out["all_params"] = sorted(n for n, _ in model.named_parameters())
    return out


KINDS["dynamic_compiled"] = dynamic_compiled


# ------------------------------------------------------------------ issue 20's door cases


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16))


def _against(model: nn.Module, fn: Any, x: torch.Tensor, y: torch.Tensor,
             call: Any) -> dict[str, Any]:
    """One training call ``call()`` of the compiled ``fn`` on ``model``
    against eager on a copy: loss and every gradient (owners must have one)."""
    ref = copy.deepcopy(model)
    want = F.mse_loss(ref(x), y)
    want.backward()
    model.zero_grad(set_to_none=True)
    loss = call()
    loss.backward()
    return dict(loss_diff=_diff(loss.detach(), want.detach(), *TOL),
                grads=_grads(model, ref, fn=fn))


def factory(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """Two models, each with a training function from one factory (Dynamo
    reuses the graph: the second model's tensors arrive as its inputs), then
    the first again; and one compiled function called with each model as an
    argument. Each call must train its own model."""
    opts = dict(schedule=case["schedule"], num_microbatches=case["m"], group=group,
                timeout=timeout, split_points=["2"])

    def make_step(model: nn.Module) -> Any:
        @torch.compile(backend="mpmd", options=opts)
        def step(x, y):
            return F.mse_loss(model(x), y)
        return step

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    first, second = _mlp(0), _mlp(1)
    steps = {"first": make_step(first), "second": make_step(second)}
    out: dict[str, Any] = {}
    for name, model in (("first", first), ("second", second), ("first_again", first)):
        fn = steps[name.replace("_again", "")]
        out[f"factory_{name}"] = _against(model, fn, x, y, lambda: fn(x, y))

    @torch.compile(backend="mpmd", options=opts)
    def step_of(model, x, y):
        return F.mse_loss(model(x), y)

    for name, model in (("first", _mlp(2)), ("second", _mlp(3))):
        out[f"argument_{name}"] = _against(model, step_of, x, y,
                                           lambda: step_of(model, x, y))
        # pipeline_of() cannot tell which model a function of a model is
        # for: it answers the latest, which _grads relies on here.
    return out


def hf_module(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    """``torch.compile(model, backend="mpmd")`` on a Hugging Face causal LM
    (transformers 5 wraps forward in wrapper(*args, **kwargs)), the loss
    outside: logits on every rank, backward through the schedule."""
    name = case["model"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = batch(name)
    want = F.cross_entropy(ref(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
    want.backward()
    compiled = torch.compile(model, backend="mpmd", options=_options(case, group, timeout))
    with _logging_ignored():
        logits = compiled(input_ids=x, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return dict(loss_diff=_diff(loss.detach(), want.detach(), *TOL),
                grads=_grads(model, ref, fn=compiled))


KINDS["factory"] = factory
KINDS["hf_module"] = hf_module
