"""What a step did: per-action timelines from the executor, metrics, exports.

The C++ executor records the begin and end of every action it runs
(steady clock, ns). From those this module derives per-rank step metrics
(measured bubble: the share of the rank's step span not spent computing),
gathers the timelines of all ranks (a collective over the pipeline group),
and writes them as a Chrome trace (chrome://tracing, Perfetto) or as a PNG
with the measured timeline above the simulated one.

Clocks: ranks on one machine share CLOCK_MONOTONIC, so their timelines line
up; across machines each rank's clock has its own origin and the picture is
only approximately aligned (at the start of the step).

A Pipeline keeps a :class:`StepRecord` per completed call (a bounded
history): per-step statistics, the median F/B/I/W time of each local stage
over the last steps (:func:`stage_times`), and timelines over several steps.

Actions here are typed (``torch_mpmd.schedules.Action``): a row is
``(action, start, end)``; ``str(action)`` names a span in a Chrome trace.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.schedules import Action, ActionKind, kind_name

__all__ = ["action_kind", "action_overhead", "step_overhead", "rank_timeline", "step_metrics",
           "bubble_fractions", "transfer_latencies", "StepRecord", "stage_times",
           "gather_timelines", "chrome_trace", "write_chrome_trace", "simulate_measured",
           "save_measured_timeline"]

Row = list[tuple[Action, float, float]]  # (action, start s, end s)

# The compute kinds, in the order stage_times reports them (by kind_name).
_COMPUTE = (ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT,
            ActionKind.BACKWARD_WEIGHT)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
# SEND/RECV kinds -> (direction, is_send), for pairing a send with its receive.
_TRANSFERS = {ActionKind.SEND_F: ("F", True), ActionKind.RECV_F: ("F", False),
              ActionKind.SEND_B: ("B", True), ActionKind.RECV_B: ("B", False)}


def action_kind(action: Action) -> str:
    """The text name of an action's kind: "F" for 2F0, "SEND_F" for 0SEND_F2->3."""
    return kind_name(action.kind)


def rank_timeline(program: Sequence[Action], trace: Sequence[tuple[int, int, int]],
                  origin_ns: int | None = None) -> Row:
    """``(action, start, end)`` in seconds from ``origin_ns`` (default: the first begin)."""
    if not trace:
        return []
    origin = trace[0][1] if origin_ns is None else origin_ns
    return [(program[i], (b - origin) * 1e-9, (e - origin) * 1e-9) for i, b, e in trace]


def step_metrics(row: Row) -> dict[str, float]:
    """Compute time, span and measured bubble fraction of one rank's step."""
    if not row:
        return {"span_s": 0.0, "compute_s": 0.0, "bubble_fraction": 0.0}
    span = row[-1][2] - row[0][1]
    compute = sum(e - s for a, s, e in row if a.is_compute)
    return {"span_s": span, "compute_s": compute,
            "bubble_fraction": max(0.0, 1.0 - compute / span) if span > 0 else 0.0}


def bubble_fractions(rows: Sequence[Row]) -> list[float]:
    """Each rank's idle share of the whole step (all ranks' rows on one clock,
    as :func:`gather_timelines` returns them): 1 - compute / (last end - first
    begin over all ranks). The simulator's definition; ``step_metrics`` of one
    row measures against that rank's own span instead, which leaves out the
    time before its first and after its last action."""
    starts = [row[0][1] for row in rows if row]
    ends = [row[-1][2] for row in rows if row]
    if not starts:
        return [0.0] * len(rows)
    span = max(ends) - min(starts)
    if span <= 0:
        return [0.0] * len(rows)
    return [max(0.0, 1.0 - step_metrics(row)["compute_s"] / span) for row in rows]


def _transfer_key(action: Action) -> tuple[str, int, int, int]:
    """(direction, sending stage, receiving stage, microbatch) of a SEND/RECV."""
    direction, is_send = _TRANSFERS[action.kind]
    if is_send:
        return direction, action.stage, action.peer_stage, action.microbatch
    return direction, action.peer_stage, action.stage, action.microbatch


