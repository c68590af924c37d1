"""Python API of torch_mpmd.schedules over the C++ core (see schedules/__init__.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from torch_mpmd import _C, schedules
from torch_mpmd.schedules import Action, ActionKind, DeadlockError, Schedule, kind_name

ROOT = Path(__file__).resolve().parents[1]
# Every schedule of the table (csrc/core/schedules/table.cpp): a new row joins
# the grids below without an edit here.
TABLE_NAMES = schedules.schedule_names()

# Two ranks that each receive before they send: rank 0 waits for 1SEND_B0,
# which comes after 1RECV_F0, which waits for 0SEND_F0, which comes after 0RECV_B0.
DEADLOCK = [["0F0", "0RECV_B0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]


def make(name="1f1b", p=4, m=8, spr=1):
    return schedules.get_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=spr)


def test_contract_snippet_returns_makespan_and_per_rank_metrics():
    s = schedules.get_schedule("1f1b", num_ranks=4, num_microbatches=8, stages_per_rank=1)
    low = s.lower()
    r = low.simulate(costs={"F": 1, "B": 2, "I": 1, "W": 1})
    assert isinstance(r.makespan, float)
    assert len(r.bubble_fraction) == 4 and len(r.peak_activations) == 4
    assert r.peak_activations == [4, 3, 2, 1]
    assert low.is_lowered and not s.is_lowered
    assert isinstance(s.to_csv(), str) and isinstance(s.to_text(), str)


def test_names_are_the_tables_and_the_readme_documents_each():
    assert schedules.names() == TABLE_NAMES == list(_C.schedule_names())
    readme = (ROOT / "README.md").read_text()
    assert [n for n in TABLE_NAMES if not re.search(rf"\b{re.escape(n)}\b", readme)] == []


def _generator_definitions() -> set[str]:
    """The generators csrc/core/schedules defines (``Schedule makeX(const ScheduleSpec& spec)``)."""
    found = set()
    for path in (ROOT / "csrc" / "core" / "schedules").glob("*.cpp"):
        found |= set(re.findall(r"^Schedule (make\w+)\(const ScheduleSpec& spec\) \{",
                                path.read_text(), re.M))
    return found


def test_every_generator_has_a_table_row_and_every_row_a_generator():
    table = (ROOT / "csrc" / "core" / "schedules" / "table.cpp").read_text()
    rows = dict(re.findall(r'^\s*\{"(\w+)", (make\w+),', table, re.M))
    assert sorted(rows) == sorted(TABLE_NAMES)
    assert set(rows.values()) == _generator_definitions(), "a generator without a row, or a row without one"
    for name in TABLE_NAMES:  # each row's generator makes the schedule of its name
        f = schedules.facts(name)
        s = make(name, p=2, m=f.min_microbatches(2), spr=f.typical_stages_per_rank)
        assert s.name == name


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_pythons_facts_are_the_cores_and_its_generators(name):
    f = schedules.facts(name)
    assert f == schedules.ScheduleFacts(**_C.schedule_facts(name))
    for p in (1, 3):
        v, least = f.typical_stages_per_rank, f.min_microbatches(p)
        assert least == _C.min_microbatches(name, p)
        s = make(name, p=p, m=least, spr=v)
        assert s.splits_backward == f.splits_backward
        assert f.family == ("split backward" if f.splits_backward else "whole backward")
        placement = _C.v_placement(p) if f.v_placement else _C.loop_placement(p, v)
        assert list(s.stage_to_rank) == placement
        if least > 1:
            with pytest.raises(ValueError, match=rf"num_microbatches={least - 1} must be >= .*"
                                                 rf"num_ranks={p}.* for {name}"):
                make(name, p=p, m=least - 1, spr=v)
        if f.max_stages_per_rank is not None:
            with pytest.raises(ValueError, match=rf"stages_per_rank={f.max_stages_per_rank + 1} "
                                                 rf"is not supported by {name}"):
                make(name, p=p, m=least, spr=f.max_stages_per_rank + 1)
    assert f.default_stages_per_rank == schedules.default_stages_per_rank(name)
    if f.same_at_one_stage:
        assert make(name, p=3, m=5, spr=1).actions == make(f.same_at_one_stage, p=3, m=5).actions


def test_the_default_is_pipelines_and_a_table_row():
    from torch_mpmd.config import PipelineConfig

    d = schedules.DEFAULT
    assert d.schedule in TABLE_NAMES and PipelineConfig(num_microbatches=2).schedule == d.schedule
    assert d.num_microbatches >= schedules.facts(d.schedule).min_microbatches(1)
    assert d.schedule_for(None) == d.schedule == d.schedule_for(1)
    several = schedules.facts(d.schedule_for(2))
    assert several.same_at_one_stage == d.schedule and several.takes_stages_per_rank(2)
    assert schedules.V_SCHEDULES == tuple(n for n in TABLE_NAMES if schedules.facts(n).v_placement)
    with pytest.raises(ValueError, match="'nope'"):
        schedules.facts("nope")


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_every_named_schedule_constructs_and_simulates_for_a_valid_spec(name):
    errors = []
    for spr in (1, 2):
        try:
            s = make(name, p=4, m=8, spr=spr)
        except ValueError as e:
            errors.append(str(e))
            continue
        assert (s.name, s.num_ranks, s.num_stages, s.stages_per_rank) == (name, 4, 4 * spr, spr)
        assert len(s.actions) == 4 and all(s.actions)
        result = s.simulate()
        assert result.makespan > 0 and all(0 <= b < 1 for b in result.bubble_fraction)
        return
    pytest.fail(f"{name} accepts neither 1 nor 2 stages per rank: {errors}")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 2), (2, 7), (4, 8), (4, 16), (8, 8)])
def test_gpipe_and_1f1b_match_closed_form_makespan_and_bubble(name, p, m):
    result = make(name, p=p, m=m).simulate(costs={"F": 1, "B": 2})
    assert result.makespan == 3 * (m + p - 1)
    assert result.bubble_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_zero_bubble_has_smaller_bubble_than_1f1b_at_same_memory():
    costs = {"F": 1, "B": 2, "I": 1, "W": 1}
    zb = make("zero_bubble").simulate(costs)
    one = make("1f1b").simulate(costs)
    assert max(zb.bubble_fraction) < min(one.bubble_fraction)
    assert zb.peak_activations == one.peak_activations


def test_bad_parameters_raise_value_error_naming_the_values():
    with pytest.raises(ValueError, match="num_ranks=0"):
        make("1f1b", p=0)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        make("gpipe", m=0)
    with pytest.raises(ValueError, match="stages_per_rank=1"):
        make("zbv", spr=1)


def test_counts_must_be_keyword_integers():
    with pytest.raises(TypeError):
        schedules.get_schedule("1f1b", 4, 8)  # type: ignore[misc]
    with pytest.raises(TypeError, match="num_ranks"):
        schedules.get_schedule("1f1b", num_ranks=4.0, num_microbatches=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_microbatches"):
        schedules.get_schedule("1f1b", num_ranks=4, num_microbatches=True)


def test_unknown_name_error_lists_every_known_name():
    with pytest.raises(ValueError, match="'no_such_schedule'") as info:
        make("no_such_schedule")
    for name in schedules.names():
        assert name in str(info.value)


@pytest.mark.parametrize("name,spr", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2),
                                      ("dualpipev", 2)])
def test_text_round_trip_preserves_compute_and_lowered_schedules(name, spr):
    s = make(name, spr=spr)
    for sched in (s, s.lower()):
        back = Schedule.from_text(sched.to_text())
        assert back == sched
        assert back.to_text() == sched.to_text()


def test_twenty_thousand_one_line_ranks_load_from_text_and_csv(tmp_path):
    # Loading checks the schedule; its per-channel counters were once a dense
    # rank x rank table (3.2 GB here). The memory bound itself is a GTest
    # (ScheduleIo.LoadingTwentyThousandOneLineRanksTakesMemoryLinearInTheText).
    p = 20_000
    text = "".join(f"{r}: {r}F0 {r}B0\n" for r in range(p))
    s = Schedule.from_text(text)
    assert (s.num_ranks, s.num_stages, s.num_microbatches) == (p, p, 1)
    assert s.action_text[-1] == [f"{p - 1}F0", f"{p - 1}B0"]
    path = tmp_path / "wide.csv"
    s.to_csv(path)
    assert Schedule.from_csv(path).actions == s.actions


# Loads, lowers and fully validates (lowering again and simulating) a text of
# `p` one-line ranks, two microbatches each, every other rank running its
# forwards swapped (so lowering must reorder the sends between neighbours);
# prints the growth of the process's peak RSS in KiB. In a fresh process: a
# peak left by earlier tests would hide the growth.
_WIDE_SCHEDULE_SCRIPT = """
import resource, sys
from torch_mpmd.schedules import Schedule
p = int(sys.argv[1])
lines = []
for r in range(p):
    f = (f"{r}F1 {r}F0" if r % 2 == 0 else f"{r}F0 {r}F1")
    lines.append(f"{r}: {f} {r}B0 {r}B1\\n")
