"""Measured finalists (torch_mpmd/planning/trials.py): which finalists run,
which wins, their record in the plan's JSON, and on 2 gloo ranks
(tests/trials_worker.py) that trials leave the first step exact (with an
optimizer built before it), that the measured faster of two finalists wins
on every rank, that the decision is cached and taken again without trials,
and that a cached profile is fitted to the launch that loads it."""

from __future__ import annotations

import math

import pytest

from dist_harness import GridRun
from torch_mpmd.config import PipelineConfig
from torch_mpmd.planning import Plan, evaluate_plan
from torch_mpmd.planning.plan import Candidate, SearchRecord, Trial
from torch_mpmd.planning.sheet import CostSheet, Unit
from torch_mpmd.planning import trials as t

_GRID = GridRun(2, "trials_worker:grid",
                [dict(id="exact", kind="exact"), dict(id="forced", kind="forced"),
                 dict(id="relative", kind="relative")], task="plan trials", timeout=400)


def _cand(schedule: str, m: int, step: float, split: tuple[str, ...] = ("blocks.2",)) -> Candidate:
    v = 2 if schedule in ("zbv", "interleaved_1f1b") else 1
    return Candidate(schedule=schedule, stages_per_rank=v, num_microbatches=m,
                     split_points=split, recompute=(False,) * (len(split) + 1),
                     predicted_step_s=step, predicted_peak_bytes=(1.0, 1.0))


def _sheet() -> CostSheet:
    names = ["tok", *(f"blocks.{i}" for i in range(4)), "ln_f"]
    units = [Unit(name=n, forward=1e-3, backward_input=1e-3, backward_weight=1e-3,
                  output_bytes=1e4) for n in names]
    return CostSheet(units=units, global_batch=16, pp_size=2, reference_microbatch=4,
                     action_overhead=1e-4, link_latency=1e-4, link_bandwidth=1e9)


def test_finalists_span_microbatch_counts_and_families_within_the_models_error():
    top = [_cand("1f1b", 4, 1.00), _cand("1f1b", 4, 1.01, ("blocks.3",)),
           _cand("interleaved_1f1b", 4, 1.02, ("blocks.1", "blocks.2", "blocks.3")),
           _cand("1f1b", 8, 1.05), _cand("zero_bubble", 4, 1.10), _cand("zbv", 16, 1.50)]
    got = t.finalists(top, count=3, error=0.15)
    picked = [c for c, _ in got]
    assert picked == [top[0], top[3], top[4]], picked  # m=8, then the split-backward family
    assert not any(d for _, d in got)
    # Past the model's error another family is not worth a trial (the next
    # best runs instead), but another m still is: the model errs most there.
    got = t.finalists(top, count=3, error=0.005)
    assert [c for c, _ in got] == [top[0], top[3], top[1]]
    assert [c for c, _ in t.finalists(top[:3] + top[4:], count=2, error=0.005)] == \
        [top[0], top[5]]


def test_the_default_runs_beside_the_finalists_or_is_marked_among_them():
    top = [_cand("1f1b", 4, 1.0), _cand("1f1b", 8, 1.1)]
    default = _cand("1f1b", 8, 1.3, ("blocks.1",))
    got = t.finalists(top, count=2, default=default)
    assert got == [(top[0], False), (top[1], False), (default, True)]
    got = t.finalists(top, count=2, default=top[1])
    assert got == [(top[0], False), (top[1], True)]
    assert t.finalists([], count=3, default=default) == []


