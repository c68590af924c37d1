"""Planning on paper (issue 21): cost sheets, plans, the search against brute force, its errors."""

from __future__ import annotations

import json

import pytest

from torch_mpmd import planning
from torch_mpmd.planning import CostSheet, Plan, Unit, evaluate_plan, plan_from_sheet
from torch_mpmd.schedules import facts, get_schedule, schedule_names


def _sheet(blocks: int = 6, pp: int = 2, batch: int = 8, **kw) -> CostSheet:
    units = [Unit("embed", 0.1, 0.1, 0.0, saved_bytes=1e6, param_bytes=4e6, output_bytes=1e6)]
    units += [Unit(f"blocks.{i}", 1.0 + 0.25 * (i % 3), 1.0, 1.0, saved_bytes=8e6, param_bytes=2e6,
                   output_bytes=1e6) for i in range(blocks)]
    units.append(Unit("head", 2.0, 2.0, 2.0, saved_bytes=16e6, param_bytes=4e6))
    args = dict(global_batch=batch, pp_size=pp, input_bytes=1e4, action_overhead=0.01,
                link_latency=0.005, link_bandwidth=1e9)
    args.update(kw)
    return CostSheet(units, **args)


def _costs(sheet: CostSheet, starts: list[int], scale: float) -> tuple[list[dict], list[float]]:
    """Per-stage costs and link seconds, from the sheet by hand (the planner's model, no
    recompute; NOTE [The first stage's backward] in csrc/core/planner.cpp)."""
    n = len(sheet.units)
    ends = starts[1:] + [n]
    stage_costs, link = [], []
    for s, (a, b) in enumerate(zip(starts, ends)):
        us = sheet.units[a:b]
        f = sum(u.forward for u in us) * scale
        i = sum(u.backward_input for u in us) * scale
        w = sum(u.backward_weight for u in us) * scale
        if a == 0:  # the model's inputs carry no gradient: the first stage's W does it all
            i, w = 0.0, i + w
        stage_costs.append({"F": f, "B": i + w, "I": i, "W": w})
        link.append(us[-1].output_bytes * scale / sheet.link_bandwidth if b < n else 0.0)
    return stage_costs, link


def _brute_step(sheet: CostSheet, name: str, v: int, m: int, split: list[str]) -> float:
    starts = [0] + [sheet.index_of(x) for x in split]
    costs, link = _costs(sheet, starts, sheet.global_batch / m / sheet.reference_microbatch)
    s = get_schedule(name, num_ranks=sheet.pp_size, stages_per_rank=v, num_microbatches=m)
    assert len(set(link[:-1])) == 1  # every cut carries the same bytes on these sheets
    r = s.lower(grad_reduce=False).simulate(
        stage_costs=costs, comm_latency=sheet.link_latency, comm_bandwidth=1.0,
        message_bytes=link[0], action_overhead=sheet.action_overhead)
    return r.makespan


def test_sheet_json_round_trip_and_file(tmp_path):
    sheet = _sheet(memory_limit=3e8, ranks_per_node=1, inter_node_bandwidth=5e8)
    assert CostSheet.from_json(sheet.to_json()) == sheet
    path = tmp_path / "sheet.json"
    sheet.to_json(path)
    assert CostSheet.from_json(path) == sheet
    # A hand-written sheet may give B alone: I and W take half each.
    data = json.loads(sheet.to_json())
    data["units"][1] = {"name": "blocks.0", "forward": 1.0, "backward": 2.0}
    assert CostSheet.from_dict(data).units[1].backward_input == 1.0


