"""The lowered schedule a rank runs: resolved from a schedule name, a
Schedule or a text/CSV file and checked against the model's plan
(:func:`resolve_schedule`), and its forward and backward parts (:func:`part`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch_mpmd.schedules import (ActionKind, facts, Schedule, get_schedule,
                                  names as schedule_names)

__all__ = ["resolve_schedule", "part", "forward_only_text", "backward_only_text", "PART_KINDS"]

_K = ActionKind
# The kinds of each part of a step a call runs (kind_of): "forward" and "eval"
# run the forward part, "backward" (the compile door) the rest, "step" all.
PART_KINDS = {
    "forward": (_K.FORWARD, _K.SEND_F, _K.RECV_F),
    "backward": (_K.FULL_BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT, _K.SEND_B, _K.RECV_B,
                 _K.REDUCE_GRAD),
}
PART_KINDS["eval"] = PART_KINDS["forward"]


def part(schedule: Schedule, which: str) -> Schedule:
    """The forward or backward part of a lowered schedule (Schedule.part: a
    subsequence of a valid program keeps every channel's order, NOTE [Channel
    order], and forwards depend only on forwards, so it runs too)."""
    return schedule.part(PART_KINDS[which], name=f"{schedule.name}-{which}")


def forward_only_text(schedule: Schedule) -> str:
    """The forward part (F, SEND_F, RECV_F) of a lowered schedule, as text."""
    return part(schedule, "forward").to_text()


def backward_only_text(schedule: Schedule) -> str:
    """The backward part of a lowered schedule (see forward_only_text)."""
    return part(schedule, "backward").to_text()


def resolve_schedule(schedule: Any, *, pp_size: int, num_stages: int, num_microbatches: int,
                     edges: Sequence[tuple[int, int]], shard: bool = False,
                     reshard_after_forward: bool = False) -> Schedule:
    """The lowered, validated schedule for the plan: from a name, a Schedule, or
    a text/CSV file. Errors name the values that do not fit. ``shard``: the
    lowering places UNSHARD/RESHARD actions (sharded data parallel; a schedule
    given lowered keeps its own, and stages without them gather lazily: NOTE
    [Lazy gather] in sharding.py)."""
    spr = num_stages // pp_size
    if isinstance(schedule, str) and schedule in schedule_names():
        row = facts(schedule)
        if row.v_placement and spr != row.fixed_stages_per_rank:
            raise ValueError(f"schedule {schedule!r} places {row.fixed_stages_per_rank} stages "
                             f"per rank (V shape); the model has {num_stages} stages on "
                             f"pp_size={pp_size} ranks ({spr} per rank)")
        sched = get_schedule(schedule, num_ranks=pp_size, num_microbatches=num_microbatches,
                             stages_per_rank=spr)
    elif isinstance(schedule, Schedule):
        sched = schedule
    elif isinstance(schedule, (str, os.PathLike)) and os.path.isfile(schedule):
        path = os.fspath(schedule)
        if path.endswith(".csv"):
            sched = Schedule.from_csv(path)
        else:
            with open(path, encoding="utf-8") as f:
                sched = Schedule.from_text(f.read())
    else:
        raise ValueError(f"schedule={schedule!r} is neither a schedule name "
                         f"({', '.join(schedule_names())}), a Schedule, nor an existing "
                         "text/CSV file")
    if (sched.num_ranks, sched.num_stages, sched.num_microbatches) != (
            pp_size, num_stages, num_microbatches):
        raise ValueError(
            f"schedule '{sched.name}' has {sched.num_ranks} ranks, {sched.num_stages} stages and "
            f"{sched.num_microbatches} microbatches; the pipeline has pp_size={pp_size}, "
            f"{num_stages} stages and num_microbatches={num_microbatches}")
    if sched.is_lowered:
        if sorted(sched.edges) != sorted(edges):
            raise ValueError(f"lowered schedule '{sched.name}' has stage edges {sched.edges}, "
                             f"the model's plan has {sorted(edges)}; pass it compute-only")
    else:
        sched = sched.with_edges(sorted(edges))
        sched = (sched.lower(shard=True, reshard_after_forward=reshard_after_forward) if shard
                 else sched.lower())
    sched.validate()
    return sched
