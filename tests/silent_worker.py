"""Ranks of tests/test_silent_errors.py: what plain PyTorch raises or honours,
the pipeline must too (issue: nothing silently wrong).

An 8-layer MLP split at ``layers.4`` on 2 gloo ranks (1f1b, m=4). Cases:
freezing and unfreezing parameters between steps (exact training against one
process, with SGD: each parameter's difference is lr times its gradients'),
a loss that does not require grad, a target of another batch size, a missing
target, ranks with different loss functions, a model output the loss cannot
read. Every case reports what each rank raised (type and message) or
returned; the test decides.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid
from optim_replay import full

D, BATCH, M, LR = 16, 8, 4, 0.1
RTOL, ATOL = 1e-5, 1e-6   # fp32, a few layers deep (SGD adds no amplification)


class MLP(nn.Module):
    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class TupleOut(MLP):
    """Returns (output, None): a loss written for a tensor fails inside."""

    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(x), None


def batch(seed: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = fn()
        return {"ok": True, "value": float(value) if isinstance(value, torch.Tensor) else None}
    except Exception as e:  # noqa: BLE001  (the test reads what was raised)
        cause = e.__cause__
        return {"ok": False, "type": type(e).__name__, "message": str(e),
                "cause": type(cause).__name__ if cause is not None else None}


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| scaled by the tolerance (<= 1: within); inf when one is missing."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


# ------------------------------------------------------------------ freezing

# (step, names to freeze, names to unfreeze) before that step; both ranks'
# stages (layers 0-3 on rank 0, 4-7 on rank 1). The last step unfreezes
# what step 2 froze: the first capture's set again.
FREEZES = [(2, ["layers.1.weight", "layers.6.weight", "layers.6.bias"], []),
           (3, ["layers.3.bias"], ["layers.6.weight"]),
           (4, [], ["layers.1.weight", "layers.6.bias", "layers.3.bias"])]


def freezing(case: dict[str, Any]) -> dict[str, Any]:
    """SGD steps with parameters frozen and unfrozen between them, on the
    module every rank holds whole (``requires_grad_``, as a fine-tuning
    recipe does), against one process doing the same. Per step: the loss,
    and for every parameter this rank holds: a frozen one has no gradient
    and did not move, a trainable one has the reference's gradient; after
    the last step every parameter equals the reference's. ``case``:
    ``kwargs`` for pipeline(), ``mesh``: a ("dp", "pp") mesh of the world
    (4 ranks: sharded dp), each replica stepping its rows of the batch."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    kwargs = dict(case.get("kwargs", {}))
    rows = slice(None)
    if case.get("dp"):
        from torch.distributed.device_mesh import init_device_mesh

        dp = case["dp"]
        mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp),
                                mesh_dim_names=("dp", "pp"))
        kwargs["mesh"] = mesh
        k = mesh.get_local_rank("dp")
        rows = slice(BATCH // dp * k, BATCH // dp * (k + 1))
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule=case.get("schedule", "1f1b"),
                         num_microbatches=M // (case.get("dp") or 1), split_points=["layers.4"],
                         timeout=60, **kwargs)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    freezes = {step: (off, on) for step, off, on in FREEZES[:case.get("changes", 3)]}
    res: dict[str, Any] = {"steps": []}
    for step in range(1 + max(freezes)):
        off, on = freezes.get(step, ([], []))
        for names, flag in ((off, False), (on, True)):
            for name in names:
                model.get_parameter(name).requires_grad_(flag)
                ref.get_parameter(name).requires_grad_(flag)
        before = {n: full(p.detach()).clone() for n, p in pipe.named_parameters()}
        x, y = batch(step)
        loss = pipe.step(x[rows], target=y[rows])
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        want = dict(ref.named_parameters())
        grads, frozen_with_grad = {}, []
        for n, p in pipe.named_parameters():
            if want[n].requires_grad:
                grads[n] = _diff(full(p.grad), want[n].grad)
            elif p.grad is not None:
                frozen_with_grad.append(n)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
        moved = [n for n, p in pipe.named_parameters() if not want[n].requires_grad
                 and not torch.equal(full(p.detach()), before[n])]
        res["steps"].append({"loss": _diff(loss.reshape(()), ref_loss.detach()),
                             "grads": grads, "frozen_with_grad": frozen_with_grad,
                             "frozen_moved": moved})
    want = dict(ref.named_parameters())
    res["params"] = {n: _diff(full(p.detach()), want[n]) for n, p in pipe.named_parameters()}
    res["local"] = sorted(n for n, _ in pipe.named_parameters())
    return res


# ------------------------------------------------------------------ errors


def _pipe(model: nn.Module, loss_fn: Any) -> Any:
    return mpmd.pipeline(model, loss_fn=loss_fn, schedule="1f1b", num_microbatches=M,
                         split_points=["layers.4"], timeout=30)


def errors(case: dict[str, Any]) -> dict[str, Any]:
    """Each misuse on a fresh pipeline, every rank alike (but "loss_fn_differs"):
    what it raised. Then a correct step on the same pipeline where it can
    still run (the ranks stayed in step)."""
    torch.manual_seed(0)
    x, y = batch(0)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for name, fn in [("constant", lambda o, t: torch.tensor(1.0)),
                     ("integer", lambda o, t: torch.tensor(1)),
                     ("detached", lambda o, t: F.mse_loss(o, t).detach())]:
        out[f"no_grad_{name}"] = _outcome(lambda: _pipe(MLP(), fn).step(x, target=y))
    pipe = _pipe(MLP_seeded(), F.mse_loss)
    out["target_rows"] = _outcome(lambda: pipe.step(x, target=y[:4]))
    out["target_missing"] = _outcome(lambda: pipe.step(x))
    # A loss of the user's own may ignore its target: it runs, and when it
    # fails on target=None the error (on every rank) says the target is missing.
    out["target_missing_custom"] = _outcome(
        lambda: _pipe(MLP_seeded(), lambda o, t: F.mse_loss(o, t)).step(x))
    out["no_target_needed"] = _outcome(
        lambda: _pipe(MLP_seeded(), lambda o, t: o.pow(2).mean()).step(x))
    out["eval_target_rows"] = _outcome(lambda: pipe.eval_step(x, target=y[:4]))
    out["then_a_step"] = _outcome(lambda: pipe.step(x, target=y))
    out["reference"] = float(F.mse_loss(MLP_seeded()(x), y))
    out["flattened_target"] = _outcome(   # (B*D,) for (B, D): splits alike
        lambda: _pipe(MLP_seeded(), lambda o, t: F.mse_loss(o.flatten(), t)).step(
            x, target=y.flatten()))
    out["loss_fn_differs"] = _outcome(
        lambda: _pipe(MLP(), F.mse_loss if rank == 0 else F.l1_loss).step(x, target=y))
    out["output_type"] = _outcome(lambda: _pipe(TupleOut(), F.mse_loss).step(x, target=y))
    return out


def MLP_seeded() -> MLP:
    torch.manual_seed(0)
    return MLP()


HANDLERS = {"freezing": freezing, "errors": errors}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, HANDLERS)