@pytest.mark.parametrize("change, message", [
    (lambda d: d["units"][2].update(forward=-1), "units[2].forward=-1 must be a finite number >= 0"),
    (lambda d: d["units"][2].update(name="embed"), "units[2].name='embed' repeats units[0]'s"),
    (lambda d: d["units"][2].update(colour=1), "unknown key 'colour' in units[2]"),
    (lambda d: d.update(pp_size=0), "pp_size=0 must be an int >= 1"),
    (lambda d: d.update(pp_size=99), "pp_size=99 is more than the sheet's 8 units"),
    (lambda d: d.update(global_batch=2.5), "global_batch=2.5 must be an int >= 1"),
    (lambda d: d.update(link_bandwidth=float("inf")), "link_bandwidth=inf must be a finite number"),
    (lambda d: d.update(units=[]), "units=[] must hold at least one unit"),
    (lambda d: d.update(speed=3), "unknown key 'speed' in the cost sheet"),
    (lambda d: d.pop("global_batch"), "the cost sheet has no 'global_batch'"),
])
def test_bad_sheets_name_the_value(change, message):
    data = json.loads(_sheet().to_json())
    change(data)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        CostSheet.from_dict(data)


def test_plan_json_round_trip_keeps_fields_and_search():
    plan = plan_from_sheet(_sheet(), top_k=3)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.search == plan.search
    assert len(plan.search.top) <= 3
    assert plan.search.top[0].schedule == plan.schedule
    # An edited plan is a plan: its fields, no search record.
    data = json.loads(plan.to_json())
    del data["search"]
    data["num_microbatches"] = 4
    edited = Plan.from_dict(data)
    assert edited.num_microbatches == 4 and edited.search is None
    with pytest.raises(ValueError, match="unknown key 'colour' in the plan"):
        Plan.from_dict({**data, "colour": 1})
    with pytest.raises(ValueError, match="recompute has 1 flags for"):
        Plan.from_dict({**data, "recompute": [False]})


def test_the_plan_is_never_worse_than_brute_force_over_a_grid():
    sheet = _sheet(blocks=6, pp=2, batch=8)
    plan = plan_from_sheet(sheet)
    grid = []
    for name in schedule_names():
        if name == "looped_bfs":
            continue  # (left out of this brute-force grid, as it always was: its time)
        v = facts(name).typical_stages_per_rank
        for m in (2, 4, 8):
            if m < facts(name).min_microbatches(sheet.pp_size):
                continue
            split = list(evaluate_plan(sheet, name, num_microbatches=m, stages_per_rank=v).split_points)
            step = _brute_step(sheet, name, v, m, split)
            # The planner's own evaluation agrees with the simulation by hand.
            assert evaluate_plan(sheet, name, num_microbatches=m, stages_per_rank=v,
                                 split_points=split).predicted_step_s == pytest.approx(step)
            grid.append((step, name, v, m))
    best = min(grid)
    assert plan.predicted_step_s <= best[0] * (1 + 1e-9), (plan.describe(), best)
    # Every split of 1F1B's 8 units into 2 stages: the min-max one the search picks is no worse.
    one = plan_from_sheet(sheet, schedules="1f1b", num_microbatches=8)
    for cut in range(1, len(sheet.units)):
        step = _brute_step(sheet, "1f1b", 1, 8, [sheet.units[cut].name])
        assert one.predicted_step_s <= step * (1 + 1e-9)


def test_memory_limit_is_respected_and_forces_a_change():
    sheet = _sheet(blocks=14, pp=4, batch=16)
    free = plan_from_sheet(sheet)
    limit = max(free.predicted_peak_bytes) * 0.8
    tight = plan_from_sheet(sheet, memory_limit=limit)
    assert max(tight.predicted_peak_bytes) <= limit
    assert all(max(c.predicted_peak_bytes) <= limit for c in tight.search.top)
    assert tight.predicted_step_s >= free.predicted_step_s
    assert (any(tight.recompute) or (tight.schedule, tight.num_microbatches, tight.stages_per_rank)
            != (free.schedule, free.num_microbatches, free.stages_per_rank))
    text = tight.describe()
    assert "over the memory limit (rejected)" in text and free.schedule in text
    # The predicted peak is what evaluate_plan says for the same fields.
    again = evaluate_plan(sheet, tight.schedule, num_microbatches=tight.num_microbatches,
                          stages_per_rank=tight.stages_per_rank, split_points=tight.split_points,
                          recompute=tight.recompute)
    assert again.predicted_peak_bytes == tight.predicted_peak_bytes
    assert again.predicted_step_s == pytest.approx(tight.predicted_step_s)
    # Without recompute the limit must be met by the schedule and m alone, or not at all.
    try:
        bare = plan_from_sheet(sheet, memory_limit=limit, recompute=False)
    except ValueError:
        pass
    else:
        assert not any(bare.recompute) and max(bare.predicted_peak_bytes) <= limit


