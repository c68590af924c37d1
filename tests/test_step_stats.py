"""Step statistics per call, median stage times over the last steps, and timelines
over several steps (issue 13 item 11): one process, and two ranks for the gather."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from dist_harness import run_ranks
from torch_mpmd.schedules import kind_name


def _pipe(schedule: str = "zbv", m: int = 4):
    torch.manual_seed(0)
    model = models.MLP(d=8, depth=4, markers=False)
    return mpmd.pipeline(model, loss_fn=F.mse_loss, schedule=schedule, num_microbatches=m,
                         split_points=["blocks.2"])


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def test_last_step_stats_describe_that_step_alone_not_running_totals():
    pipe = _pipe("gpipe")
    x, y = _batch()
    seen = []
    for _ in range(3):
        pipe.step(x, target=y)
        seen.append(dict(pipe.last_step_stats))
    assert [(s["kind"], s["step"]) for s in seen] == [("step", 0), ("step", 1), ("step", 2)]
    assert all("steps" not in s for s in seen)  # no count of all runs
    program = pipe.schedule.actions[0]
    assert all(s["actions"] == len(program) for s in seen)
    # Each step alike (the simulator's bound), not a running maximum or sum.
    bound = pipe.schedule.simulate().peak_activations[0]
    assert [s["peak_live_forwards"] for s in seen] == [bound] * 3
    with torch.no_grad():
        pipe(x)
    stats = pipe.last_step_stats
    assert (stats["kind"], stats["step"]) == ("forward", 3)
    assert stats["actions"] < len(program) and stats["peak_live_forwards"] == 2 * 4
    assert stats["peak_state_values"] == 0  # nothing held for a backward


def test_stage_times_are_medians_per_local_stage_and_kind_over_the_last_steps():
    pipe = _pipe("zbv")
    x, y = _batch()
    for _ in range(3):
        pipe.step(x, target=y)
    times = pipe.stage_times()
    assert sorted(times) == [0, 1]
    assert all(set(kinds) == {"F", "I", "W"} for kinds in times.values())  # zbv: no B
    assert all(t > 0 for kinds in times.values() for t in kinds.values())
    # The medians of the durations the timelines show, for the steps asked for.
    spans: dict[tuple[int, str], list[float]] = {}
    for action, start, end in pipe.timelines(steps=2)[0]:
        if action.is_compute:
            spans.setdefault((action.stage, kind_name(action.kind)), []).append(end - start)
    for stage, kinds in pipe.stage_times(last_n=2).items():
        for kind, median in kinds.items():
            assert len(spans[(stage, kind)]) == 2 * 4  # 2 steps x 4 microbatches
            assert median == pytest.approx(statistics.median(spans[(stage, kind)]), rel=1e-6)


def test_stage_times_count_training_steps_only_and_need_one():
    pipe = _pipe("gpipe")
    x, y = _batch()
    with torch.no_grad():
        pipe(x)
    with pytest.raises(RuntimeError, match="no completed step"):
        pipe.stage_times()
    pipe.step(x, target=y)
    with torch.no_grad():
        pipe(x)
    assert set(pipe.stage_times()[1]) == {"F", "B"}  # the forward call's F is not counted
    with pytest.raises(ValueError, match="last_n=0"):
        pipe.stage_times(last_n=0)


def test_history_is_bounded_by_stats_window(tmp_path):
    pipe = _pipe("gpipe")
    pipe.stats_window = 2
    x, y = _batch()
    for _ in range(4):
        pipe.step(x, target=y)
    (row,) = pipe.timelines(steps=3)  # only 2 kept
    program = pipe.schedule.actions[0]
    assert [t for t, _, _ in row] == program * 2
    assert all(a[2] <= b[1] for a, b in zip(row, row[1:]))  # in time order, one clock
    with pytest.raises(ValueError, match="stats_window=0"):
        pipe.stats_window = 0
    pipe.stats_window = 1  # shrinking keeps the newest
    (row,) = pipe.timelines(steps=5)
    assert [t for t, _, _ in row] == program
    assert pipe.last_step_stats["step"] == 3


def test_save_trace_and_timeline_cover_several_steps(tmp_path):
    pipe = _pipe("zbv")
    x, y = _batch()
    for _ in range(3):
        pipe.step(x, target=y)
    pipe.save_trace(tmp_path / "t.json", steps=2)
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    assert [e["name"] for e in spans] == pipe.schedule.action_text[0] * 2
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(spans, spans[1:]))
    pipe.save_timeline(tmp_path / "t.png", steps=3)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_timelines_over_several_steps_on_two_ranks_line_up_per_step():
    run = run_ranks(2, "fault_worker:timelines_over_steps", 3, timeout=180)
    for rank, res in enumerate(run.results):
        programs = res["programs"]
        rows = res["rows"]
        assert len(rows) == 2
        for r, row in enumerate(rows):  # every rank's 3 steps, in order, on one clock
            assert [t for t, _, _ in row] == programs[r] * 3, (rank, r)
            assert all(a[2] <= b[1] + 1e-6 for a, b in zip(row, row[1:]))
        assert min(row[0][1] for row in rows) == 0.0
        assert set(res["stage_times"]) == {str(s) for s in res["local_stages"]}
    assert run.results[0]["rows"] == run.results[1]["rows"]  # the same picture on each rank


def test_compile_door_calls_record_their_own_stats_forward_then_backward():
    # The door's forward part and backward part go through the same step as
    # pipe.step (step.py): each completed call is what last_step_stats and
    # the history describe, the backward part as kind "backward".
    torch.manual_seed(0)
    model = models.MLP(d=8, depth=4, markers=False)
    compiled = torch.compile(model, backend="mpmd", options=dict(
        schedule="gpipe", num_microbatches=4, split_points=["blocks.2"]))
    x, y = _batch()
    out = compiled(x)
    pipe = mpmd.pipeline_of(compiled)
    forward = dict(pipe.last_step_stats)
    F.mse_loss(out, y).backward()
    backward = dict(pipe.last_step_stats)
    assert forward["kind"] == "forward" and backward["kind"] == "backward", (forward, backward)
    assert backward["step"] == forward["step"]          # one training step: both parts
    assert backward["actions"] > 0 and forward["actions"] > 0
    assert [r.kind for r in pipe.calls.records] == ["forward", "backward"]
    assert all(p.grad is not None for p in model.parameters())
    # The next training call counts a new step.
    compiled(x)
    assert pipe.last_step_stats["step"] == forward["step"] + 1
