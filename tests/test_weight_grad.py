"""The weight-gradient split (torch_mpmd/weight_grad.py), in one process: I
(one engine call for the inputs and every weight node's output) followed by W
(formulas or per-node engine calls) gives the gradients of one full backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from torch_mpmd.graph.stage import split_model
from torch_mpmd.programs.weight_grad import WeightGradPlan

_ENGINE = torch.autograd.Variable._execution_engine


class Mixed(nn.Module):
    """Every formula rule, a frozen bias, and a node W must leave to the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=-2)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.fc_nobias = nn.Linear(16, 8, bias=False)
        self.frozen_bias = nn.Linear(8, 8)
        self.frozen_bias.bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))  # x * scale: the engine's

    def forward(self, idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + h
        x = self.fc_nobias(torch.tanh(self.fc(self.ln(x))))
        return self.frozen_bias(x) * self.scale


def _split_grads(module: nn.Module, idx: torch.Tensor, h: torch.Tensor,
                 dy: torch.Tensor) -> tuple[torch.Tensor, WeightGradPlan, tuple]:
    """I then W for one forward of ``module``'s one-stage split; the input's
    gradient, the plan and (zs, dzs, xs)."""
    gm = split_model(module, idx, h.detach()).stages[0]
    plan = WeightGradPlan.build(gm)
    assert plan is not None
    leaf = h.detach().requires_grad_(True)
    out, zs, xs = plan.split_outputs(plan.module(idx, leaf))
    got = _ENGINE.run_backward((out[0],), (dy,), True, False, (leaf, *zs), True, False)
    dh, dzs = got[0], list(got[1:])
    if plan.can_accumulate(zs, dzs, xs):
        plan.accumulate(zs, dzs, xs)
    return dh, plan, (zs, dzs, xs)


def test_input_and_weight_gradients_equal_one_full_backward():
    torch.manual_seed(0)
    model = Mixed()
    idx = torch.tensor([[1, 9, 3, 4], [9, 0, 2, 10]])
    h = torch.randn(2, 4, 8)
    dy = torch.randn(2, 4, 8)
    ref_h = h.clone().requires_grad_(True)
    model(idx, ref_h).backward(dy)
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    dh, plan, _ = _split_grads(model, idx, h, dy)
    rules = sorted(w.rule for w in plan.nodes)
    assert rules == ["embedding", "engine", "layer_norm", "linear", "linear", "linear"]
    assert_close(dh, ref_h.grad, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert model.frozen_bias.bias.grad is None
    assert model.emb.weight.grad[9].abs().sum() == 0  # padding_idx=-2 is row 9


def test_weight_gradients_accumulate_and_hooks_still_run():
    torch.manual_seed(0)
    model = Mixed()
    idx = torch.tensor([[1, 2, 3, 4]])
    h, dy = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    ref_h = h.clone().requires_grad_(True)
    model(idx, ref_h).backward(dy)
    model(idx, ref_h).backward(dy)
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    seen: list[str] = []
    model.fc.weight.register_hook(lambda g: seen.append("tensor hook") or g * 1.0)
    model.ln.weight.register_post_accumulate_grad_hook(lambda p: seen.append("post hook"))
    _split_grads(model, idx, h, dy)
    _split_grads(model, idx, h, dy)
    assert sorted(seen) == ["post hook"] * 2 + ["tensor hook"] * 2
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


class Tied(nn.Module):
    """A tied embedding and head, and (optionally) a shared scale the engine must handle."""

    def __init__(self, engine_shared: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.full((6,), 0.5)) if engine_shared else None

    def forward(self, idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = self.fc(self.fc(self.emb(idx) + h))  # fc.weight and fc.bias read twice
        if self.scale is not None:
            x = x * self.scale * self.scale
        return F.linear(x, self.emb.weight)  # the head reads the embedding


def test_tied_parameters_sum_each_readers_contribution():
    torch.manual_seed(2)
    model = Tied()
    idx = torch.tensor([[1, 5, 7]])
    h, dy = torch.randn(1, 3, 6), torch.randn(1, 3, 10)
    ref_h = h.clone().requires_grad_(True)
    model(idx, ref_h).backward(dy)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    dh, plan, state = _split_grads(model, idx, h, dy)
    assert [w.shared for w in plan.nodes] == [True] * 4
    assert plan.can_accumulate(*state)
    assert_close(dh, ref_h.grad, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    model.fc.weight.register_hook(lambda g: g)
    assert not plan.can_accumulate(*state)  # the runner re-walks the stage for such a step


def test_a_shared_parameter_without_a_formula_has_no_split_plan():
    gm = split_model(Tied(engine_shared=True), torch.tensor([[1, 2]]),
                     torch.randn(1, 2, 6)).stages[0]
    assert WeightGradPlan.build(gm) is None


class InPlace(nn.Module):
    """A weight node's output written in place, and one under autocast."""

    def __init__(self, autocast: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.autocast = autocast

    def forward(self, idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.emb(idx) + h)
        y.relu_()  # Z changed after the node ran: W must go through the relu
        if self.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc2(y).float()  # X fp32, Z and dZ bf16
        return self.fc2(y)


@pytest.mark.parametrize("autocast", [False, True])
def test_in_place_writes_and_autocast_fall_back_to_the_engine(autocast):
    torch.manual_seed(3)
    model = InPlace(autocast)
    idx = torch.tensor([[1, 2, 3]])
    h, dy = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    ref_h = h.clone().requires_grad_(True)
    model(idx, ref_h).backward(dy)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    dh, _, _ = _split_grads(model, idx, h, dy)
    assert_close(dh, ref_h.grad, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_input_written_after_the_node_ran_is_an_error_as_in_autograd():
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            a = (idx.float() + h) * 3
            y = self.fc(a)
            a.mul_(2)
            return y + a

    idx, h, dy = torch.tensor([[1, 2, 3, 4]]), torch.randn(1, 4), torch.randn(1, 4)
    with pytest.raises(RuntimeError, match="inplace"):
        Late()(idx, h).backward(dy)
    with pytest.raises(RuntimeError, match="inplace"):
        _split_grads(Late(), idx, h, dy)


@pytest.mark.parametrize("shape", [(5, 8), (8,)])
def test_linear_formula_handles_any_leading_shape(shape):
    torch.manual_seed(1)
    fc = nn.Linear(8, 3)

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = fc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    x = torch.randn(*shape)
    dy = torch.randn(*shape[:-1], 3)
    fc(x).backward(dy)
    ref = [fc.weight.grad.clone(), fc.bias.grad.clone()]
    fc.zero_grad(set_to_none=True)
    gm = split_model(One(), x).stages[0]
    plan = WeightGradPlan.build(gm)
    leaf = x.clone().requires_grad_(True)
    out, zs, xs = plan.split_outputs(plan.module(leaf))
    got = _ENGINE.run_backward((out[0],), (dy,), True, False, (leaf, *zs), True, False)
    plan.accumulate(zs, list(got[1:]), xs)
    assert_close(fc.weight.grad, ref[0])
    assert_close(fc.bias.grad, ref[1])