def test_infeasible_limit_names_the_numbers():
    sheet = _sheet()
    with pytest.raises(ValueError) as info:
        plan_from_sheet(sheet, memory_limit=12345)
    text = str(info.value)
    assert "no plan fits memory_limit=" in text and "(12345 bytes)" in text
    assert "smallest predicted peak is" in text and " m=" in text
    smallest = float(text.split("smallest predicted peak is")[1].split("(")[1].split(" bytes")[0])
    assert smallest > 12345
    plan = plan_from_sheet(sheet, memory_limit=smallest)
    assert max(plan.predicted_peak_bytes) <= smallest


def test_user_constraints_are_kept():
    sheet = _sheet(blocks=14, pp=4, batch=16)
    plan = plan_from_sheet(sheet, schedules=["1f1b", "interleaved_1f1b"], num_microbatches=8)
    assert plan.schedule in ("1f1b", "interleaved_1f1b") and plan.num_microbatches == 8
    assert all(c.num_microbatches == 8 for c in plan.search.top)
    plan = plan_from_sheet(sheet, schedules="interleaved_1f1b", stages_per_rank=2)
    assert (plan.schedule, plan.stages_per_rank) == ("interleaved_1f1b", 2)
    assert len(plan.split_points) == 4 * 2 - 1 and len(plan.recompute) == 8
    with pytest.raises(ValueError, match="num_microbatches=2 must be >= num_ranks=4 for zbv"):
        plan_from_sheet(sheet, schedules="zbv", num_microbatches=2)
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        plan_from_sheet(sheet, schedules="fast")
    with pytest.raises(ValueError, match="num_microbatches=3 must divide global_batch=16"):
        plan_from_sheet(sheet, num_microbatches=3)
    with pytest.raises(ValueError, match="no unit named 'blocks.99'"):
        evaluate_plan(sheet, "1f1b", num_microbatches=4, split_points=["blocks.1", "blocks.2", "blocks.99"])


def test_describe_and_determinism():
    sheet = _sheet(blocks=14, pp=4, batch=16, memory_limit=2e8)
    a, b = plan_from_sheet(sheet), plan_from_sheet(sheet)
    assert a == b and a.search.top == b.search.top
    text = a.describe()
    for needle in ("plan (simulated)", "split_points", "recompute", "predicted step",
                   "predicted peak per rank", "top candidates", "candidates/s"):
        assert needle in text
    assert planning.plan_from_sheet is plan_from_sheet


def test_split_points_name_where_stages_start():
    sheet = _sheet(blocks=6, pp=2, batch=4)
    plan = evaluate_plan(sheet, "1f1b", num_microbatches=4, split_points=["blocks.3"])
    assert plan.split_points == ("blocks.3",)
    assert len(plan.predicted_peak_bytes) == 2
    # Brute force over every 2-way cut confirms the search's min-max split is optimal for 1f1b.
    weights = [u.forward + u.backward_input + u.backward_weight for u in sheet.units]
    best = min(max(sum(weights[:c]), sum(weights[c:])) for c in range(1, len(weights)))
    chosen = evaluate_plan(sheet, "1f1b", num_microbatches=4)
    cut = sheet.index_of(chosen.split_points[0])
    assert max(sum(weights[:cut]), sum(weights[cut:])) == best


