"""Ranks of tests/test_plan_dp.py: ``mpmd.plan`` on a ("dp", "pp") = (2, 2) mesh
of 4 gloo ranks chooses the data-parallel mode, and ``pipeline(mesh=mesh,
plan=plan)`` runs it.

One case: a plan without a limit (replicate: as fast, fewer actions), the
limit that rules out every replicated candidate (from the sheet the plan
carries: rank 0's number, broadcast) and the plan under it (shard); each
plan trains one step like one process on the global batch (the replicas'
batches concatenated): the loss and every gradient of this rank's
parameters (a DTensor shard's in full), never skipping one whose gradient
is missing. Also: ``plan="auto"`` with ``data_parallel="shard"`` beside it
keeps the mode, and a contradicting ``data_parallel=`` beside a plan is a
ValueError naming both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torch_mpmd as mpmd
from dist_harness import run_grid
from torch_mpmd.planning import plan_from_sheet
from torch_mpmd.planning import profile as profiling

DP, PP = 2, 2
BATCH = 8  # per replica
M = 4
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    """An input projection heavier than the head, four equal blocks: the
    search's split puts more parameters on pipeline rank 0, whose replicas'
    gathers then cost the sharded plan more than the all-reduces it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(DP * BATCH, 32, generator=g), torch.randn(DP * BATCH, 4, generator=g)


def _diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| scaled so that <= 1 is within tolerance; inf when missing."""
    if isinstance(got, DTensor):
        got = got.full_tensor()  # collective over the parameter's dp group
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    got, want = got.detach().double(), want.detach().double()
    return float(((got - want).abs() / (ATOL + RTOL * want.abs())).max())


def _one_step(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step of ``pipe`` on this replica's rows against one process on the
    global batch: the loss and every gradient this rank holds."""
    ref = _model()
    gx, gy = _global_batch()
    want = F.mse_loss(ref(gx), gy)
    want.backward()
    got = pipe.step(x, target=y)
    ref_grads = dict(ref.named_parameters())
    return {"loss": _diff(got, want),
            "grads": {n: _diff(p.grad, ref_grads[n].grad) for n, p in pipe.named_parameters()}}


def _plan_fields(plan: Any) -> dict[str, Any]:
    return plan.to_dict() | {"search": None}


def _smallest_peak(sheet: Any, mode: str) -> float:
    """The smallest predicted peak of the test's candidates in ``mode``, as
    the planner's infeasible error names it."""
    try:
        plan_from_sheet(sheet, memory_limit=1.0, schedules="1f1b", num_microbatches=M,
                        data_parallel=mode)
    except ValueError as e:
        text = str(e).split("smallest predicted peak is")[1]
        return float(text.split("(")[1].split(" bytes")[0])
    raise AssertionError("a plan fit in 1 byte")


def dp_plans(case: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="mpmd_dp_profiles_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cache = box[0]
    os.environ["MPMD_PROFILE_CACHE"] = cache  # plan="auto" profiles from it too
    try:
        return _dp_plans(mesh, cache)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(cache, ignore_errors=True)


def _dp_plans(mesh: Any, cache: str) -> dict[str, Any]:
    rank = dist.get_rank()
    replica = rank // PP  # the mesh is (dp, pp): global rank = dp * PP + pp
    gx, gy = _global_batch()
    x, y = gx[replica * BATCH:(replica + 1) * BATCH], gy[replica * BATCH:(replica + 1) * BATCH]
    res: dict[str, Any] = {}
    model = _model()
    search = dict(loss_fn=F.mse_loss, target=y, group=mesh, schedules="1f1b",
                  num_microbatches=M, cache_dir=cache)

    before = profiling.measurements
    free = mpmd.plan(model, (x,), **search)
    res["measured"] = profiling.measurements - before
    res["free"] = _plan_fields(free)
    res["sheet_dp"] = [free.sheet.dp_size, free.sheet.dp_latency, free.sheet.dp_bandwidth]
    res["free_describe"] = free.describe()

    # Rank 0's limit for every rank: below every replicated candidate's peak.
    peaks = [_smallest_peak(free.sheet, "replicate"), _smallest_peak(free.sheet, "shard")]
    box = [peaks]
    dist.broadcast_object_list(box, src=0)
    res["smallest_peaks"] = peaks = box[0]
    limit = peaks[0] * 0.99
    before = profiling.measurements
    # trials=0: the peaks above are the free plan's sheet's. With trials the
    # cached units are fitted to a new calibration first, whose timings may
    # move the time-balanced splits and with them every candidate's peak (a
    # loaded machine once left no shard candidate under this limit).
    tight = mpmd.plan(model, (x,), memory_limit=limit, trials=0, **search)
    res["measured_again"] = profiling.measurements - before
    res["limit"] = limit
    res["tight"] = _plan_fields(tight)
    res["tight_describe"] = tight.describe()

    for name, plan in (("free", free), ("tight", tight)):
        pipe = mpmd.pipeline(_model(), loss_fn=F.mse_loss, mesh=mesh, plan=plan)
        res[f"{name}_config"] = [pipe.config.data_parallel, pipe.config.schedule,
                                 pipe.config.num_microbatches, list(pipe.config.split_points)]
        res[f"{name}_step"] = _one_step(pipe, x, y)
        res[f"{name}_owned"] = sorted(n for n, _ in pipe.named_parameters())

    # plan="auto" keeps the mode the pipeline was built with.
    auto = mpmd.pipeline(_model(), loss_fn=F.mse_loss, mesh=mesh, plan="auto",
                         data_parallel="shard", schedule="1f1b", num_microbatches=M)
    before = profiling.measurements
    res["auto_step"] = _one_step(auto, x, y)
    res["auto_measured"] = profiling.measurements - before
    res["auto_plan"] = _plan_fields(auto.config.plan)

    other = "replicate" if tight.data_parallel == "shard" else "shard"
    try:
        mpmd.pipeline(_model(), loss_fn=F.mse_loss, mesh=mesh, plan=tight, data_parallel=other)
        res["contradiction"] = None
    except ValueError as e:
        res["contradiction"] = str(e)
    return res


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, {"dp_plans": dp_plans})
