"""Python state that forward or loss_fn reads, changed between steps, is seen
by the next step as eager PyTorch sees it (tests/state_worker.py, 2 gloo
ranks): a module attribute, a global, a closure cell, a loss module's
attribute, a partial's keyword; a loss that switches kind; a loss that
raises; a value forward changes at every call (NOTE [State guards] in
torch_mpmd/graph/state_guards.py, NOTE [Loss state] in
torch_mpmd/programs/loss_state.py)."""

from __future__ import annotations

import pytest

from dist_harness import GridRun

LOSSES = ["closure", "global", "module", "partial"]
CASES = ([dict(id="forward", kind="forward_state")]
         + [dict(id=f"loss-{w}", kind="loss_state", loss=w) for w in LOSSES]
         + [dict(id="kind", kind="loss_kind"), dict(id="raises-flag", kind="loss_raises", how="flag"),
            dict(id="raises-counter", kind="loss_raises", how="counter"),
            dict(id="counting", kind="counting_forward"),
            dict(id="dynamic-branch", kind="dynamic_branch"),
            # Last: its refusal comes after the step's transfers, which leaves the
            # process groups unusable for the cases after it.
            dict(id="kind-accumulating", kind="loss_kind", zero_grad=False)])
_GRID = GridRun(2, "state_worker:grid", CASES, task="state", timeout=600)


def _check_steps(case: str, count: int) -> list[dict]:
    got = _GRID.results(case)
    for rank, r in enumerate(got):
        assert len(r["steps"]) == count, (rank, r["steps"])
        for step, s in enumerate(r["steps"]):
            assert "raised" not in s, (rank, step, s)
            assert s["loss"] <= 1, f"rank {rank} step {step}: loss {s['value']} != eager " \
                f"{s['eager']}"
            bad = {n: d for n, d in s["grads"].items() if d > 1}
            assert not bad and s["grads"], f"rank {rank} step {step}: gradients off: {bad}"
    return got


def test_forward_state_changed_between_steps_is_seen_as_eager_sees_it():
    got = _check_steps("forward", 5)
    # Four states (the last is the first again, whose capture is reused).
    assert [r["captures"] for r in got] == [4, 4], got


@pytest.mark.parametrize("which", LOSSES)
def test_loss_fn_state_changed_between_steps_is_seen_as_eager_sees_it(which):
    got = _check_steps(f"loss-{which}", {"closure": 4, "global": 3, "module": 3,
                                         "partial": 2}[which])
    values = [s["value"] for s in got[0]["steps"]]
    assert len(set(round(v, 5) for v in values)) > 1, values  # the change mattered


def test_a_loss_that_switches_between_scalar_and_pair_is_read_at_every_step():
    _check_steps("kind", 3)
    # With the scalar steps' gradients still held, the switch is refused
    # (README: zero the gradients before switching losses), on every rank.
    for rank, r in enumerate(_GRID.results("kind-accumulating")):
        assert len(r["steps"]) == 2 and r["steps"][0]["loss"] <= 1, (rank, r)
        assert r["steps"][1]["raised"] == "ValueError", (rank, r["steps"][1])
        assert "zero the gradients before switching losses" in r["steps"][1]["message"]


@pytest.mark.parametrize("how", ["flag", "counter"])
def test_a_loss_fn_that_raises_at_a_later_step_raises_on_every_rank(how):
    got = _GRID.results(f"raises-{how}")
    for rank, r in enumerate(got):
        steps = r["steps"]
        assert "raised" in steps[-1], (rank, steps)
        assert "loss_fn refuses" in steps[-1]["message"], (rank, steps[-1])
        if not r["last_stage"]:
            assert steps[-1]["raised"] == "PipelineError", (rank, steps[-1])
        for s in steps[:-1]:
            assert "raised" not in s and s["loss"] <= 1, (rank, s)
        if how == "flag":
            assert len(steps) == 3, (rank, steps)   # the step that set the flag
        else:
            assert len(steps) in (3, 4), (rank, steps)  # (the trace's calls: one step early)
            if r["last_stage"]:  # after the first build: at every microbatch
                assert r["calls"][1] - r["calls"][0] == 4, r["calls"]


def test_a_branch_on_a_size_in_loss_fn_is_refused_for_sizes_on_its_other_side():
    got = _GRID.results("dynamic-branch")
    for rank, r in enumerate(got):
        both = r["both_sides"]
        assert "raised" in both, (rank, both)   # eager takes the branch per microbatch
        assert "microbatch 1" in both["message"], (rank, both)
        assert "x.size(1) <= 6" in both["message"], (rank, both)
        assert "Nothing ran" in both["message"] or rank == 1, (rank, both)
        one = r["one_side"]   # the ranks stayed in step: lengths on one side train
        assert "raised" not in one, (rank, one)
        assert one["loss"] <= 1 and one["grads"], (rank, one)
        assert not {n: d for n, d in one["grads"].items() if d > 1}, (rank, one)


def test_a_value_forward_changes_at_every_call_is_refused_naming_it():
    for rank, r in enumerate(_GRID.results("counting")):
        assert r["raised"] == "ValueError", (rank, r)
        assert "model.calls" in r["message"], (rank, r)
        assert "captured this model 8 times" in r["message"], (rank, r)
