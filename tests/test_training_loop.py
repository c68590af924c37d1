"""The training loop around Pipeline.step (issue 13): the global gradient norm
(clip_grad_norm_, tied weights counted once, dp=2), eval_step, forward with
output_rank, the model's own loss with loss_fn=None, an optimizer built
before the first step, in-place writes to inputs with several microbatches,
and the errors that come before any transfer (step under no_grad, a target
with loss_fn=None, an empty batch, a non-finite timeout).

Multi-process on gloo (tests/training_worker.py) against one process; two
launches (2 ranks, and 4 ranks as dp=2 x pp=2) shared by the tests here.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from dist_harness import run_ranks

LOSS_TOL = 1e-5   # fp32 sums in another order
GRAD_TOL = 1e-6
OUTPUT_RTOL = 1e-6  # of the output's largest magnitude (training_worker.output_diff)


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, "training_worker:two_ranks", timeout=300).results


@pytest.fixture(scope="module")
def dp():
    return run_ranks(4, "training_worker:data_parallel", timeout=300).results


def case(results, name):
    """Every rank's result of one case (failing with a rank's traceback if any)."""
    got = [r[name] for r in results]
    for rank, g in enumerate(got):
        assert "error" not in g, f"rank {rank}:\n{g['error']}"
    return got


def check_clip_and_eval(got):
    for rank, r in enumerate(got):
        for key in ("loss", "norm", "inf_norm", "eval_train_mode", "eval_eval_mode"):
            assert r[key] < LOSS_TOL, (rank, key, r)
        for key in ("grads", "clipped_grads", "inf_clipped_grads"):
            assert r[key] < GRAD_TOL, (rank, key, r)
        assert r["norm_value"] > 0.5  # the clip did scale the gradients
        assert r["eval_kept_grads"] and not r["eval_requires_grad"]
    # The same norm, bit for bit, on every rank (each rank scaled by it).
    assert len({r["norm_value"] for r in got}) == 1
    assert len({r["inf_norm_value"] for r in got}) == 1


def test_clip_grad_norm_and_eval_step_equal_one_process_with_tied_weights(two):
    check_clip_and_eval(case(two, "clip_and_eval"))


def test_clip_grad_norm_and_eval_step_with_data_parallel_replicas(dp):
    check_clip_and_eval(case(dp, "clip_and_eval"))


def test_non_finite_norm_is_seen_by_every_rank(two):
    for r in case(two, "nonfinite"):
        assert r["raised"] == "RuntimeError"
        assert r["norm_is_nan"] and r["grads_nan"]


def test_output_rank_delivers_to_one_rank_only(two):
    got = case(two, "outputs_and_errors")
    for rank, r in enumerate(got):
        assert r["output_None"] < OUTPUT_RTOL
        for where in (0, 1):
            value = r[f"output_{where}"]
            if rank == where:
                assert value is not None and value < OUTPUT_RTOL
            else:
                assert value is None
        assert r["bad_output_rank"] == "ValueError"


def test_errors_come_on_every_rank_before_any_transfer(two):
    for r in case(two, "outputs_and_errors"):
        no_grad = r["no_grad_step"]
        assert no_grad["type"] == "RuntimeError" and "no_grad" in no_grad["message"]
        assert no_grad["seconds"] < 1.0  # not a timeout
        assert r["empty_batch"]["type"] == "ValueError"
        assert "batch size 0" in r["empty_batch"]["message"]
        assert "num_microbatches=2" in r["empty_batch"]["message"]
        assert r["target_without_loss_fn"]["type"] == "ValueError"
        assert "loss_fn=None" in r["target_without_loss_fn"]["message"]
        assert r["eval_target_without_loss_fn"] == "ValueError"
        # No rank communicated: the next step pairs with the other ranks' next step.
        assert r["loss_after_errors"] < LOSS_TOL and r["grads_after_errors"] < GRAD_TOL


@pytest.mark.parametrize("kind", ["scalar", "dict", "dataclass", "namedtuple", "hf_gpt2"])
def test_loss_from_the_models_output(two, kind):
    for r in case(two, f"model_loss_{kind}"):
        assert r["functional"]  # step's loss is the functional programs' (loss_tail)
        assert r["loss"] < LOSS_TOL and r["eval"] < LOSS_TOL  # eval: the runner's _loss
        assert r["grads"] < GRAD_TOL


def test_optimizer_built_before_the_first_step_steps_only_this_ranks_parameters(two):
    got = case(two, "optimizer")
    for r in got:
        assert r["listed_before"] == r["all"] > r["listed_after"]
        assert r["others"] and r["others_unchanged"] and r["others_grad_none"]
        assert r["local"] < 1e-5 and r["local_moved"] > 0
        assert r["norms"] < LOSS_TOL
    assert not set(got[0]["others"]) & set(got[1]["others"])  # each parameter lives somewhere


@pytest.mark.parametrize("path", ["functional", "autograd"])
def test_model_writing_its_input_in_place_trains_as_in_eager(two, path):
    for r in case(two, f"in_place_{path}"):
        assert r["functional"] == (path == "functional")
        assert r["loss"] < LOSS_TOL and r["grads"] < GRAD_TOL


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, 1e300])
def test_timeout_that_is_not_a_finite_number_is_named(timeout):
    with pytest.raises(ValueError, match="timeout="):
        mpmd.pipeline(models.MLP(), loss_fn=F.mse_loss, num_microbatches=2, timeout=timeout)


def test_clip_before_the_first_step_says_so():
    pipe = mpmd.pipeline(models.MLP(), loss_fn=F.mse_loss, num_microbatches=2)
    with pytest.raises(RuntimeError, match="captured"):
        pipe.clip_grad_norm_(1.0)


def test_eval_step_in_one_process_is_the_eager_loss():
    torch.manual_seed(0)
    model = models.MLP(d=8, depth=2)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, schedule="gpipe",
                         stages_per_rank=2)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    loss = pipe.eval_step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach())