def transfer_latencies(rows: Sequence[Row]) -> list[float]:
    """Seconds from the begin of each SEND to the end of its RECV, for the
    transfers whose receiver was already waiting when the send began (all
    ranks' rows on one clock): what a message took to arrive, as the simulator's
    ``comm_latency`` models it."""
    sends: dict[tuple[str, int, int, int], float] = {}
    recvs: dict[tuple[str, int, int, int], tuple[float, float]] = {}
    for row in rows:
        for action, start, end in row:
            if action.kind not in _TRANSFERS:
                continue
            key = _transfer_key(action)
            if _TRANSFERS[action.kind][1]:
                sends[key] = start
            else:
                recvs[key] = (start, end)
    return [end - sends[key] for key, (start, end) in recvs.items()
            if key in sends and start <= sends[key]]


@dataclass(frozen=True)
class StepRecord:
    """What one completed call (``step``, ``forward``, ``eval_step``) did on
    this rank: the executor's trace and the call's own peaks (not totals)."""

    kind: str                               # "step", "forward", "eval", "backward"
    step: int                               # the pipeline's step counter during the call
    rank: int                               # this rank in the pipeline group
    programs: Sequence[Sequence[Action]]    # every rank's program of this kind of call
    trace: torch.Tensor                     # int64 [actions, 3]: action index, begin, end ns
    counters: dict[str, int]                # the executor's peaks in this call
    peak_activation_bytes: dict[int, int]   # per local stage
    # Per microbatch, the shape of its first tensor input: the sizes of
    # explicit microbatches of different lengths ("0F3" is microbatch 3's).
    microbatch_shapes: tuple[tuple[int, ...], ...] = ()
    peak_held_bytes: int = 0                # over all local stages at once
    peak_gathered_bytes: int = 0            # full parameters gathered at once (shard mode)
    peak_live_bytes: int = 0                # held + gathered + unreduced full gradients at once

    @property
    def program(self) -> Sequence[Action]:
        return self.programs[self.rank]

    def row(self, origin_ns: int | None = None) -> Row:
        """This rank's ``(action, start, end)`` (seconds from ``origin_ns``,
        default the call's first begin)."""
        return rank_timeline(self.program, self.trace.tolist(), origin_ns)

    def stats(self) -> dict[str, Any]:
        """The call's statistics (Pipeline.last_step_stats)."""
        return {"kind": self.kind, "step": self.step, "actions": int(self.trace.shape[0]),
                "peak_live_forwards": self.counters["peak_live_forwards"],
                "peak_buffered": self.counters["peak_buffered"],
                "peak_state_values": self.counters["peak_state_values"],
                "peak_activation_bytes": dict(self.peak_activation_bytes),
                "peak_held_bytes": self.peak_held_bytes,
                "peak_gathered_bytes": self.peak_gathered_bytes,
                "peak_live_bytes": self.peak_live_bytes,
                "microbatch_shapes": [list(shape) for shape in self.microbatch_shapes],
                **step_metrics(self.row())}


def stage_times(records: Sequence[StepRecord], last_n: int | None = None
                ) -> dict[int, dict[str, float]]:
    """Per local stage, the median seconds of its F, B, I and W actions (the
    kinds its program runs) over the last ``last_n`` training-step records
    (default: all given); forward and eval calls are left out (no backward
    follows their forwards, so their F is not a training F)."""
    steps = [r for r in records if r.kind == "step"]
    if last_n is not None:
        steps = steps[-last_n:] if last_n > 0 else []
    times: dict[int, dict[str, list[float]]] = {}
    for rec in steps:
        program = rec.program
        for i, b, e in rec.trace.tolist():
            action = program[i]
            if action.is_compute:
                times.setdefault(action.stage, {}).setdefault(
                    kind_name(action.kind), []).append((e - b) * 1e-9)
    order = [kind_name(k) for k in _COMPUTE]
    return {stage: {k: statistics.median(kinds[k]) for k in order if k in kinds}
            for stage, kinds in sorted(times.items())}


_KIND_CODES = {"step": 0, "forward": 1, "eval": 2, "backward": 3}


