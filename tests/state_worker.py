"""Ranks of tests/test_state_guards.py: Python state that forward or loss_fn
reads, changed between steps, is seen by the next step as in eager PyTorch
(NOTE [State guards], NOTE [Loss state]).

A 4-layer MLP split at ``layers.2`` on 2 gloo ranks (1f1b, m=4), stepped
beside an eager copy of itself. Between steps the case changes one value:
a module attribute, a global, a closure cell, a loss module's attribute, a
flag that switches the loss between a scalar and a (sum, count) pair. Every
step reports the pipeline's loss and every held parameter's gradient
against the eager reference (scaled by the tolerance: <= 1 is equal; inf:
no gradient), or what it raised.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid

D, BATCH, M, CLASSES = 8, 8, 4, 8
RTOL, ATOL = 1e-5, 1e-6

SHIFT = 0.0          # a global forward reads
LOSS_SCALE = 1.0     # a global loss_fn reads
TOKEN_WEIGHTED = False


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.temperature = 1.0
        self.use_shift = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        if self.use_shift:
            x = x + SHIFT
        return x / self.temperature


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, D, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _run(changes: list[Callable[[nn.Module], None]], loss_fn: Callable, *,
         ref_loss: Callable[[Any, Any], torch.Tensor] | None = None,
         kwargs: dict | None = None, zero_grad: bool = True) -> dict[str, Any]:
    """One step per entry of ``changes`` (each applied to both models first):
    each step's loss and gradients against eager, or what it raised.
    ``zero_grad``: gradients are zeroed after each step (else they accumulate)."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule="1f1b", num_microbatches=M,
                         split_points=["layers.2"], timeout=60, **(kwargs or {}))
    eager_loss = ref_loss or _mean_of_microbatches(loss_fn)
    steps = []
    for step, change in enumerate(changes):
        change(model)
        change(ref)
        x, y = _batch(step)
        try:
            loss = pipe.step(x, target=y)
        except Exception as e:  # noqa: BLE001  (the test reads what was raised)
            steps.append({"raised": type(e).__name__, "message": str(e)})
            break
        want = eager_loss(ref(x), y)
        want.backward()
        grads = {n: _diff(p.grad, dict(ref.named_parameters())[n].grad)
                 for n, p in pipe.named_parameters()}
        steps.append({"loss": _diff(loss.reshape(()), want.detach()), "grads": grads,
                      "value": float(loss), "eager": float(want)})
        if zero_grad:
            pipe.zero_grad()
            ref.zero_grad()
    return {"steps": steps, "captures": pipe.inspect().captures if pipe.is_captured else 0}


