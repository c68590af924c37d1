"""Functions run inside the ranks of tests/test_training_loop.py (dist_harness).

Each case builds a model, steps a pipeline on it and the same model in one
process, and reports numbers (differences, norms, which errors were raised)
for the pytest side to check. Every case runs on its own process group (a
failed case leaves nothing the next one could receive) and catches its own
errors, so one failure does not hide the others.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import models
import torch_mpmd as mpmd
from pipeline_worker import _drop_group, _error_text, _fresh_group, _rank_world

SPLIT = ["blocks.1"]  # CharGPT over 2 stages: wte on stage 0, the tied lm_head on stage 1


def lm(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return models.CharGPT(vocab=32, d=16, n_layer=2, n_head=2, block_size=8)


def tokens(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (n, 8), generator=g), torch.randint(0, 32, (n, 8), generator=g)


def max_diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """Largest absolute difference (inf when one side is missing)."""
    if got is None or want is None or got.shape != want.shape:
        return math.inf
    return float((got.detach().double() - want.detach().double()).abs().max())


def output_diff(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """max |got - want| relative to want's largest magnitude (absolute where that
    is under 1): logits near 0 are sums of terms as large as the others and
    carry their rounding (microbatched matmuls sum in another order; 1 ulp of
    a logit of 17 is 1.9e-6)."""
    return max_diff(got, want) / max(float(want.abs().max()), 1.0)


def grad_diff(pipe: mpmd.Pipeline, ref: nn.Module) -> float:
    want = dict(ref.named_parameters())
    return max(max_diff(p.grad, want[n].grad) for n, p in pipe.named_parameters())


def raised(fn: Callable[[], Any]) -> dict[str, Any]:
    """The exception ``fn`` raised (type and first line) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"type": type(e).__name__, "message": str(e).splitlines()[0],
                "seconds": time.monotonic() - t0}
    return {"type": None, "message": "", "seconds": time.monotonic() - t0}


