"""The planner's data-parallel mode on a mesh (issue 21): ``mpmd.plan(...,
group=mesh)`` with a "dp" dimension measures the dp group's all-reduce,
searches replicate and shard, picks shard where the memory limit rules
replicate out and replicate where nothing does; ``pipeline(mesh=mesh,
plan=plan)`` runs the plan's mode and trains exactly like one process
(tests/plan_dp_worker.py, a ("dp", "pp") = (2, 2) mesh of 4 gloo ranks); and
a plan's mode against a contradicting setting, in one process."""

from __future__ import annotations

import dataclasses

import pytest

from dist_harness import GridRun
from torch_mpmd.config import PipelineConfig
from torch_mpmd.planning import CostSheet, Unit, plan_from_sheet

_GRID = GridRun(4, "plan_dp_worker:grid", [dict(id="dp_plans", kind="dp_plans")], task="dp",
                timeout=300)


def _check_step(rank: int, what: str, step: dict) -> None:
    assert step["loss"] <= 1, f"rank {rank} {what}: loss off by {step['loss']} tolerances"
    assert step["grads"], f"rank {rank} {what}: holds no parameter"
    bad = {n: d for n, d in step["grads"].items() if d > 1}
    assert not bad, f"rank {rank} {what}: gradients off (inf: missing): {bad}"


def test_plan_on_a_dp_mesh_picks_shard_under_a_tight_limit_and_trains_like_one_process():
    results = _GRID.results("dp_plans")
    r0 = results[0]
    # The same plans on every rank.
    for key in ("free", "tight", "limit", "smallest_peaks", "auto_plan"):
        assert all(r[key] == r0[key] for r in results), (key, [r[key] for r in results])
    # The sheet knows the dp group: its size and measured all-reduce rates.
    size, latency, bandwidth = r0["sheet_dp"]
    assert size == 2 and latency > 0 and bandwidth > 0, r0["sheet_dp"]
    assert sum(r["measured"] for r in results) == 2  # each replica's pipeline rank 0
    assert all(r["measured_again"] == 0 and r["auto_measured"] == 0 for r in results)
    # No limit: replicate; a limit below every replicated candidate: shard, under it.
    assert r0["free"]["data_parallel"] == "replicate", r0["free_describe"]
    replicate_peak, shard_peak = r0["smallest_peaks"]
    assert shard_peak < r0["limit"] < replicate_peak, r0["smallest_peaks"]
    assert r0["tight"]["data_parallel"] == "shard", r0["tight_describe"]
    assert max(r0["tight"]["predicted_peak_bytes"]) <= r0["limit"]
    assert "data_parallel=shard" in r0["tight_describe"].splitlines()[0]
    for rank, r in enumerate(results):
        for name in ("free", "tight"):
            plan = r[name]
            assert r[f"{name}_config"] == [plan["data_parallel"], plan["schedule"],
                                           plan["num_microbatches"], plan["split_points"]]
            _check_step(rank, name, r[f"{name}_step"])
        _check_step(rank, "plan='auto'", r["auto_step"])
        assert r["auto_plan"]["data_parallel"] == "shard"
        assert r["contradiction"] and "data_parallel='replicate' contradicts the plan's " \
            "data_parallel='shard'" in r["contradiction"], r["contradiction"]
    # Every parameter has an owner in each replica, under both plans.
    model_params = {"inp.weight", "inp.bias", "head.weight", "head.bias"} | {
        f"blocks.{i}.0.{k}" for i in range(4) for k in ("weight", "bias")}
    for name in ("free", "tight"):
        for replica in range(2):
            owned = set().union(*(set(results[replica * 2 + pp][f"{name}_owned"])
                                  for pp in range(2)))
            assert owned == model_params, (name, replica, owned ^ model_params)


def _shard_plan():
    sheet = CostSheet([Unit("a", 1, 1, 1, 100, 100, 7), Unit("b", 1, 1, 1, 50, 200, 3)],
                      global_batch=2, pp_size=2, dp_size=2, dp_latency=0.25, dp_bandwidth=100)
    return plan_from_sheet(sheet, data_parallel="shard", num_microbatches=2)


def test_a_plans_data_parallel_fills_the_setting_and_a_contradiction_names_both():
    plan = _shard_plan()
    assert plan.data_parallel == "shard"
    with pytest.raises(ValueError, match="data_parallel='replicate' contradicts the plan's "
                                         "data_parallel='shard'"):
        PipelineConfig.from_settings(plan=plan, data_parallel="replicate")
    # Without a mesh there is nothing to shard over: the error says whose mode it is.
    with pytest.raises(ValueError, match="the plan's data_parallel='shard' shards over the mesh"):
        PipelineConfig.from_settings(plan=plan)
    replicated = dataclasses.replace(plan, data_parallel="replicate")
    config = PipelineConfig.from_settings(plan=replicated)
    assert config.data_parallel == "replicate" and config.num_microbatches == 2
    assert "data_parallel=replicate" in config.shared_settings()["plan"]
