"""Nothing silently wrong where plain PyTorch raises or honours the user
(tests/silent_worker.py, 2 gloo ranks; sharded dp on 4): freezing and
unfreezing between steps trains exactly, and each misuse is a clear error on
every rank, before any transfer where it can be known."""

from __future__ import annotations

import pytest

from dist_harness import GridRun

FREEZING = [dict(id="freezing-fx-1f1b", kind="freezing"),
            dict(id="freezing-fx-zero_bubble", kind="freezing", schedule="zero_bubble"),
            # Inductor programs: freeze, then back to the first set (its
            # capture and programs are reused: two compiles, not three).
            dict(id="freezing-inductor", kind="freezing", changes=1, kwargs={"compile": True})]
CASES = FREEZING + [dict(id="errors", kind="errors")]
_GRID = GridRun(2, "silent_worker:grid", CASES, task="silent", timeout=600)
_GRID4 = GridRun(4, "silent_worker:grid",
                 [dict(id="freezing-sharded", kind="freezing", dp=2,
                       kwargs={"data_parallel": "shard"}),
                  dict(id="freezing-replicated", kind="freezing", dp=2)],
                 task="silent", timeout=400)


def _check_freezing(got: list[dict]) -> None:
    held = set()
    for rank, r in enumerate(got):
        held |= set(r["local"])
        for step, s in enumerate(r["steps"]):
            assert s["loss"] <= 1, (rank, step, s)
            assert not s["frozen_with_grad"], f"rank {rank} step {step}: frozen parameters " \
                f"got a gradient: {s['frozen_with_grad']}"
            assert not s["frozen_moved"], (rank, step, s["frozen_moved"])
            bad = {n: d for n, d in s["grads"].items() if d > 1}
            assert not bad, f"rank {rank} step {step}: gradients off (inf: missing): {bad}"
            assert s["grads"], (rank, step)
        bad = {n: d for n, d in r["params"].items() if d > 1}
        assert not bad, f"rank {rank}: parameters off after the steps: {bad}"
    assert len(held) == 16, sorted(held)   # every parameter of the 8 layers is on some rank


@pytest.mark.parametrize("case", [c["id"] for c in FREEZING])
def test_freezing_and_unfreezing_between_steps_trains_like_one_process(case):
    _check_freezing(_GRID.results(case))


@pytest.mark.parametrize("case", ["freezing-sharded", "freezing-replicated"])
def test_freezing_between_steps_under_data_parallel_trains_like_one_process(case):
    _check_freezing(_GRID4.results(case))


def _errors() -> list[dict]:
    return _GRID.results("errors")


@pytest.mark.parametrize("name", ["no_grad_constant", "no_grad_integer", "no_grad_detached"])
def test_a_loss_that_does_not_require_grad_raises_on_every_rank_naming_loss_fn(name):
    for rank, r in enumerate(_errors()):
        o = r[name]
        assert not o["ok"], (rank, o)
        assert "does not require grad" in o["message"], (rank, o)
        assert "loss_fn" in o["message"] and "<lambda>" in o["message"], (rank, o)


def test_a_target_of_another_batch_size_is_a_value_error_before_any_transfer():
    for rank, r in enumerate(_errors()):
        for key in ("target_rows", "eval_target_rows"):
            o = r[key]
            # A ValueError of its own on every rank (not a PipelineError
            # relayed from a peer): raised before capture or any exchange.
            assert o["type"] == "ValueError", (rank, key, o)
            assert "target has batch size 4" in o["message"], (rank, o)
            assert "batch size 8" in o["message"], (rank, o)
        assert r["target_missing"]["type"] == "ValueError", (rank, r["target_missing"])
        assert "target is missing" in r["target_missing"]["message"]
        assert "mse_loss" in r["target_missing"]["message"]
        custom = r["target_missing_custom"]
        assert not custom["ok"] and "target is missing" in custom["message"], (rank, custom)
        assert r["no_target_needed"]["ok"], (rank, r["no_target_needed"])
        # The ranks stayed in step: the same pipeline then trains.
        assert r["then_a_step"]["ok"], (rank, r["then_a_step"])
        assert r["then_a_step"]["value"] == pytest.approx(r["reference"], rel=1e-5)
        # A target flattened over samples splits alike and is accepted.
        assert r["flattened_target"]["ok"], (rank, r["flattened_target"])
        assert r["flattened_target"]["value"] == pytest.approx(r["reference"], rel=1e-5)


def test_ranks_with_different_loss_functions_raise_at_start_up_naming_both():
    for rank, r in enumerate(_errors()):
        o = r["loss_fn_differs"]
        assert not o["ok"], (rank, o)
        assert "loss_fn" in o["message"], (rank, o)
        assert "mse_loss" in o["message"] and "l1_loss" in o["message"], (rank, o)


def test_a_model_output_the_loss_cannot_read_is_named_in_the_error():
    for rank, r in enumerate(_errors()):
        o = r["output_type"]
        assert not o["ok"], (rank, o)
        assert "a value of type tuple" in o["message"], (rank, o)
        assert "mse_loss" in o["message"], (rank, o)
