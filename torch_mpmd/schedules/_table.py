"""What the schedule table says about each named schedule.

The table lives in the C++ core (csrc/core/schedules/table.h: one row per
schedule, next to its generator); this module is its Python view, read
through the bindings, so C++ and Python never keep their own lists::

    from torch_mpmd import schedules
    schedules.facts("zbv").min_stages_per_rank      # 2
    schedules.facts("zbv").min_microbatches(4)      # 4: m >= num_ranks
    schedules.schedule_names()                      # the table's order
    schedules.DEFAULT.schedule, schedules.DEFAULT.num_microbatches
"""

from __future__ import annotations

import dataclasses
import functools

from torch_mpmd import _C

__all__ = ["DEFAULT", "Default", "ScheduleFacts", "facts", "schedule_names", "table"]


@dataclasses.dataclass(frozen=True)
class ScheduleFacts:
    """One row of the schedule table."""

    name: str
    min_stages_per_rank: int
    max_stages_per_rank: int | None      # None: any number >= the minimum
    placement: str                       # "loop" (stage s on rank s % p) or "v"
    microbatches_per_rank: int           # it needs m >= this * num_ranks (0: any m >= 1)
    splits_backward: bool                # its programs hold I/W, not only B
    family: str                          # "split backward" or "whole backward"
    same_at_one_stage: str | None        # the schedule it is at one stage per rank
    default_stages_per_rank: int         # what it places when nothing else says
    typical_stages_per_rank: int         # the fewest that show what it is for (examples, trials)

    @property
    def v_placement(self) -> bool:
        return self.placement == "v"

    @property
    def fixed_stages_per_rank(self) -> int | None:
        """The one stages-per-rank count it takes, or None when it takes several."""
        fixed = self.max_stages_per_rank == self.min_stages_per_rank
        return self.min_stages_per_rank if fixed else None

    def takes_stages_per_rank(self, stages_per_rank: int) -> bool:
        return stages_per_rank >= self.min_stages_per_rank and (
            self.max_stages_per_rank is None or stages_per_rank <= self.max_stages_per_rank)

    def min_microbatches(self, num_ranks: int) -> int:
        """The fewest microbatches it takes on ``num_ranks`` ranks."""
        return max(1, self.microbatches_per_rank * num_ranks)


@functools.cache
def table() -> tuple[ScheduleFacts, ...]:
    """Every row, in the core's order."""
    return tuple(ScheduleFacts(**row) for row in _C.schedule_table())


def schedule_names() -> list[str]:
    """The names of the table, in its order (what ``get_schedule`` accepts)."""
    return [row.name for row in table()]


def facts(name: str) -> ScheduleFacts:
    """The row of ``name``; ValueError for an unknown name, listing the known ones."""
    for row in table():
        if row.name == name:
            return row
    raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(schedule_names())}")


@dataclasses.dataclass(frozen=True)
class Default:
    """What a user gets without naming a schedule: ``schedule`` (``pipeline()``'s
    default) and ``num_microbatches`` for a call that does not split its batch
    (the compile door; ``pipeline()`` asks for its count)."""

    schedule: str
    num_microbatches: int

    def schedule_for(self, stages_per_rank: int | None) -> str:
        """The default schedule at ``stages_per_rank`` (None: one): ``schedule``
        where it takes that many, else the schedule that is ``schedule`` at one
        stage per rank ("interleaved_1f1b" for 1f1b). ValueError naming the
        count when none takes it."""
        return _C.default_schedule(1 if stages_per_rank is None else stages_per_rank)


DEFAULT = Default(schedule=_C.DEFAULT_SCHEDULE, num_microbatches=_C.DEFAULT_MICROBATCHES)
