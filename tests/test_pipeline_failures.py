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

@pytest.mark.parametrize("pooled", [False, True])
def test_harness_kills_hung_ranks_at_its_timeout_and_reports_their_stderr(pooled):
    """A launch that times out: the hung rank is killed, its partial result
    and stderr survive, and its stderr ends with where it hung (every
    thread's stack, asked for before the kill), in a fresh launch and in a
    worker group's call."""
    run = run_ranks(2, "pipeline_worker:hang_on_rank", 1, timeout=8, failure_grace=None,
                    check=False, pooled=pooled)
    assert run.timed_out
    assert run.returncodes[1] != 0 and not run.complete[1]
    assert run.results[1] == {"before_hang": 1}  # its partial result survives
    with pytest.raises(AssertionError,
                       match=r"(?s)rank 1 .*about to hang.*File .*pipeline_worker.py\", "
                             r"line \d+ in hang_on_rank"):
        run.check()


# ------------------------------------------------------------------ ranks in lockstep (NOTE [Lockstep])

LOCKSTEP_TIMEOUT = 60.0
WITHIN = 30.0  # "within seconds": far below LOCKSTEP_TIMEOUT, generous on a loaded machine


@pytest.fixture(scope="module")
def lockstep():
    """fault_worker.lockstep_sequence on 2 ranks: rank 1 fails on its own in
    four ways (each followed by a step every rank makes), then the ranks make
    different calls."""
    run = run_ranks(2, "fault_worker:lockstep_sequence", LOCKSTEP_TIMEOUT, timeout=300,
                    failure_grace=None, check=False)
    assert not run.timed_out and all(r is not None for r in run.results), run.describe([0, 1])
    return run.results


def _raised(outcome, exc_type, *patterns):
    assert not outcome["ok"] and outcome["type"] == exc_type, outcome
    for pattern in patterns:
        assert re.search(pattern, outcome["message"]), (pattern, outcome["message"])
    assert outcome["seconds"] < WITHIN, outcome  # not the timeout: the rank was told


@pytest.mark.parametrize("failure,first_line", [
    ("first_call_bad_argument", r"ValueError: positional argument 0 has batch size 6"),
    ("later_bad_argument", r"ValueError: positional argument 0 has batch size 6"),
], ids=["in-the-first-call-while-capturing", "in-a-later-call"])
def test_bad_argument_only_one_rank_sees_makes_every_rank_raise_at_once(lockstep, failure,
                                                                          first_line):
    healthy, failing = lockstep[0][failure], lockstep[1][failure]
    assert failing["type"] == "ValueError" and not failing["ok"], failing  # its own error
    assert any("other ranks were told" in n for n in failing["notes"]), failing
    _raised(healthy, "PipelineError", r"^rank 0: step abandoned because rank 1 failed: " +
            first_line, "still in step")
    assert healthy["peer"] == 1


@pytest.mark.parametrize("failure", ["loss_fn_raises", "stage_raises"])
def test_a_rank_whose_own_code_raises_mid_step_makes_every_rank_raise_naming_it(lockstep,
                                                                                failure):
    what = "loss_fn" if failure == "loss_fn_raises" else "stage"
    healthy, failing = lockstep[0][failure], lockstep[1][failure]
    _raised(healthy, "PipelineError", rf"rank 1 failed: ValueError: {what} failed on purpose "
            r"\(in action 1F0\)", "gradients of this step are wrong")
    _raised(failing, "PipelineError", r"rank 1: action 1F0 \(#1\) failed: ValueError: "
            rf"{what} failed on purpose", "1F0  <-- FAILED HERE", "stand-in values",
            "other ranks were told")
    assert failing["cause"] == "ValueError"


@pytest.mark.parametrize("after", ["step_after_first_call_failure", "step_after_loss_fn_failure",
                                   "step_after_stage_failure", "step_after_later_failure"])
def test_after_a_rank_failed_on_its_own_the_ranks_are_in_step_and_the_next_step_is_exact(
        lockstep, after):
    for rank in (0, 1):
        outcome = lockstep[rank][after]
        assert outcome["ok"], outcome
        assert outcome["value"] == pytest.approx(lockstep[rank]["reference_loss"], rel=1e-5)


def test_ranks_making_different_calls_raise_naming_each_call_and_later_calls_refuse(lockstep):
    for rank in (0, 1):
        _raised(lockstep[rank]["different_calls"], "PipelineError", "not in the same call",
                r"rank 0: the start of step \d+", r"rank 1: the start of a forward call",
                "restart the job")
        later = lockstep[rank]["call_after_different_calls"]
        _raised(later, "PipelineError", rf"^rank {rank}: cannot run step: an earlier call failed",
                "torchrun --max-restarts")
        assert later["seconds"] < 1.0  # refused without communicating


