"""Workers of tests/test_lockstep_bounds.py (run by dist_harness): ranks of one
pipeline given microbatches of the same shapes but different contents
(NOTE [Microbatch contents] in runtime/contents.py), and ranks that stall or die
in mpmd.plan's profiling (NOTE [Named waits] in parallel/named_waits.py)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeline_worker as W
import torch_mpmd as mpmd
from dist_harness import partial_result, run_grid


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did: its float value, or the exception's type and message."""
    try:
        return {"ok": True, "value": float(fn())}
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"ok": False, "type": type(e).__name__, "message": str(e)[:3000]}


def contents(case: dict[str, Any]) -> dict[str, Any]:
    """2 pipeline ranks (1f1b, m=4, batch 8): rank 1 is given a batch whose
    target differs in microbatch 2's rows only, then a microbatch list whose
    microbatch 1 input differs in one element; then every rank the same batch. Each call's outcome,
    the eager loss of the batch and the largest difference of a local
    gradient from eager's after the last call."""
    rank = dist.get_rank()
    x, y = W.make_batch("skip")
    model = W.build_model("skip")
    with torch.no_grad():
        reference = float(F.mse_loss(W.build_model("skip")(x), y))
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=4,
                         split_points=W.SKIP_SPLITS[2], timeout=60)
    out: dict[str, Any] = {"reference": reference}
    y_other = y.clone()
    if rank == 1:
        y_other[4:6] += 0.5  # microbatch 2 of 4 (2 rows each)
    out["batch_target"] = _outcome(lambda: pipe.step(x, target=y_other))
    mbs = [((x[2 * k:2 * k + 2].clone(),), {}) for k in range(4)]
    targets = [y[2 * k:2 * k + 2] for k in range(4)]
    if rank == 1:
        mbs[1][0][0][0, 0] += 1e-3  # one element of microbatch 1's input
    pipe.zero_grad()
    out["list_input"] = _outcome(lambda: pipe.step(microbatches=mbs, targets=targets))
    pipe.zero_grad()
    out["same"] = _outcome(lambda: pipe.step(x, target=y))
    ref = W.build_model("skip")
    F.mse_loss(ref(x), y).backward()
    want = dict(ref.named_parameters())
    # Every local parameter's gradient against eager (a missing one counts).
    out["grad_diff"] = max(float((p.grad - want[n].grad).abs().max()) if p.grad is not None
                           else float("inf") for n, p in pipe.named_parameters())
    return out


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, {"contents": contents}, key="bounds")


def fault_in_profiling(mode: str, timeout: float) -> dict[str, Any]:
    """mpmd.plan on 2 ranks with ``timeout``: ``mode`` "rank1_dies": rank 1
    exits (os._exit) before profiling's first collective; "rank0_stalls":
    rank 0 stalls while it measures the units (rank 1 waits for its sheet).
    The survivor records what plan raised (a partial result) and lets it
    escape, so its process exits."""
    from torch_mpmd.planning import profile as profiling

    rank = dist.get_rank()
    if mode == "rank1_dies" and rank == 1:
        def dying_call_order(*args: Any, **kwargs: Any) -> Any:
            os._exit(3)

        profiling.call_order = dying_call_order
    if mode == "rank0_stalls" and rank == 0:
        def stalled_measure(*args: Any, **kwargs: Any) -> Any:
            partial_result({"rank": rank, "stalled_at": time.time()})
            time.sleep(300)

        profiling._measure = stalled_measure
    x, y = W.make_batch("skip")
    start = time.monotonic()
    try:
        mpmd.plan(W.build_model("skip"), (x,), loss_fn=F.mse_loss, target=y,
                  schedules=["1f1b"], cache_dir=tempfile.mkdtemp(), timeout=timeout)
    except Exception as e:
        partial_result({"rank": rank, "raised_after": time.monotonic() - start,
                        "type": type(e).__name__, "message": str(e)[:3000],
                        "peer": getattr(e, "peer", None)})
        raise
    return {"rank": rank, "error": f"plan returned although {mode}"}


def die_mid_chain(timeout: float) -> dict[str, Any]:
    """4 pipeline ranks over a chain of layers (1f1b, a stage each: every rank
    talks to its neighbours only): rank 0 exits (os._exit, code 3) in its
    stage's first forward. Every other rank records what its step raised (a
    partial result), then lets it escape so its process exits."""
    from torch_mpmd.runtime.program_runner import ProgramRunner

    rank = dist.get_rank()
    if rank == 0:
        def dying_forward(self: Any, stage: int, mb: int, inputs: Any) -> Any:
            os._exit(3)

        ProgramRunner.forward = dying_forward
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=4,
                         split_points=["2", "4", "6"], timeout=timeout)
    start = time.monotonic()
    try:
        pipe.step(x, target=y)
    except mpmd.PipelineError as e:
        partial_result({"rank": rank, "raised_after": time.monotonic() - start,
                        "message": str(e)[:4000], "peer": e.peer})
        raise
    return {"rank": rank, "error": "the step returned although rank 0 died"}


def stall_in_meta_init(timeout: float) -> dict[str, Any]:
    """A tied GPT built on the meta device, 2 pipeline ranks: rank 1's init_fn
    stalls, so rank 0 waits at the broadcast of the tied parameters; it
    records what its first step raised (a partial result) and lets it escape."""
    import models

    rank = dist.get_rank()

    def init_fn(module: torch.nn.Module) -> None:
        if rank == 1:
            time.sleep(300)

    pipe, ids = models.meta_gpt_pipeline(init_fn, timeout)
    start = time.monotonic()
    try:
        pipe.step(ids, target=ids)
    except mpmd.PipelineError as e:
        partial_result({"rank": rank, "raised_after": time.monotonic() - start,
                        "message": str(e)[:3000], "peer": e.peer})
        raise
    return {"rank": rank, "error": "the step returned although rank 1 stalled"}
