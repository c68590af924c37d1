"""2-rank workers for the lockstep and bounded-wait tests in test_pipeline_failures.py
(run by dist_harness): ranks that fail on their own, call differently, stall or
never come."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeline_worker as W
import torch_mpmd as mpmd
from dist_harness import partial_result
from torch_mpmd.runtime.program_runner import ProgramRunner
from torch_mpmd.runtime.runner import StageRunner


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did: its value, or the exception's type, message, cause and notes."""
    start = time.monotonic()
    try:
        value = fn()
        if isinstance(value, torch.Tensor):  # a call that should have failed returned
            value = value.tolist()
        out: dict[str, Any] = {"ok": True, "value": value}
    except BaseException as e:  # noqa: BLE001  (reported to the test)
        out = {"ok": False, "type": type(e).__name__, "message": str(e)[:4000],
               "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None,
               "notes": list(getattr(e, "__notes__", [])), "peer": getattr(e, "peer", None)}
    out["seconds"] = time.monotonic() - start
    return out


def _stall_last_stage(when: Callable[[], bool], stall: Callable[[], None]) -> None:
    """Make this rank's forward of the last stage call ``stall()`` while ``when()``
    (both runners: forward-only calls run the autograd one)."""
    for cls in (StageRunner, ProgramRunner):
        original = cls.forward

        def forward(self, stage, mb, inputs, _original=original):
            if stage == self.num_stages - 1 and when():
                stall()
            return _original(self, stage, mb, inputs)

        cls.forward = forward


def lockstep_sequence(timeout: float) -> dict[str, Any]:
    """Rank 1 (the last stage under 1f1b) fails on its own in several ways,
    each followed by a call every rank makes alike; then the ranks make
    different calls. Returns every call's outcome, by name, with a reference
    loss."""
    rank = dist.get_rank()
    bad = rank == 1
    x, y = W.make_batch("skip")
    reference = float(F.mse_loss(W.build_model("skip")(x), y))
    flags = {"loss_raises": False, "stage_raises": False}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if flags["loss_raises"]:
            raise ValueError("loss_fn failed on purpose")
        return F.mse_loss(out, target)

    def raise_in_stage() -> None:
        raise ValueError("stage failed on purpose")

    _stall_last_stage(lambda: flags["stage_raises"], raise_in_stage)
    pipe = mpmd.pipeline(W.build_model("skip"), loss_fn=loss_fn, schedule="1f1b",
                         num_microbatches=4, split_points=W.SKIP_SPLITS[2], timeout=timeout)
    out: dict[str, Any] = {"rank": rank, "reference_loss": reference}

    def record(name: str, fn: Callable[[], Any]) -> None:
        out[name] = _outcome(fn)
        partial_result(out)

    def step() -> float:
        pipe.zero_grad()
        return float(pipe.step(x, target=y))

    # A bad argument only rank 1 sees, in the first call (rank 0 is capturing).
    record("first_call_bad_argument", lambda: pipe.step(x[:6] if bad else x, target=y))
    record("step_after_first_call_failure", step)
    # A loss_fn that raises: on rank 1, while it builds the last stage's program.
    pipe2 = mpmd.pipeline(W.build_model("skip"), loss_fn=loss_fn, schedule="1f1b",
                          num_microbatches=4, split_points=W.SKIP_SPLITS[2], timeout=timeout)
    flags["loss_raises"] = True
    record("loss_fn_raises", lambda: pipe2.step(x, target=y))
    flags["loss_raises"] = False
    record("step_after_loss_fn_failure", lambda: float(pipe2.step(x, target=y)))
    # A stage that raises mid-step (rank 1's last stage, in its first forward).
    flags["stage_raises"] = bad
    record("stage_raises", step)
    flags["stage_raises"] = False
    record("step_after_stage_failure", step)
    # A bad argument only rank 1 sees, in a later call.
    record("later_bad_argument", lambda: pipe.step(x[:6] if bad else x, target=y))
    record("step_after_later_failure", step)
    # The ranks make different calls: no call pairs with the wrong one.
    record("different_calls", lambda: float(pipe.step(x, target=y)) if not bad else
           pipe(x).shape)
    record("call_after_different_calls", step)
    return out