def gather_timelines(records: Sequence[StepRecord], group: Any, timeout_s: float,
                     wait: Any) -> list[Row]:
    """Every rank's timeline over the calls of ``records`` (this rank's last
    calls, oldest first), on every rank, in seconds from the earliest begin of
    any rank. Collective over ``group`` (the pipeline group; None: one rank):
    the ranks' histories hold the same calls (NOTE [Lockstep]); each sends its
    last ``min`` over the ranks of ``len(records)``. Each all_gather is bounded
    by ``timeout_s`` and waited for by ``wait(work, what)``."""
    from torch_mpmd.parallel import lockstep

    if group is None:
        origin = min((int(rec.trace[0, 1]) for rec in records if rec.trace.numel()), default=0)
        return [[t for rec in records for t in rec.row(origin)]]
    world = dist.get_world_size(group)
    count = torch.tensor([len(records)], dtype=torch.int64)
    counts = torch.zeros(world, 1, dtype=torch.int64)
    wait(lockstep.all_gather(list(counts.unbind(0)), count, group, timeout_s),
         "the gathering of timelines (all_gather of their lengths)")
    k = int(counts.min())
    mine = records[len(records) - k:] if k else []
    # Rows (call number, kind, action index, begin ns, end ns) of this rank's calls.
    parts = [torch.cat([torch.tensor([[j, _KIND_CODES[rec.kind]]], dtype=torch.int64)
                        .expand(rec.trace.shape[0], 2), rec.trace], dim=1)
             for j, rec in enumerate(mine)]
    local = torch.cat(parts) if parts else torch.zeros(0, 5, dtype=torch.int64)
    sizes = torch.zeros(world, 1, dtype=torch.int64)
    wait(lockstep.all_gather(list(sizes.unbind(0)), torch.tensor([local.shape[0]]), group,
                             timeout_s), "the gathering of timelines (all_gather of sizes)")
    longest = int(sizes.max())
    padded = torch.zeros(longest, 5, dtype=torch.int64)
    padded[:local.shape[0]] = local
    everyone = torch.zeros(world, longest, 5, dtype=torch.int64)
    wait(lockstep.all_gather(list(everyone.unbind(0)), padded, group, timeout_s),
         "the gathering of timelines (all_gather)")
    tables = [everyone[r, :int(sizes[r])].tolist() for r in range(world)]
    origin = min((t[0][3] for t in tables if t), default=0)
    # Call j is the same call on every rank: its programs are this rank's record's.
    for r in range(world):
        if any(kind != _KIND_CODES[mine[j].kind] for j, kind, _, _, _ in tables[r]):
            raise RuntimeError(f"the timelines of rank {r} are of other calls than this "
                               "rank's: the ranks' histories differ")
    return [[(mine[j].programs[r][i], (b - origin) * 1e-9, (e - origin) * 1e-9)
             for j, _, i, b, e in tables[r]] for r in range(world)]


