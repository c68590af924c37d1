"""Failures: a peer that dies mid-step becomes mpmd.PipelineError on the others
within the pipeline timeout; bad arguments are ValueErrors raised before any rank
communicates; the test harness itself kills hung ranks and reports them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import pipeline_worker as W
import torch_mpmd as mpmd
from dist_harness import run_ranks

PIPELINE_TIMEOUT = 5.0
LAUNCH_TIMEOUT = 120.0  # the survivors must be done long before this



# ------------------------------------------------------------------ a dead peer

@pytest.mark.parametrize("schedule,dying_rank", [("1f1b", 1), ("zbv", 0)],
                         ids=["1f1b-last-stage-rank1-dies", "zbv-last-stage-rank0-dies"])
def test_peer_exiting_mid_step_raises_pipeline_error_naming_the_peer(schedule, dying_rank):
    # The loss runs on the last stage: rank 1 under 1f1b, rank 0 under zbv's V placement.
    run = run_ranks(2, "pipeline_worker:die_in_loss_fn", schedule, dying_rank,
                    PIPELINE_TIMEOUT, timeout=LAUNCH_TIMEOUT, failure_grace=None, check=False)
    survivor = 1 - dying_rank
    assert not run.timed_out, "the surviving rank never gave up:\n" + run.describe([survivor])
    assert run.returncodes[dying_rank] == 3, run.describe([dying_rank])
    assert run.returncodes[survivor] not in (0, None), run.describe([survivor])
    err = run.stderr[survivor]
    assert "PipelineError" in err, run.describe([survivor])
    message = err[err.rindex("PipelineError"):]
    assert re.search(rf"\brank {survivor}\b", message), message
    assert re.search(rf"peer\D{{0,12}}\b{dying_rank}\b", message, re.IGNORECASE), message
    assert "<-- FAILED HERE" in message, message
    assert re.search(r"\d+(SEND|RECV)_[FB]\d+", message), message


def test_pipeline_error_is_a_runtime_error():
    assert issubclass(mpmd.PipelineError, RuntimeError)


# ------------------------------------------------------------------ bad arguments, 1 process

def _pipeline_and_step(model_name: str, batch: int = W.BATCH, **kwargs):
    """pipeline() then one step: the ValueError may come from either (capture is lazy)."""
    x, y = W.make_batch(model_name)
    pipe = mpmd.pipeline(W.build_model(model_name), loss_fn=W.loss_fn_for(model_name),
                         timeout=PIPELINE_TIMEOUT, **kwargs)
    return pipe.step(x[:batch], target=y[:batch])


def test_num_microbatches_not_dividing_the_batch_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"(?s)(3.*8|8.*3)"):
        _pipeline_and_step("skip", schedule="gpipe", num_microbatches=3)


def test_batch_smaller_than_num_microbatches_is_a_value_error():
    with pytest.raises(ValueError, match="4"):
        _pipeline_and_step("skip", batch=2, schedule="gpipe", num_microbatches=4)


@pytest.mark.parametrize("m", [0, -2])
def test_non_positive_num_microbatches_is_a_value_error(m):
    with pytest.raises(ValueError, match=str(m)):
        _pipeline_and_step("skip", schedule="gpipe", num_microbatches=m)


def test_unknown_schedule_name_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="no_such_schedule"):
        _pipeline_and_step("skip", schedule="no_such_schedule", num_microbatches=2)


def test_stages_per_rank_disagreeing_with_markers_is_a_value_error_naming_both():
    # SkipNet's markers make 4 stages; on one rank that is 4 per rank, not 3.
    with pytest.raises(ValueError, match=r"(?s)(3.*4|4.*3)"):
        _pipeline_and_step("skipnet", schedule="interleaved_1f1b", num_microbatches=2,
                           stages_per_rank=3)


def test_dualpipev_with_too_few_microbatches_is_a_value_error():
    with pytest.raises(ValueError, match="dualpipev"):
        _pipeline_and_step("skip", schedule="dualpipev", num_microbatches=1,
                           split_points=W.SKIP_SPLITS[2])


def test_world_size_one_pipeline_still_trains_after_a_rejected_call():
    # The rejected step must not leave the pipeline half-built.
    x, y = W.make_batch("skip")
    model = W.build_model("skip")
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=4,
                         timeout=PIPELINE_TIMEOUT)
    with pytest.raises(ValueError):
        pipe.step(x[:6], target=y[:6])
    ref = W.build_model("skip")
    want = F.mse_loss(ref(x), y)
    torch.testing.assert_close(pipe.step(x, target=y), want.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ bad arguments, 2 ranks

def test_bad_arguments_on_two_ranks_are_value_errors_on_every_rank_before_communicating():
    # pipeline timeout 5 s: a rank that started communicating would raise PipelineError
    # (not ValueError) once its peer gave up, and a hang is a launch failure.
    names = list(W.BAD_ARGUMENT_CASES)
    run = run_ranks(2, "pipeline_worker:bad_arguments", names, PIPELINE_TIMEOUT,
                    timeout=LAUNCH_TIMEOUT)
    expect = {"stages-not-multiple-of-pp": r"(?s)3.*2", "batch-not-divisible": r"(?s)(3.*8|8.*3)",
              "zbv-m-below-p": r"zbv", "spr-disagrees-with-markers": r"(?s)(4.*2|2.*4)"}
    bad = []
    for rank, res in enumerate(run.results):
        for name in names:
            got = res[name]
            if not got.get("is_value_error") or not re.search(expect[name], got["message"]):
                bad.append(f"rank {rank} {name}: {got['type']}: {got['message'][:800]}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the harness

def test_harness_kills_hung_ranks_at_its_timeout_and_reports_their_stderr():
    run = run_ranks(2, "pipeline_worker:hang_on_rank", 1, timeout=8, failure_grace=None,
                    check=False)
    assert run.timed_out
    assert run.returncodes[1] != 0 and not run.complete[1]
    assert run.results[1] == {"before_hang": 1}  # its partial result survives
    with pytest.raises(AssertionError, match=r"(?s)rank 1 .*about to hang"):
        run.check()