def stall_in_forward(mode: str, timeout: float) -> dict[str, Any]:
    """Rank 1 stalls (``mode`` "sleep": time.sleep; "sigstop": stops itself) in
    its last stage's forward of the second call; rank 0 calls ``pipe(x)`` and
    must raise within the timeout, then exit through the PipelineError (the
    test reads its exit time)."""
    rank = dist.get_rank()
    calls = {"n": 0}

    def stall() -> None:
        partial_result({"rank": rank, "stalled_at": time.time()})
        if mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(300)

    if rank == 1:
        _stall_last_stage(lambda: calls["n"] >= 1, stall)
    x, _ = W.make_batch("skip")
    pipe = mpmd.pipeline(W.build_model("skip"), loss_fn=F.mse_loss, schedule="1f1b",
                         num_microbatches=2, split_points=W.SKIP_SPLITS[2], timeout=timeout)
    with torch.no_grad():
        pipe(x)  # capture and a first call, not timed
        calls["n"] += 1
        start = time.monotonic()
        try:
            pipe(x)
        except mpmd.PipelineError as e:
            partial_result({"rank": rank, "raised_after": time.monotonic() - start,
                            "raised_at": time.time(), "message": str(e)[:4000]})
            traceback.print_exc()
            raise  # the process exits through it, as a script's would
    return {"rank": rank, "error": "the call returned although rank 1 stalled"}


def never_calls(timeout: float) -> dict[str, Any]:
    """Rank 1 never calls the pipeline; rank 0's first step must raise within the
    timeout (its capture included), not after a longer start-up wait."""
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(300)
        return {"rank": rank}
    return _first_step_raises(timeout, 2, "rank 1 never called")


def _first_step_raises(timeout: float, stages: int, why: str) -> dict[str, Any]:
    """The first step of a 1f1b pipeline of ``stages`` stages must raise
    PipelineError (``why`` it cannot complete): records when and what (a
    partial result), then lets it escape so the process exits."""
    rank = dist.get_rank()
    x, y = W.make_batch("skip")
    pipe = mpmd.pipeline(W.build_model("skip"), loss_fn=F.mse_loss, schedule="1f1b",
                         num_microbatches=stages, split_points=W.SKIP_SPLITS[stages],
                         timeout=timeout)
    start = time.monotonic()
    try:
        pipe.step(x, target=y)
    except mpmd.PipelineError as e:
        partial_result({"rank": rank, "raised_after": time.monotonic() - start,
                        "raised_at": time.time(), "message": str(e)[:4000], "peer": e.peer})
        raise
    return {"rank": rank, "error": f"the step returned although {why}"}


def timelines_over_steps(steps: int) -> dict[str, Any]:
    """``steps`` training steps (1f1b, 2 ranks); every rank's timelines of all of
    them, gathered on this rank, and this rank's stage times."""
    x, y = W.make_batch("skip")
    pipe = mpmd.pipeline(W.build_model("skip"), loss_fn=F.mse_loss, schedule="1f1b",
                         num_microbatches=4, split_points=W.SKIP_SPLITS[2], timeout=60)
    for _ in range(steps):
        pipe.step(x, target=y)
    rows = [[(str(a), s, e) for a, s, e in row] for row in pipe.timelines(steps=steps)]
    return {"programs": pipe.schedule.action_text, "rows": rows,
            "stage_times": pipe.stage_times(), "local_stages": list(pipe.local_stages)}


def die_mid_pipeline(dying_rank: int, timeout: float) -> dict[str, Any]:
    """4 pipeline ranks (1f1b, a stage each): ``dying_rank`` exits (code 3)
    in its stage's first forward; every other rank records what its step
    raised (partial result), then lets it escape so its process exits."""
    rank = dist.get_rank()
    if rank == dying_rank:

        def dying_forward(self, stage, mb, inputs):
            os._exit(3)

        ProgramRunner.forward = dying_forward
    return _first_step_raises(timeout, 4, "a peer died")


def leaves_early(timeout: float) -> dict[str, Any]:
    """Rank 1 returns (its process exits cleanly) without calling the
    pipeline; rank 0's first step must raise at once, naming rank 1 as gone,
    not after ``timeout``."""
    rank = dist.get_rank()
    if rank == 1:   # the script ends here: exit code 0, without destroy_process_group
        partial_result({"rank": rank, "left_at": time.time()})
        sys.exit(0)
    return _first_step_raises(timeout, 2, "rank 1 left")