def _mean_of_microbatches(loss_fn: Callable) -> Callable:
    """The eager reference of the loss contract: the mean of the microbatches'
    losses, or a token-weighted pair's global sum over global count."""
    def reference(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        parts = [loss_fn(o, t) for o, t in zip(out.chunk(M), y.chunk(M))]
        if isinstance(parts[0], tuple):
            return sum(p[0] for p in parts) / sum(float(p[1]) for p in parts)
        return sum(parts) / M
    return reference


def _set(**values: Any) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        for name, value in values.items():
            setattr(model, name, value)
    return change


def _set_global(name: str, value: Any) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        globals()[name] = value
    return change


def _keep(model: nn.Module) -> None:
    pass


# ------------------------------------------------------------------ cases


def forward_state(case: dict[str, Any]) -> dict[str, Any]:
    """A module attribute and a global that forward reads, changed between
    steps (and changed back: the first capture serves again)."""
    global SHIFT
    SHIFT = 0.0
    changes = [_keep, _set(temperature=2.0), _set(use_shift=True),
               _set_global("SHIFT", 0.5), _set(temperature=1.0, use_shift=False)]
    return _run(changes, F.cross_entropy, kwargs=case.get("kwargs"))


def loss_state(case: dict[str, Any]) -> dict[str, Any]:
    """A closure cell, a global, a partial's keyword and a loss module's
    attribute, each changed between steps."""
    global LOSS_SCALE
    LOSS_SCALE = 1.0
    which = case["loss"]
    weight = [1.0]
    if which == "closure":
        def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(o, t) * weight[0]

        def change(value: float) -> Callable:
            return lambda m: weight.__setitem__(0, value)
        changes = [_keep, change(0.5), change(0.5), change(2.0)]
    elif which == "global":
        def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(o, t) * LOSS_SCALE
        changes = [_keep, _set_global("LOSS_SCALE", 0.5), _set_global("LOSS_SCALE", 3.0)]
    elif which == "module":  # label_smoothing of nn.CrossEntropyLoss
        loss_fn = nn.CrossEntropyLoss()
        changes = [_keep, lambda m: setattr(loss_fn, "label_smoothing", 0.2),
                   lambda m: setattr(loss_fn, "label_smoothing", 0.0)]
    else:  # a partial whose keywords are edited in place
        loss_fn = functools.partial(F.cross_entropy, label_smoothing=0.0)
        changes = [_keep, lambda m: loss_fn.keywords.__setitem__("label_smoothing", 0.3)]
    return _run(changes, loss_fn)


def _switching_loss(o: torch.Tensor, t: torch.Tensor) -> Any:
    total = F.cross_entropy(o, t, reduction="sum")
    return (total, t.numel()) if TOKEN_WEIGHTED else total / t.numel()


def loss_kind(case: dict[str, Any]) -> dict[str, Any]:
    """A global flag switches loss_fn between a scalar and a (sum, count)
    pair: the step's loss follows the kind loss_fn returns now."""
    global TOKEN_WEIGHTED
    TOKEN_WEIGHTED = False
    changes = [_keep, _set_global("TOKEN_WEIGHTED", True), _set_global("TOKEN_WEIGHTED", False)]
    return _run(changes, _switching_loss, zero_grad=case.get("zero_grad", True))


REFUSE = False


def loss_raises(case: dict[str, Any]) -> dict[str, Any]:
    """A loss_fn that raises from a later step on, as eager PyTorch would run
    it. ``how="flag"``: it raises while a global flag is set (set before the
    third step). ``how="counter"``: it counts its own calls and raises past
    a limit (eager: at the fourth step's first microbatch). Tracing it for the
    last stage's programs calls it too (there the rank learns that it changes
    state, and runs it under autograd from then on), so the counter reaches
    the limit up to a step early; ``calls`` records the count after each step."""
    global REFUSE
    REFUSE = False
    calls = [0]
    counts = []

    def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if case["how"] == "counter":
            calls[0] += 1
            if calls[0] > 3 * M:
                raise RuntimeError(f"loss_fn refuses call {calls[0]}")
        elif REFUSE:
            raise RuntimeError("loss_fn refuses: REFUSE is set")
        return F.cross_entropy(o, t)

    def reference(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        counts.append(calls[0])
        return F.cross_entropy(o, t)  # (eager's microbatch mean: equal microbatches)
    changes = [_keep, _keep, _set_global("REFUSE", True), _keep, _keep]
    out = _run(changes, loss_fn, ref_loss=reference)
    out["calls"] = counts
    out["last_stage"] = dist.get_rank() == dist.get_world_size() - 1
    return out


def counting_forward(case: dict[str, Any]) -> dict[str, Any]:
    """forward changes a value it reads at every call (a counter): the
    pipeline follows it for some calls, then refuses with an error naming it."""
    class Counting(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(x) * (1.0 + 0.0 * self.calls)

    torch.manual_seed(0)
    pipe = mpmd.pipeline(Counting(), loss_fn=F.cross_entropy, schedule="1f1b",
                         num_microbatches=M, split_points=["layers.2"], timeout=60)
    x, y = _batch(0)
    for step in range(12):
        try:
            pipe.step(x, target=y)
        except Exception as e:  # noqa: BLE001
            return {"raised": type(e).__name__, "message": str(e), "at": step}
    return {"raised": None, "at": 12}


class Seq(nn.Module):
    """Per-position layers: inputs (rows, length, D) of any length."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _branching_loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(o, t)
    return loss * 3 if t.shape[1] > 6 else loss


def dynamic_branch(case: dict[str, Any]) -> dict[str, Any]:
    """dynamic=True, explicit microbatches of lengths on both sides of a
    branch on the length in loss_fn: refused naming the microbatch and the
    branch's assumption, before anything runs; then a call on one side of
    it trains like eager."""
    torch.manual_seed(0)
    model = Seq()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=_branching_loss, schedule="1f1b", num_microbatches=2,
                         split_points=["layers.2"], timeout=60, dynamic=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 10, D, generator=g), torch.randn(2, 10, D, generator=g)

    def call(lengths: list[int]) -> dict[str, Any]:
        mbs = [((x[:, :n].contiguous(),), {}) for n in lengths]
        targets = [y[:, :n].contiguous() for n in lengths]
        try:
            loss = pipe.step(microbatches=mbs, targets=targets)
        except Exception as e:  # noqa: BLE001
            return {"raised": type(e).__name__, "message": str(e)}
        want = sum(_branching_loss(ref(a[0]), t) for (a, _), t in zip(mbs, targets)) / len(mbs)
        want.backward()
        grads = {n: _diff(p.grad, dict(ref.named_parameters())[n].grad)
                 for n, p in pipe.named_parameters()}
        pipe.zero_grad()
        ref.zero_grad()
        return {"loss": _diff(loss.reshape(()), want.detach()), "grads": grads}
    return {"both_sides": call([4, 9]), "one_side": call([4, 5])}


HANDLERS = {"dynamic_branch": dynamic_branch, "forward_state": forward_state, "loss_state": loss_state, "loss_kind": loss_kind,
            "loss_raises": loss_raises, "counting_forward": counting_forward}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, HANDLERS)