def chrome_trace(rows: Sequence[Row], *, title: str = "torch_mpmd step") -> dict[str, Any]:
    """A Chrome trace (JSON object format): one process per rank, one span per action."""
    events: list[dict[str, Any]] = []
    for rank, row in enumerate(rows):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        for action, start, end in row:
            events.append({"name": str(action), "cat": action_kind(action), "ph": "X",
                           "pid": rank, "tid": 0,
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def _replace_atomically(path: str | os.PathLike, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader, or another process
    writing the same path, never sees a half-written file."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_chrome_trace(path: str | os.PathLike, rows: Sequence[Row], **kwargs: Any) -> None:
    """The rows as a Chrome trace JSON file (replaced atomically)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(rows, **kwargs), f)
    _replace_atomically(path, write)


def action_overhead(rows: Sequence[Row]) -> float:
    """Seconds the runtime spends per action in measured ``rows`` (NOTE [Action
    overhead] in csrc/core/simulator.h): on each rank, the gaps between one
    action's end and the next one's begin, and the SEND actions' own spans
    (posting a transfer), over the number of actions. Gaps over ten times the
    median gap (between two calls in rows of several) are left out."""
    gaps: list[float] = []
    posting = 0.0
    actions = 0
    for row in rows:
        actions += len(row)
        for (_, _, end), (action, start, _) in zip(row, row[1:]):
            gaps.append(max(0.0, start - end))
        posting += sum(e - s for a, s, e in row if a.kind in _SENDS)
    if not actions:
        return 0.0
    typical = statistics.median(gaps) if gaps else 0.0
    return (sum(g for g in gaps if g <= 10 * typical) + posting) / actions


def step_overhead(step_s: float, rows: Sequence[Row]) -> float:
    """Seconds of a measured step outside its actions: its wall time
    ``step_s`` (e.g. barrier to barrier) minus the span of its timeline
    ``rows`` (one call's, Pipeline.timelines()), at least 0."""
    starts = [row[0][1] for row in rows if row]
    ends = [row[-1][2] for row in rows if row]
    return max(0.0, step_s - (max(ends) - min(starts))) if starts else step_s


def simulate_measured(schedule: Any, rows: Sequence[Row], *,
                      comm_latency_s: float = 0.0, action_overhead_s: float = 0.0,
                      step_overhead_s: float = 0.0, statistic: str = "median") -> Any:
    """The simulator's run of ``schedule`` with each stage's measured median
    F/B/I/W times (ms) from ``rows``, timeline included: what the schedule
    would do with every message arriving ``comm_latency_s`` after it is sent,
    ``action_overhead_s`` of runtime before each action and
    ``step_overhead_s`` per step outside the actions (defaults: free
    communication, no runtime overhead; :func:`transfer_latencies`,
    :func:`action_overhead` and :func:`step_overhead` measure them).
    ``statistic``: "median" (robust to a stray slow action) or "mean" (a
    step's total compute, which the step time follows) of each stage and
    kind's measured times."""
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic={statistic!r} must be 'median' or 'mean'")
    summary = statistics.median if statistic == "median" else statistics.fmean
    by_stage_kind: dict[int, dict[str, list[float]]] = {}
    for row in rows:
        for a, s, e in row:
            if a.is_compute:
                by_stage_kind.setdefault(a.stage, {}).setdefault(action_kind(a), []).append(
                    (e - s) * 1e3)
    stage_costs = {st: {k: summary(v) for k, v in kinds.items()}
                   for st, kinds in by_stage_kind.items()}
    return schedule.simulate(costs={kind_name(k): 1e-3 for k in _COMPUTE},
                             stage_costs=stage_costs,
                             comm_latency=comm_latency_s * 1e3,
                             action_overhead=action_overhead_s * 1e3,
                             step_overhead=step_overhead_s * 1e3, timeline=True)


def save_measured_timeline(schedule: Any, rows: Sequence[Row],
                           path: str | os.PathLike) -> None:
    """PNG: the measured timeline (ms) above the simulated one, whose compute
    costs are the measured medians per stage and kind (so the two compare)."""
    from torch_mpmd.schedules.plot import import_matplotlib, add_legend, draw_timeline

    Figure, FigureCanvasAgg, _ = import_matplotlib()
    ms_rows = [[(t, s * 1e3, e * 1e3) for t, s, e in row] for row in rows]
    sim = simulate_measured(schedule, rows)
    measured_span = max((row[-1][2] for row in ms_rows if row), default=1e-9)
    span = max(measured_span, sim.makespan, 1e-9)
    width_in = min(40.0, max(10.0, 0.5 * schedule.num_microbatches * schedule.stages_per_rank
                             + 4.0))
    ranks = len(rows)
    fig = Figure(figsize=(width_in, 2.0 + 1.1 * ranks), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    ppu = (width_in - 1.5) * 72 / span
    kinds = draw_timeline(top, ms_rows, span, ppu)
    kinds += draw_timeline(bottom, sim.timeline, span, ppu)
    bubbles = bubble_fractions(rows)
    top.set_title(f"measured: {schedule.name}, {schedule.num_ranks} ranks, "
                  f"{schedule.num_microbatches} microbatches; step {measured_span:.1f} ms, "
                  f"bubble per rank {', '.join(f'{b:.0%}' for b in bubbles)}")
    bottom.set_title(f"simulated with the measured median costs per stage: makespan {sim.makespan:.1f} ms, "
                     f"bubble per rank "
                     f"{', '.join(f'{b:.0%}' for b in sim.bubble_fraction)}")
    bottom.set_xlabel("ms")
    add_legend(fig, top, kinds)
    _replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
