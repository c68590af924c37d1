"""pipeline(bytes_cost=): the balanced split prices the bytes crossing each cut
(issue 13 item 7; NOTE [Bytes cost] in csrc/core/partition.h), single process."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import models
import torch_mpmd as mpmd
from torch_mpmd import _C
from torch_mpmd.compile.backend import mpmd_backend

BATCH, NARROW, WIDE = 8, 32, 1024


class WideMiddle(nn.Module):
    """Narrow layers around a wide pair: ``up`` and ``down`` hold nearly all
    the FLOPs, so a split by compute alone cuts between them, where the
    activation is WIDE floats per row; every other boundary passes NARROW."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(NARROW, NARROW)
        self.b = nn.Linear(NARROW, NARROW)
        self.up = nn.Linear(NARROW, WIDE)
        self.down = nn.Linear(WIDE, NARROW)
        self.c = nn.Linear(NARROW, NARROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b(torch.relu(self.a(x))))
        h = torch.relu(self.up(x))
        return self.c(torch.relu(self.down(h)))


def crossing_bytes(split) -> list[int]:
    """Bytes of each value the plan sends between stages, per microbatch."""
    return sorted(v.bytes for v in split.plan.cross_stage_values)


def x_and_target():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, NARROW, generator=g), torch.randn(BATCH, NARROW, generator=g)


def test_split_model_with_default_bytes_cost_cuts_at_a_narrow_boundary_and_compute_alone_does_not():
    x, _ = x_and_target()
    default = mpmd.split_model(WideMiddle(), x, num_stages=2)
    assert crossing_bytes(default) == [BATCH * NARROW * 4]
    explicit = mpmd.split_model(WideMiddle(), x, num_stages=2, bytes_cost=_C.DEFAULT_BYTES_COST)
    assert explicit.plan.hash == default.plan.hash
    compute_only = mpmd.split_model(WideMiddle(), x, num_stages=2, bytes_cost=0)
    assert crossing_bytes(compute_only) == [BATCH * WIDE * 4]
    # What pricing traffic gives up: compute alone balances the stages better.
    assert max(compute_only.plan.stage_cost) < max(default.plan.stage_cost)


@pytest.mark.parametrize("bytes_cost,crossing", [(None, BATCH * NARROW * 4), (0, BATCH * WIDE * 4)])
def test_pipeline_passes_bytes_cost_to_its_split_and_trains_as_one_process(bytes_cost, crossing):
    # One rank, two stages on it: the split is pipeline()'s own (Pipeline
    # builds it on the first step); two microbatches of BATCH / 2 rows.
    x, y = x_and_target()
    torch.manual_seed(0)
    reference = WideMiddle()
    model = copy.deepcopy(reference)
    pipe = mpmd.pipeline(model, loss_fn=nn.functional.mse_loss, schedule="gpipe",
                         num_microbatches=2, stages_per_rank=2, bytes_cost=bytes_cost)
    loss = pipe.step(x, target=y)
    assert crossing_bytes(pipe.split) == [crossing // 2]
    expected = torch.stack([nn.functional.mse_loss(reference(xc), yc)
                            for xc, yc in zip(x.chunk(2), y.chunk(2))]).mean()
    expected.backward()
    assert_close(loss, expected.detach())
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "100", True])
def test_bytes_cost_that_is_not_a_finite_non_negative_number_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"^bytes_cost="):
        mpmd.pipeline(models.MLP(), num_microbatches=1, bytes_cost=bad)
    # The mpmd backend's options are pipeline()'s, checked by the same code.
    with pytest.raises(ValueError, match=r"^bytes_cost="):
        mpmd_backend(None, [], options={"bytes_cost": bad})


def test_bytes_cost_is_an_option_of_the_mpmd_backend():
    from torch_mpmd.compile.backend import BACKEND_OPTIONS

    assert "bytes_cost" in BACKEND_OPTIONS