def test_the_default_is_1f1b_at_4p_microbatches_split_evenly_by_blocks():
    sheet = _sheet()
    c = t.default_contender(sheet)
    assert (c.schedule, c.stages_per_rank, c.num_microbatches) == ("1f1b", 1, 8)
    assert c.split_points == ("blocks.2",)
    want = evaluate_plan(sheet, "1f1b", num_microbatches=8, split_points=["blocks.2"])
    assert c.predicted_step_s == pytest.approx(want.predicted_step_s)
    # Refined blocks: the block's first part starts it.
    names = ["tok", "blocks.0", "blocks.1.attn", "blocks.1.mlp", "blocks.2", "blocks.3"]
    refined = CostSheet(units=[Unit(name=n, forward=1e-3, backward_input=1e-3, backward_weight=1e-3)
                               for n in names], global_batch=6,
                        pp_size=2, reference_microbatch=1)
    assert t.even_split(refined, 2) == ["blocks.2"]
    assert t.even_split(refined, 4) == ["blocks.1.attn", "blocks.2", "blocks.3"]
    assert t.even_split(refined, 5) is None
    assert t.default_contender(refined, num_microbatches=3).num_microbatches == 3
    # Over the memory limit: no default contender.
    assert t.default_contender(sheet, memory_limit=1.0) is None


def test_a_best_cutting_inside_a_block_runs_beside_its_split_between_blocks():
    names = ["tok", "blocks.0", "blocks.1.attn", "blocks.1.mlp", "blocks.2", "blocks.3",
             "ln_f", "head"]
    sheet = CostSheet(units=[Unit(name=n, forward=1e-3, backward_input=1e-3,
                                  backward_weight=1e-3, output_bytes=1e4) for n in names],
                      global_batch=8, pp_size=2, reference_microbatch=2,
                      action_overhead=1e-4, link_latency=1e-4, link_bandwidth=1e9)
    inside = _cand("zero_bubble", 2, 1.0, ("blocks.1.mlp",))
    assert t.cuts_inside_blocks(sheet, inside)
    # A block's first part, a whole block, a unit after the blocks: not inside.
    for split in (("blocks.1.attn",), ("blocks.2",), ("head",)):
        assert not t.cuts_inside_blocks(sheet, _cand("zero_bubble", 2, 1.0, split))
        assert t.at_block_boundaries(sheet, _cand("zero_bubble", 2, 1.0, split)) is None
    whole = t.at_block_boundaries(sheet, inside)
    assert (whole.schedule, whole.num_microbatches, whole.split_points) == \
        ("zero_bubble", 2, ("blocks.2",))
    want = evaluate_plan(sheet, "zero_bubble", num_microbatches=2, split_points=["blocks.2"])
    assert whole.predicted_step_s == pytest.approx(want.predicted_step_s)
    assert t.at_block_boundaries(sheet, inside, memory_limit=1.0) is None
    other_m = _cand("zero_bubble", 4, 1.1, ("blocks.2",))
    got = t.finalists([inside, other_m], count=2, beside=[whole, other_m])
    assert [c for c, _ in got] == [inside, other_m, whole]  # (other_m once)


def _trial(m: int, steps: tuple[float, ...], predicted: float = 1.0) -> Trial:
    return Trial(schedule="1f1b", stages_per_rank=1, num_microbatches=m,
                 split_points=("blocks.2",), recompute=(False, False),
                 predicted_step_s=predicted, steps_s=steps)


def test_the_least_median_wins_not_the_prediction_nor_a_lucky_step():
    a = _trial(4, (0.10, 0.30, 0.31, 0.32, 0.30), predicted=0.1)  # one fast step
    b = _trial(8, (0.20, 0.21, 0.20, 0.22, 0.20), predicted=0.5)
    assert t.choose([a, b]) is b
    assert b.measured_step_s == 0.20 and a.measured_step_s == 0.30
    tie = _trial(2, (0.20, 0.21, 0.20, 0.22, 0.20), predicted=0.4)
    assert t.choose([b, tie]) is tie  # equal medians: the prediction
    with pytest.raises(ValueError, match="no trials"):
        t.choose([])
    assert math.isinf(_trial(1, ()).measured_step_s)