# ------------------------------------------------------------------ data parallel


def _smallest_peak(sheet: CostSheet, **kw) -> float:
    """The smallest predicted peak of any candidate, as the infeasible error names it."""
    with pytest.raises(ValueError, match="smallest predicted peak is") as info:
        plan_from_sheet(sheet, memory_limit=1.0, **kw)
    return float(str(info.value).split("smallest predicted peak is")[1].split("(")[1].split(" bytes")[0])


def test_dp_sheet_json_round_trip_and_older_json():
    sheet = _sheet(dp_size=4, dp_latency=2e-5, dp_bandwidth=5e9)
    assert CostSheet.from_json(sheet.to_json()) == sheet
    assert json.loads(sheet.to_json())["dp_size"] == 4
    # A sheet written before data parallel: one replica, the link's rates.
    data = json.loads(_sheet().to_json())
    for key in ("dp_size", "dp_latency", "dp_bandwidth"):
        data.pop(key)
    old = CostSheet.from_dict(data)
    assert (old.dp_size, old.dp_latency, old.dp_bandwidth) == (1, None, None)
    assert old == _sheet()
    with pytest.raises(ValueError, match="dp_size=0 must be an int >= 1"):
        CostSheet.from_dict({**data, "dp_size": 0})
    with pytest.raises(ValueError, match="dp_bandwidth=-1 must be a finite number >= 0"):
        CostSheet.from_dict({**data, "dp_bandwidth": -1})


def test_dp_collectives_are_in_the_prediction():
    one = _sheet(blocks=6, pp=2, batch=8)
    dp = _sheet(blocks=6, pp=2, batch=8, dp_size=4, dp_latency=1e-3, dp_bandwidth=1e8)
    fields = dict(num_microbatches=4, split_points=["blocks.3"])
    base = evaluate_plan(one, "1f1b", **fields)
    rep = evaluate_plan(dp, "1f1b", **fields)
    shard = evaluate_plan(dp, "1f1b", data_parallel="shard", **fields)
    assert (rep.data_parallel, shard.data_parallel) == ("replicate", "shard")
    # Rank 0 ends the step: its all-reduce of embed + blocks 0-2 (10 MB) follows its last
    # backward, 2 (d-1) latency + 2 (d-1)/d bytes / bandwidth, and one more action.
    ar = 6 * 1e-3 + 1.5 * 10e6 / 1e8
    assert rep.predicted_step_s == pytest.approx(base.predicted_step_s + ar + 0.01)
    assert shard.predicted_step_s > base.predicted_step_s + ar / 2
    # Memory per rank: replicate keeps whole state; shard a quarter of it plus what it gathers.
    assert rep.predicted_peak_bytes[0] >= base.predicted_peak_bytes[0]
    assert shard.predicted_peak_bytes[0] < rep.predicted_peak_bytes[0]
    # With one replica nothing is priced, whatever the mode.
    assert evaluate_plan(one, "1f1b", data_parallel="shard", **fields).predicted_step_s == \
        base.predicted_step_s
    with pytest.raises(ValueError, match="data_parallel='zero3' must be one of"):
        evaluate_plan(dp, "1f1b", data_parallel="zero3", **fields)


