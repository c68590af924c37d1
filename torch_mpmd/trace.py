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
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank_timeline", "step_metrics", "bubble_fractions", "transfer_latencies",
           "gather_timelines", "chrome_trace",
           "simulate_measured", "save_measured_timeline"]

Row = list[tuple[str, float, float]]  # (action, start s, end s)

_COMPUTE = ("F", "B", "I", "W")


def action_kind(token: str) -> str:
    """The kind of an action in text form: "F" for "2F0", "SEND_F" for "0SEND_F2->3"."""
    body = token.split("->")[0].split("<-")[0]
    return body.strip("0123456789")


def rank_timeline(program: Sequence[str], trace: Sequence[tuple[int, int, int]],
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
    compute = sum(e - s for t, s, e in row if action_kind(t) in _COMPUTE)
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


_TRANSFER = re.compile(r"^(\d+)(SEND|RECV)_([FB])(\d+)(?:(?:->|<-)(\d+))?$")


def _transfer_key(token: str) -> tuple[str, int, int, int] | None:
    """(direction, sending stage, receiving stage, microbatch) of a SEND/RECV token."""
    match = _TRANSFER.match(token)
    if match is None:
        return None
    stage, op, direction, mb, peer = match.groups()
    stage, mb = int(stage), int(mb)
    # Without an arrow the peer is the adjacent stage: F flows up, B down.
    step = 1 if direction == "F" else -1
    if op == "SEND":
        return direction, stage, int(peer) if peer else stage + step, mb
    return direction, int(peer) if peer else stage - step, stage, mb


def transfer_latencies(rows: Sequence[Row]) -> list[float]:
    """Seconds from the begin of each SEND to the end of its RECV, for the
    transfers whose receiver was already waiting when the send began (all
    ranks' rows on one clock): what a message took to arrive, as the simulator's
    ``comm_latency`` models it."""
    sends: dict[tuple[str, int, int, int], float] = {}
    recvs: dict[tuple[str, int, int, int], tuple[float, float]] = {}
    for row in rows:
        for token, start, end in row:
            key = _transfer_key(token)
            if key is None:
                continue
            if "SEND" in token:
                sends[key] = start
            else:
                recvs[key] = (start, end)
    return [end - sends[key] for key, (start, end) in recvs.items()
            if key in sends and start <= sends[key]]


def gather_timelines(program: Sequence[str], trace: Sequence[tuple[int, int, int]],
                     programs: Sequence[Sequence[str]], group: Any) -> list[Row]:
    """Every rank's timeline of the last step, on every rank (collective over
    ``group``; ``programs`` are all ranks' programs, as in the schedule), in
    seconds from the earliest begin of any rank."""
    if group is None:
        return [rank_timeline(program, trace)]
    world = dist.get_world_size(group)
    local = torch.tensor([[i, b, e] for i, b, e in trace], dtype=torch.int64).reshape(-1, 3)
    count = torch.tensor([local.shape[0]], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c) for c in counts)
    padded = torch.zeros((longest, 3), dtype=torch.int64)
    padded[:local.shape[0]] = local
    everyone = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    traces = [[tuple(int(v) for v in row) for row in t[:int(c)].tolist()]
              for t, c in zip(everyone, counts)]
    origin = min((t[0][1] for t in traces if t), default=0)
    return [rank_timeline(programs[r], traces[r], origin) for r in range(world)]


def chrome_trace(rows: Sequence[Row], *, title: str = "torch_mpmd step") -> dict[str, Any]:
    """A Chrome trace (JSON object format): one process per rank, one span per action."""
    events: list[dict[str, Any]] = []
    for rank, row in enumerate(rows):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        for token, start, end in row:
            kind = action_kind(token)
            events.append({"name": token, "cat": kind, "ph": "X", "pid": rank, "tid": 0,
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(path: str | os.PathLike, rows: Sequence[Row], **kwargs: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(rows, **kwargs), f)


def simulate_measured(schedule: Any, rows: Sequence[Row], *,
                      comm_latency_s: float = 0.0) -> Any:
    """The simulator's run of ``schedule`` with each stage's measured median
    F/B/I/W times (ms) from ``rows``, timeline included: what the schedule
    would do with no runtime overhead and every message arriving
    ``comm_latency_s`` after it is sent (default: free communication)."""
    by_stage_kind: dict[int, dict[str, list[float]]] = {}
    for row in rows:
        for t, s, e in row:
            if action_kind(t) in _COMPUTE:
                stage = int(t[:len(t) - len(t.lstrip("0123456789"))])
                by_stage_kind.setdefault(stage, {}).setdefault(action_kind(t), []).append(
                    (e - s) * 1e3)
    stage_costs = {st: {k: statistics.median(v) for k, v in kinds.items()}
                   for st, kinds in by_stage_kind.items()}
    return schedule.simulate(costs={k: 1e-3 for k in _COMPUTE}, stage_costs=stage_costs,
                             comm_latency=comm_latency_s * 1e3, timeline=True)


def save_measured_timeline(schedule: Any, rows: Sequence[Row],
                           path: str | os.PathLike) -> None:
    """PNG: the measured timeline (ms) above the simulated one, whose compute
    costs are the measured medians per stage and kind (so the two compare)."""
    from torch_mpmd.schedules._plot import _import_matplotlib, add_legend, draw_timeline

    Figure, FigureCanvasAgg, _ = _import_matplotlib()
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
    fig.savefig(os.fspath(path), dpi=110)