def test_trials_travel_in_the_plans_json_and_its_description():
    trial = _trial(4, (0.2, 0.1, 0.3))
    plan = Plan(schedule="1f1b", num_microbatches=4, stages_per_rank=1,
                split_points=("blocks.2",), recompute=(False, False), predicted_step_s=1.0,
                predicted_peak_bytes=(1.0, 1.0),
                search=SearchRecord(trials=(trial, dataclass_default(trial)), profile_s=2.0,
                                    trials_s=3.0, decided_by="trials"))
    back = Plan.from_json(plan.to_json())
    assert back.search.trials == plan.search.trials
    assert back.search.decided_by == "trials" and back.search.trials_s == 3.0
    text = plan.describe()
    assert "trials (trials decided" in text and "the default a user writes first" in text
    assert "*" in text.splitlines()[-2]  # the chosen trial is marked
    assert plan.planning_summary().startswith("decided by trials (2 run, measured 200.0 ms "
                                             "against the default's 400.0 ms); planning 5.0 s")
    bad = plan.to_dict()
    bad["search"]["trials"][0]["steps_s"] = ["0.2"]
    with pytest.raises(ValueError, match=r"search.trials\[0\]: steps_s\[0\]='0.2'"):
        Plan.from_dict(bad)


def dataclass_default(trial: Trial) -> Trial:
    import dataclasses
    return dataclasses.replace(trial, num_microbatches=8, steps_s=(0.4,), default=True)


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_plan_trials_must_be_a_count(value):
    with pytest.raises(ValueError, match="plan_trials="):
        PipelineConfig(plan="auto", plan_trials=value)


def test_trials_keep_the_first_step_exact_with_an_optimizer_built_before_it():
    results = _GRID.results("exact")
    for rank, r in enumerate(results):
        assert r["decided_by"] == "trials", (rank, r["decided_by"])
        assert len(r["trials"]) >= 2 and any(x["default"] for x in r["trials"])
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']}"
        assert r["grads"], f"rank {rank} holds no parameter"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
        bad = {n: d for n, d in r["params"].items() if d > 1}
        assert not bad, f"rank {rank}: parameters off after AdamW's step: {bad}"
        bad = {n: d for n, d in r["others"].items() if d > 0}
        assert not bad, f"rank {rank}: parameters it does not hold changed: {bad}"
        assert r["opt_params"] >= r["held"] > 0
        assert r["pipelines_alive"] == 1, f"rank {rank}: trial pipelines still alive"
    assert results[0]["trials"] == results[1]["trials"]


def test_the_measured_faster_of_two_forced_finalists_wins_on_every_rank():
    r0, r1 = _GRID.results("forced")
    assert r0["plan"] == r1["plan"] and r0["trials"] == r1["trials"]
    trials = r0["trials"]
    assert {x["fields"][2] for x in trials} == {1, 8}, trials
    counts = sorted(len(x["steps"]) for x in trials)
    # Every finalist the same steps; the close ones more (when two medians are close).
    assert t.TRIAL_STEPS <= counts[0] <= t.MAX_TRIAL_STEPS, counts
    assert counts[-1] == counts[0] or counts[-1] >= counts[0] + t.EXTRA_STEPS, counts
    medians = [sorted(x["steps"])[len(x["steps"]) // 2] for x in trials]
    fastest = trials[medians.index(min(medians))]["fields"]
    assert r0["plan"] == fastest, (r0["plan"], trials)
    assert r0["decided_by"] == "trials", r0["summary"]
    for r in (r0, r1):
        assert r["again_equal"] and r["again_decided_by"] == "cached decision"
        assert r["again_trials_equal"]
        assert r["fresh_decided_by"] == "trials" and r["fresh_trials_differ"]


def test_a_cached_profile_is_fitted_to_the_launch_that_loads_it():
    for r in _GRID.results("relative"):
        assert r["measured_again"] == 0 and r["units_equal_names"]
        # The cached entry said 9 s per action and per step; this launch measured.
        assert r["second_action"] < 0.1 and r["second_step"] < 0.1, r


def test_the_trials_time_comes_from_the_environment_or_is_an_error_naming_it(monkeypatch):
    monkeypatch.delenv("MPMD_TRIAL_SECONDS", raising=False)
    assert t.trial_seconds() == t.TRIAL_SECONDS
    monkeypatch.setenv("MPMD_TRIAL_SECONDS", "0.5")
    assert t.trial_seconds() == 0.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("MPMD_TRIAL_SECONDS", bad)
        with pytest.raises(ValueError, match=f"MPMD_TRIAL_SECONDS='{bad}'"):
            t.trial_seconds()