def test_dp_mode_is_searched_and_the_memory_limit_flips_it():
    sheet = _sheet(blocks=6, pp=2, batch=8, dp_size=4, dp_latency=1e-3, dp_bandwidth=1e8)
    free = plan_from_sheet(sheet, top_k=20)
    assert {c.data_parallel for c in free.search.top} == {"replicate", "shard"}
    assert free.data_parallel == "replicate", free.describe()
    # Replicate is faster (or as fast) than the same plan sharded.
    same = evaluate_plan(sheet, free.schedule, num_microbatches=free.num_microbatches,
                         stages_per_rank=free.stages_per_rank, split_points=free.split_points,
                         recompute=free.recompute, data_parallel="shard")
    assert same.predicted_step_s >= free.predicted_step_s
    # A limit below every replicated candidate's peak: shard wins, within the limit.
    limit = _smallest_peak(sheet, data_parallel="replicate") * 0.99
    assert _smallest_peak(sheet, data_parallel="shard") < limit
    tight = plan_from_sheet(sheet, memory_limit=limit)
    assert tight.data_parallel == "shard", tight.describe()
    assert max(tight.predicted_peak_bytes) <= limit
    assert all(c.data_parallel == "shard" for c in tight.search.top)
    assert any(r.data_parallel == "replicate" and "over memory_limit" in r.reason
               for r in tight.search.rejected)
    text = tight.describe()
    assert "data_parallel=shard" in text.splitlines()[0]
    assert "data_parallel=replicate" in text  # the rejected, faster plans
    # Restricting the modes: replicate alone no longer fits; one replica searches replicate only.
    with pytest.raises(ValueError, match="no plan fits memory_limit"):
        plan_from_sheet(sheet, memory_limit=limit, data_parallel="replicate")
    one = plan_from_sheet(_sheet(blocks=6, pp=2, batch=8), top_k=20)
    assert {c.data_parallel for c in one.search.top} == {"replicate"}
    with pytest.raises(ValueError, match="data_parallel='zero3' is not a mode"):
        plan_from_sheet(sheet, data_parallel="zero3")


def test_plan_data_parallel_json_round_trip_and_older_json():
    sheet = _sheet(blocks=6, pp=2, batch=8, dp_size=4, dp_latency=1e-3, dp_bandwidth=1e8)
    plan = plan_from_sheet(sheet, data_parallel="shard")
    assert plan.data_parallel == "shard"
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.data_parallel == "shard" and back.search == plan.search
    data = json.loads(plan.to_json())
    del data["data_parallel"]
    del data["search"]
    assert Plan.from_dict(data).data_parallel == "replicate"  # a plan written before the mode
    old_search = json.loads(plan.to_json())["search"]
    for c in old_search["top"] + old_search["rejected"]:
        c.pop("data_parallel")
    again = Plan.from_dict({**json.loads(plan.to_json()), "search": old_search})
    assert {c.data_parallel for c in again.search.top} == {"replicate"}
    assert again == plan  # the search record takes no part in equality
    with pytest.raises(ValueError, match="data_parallel='zero3' must be one of"):
        Plan.from_dict({**data, "data_parallel": "zero3"})


def test_replan_keeps_the_first_stage_units_own_split_of_their_backward():
    # The first stage's I computes nothing (measured: I ~0, W the whole
    # backward); its units keep the profile's I/W ratio of the measured
    # total, so a split that moves them to a later stage still has their I.
    from torch_mpmd.planning.auto import replan_sheet

    profile = _sheet(blocks=2, pp=2, batch=8)  # embed, blocks.0, blocks.1, head
    times = {0: {"F": 3.0, "I": 0.01, "W": 5.99}, 1: {"F": 4.0, "I": 3.0, "W": 2.0}}
    sheet = replan_sheet(times, profile_sheet=profile, split_points=["blocks.1"],
                         num_stages=2, global_batch=8, num_microbatches=8, pp_size=2)
    embed, block0, block1, head = sheet.units
    # Stage 0 (embed, blocks.0; profile I 0.1 + 1.0, W 0.0 + 1.0): 6.0 shared 1.1 : 1.0.
    assert embed.backward_input + block0.backward_input == pytest.approx(6.0 * 1.1 / 2.1)
    assert embed.backward_weight + block0.backward_weight == pytest.approx(6.0 * 1.0 / 2.1)
    assert block0.backward_input == pytest.approx(6.0 * 1.0 / 2.1)
    # A later stage keeps its measured split, shared in the profile's proportions.
    assert block1.backward_input + head.backward_input == pytest.approx(3.0)
    assert block1.backward_weight + head.backward_weight == pytest.approx(2.0)