text = "".join(lines)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
s = Schedule.from_text(text)
lowered = s.lower()
s.validate()
lowered.validate()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
assert lowered.num_ranks == p and len(lowered.actions[p // 2]) == 13, lowered.actions[p // 2]
print(len(text), grown)
"""


def test_twenty_thousand_one_line_ranks_lower_and_validate_in_memory_linear_in_the_text():
    # Lowering's receive order and per-channel counters were once rank x rank
    # tables: 3 GB and 9 s to lower 20,000 ranks (NOTE [Sparse channels] in
    # csrc/core/transfer_index.h). Memory decides; the timeout only catches a
    # hang (the quadratic version took ~30 s here).
    out = subprocess.run([sys.executable, "-c", _WIDE_SCHEDULE_SCRIPT, "20000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text_bytes, grown_kib = map(int, out.stdout.split())
    # ~17 MB measured for 724 KB of text (the Python lists of action strings
    # included); one 20,000 x 20,000 table of 8-byte offsets alone is 3.2 GB.
    assert grown_kib * 1024 < 200 * text_bytes, (grown_kib, text_bytes)


def test_csv_round_trip_through_a_file(tmp_path):
    s = make("interleaved_1f1b", spr=2)
    path = tmp_path / "sched.csv"
    text = s.to_csv(path)
    assert path.read_text() == text
    back = Schedule.from_csv(path)
    assert back.actions == s.actions
    assert back.stage_to_rank == s.stage_to_rank
    assert back.num_microbatches == s.num_microbatches


def test_csv_in_torch_format_with_idle_cells_loads(tmp_path):
    # What torch.distributed.pipelining's _dump_csv writes for 1F1B, p=2, m=2:
    # None (idle) slots become empty cells.
    path = tmp_path / "torch.csv"
    path.write_text("0F0,0F1,,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n")
    s = Schedule.from_csv(path)
    assert s.action_text == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert (s.num_ranks, s.num_stages, s.num_microbatches) == (2, 2, 2)
    assert s.simulate().makespan == 3 * (2 + 2 - 1)


@pytest.mark.parametrize("text,token", [("0: 0F0 0X1", "0X1"), ("0: 0F0 0F", "0F"),
                                        ("0: 0F0 F0", "F0"), ("0: 0F99999999999", "0F99999999999")])
def test_malformed_text_raises_value_error_naming_the_token(text, token):
    with pytest.raises(ValueError, match=f"'{token}'"):
        Schedule.from_text(text)


def test_from_actions_names_rank_position_and_token_of_a_bad_action():
    with pytest.raises(schedules.ParseError, match=r"rank 1, action 2: .*'1Q0'"):
        Schedule.from_actions([["0F0", "0B0"], ["1F0", "1B0", "1Q0"]])
    assert issubclass(schedules.ParseError, ValueError)


def test_loaded_schedule_breaking_an_invariant_raises_value_error():
    with pytest.raises(ValueError, match="0F0"):
        Schedule.from_actions([["0F0", "0F0", "0B0"]])


@pytest.mark.parametrize("check", ["validate", "simulate"])
def test_deadlocking_schedule_raises_deadlock_error_naming_blocked_actions(check):
    s = Schedule.from_actions(DEADLOCK)
    with pytest.raises(DeadlockError) as info:
        getattr(s, check)()
    assert isinstance(info.value, RuntimeError)
    assert "0RECV_B0" in str(info.value) and "1RECV_F0" in str(info.value)


def test_with_edges_skip_connection_lowers_to_transfers_with_explicit_peer():
    s = make("1f1b", p=4, m=4)
    skip = s.with_edges(s.edges + [(0, 3)])
    assert (0, 3) in skip.edges and (0, 3) not in s.edges
    low = skip.lower()
    assert "0SEND_F0->3" in low.action_text[0]
    assert "3RECV_F0<-0" in low.action_text[3]
    assert Action(0, ActionKind.SEND_F, 0, 3) in low.actions[0]
    assert Action(3, ActionKind.RECV_F, 0, 0) in low.actions[3]
    assert Schedule.from_text(skip.to_text()).edges == skip.edges


def test_with_edges_rejects_bad_edges_and_lowered_schedules():
    s = make("1f1b", p=4, m=4)
    with pytest.raises(ValueError, match=r"\(3, 0\)"):
        s.with_edges([(3, 0)])
    with pytest.raises(ValueError, match="num_stages=4"):
        s.with_edges([(0, 4)])
    with pytest.raises(ValueError, match="lowered"):
        s.lower().with_edges(s.edges)


def test_to_csv_refuses_skip_edges_it_cannot_express():
    s = make("1f1b", p=4, m=4)
    with pytest.raises(ValueError, match="to_text"):
        s.with_edges(s.edges + [(0, 2)]).to_csv()


def test_simulate_lowers_a_compute_only_schedule_first():
    s = make("zero_bubble")
    assert s.simulate() == s.lower().simulate()


def test_lowering_twice_raises_value_error():
    with pytest.raises(ValueError, match="already lowered"):
        make().lower().lower()


def test_lower_without_grad_reduce_has_no_reduce_actions():
    s = make()
    assert any(a.kind == ActionKind.REDUCE_GRAD for row in s.lower().actions for a in row)
    assert not any(a.kind == ActionKind.REDUCE_GRAD
                   for row in s.lower(grad_reduce=False).actions for a in row)


@pytest.mark.parametrize("costs,key", [({"F": 1, "X": 2}, "'X'"), ({"B": -1}, "'B'"),
                                       ({"W": float("nan")}, "'W'"), ({"F": "1"}, "'F'")])
def test_simulate_rejects_unknown_or_invalid_costs_naming_the_key(costs, key):
    with pytest.raises(ValueError, match=key):
        make().simulate(costs)


def test_simulate_rejects_negative_link_parameters():
    with pytest.raises(ValueError, match="comm_latency"):
        make().simulate(comm_latency=-1)
    with pytest.raises(ValueError, match="stage_costs"):
        make().simulate(stage_costs=[{"F": 1}])


def test_slower_stage_and_comm_latency_lengthen_the_makespan():
    s = make("1f1b", p=4, m=8)
    base = s.simulate().makespan
    assert s.simulate(stage_costs={3: {"F": 2, "B": 4}}).makespan > base
    assert s.simulate(stage_costs=[{}, {}, {}, {"F": 2, "B": 4}]).makespan > base
    assert s.simulate(comm_latency=0.5).makespan > base
    assert s.simulate(message_bytes=100, comm_bandwidth=100).makespan > base


def test_action_overhead_costs_each_action_of_a_serial_pipeline():
    s = make("gpipe", p=2, m=2)  # lowered: every rank's actions are ordered by data
    base = s.simulate(costs={"F": 1, "B": 2}).makespan
    with_overhead = s.simulate(costs={"F": 1, "B": 2}, action_overhead=0.1).makespan
    assert with_overhead > base
    # At most every action of the lowered program delays the end once.
    assert with_overhead <= base + 0.1 * sum(len(row) for row in s.lower().actions) + 1e-9
    with pytest.raises(ValueError, match="action_overhead"):
        s.simulate(action_overhead=-1)


def test_step_overhead_adds_once_to_the_makespan():
    s = make("1f1b", p=2, m=4)
    base = s.simulate(costs={"F": 1, "B": 2}).makespan
    assert s.simulate(costs={"F": 1, "B": 2}, step_overhead=0.75).makespan == \
        pytest.approx(base + 0.75)
    with pytest.raises(ValueError, match="step_overhead"):
        s.simulate(step_overhead=-1)


def test_measured_step_overhead_is_the_wall_time_outside_the_timeline():
    from torch_mpmd import trace

    s = make("1f1b", p=2, m=2)
    rows = s.simulate(costs={"F": 1, "B": 2}, timeline=True).timeline
    span = max(r[-1][2] for r in rows) - min(r[0][1] for r in rows)
    assert trace.step_overhead(span + 0.5, rows) == pytest.approx(0.5)
    assert trace.step_overhead(span - 1, rows) == 0.0


def test_timeline_covers_every_lowered_action_with_its_cost():
    s = make("1f1b", p=2, m=3)
    result = s.simulate(costs={"F": 1, "B": 2}, timeline=True)
    assert s.simulate().timeline is None
    assert [[a for a, _, _ in row] for row in result.timeline] == s.lower().actions
    for row in result.timeline:
        for action, start, end in row:
            assert 0 <= start <= end <= result.makespan
            if action.is_compute:
                assert end - start == {"F": 1, "B": 2}[kind_name(action.kind)]


def test_actions_are_typed_values_whose_str_is_the_text_form():
    low = make("1f1b", p=2, m=2).lower()
    assert [[str(a) for a in row] for row in low.actions] == low.action_text
    first = low.actions[0][0]
    assert isinstance(first, Action) and first == Action(0, ActionKind.FORWARD, 0)
    assert (first.stage, first.kind, first.microbatch, first.peer_stage) == (
        0, ActionKind.FORWARD, 0, -1)
    send = next(a for a in low.actions[0] if a.kind == ActionKind.SEND_F)
    assert (send.peer_stage, str(send)) == (1, "0SEND_F0")  # the default peer is implied
    reduce = low.actions[1][-1]
    assert (reduce.kind, reduce.microbatch, str(reduce)) == (ActionKind.REDUCE_GRAD, -1,
                                                            "1REDUCE_GRAD")
    assert Action.parse("0SEND_F2->3") == Action(0, ActionKind.SEND_F, 2, 3)
    assert len({Action.parse("2F0"), Action(2, ActionKind.FORWARD, 0)}) == 1
    assert first != "0F0"  # typed: never equal to its text


def test_action_values_the_text_form_cannot_spell_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"Action\(stage=2, kind=REDUCE_GRAD, microbatch=3"):
        Action(2, ActionKind.REDUCE_GRAD, 3)
    with pytest.raises(ValueError, match="microbatch index"):
        Action(0, ActionKind.FORWARD)
    with pytest.raises(ValueError, match="peer_stage=1"):
        Action(0, ActionKind.FORWARD, 0, 1)
    with pytest.raises(ValueError, match="stage 0 has no previous stage"):
        Action(0, ActionKind.RECV_F, 0)


def test_actions_pickle_and_from_actions_takes_them():
    import pickle

    s = make("zbv", p=2, m=4, spr=2).lower()
    assert pickle.loads(pickle.dumps(s.actions)) == s.actions
    back = Schedule.from_actions(make("zbv", p=2, m=4, spr=2).actions, "zbv")
    assert back.actions == make("zbv", p=2, m=4, spr=2).actions


def test_part_keeps_the_actions_of_the_kinds_in_order():
    low = make("1f1b", p=2, m=2).lower()
    forward = (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F)
    part = low.part(forward, name="1f1b-forward")
    assert part.name == "1f1b-forward" and part.stage_to_rank == low.stage_to_rank
    assert part.actions == [[a for a in row if a.kind in forward] for row in low.actions]
    assert part.action_text == [["0F0", "0SEND_F0", "0F1", "0SEND_F1"],
                                ["1RECV_F0", "1F0", "1RECV_F1", "1F1"]]
    assert low.actions == make("1f1b", p=2, m=2).lower().actions  # the source is unchanged
    assert not low.splits_backward and make("zero_bubble", p=2, m=4).splits_backward


def test_schedule_is_immutable_and_returns_copies():
    s = make()
    with pytest.raises(AttributeError):
        s.name = "x"  # type: ignore[misc]
    s.actions[0].clear()
    s.action_text[0].clear()
    s.stage_to_rank.append(9)
    assert len(s.actions[0]) == 16 and s.stage_to_rank == [0, 1, 2, 3]
    assert len(s.action_text[0]) == 16


def test_table_and_repr_show_every_rank():
    s = make("1f1b", p=4, m=8)
    table = s.table()
    for r in range(4):
        assert f"rank {r} | {r}F0" in table
    assert "4 ranks, 4 stages, 8 microbatches" in table
    assert repr(s) == ("Schedule(name='1f1b', num_ranks=4, num_stages=4, num_microbatches=8, "
                       "is_lowered=False)")


def test_importing_the_package_does_not_import_torch():
    code = "import sys, torch_mpmd; torch_mpmd.schedules.names(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name,spr", [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_csv_cells_parse_identically_in_torch_pipelining(name, spr):
    """Our CSV is torch.distributed.pipelining's: every cell, compute-only and
    lowered, parses with torch's own action parser and prints back the same."""
    import csv
    import io

    from torch.distributed.pipelining.schedules import _Action

    sched = schedules.get_schedule(name, num_ranks=2, num_microbatches=4, stages_per_rank=spr)
    for text in (sched.to_csv(), sched.lower().to_csv()):
        rows = list(csv.reader(io.StringIO(text)))
        assert len(rows) == 2
        for row in rows:
            for cell in row:
                assert str(_Action.from_str(cell)) == cell
    # And torch-printed actions load back into the same schedule.
    torch_rows = [[str(_Action.from_str(str(a))) for a in rank] for rank in sched.actions]
    assert Schedule.from_actions(torch_rows).actions == sched.actions


# -- sharded data parallel: UNSHARD/RESHARD -----------------------------------


def test_lower_shard_gathers_each_stage_around_its_compute():
    low = make("1f1b", p=2, m=2).lower(shard=True)
    assert low.action_text == [
        ["0UNSHARD", "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1",
         "0RESHARD", "0REDUCE_GRAD"],
        ["1UNSHARD", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
         "1RESHARD", "1REDUCE_GRAD"],
    ]
    assert low.is_lowered
    low.validate()
    assert Schedule.from_text(low.to_text()) == low
    # The interleaved rank prefetches its second stage one compute ahead
    # (prefetch 1) or right before its first compute, above its RECV (0).
    inter = make("interleaved_1f1b", p=2, m=4, spr=2)
    assert inter.lower(shard=True).action_text[0][:4] == [
        "0UNSHARD", "0F0", "0SEND_F0", "2UNSHARD"]
    assert inter.lower(shard=True, unshard_prefetch=0).action_text[0][4:8] == [
        "0SEND_F1", "2UNSHARD", "2RECV_F0", "2F0"]
    split = make("gpipe", p=2, m=4, spr=2).lower(shard=True, reshard_after_forward=True)
    assert (split.action_text[0].count("0UNSHARD") == 2
            and split.action_text[0].count("2UNSHARD") == 1)


def test_lower_shard_rejects_a_negative_prefetch_and_sharded_input():
    with pytest.raises(ValueError, match="unshard_prefetch=-1"):
        make().lower(shard=True, unshard_prefetch=-1)
    with pytest.raises(ValueError, match="already lowered"):
        make().lower(shard=True).lower(shard=True)


def test_broken_unshard_windows_raise_value_error_naming_rank_and_action():
    with pytest.raises(ValueError, match=r"rank 0, action #3 '0B0'"):
        Schedule.from_actions([["0UNSHARD", "0F0", "0RESHARD", "0B0"]])
    with pytest.raises(ValueError, match=r"rank 0, action #0 '0UNSHARD'.*end of the program"):
        Schedule.from_actions([["0UNSHARD", "0F0", "0B0"]])
    with pytest.raises(ValueError, match="takes no microbatch"):
        Schedule.from_actions([["0UNSHARD3", "0F0", "0B0", "0RESHARD"]])


def test_simulate_counts_the_gather_and_overlaps_it_with_earlier_compute():
    # Two stages on one rank: 0F0 1F0 1B0 0B0. Gathers cost 3 and queue on one
    # collective stream. Prefetch 0: gather 0 [0,3], 0F0 [3,4], gather 1
    # [4,7], 1F0 [7,8], 1B0 [8,10], 0B0 [10,12]. Prefetch 1: gathers [0,3] and
    # [3,6]; 0F0 [3,4], 1F0 [6,7], 1B0 [7,9], 0B0 [9,11].
    s = Schedule.from_actions([["0F0", "1F0", "1B0", "0B0"]])
    costs = {"UNSHARD": 3}
    assert s.lower(shard=True, unshard_prefetch=0).simulate(costs).makespan == 12
    one = s.lower(shard=True).simulate(costs, timeline=True)
    assert one.makespan == 11
    assert one.busy == [6]
    assert [(str(a), s, e) for a, s, e in one.timeline[0][:3]] == [
        ("0UNSHARD", 0, 3), ("1UNSHARD", 3, 6), ("0F0", 3, 4)]
    assert s.lower(shard=True).simulate({"RESHARD": 1}).makespan == 6 + 2
    assert s.lower(shard=True).simulate(stage_costs={1: {"UNSHARD": 5}}).makespan == 10
    # REDUCE_GRAD is asynchronous too: 1REDUCE_GRAD [4,9] beside 0B0 [4,6],
    # then 0REDUCE_GRAD [9,14].
    assert s.simulate({"REDUCE_GRAD": 5}).makespan == 14


def test_plot_of_a_sharded_schedule_draws_the_collectives(tmp_path):
    from torch_mpmd.schedules.plot import KIND_COLOURS, save_timeline

    low = make("interleaved_1f1b", p=2, m=4, spr=2).lower(shard=True, reshard_after_forward=True)
    result = low.simulate({"UNSHARD": 0.5, "RESHARD": 0.1, "REDUCE_GRAD": 1}, timeline=True)
    path = tmp_path / "sharded.png"
    save_timeline(low, result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {ActionKind.UNSHARD, ActionKind.RESHARD} <= set(KIND_COLOURS)


@pytest.mark.parametrize("name,spr", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_sharded_csv_cells_parse_identically_in_torch_pipelining(name, spr):
    import csv
    import io

    from torch.distributed.pipelining.schedules import _Action

    low = make(name, p=2, m=4, spr=spr).lower(shard=True)
    for row in csv.reader(io.StringIO(low.to_csv())):
        for cell in row:
            assert str(_Action.from_str(cell)) == cell


def test_simulate_ends_a_tied_sum_after_its_last_member_posted_it():
    """A sum over the ranks of stages 0 and 3 (tied weights, interleaved on 2
    ranks): each rank posts it at its last REDUCE_GRAD of those stages; both
    ranks' steps end `cost` after the later post."""
    s = schedules.get_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=4,
                               stages_per_rank=2)
    plain = s.simulate(timeline=True)
    tied = s.simulate(cross_rank_reduces=[([0, 3], 5.0)], timeline=True)
    posts = [max(end for action, _, end in plain.timeline[r]
                 if str(action) in ("0REDUCE_GRAD", "3REDUCE_GRAD")) for r in range(2)]
    assert tied.makespan == pytest.approx(max(plain.makespan, max(posts) + 5.0))
    assert tied.makespan > plain.makespan


@pytest.mark.parametrize("bad, words", [
    ([([0, 9], 1.0)], "stages [0, 9]"),
    ([([0], 1.0)], "two or more stages"),
    ([([0, 1], -1.0)], "cost"),
    ([(0, 1.0)], "must be (stages, cost)"),
])
def test_simulate_rejects_bad_cross_rank_reduces_naming_them(bad, words):
    s = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=re.escape(words)):
        s.simulate(cross_rank_reduces=bad)