# ------------------------------------------------------------------ bounded waits, prompt exits

STALL_TIMEOUT = 5.0
EXIT_WITHIN = 10.0  # seconds from the PipelineError to the survivor's process exit


def _survivor(run, patterns, within=STALL_TIMEOUT + 5.0):
    """Rank 0 raised PipelineError ``within`` seconds of its call and exited soon after."""
    survivor = run.results[0]
    assert survivor is not None and "raised_after" in survivor, run.describe([0])
    assert survivor["raised_after"] < within, survivor
    for pattern in patterns:
        assert re.search(pattern, survivor["message"]), (pattern, survivor["message"])
    assert run.returncodes[0] not in (0, None), run.describe([0])
    exited = run.exit_wall(0)
    assert exited is not None, "the harness had to kill the survivor:\n" + run.describe([0])
    assert exited - survivor["raised_at"] < EXIT_WITHIN, (exited - survivor["raised_at"],
                                                          run.describe([0]))


@pytest.mark.parametrize("mode", ["sleep", "sigstop"])
def test_stalled_peer_survivor_raises_within_the_timeout_and_its_process_exits_promptly(mode):
    # Rank 1 stalls in its last stage's forward; rank 0's pipe(x) waits for it
    # at the end of the call. Its process exits through the PipelineError: no
    # group destructor waits out the process-group timeout (60 s here).
    run = run_ranks(2, "fault_worker:stall_in_forward", mode, STALL_TIMEOUT, timeout=120,
                    pg_timeout=60, failure_grace=3, check=False)
    assert run.results[1] is not None and "stalled_at" in run.results[1], run.describe([1])
    _survivor(run, [r"^rank 0: waiting for the other ranks at the end of a forward call",
                    r"within the 5 s timeout", "restart the job"])


def test_peer_that_never_calls_fails_the_first_step_within_the_timeout():
    # Start-up waits are bounded by timeout= (startup_timeout= when given), not
    # by a longer start-up minimum.
    run = run_ranks(2, "fault_worker:never_calls", STALL_TIMEOUT, timeout=120, pg_timeout=60,
                    failure_grace=3, check=False)
    _survivor(run, [r"^rank 0: the other ranks did not arrive at the start-up comparison of "
                    r"plans within 5 s"], within=STALL_TIMEOUT + 25.0)  # capture included


def test_with_four_ranks_every_survivor_names_the_rank_that_died_first():
    # Rank 1 dies; ranks 0 and 2 see its connections close and name it; rank
    # 3 only sees rank 2 stop (NOTE [Who died first]) and must still name
    # rank 1, not blame rank 2. The store outlives the ranks, as torchrun's
    # agent store does.
    run = run_ranks(4, "fault_worker:die_mid_pipeline", 1, STALL_TIMEOUT, timeout=120,
                    pg_timeout=60, failure_grace=None, check=False, agent_store=True)
    assert not run.timed_out, run.describe()
    assert run.returncodes[1] == 3, run.describe([1])
    for rank in (0, 2, 3):
        res = run.results[rank]
        assert res is not None and "message" in res, run.describe([rank])
        assert res["raised_after"] < STALL_TIMEOUT + 10, res
        message = res["message"]
        named = res["peer"] == 1 or "rank 1 died first" in message
        assert named, f"rank {rank} does not name rank 1:\n{message}"
    assert "rank 1 died first" in run.results[3]["message"], run.results[3]["message"]


def test_a_peer_that_exits_cleanly_before_its_first_step_is_named_at_once():
    # Rank 1's script ends (exit code 0) without calling the pipeline; rank
    # 0's first step raises well within its 30 s timeout, naming rank 1 as
    # gone (NOTE [Ranks that left]). The store lives in rank 0 here.
    run = run_ranks(2, "fault_worker:leaves_early", 30.0, timeout=120, pg_timeout=60,
                    failure_grace=None, check=False)
    assert run.returncodes[1] == 0, run.describe([1])
    survivor = run.results[0]
    assert survivor is not None and "raised_after" in survivor, run.describe([0])
    assert survivor["raised_after"] < 10.0, survivor   # capture included; not the timeout
    assert re.search(r"^rank 0: rank 1 left the job \(the process exited\) before joining "
                     r"the pipeline", survivor["message"]), survivor["message"]