def run_cases(cases: dict[str, Callable[[Any], dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": _rank_world()[0]}
    for name, case in cases.items():
        group = _fresh_group()
        try:
            out[name] = case(group)
        except Exception:  # noqa: BLE001  (reported to the test)
            out[name] = {"error": _error_text()}
        finally:
            _drop_group(group)
    return out


# ------------------------------------------------------------------ clip, eval, outputs


def clip_and_eval(group: Any = None, mesh: Any = None) -> dict[str, Any]:
    """Step, clip (2-norm, then inf-norm), eval_step (train and eval mode) of a
    tied GPT against one process on the whole batch; with ``mesh`` each dp
    replica steps on its half of the batch."""
    dp = mesh.size(0) if mesh is not None else 1
    share = slice(None)
    if mesh is not None:
        k = mesh.get_local_rank("dp")
        share = slice(8 // dp * k, 8 // dp * (k + 1))
    model = gpt()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=lm, num_microbatches=2, split_points=SPLIT,
                         group=None if mesh is not None else group, mesh=mesh)
    x, y = tokens(1)
    res: dict[str, Any] = {}
    loss = pipe.step(x[share], target=y[share])
    ref_loss = lm(ref(x), y)
    ref_loss.backward()
    res["loss"] = max_diff(loss, ref_loss)
    res["grads"] = grad_diff(pipe, ref)

    norm = pipe.clip_grad_norm_(0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    res["norm"], res["norm_value"], res["ref_norm"] = (max_diff(norm, ref_norm), float(norm),
                                                        float(ref_norm))
    res["clipped_grads"] = grad_diff(pipe, ref)
    inf_norm = pipe.clip_grad_norm_(0.01, norm_type=math.inf)
    ref_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=math.inf)
    res["inf_norm"], res["inf_norm_value"] = max_diff(inf_norm, ref_inf), float(inf_norm)
    res["inf_clipped_grads"] = grad_diff(pipe, ref)

    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    xe, ye = tokens(2)
    train_eval = pipe.eval_step(xe[share], target=ye[share])
    pipe.eval()
    eval_eval = pipe.eval_step(xe[share], target=ye[share])
    pipe.train()
    ref.eval()
    with torch.no_grad():
        ref_eval = lm(ref(xe), ye)
    res["eval_train_mode"] = max_diff(train_eval, ref_eval)
    res["eval_eval_mode"] = max_diff(eval_eval, ref_eval)
    res["eval_kept_grads"] = all(torch.equal(p.grad, before[n])
                                 for n, p in pipe.named_parameters())
    res["eval_requires_grad"] = eval_eval.requires_grad
    return res


def nonfinite_norm(group: Any) -> dict[str, Any]:
    """A nan gradient on the last stage's rank only: every rank sees a nan norm
    and, with error_if_nonfinite, every rank raises."""
    model = gpt()
    pipe = mpmd.pipeline(model, loss_fn=lm, num_microbatches=2, split_points=SPLIT, group=group)
    x, y = tokens(1)
    pipe.step(x, target=y)
    if pipe.rank == pipe.pp_size - 1:
        pipe.ln_f.weight.grad[0] = math.nan
    err = raised(lambda: pipe.clip_grad_norm_(1.0, error_if_nonfinite=True))
    norm = pipe.clip_grad_norm_(1.0)
    return {"raised": err["type"], "norm_is_nan": bool(torch.isnan(norm)),
            "grads_nan": all(bool(torch.isnan(p.grad).all()) for p in pipe.parameters()
                             if p.grad is not None)}


def outputs_and_errors(group: Any) -> dict[str, Any]:
    """output_rank, step under no_grad, target with loss_fn=None, an empty batch:
    the errors come on every rank before any transfer (the pipeline steps
    normally afterwards)."""
    model = gpt()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=lm, num_microbatches=2, split_points=SPLIT, group=group)
    x, y = tokens(1)
    with torch.no_grad():
        want = ref(x)
    res: dict[str, Any] = {}
    for where in (None, 0, 1):
        out = pipe(x, output_rank=where)
        res[f"output_{where}"] = None if out is None else output_diff(out, want)
    with torch.no_grad():
        res["no_grad_step"] = raised(lambda: pipe.step(x, target=y))
    res["bad_output_rank"] = raised(lambda: pipe(x, output_rank=2))["type"]
    res["empty_batch"] = raised(lambda: pipe.step(x[:0], target=y[:0]))
    no_loss = mpmd.pipeline(copy.deepcopy(ref), num_microbatches=2, split_points=SPLIT,
                            group=group)
    res["target_without_loss_fn"] = raised(lambda: no_loss.step(x, target=y))
    res["eval_target_without_loss_fn"] = raised(lambda: no_loss.eval_step(x, target=y))["type"]
    loss = pipe.step(x, target=y)  # still in step with the other ranks
    ref_loss = lm(ref(x), y)
    ref_loss.backward()
    res["loss_after_errors"] = max_diff(loss, ref_loss)
    res["grads_after_errors"] = grad_diff(pipe, ref)
    return res


# ------------------------------------------------------------------ the model's own loss


@dataclasses.dataclass
class LossAndLogits:
    loss: torch.Tensor
    logits: torch.Tensor


pytree.register_dataclass(LossAndLogits)  # (Dynamo returns what pytree can flatten)


class LogitsAndLoss(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


class LossInOutput(nn.Module):
    """Two stages; returns its loss given ``labels``, in a container of ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        mpmd.stage_boundary()
        logits = self.b(h)
        loss = F.mse_loss(logits, labels)
        if self.kind == "dict":
            return {"logits": logits, "loss": loss}
        if self.kind == "dataclass":
            return LossAndLogits(loss, logits)
        if self.kind == "namedtuple":
            return LogitsAndLoss(logits, loss)
        return loss


def _hf_gpt2() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


def model_loss(group: Any, kind: str) -> dict[str, Any]:
    """loss_fn=None, labels= as a keyword: step's loss and gradients (the
    functional programs' loss) and eval_step's (the autograd runner's) equal
    one process's."""
    torch.manual_seed(0)
    if kind == "hf_gpt2":
        model = _hf_gpt2()
        split = ["transformer.h.1"]
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 32, (8, 8), generator=g)
        labels = torch.randint(0, 32, (8, 8), generator=g)
    else:
        model = LossInOutput(kind)
        split = None
        x, labels = torch.randn(8, 8), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, num_microbatches=2, split_points=split, group=group)
    loss = pipe.step(x, labels=labels)

    def ref_loss(out: Any) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else (
            out["loss"] if isinstance(out, dict) else out.loss)

    # The reference in microbatches too: HF's loss is a mean over each chunk's tokens.
    want = sum(ref_loss(ref(xc, labels=lc)) for xc, lc in zip(x.chunk(2), labels.chunk(2))) / 2
    want.backward()
    return {"loss": max_diff(loss, want), "grads": grad_diff(pipe, ref),
            "eval": max_diff(pipe.eval_step(x, labels=labels), want),
            "functional": pipe.inspect().uses_programs}


# ------------------------------------------------------------------ optimizers, inputs


def optimizer_before_capture(group: Any) -> dict[str, Any]:
    """AdamW built from pipe.parameters() before the first step (the whole
    module's): after 3 steps with global clipping, the parameters of other
    ranks' stages are untouched (no .grad), this rank's equal one process's."""
    model = gpt()
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe = mpmd.pipeline(model, loss_fn=lm, num_microbatches=2, split_points=SPLIT, group=group)
    listed_before = len(list(pipe.parameters()))
    # eps 1e-6, not 1e-8: the attention's key bias has a zero gradient up to
    # rounding (softmax ignores a shift), which Adam would scale up to lr-sized
    # steps of noise that differ with the order of the sums.
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    norm_diffs = []
    for seed in range(3):
        x, y = tokens(seed)
        pipe.step(x, target=y)
        norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        lm(ref(x), y).backward()
        norm_diffs.append(max_diff(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        ref_opt.step()
        ref_opt.zero_grad()
    local = dict(pipe.named_parameters())
    want = dict(ref.named_parameters())
    others = {n: p for n, p in model.named_parameters() if n not in local}
    return {
        "listed_before": listed_before, "listed_after": len(list(pipe.parameters())),
        "all": len(list(model.parameters())),
        "others": sorted(others),
        "others_unchanged": all(torch.equal(p, initial[n]) for n, p in others.items()),
        "others_grad_none": all(p.grad is None for p in others.values()),
        "local": max(max_diff(p, want[n]) for n, p in local.items()),
        "local_moved": min(max_diff(p, initial[n]) for n, p in local.items()),
        "norms": max(norm_diffs),
    }


class WritesItsInput(nn.Module):
    """Doubles its input in place before the first layer; the second stage
    reads the doubled input too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = torch.tanh(self.a(x))
        mpmd.stage_boundary()
        return self.b(h) + x


def in_place_input(group: Any, autograd: bool) -> dict[str, Any]:
    """num_microbatches=4 (chunk() views of one batch): trains as in eager, on
    the functional programs or (a gradient hook on a parameter) the autograd
    runner."""
    torch.manual_seed(0)
    model = WritesItsInput()
    ref = copy.deepcopy(model)
    if autograd:
        model.a.weight.register_hook(lambda g: g)
        model.b.weight.register_hook(lambda g: g)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=4, group=group)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    loss = pipe.step(x.clone(), target=y)
    ref_loss = F.mse_loss(ref(x.clone()), y)
    ref_loss.backward()
    return {"loss": max_diff(loss, ref_loss), "grads": grad_diff(pipe, ref),
            "functional": pipe.inspect().uses_programs}


# ------------------------------------------------------------------ launches


def two_ranks() -> dict[str, Any]:
    return run_cases({
        "clip_and_eval": clip_and_eval,
        "nonfinite": nonfinite_norm,
        "outputs_and_errors": outputs_and_errors,
        "optimizer": optimizer_before_capture,
        **{f"model_loss_{kind}": (lambda grp, kind=kind: model_loss(grp, kind))
           for kind in ("scalar", "dict", "dataclass", "namedtuple", "hf_gpt2")},
        "in_place_functional": lambda grp: in_place_input(grp, autograd=False),
        "in_place_autograd": lambda grp: in_place_input(grp, autograd=True),
    })


def data_parallel() -> dict[str, Any]:
    """dp=2 x pp=2 on 4 ranks: the norm counts each replica's averaged gradient once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out: dict[str, Any] = {"rank": dist.get_rank()}
    try:
        out["clip_and_eval"] = clip_and_eval(mesh=mesh)
    except Exception:  # noqa: BLE001  (reported to the test)
        out["clip_and_eval"] = {"error": _error_text()}
    return out

