"""Pipeline schedules: generate, load, lower, validate and simulate.

    from torch_mpmd import schedules
    s = schedules.get_schedule("1f1b", num_ranks=4, num_microbatches=8)
    r = s.lower().simulate(costs={"F": 1, "B": 2, "I": 1, "W": 1})
    r.makespan, r.bubble_fraction, r.peak_activations

All the work happens in the C++ core (csrc/core); this package is a thin,
immutable view over it. Actions are typed values (``Action``: ``stage``,
``kind`` (an ``ActionKind``), ``microbatch``, ``peer_stage``), built by the
core; ``str(action)`` is the text form (``"2F0"``, ``"0SEND_F2->3"``) and
only text a user wrote is parsed, by the core (``Action.parse``,
``Schedule.from_text``/``from_csv``/``from_actions``).

What the code asks about a named schedule (the stages per rank it takes,
its placement, its minimum microbatch count, whether it splits the
backward) is one table in the core, read here: ``facts(name)``,
``schedule_names()``, ``DEFAULT`` (what a user gets without naming one).

Errors: ``ValueError`` (``ScheduleError``, ``ParseError``) for bad parameters
or malformed text, naming the values or the token; ``DeadlockError`` (a
``RuntimeError``) when ranks wait on each other forever. CLI:
``python -m torch_mpmd.schedules show --help``.
"""

from __future__ import annotations

import operator

from torch_mpmd import _C
from torch_mpmd.schedules._schedule import Schedule
from torch_mpmd.schedules._simulation import SimulationResult
from torch_mpmd.schedules._table import (DEFAULT, Default, ScheduleFacts, facts, schedule_names,
                                         table)

Action = _C.Action
ActionKind = _C.ActionKind
DeadlockError = _C.DeadlockError
ParseError = _C.ParseError
ScheduleError = _C.ScheduleError

__all__ = [
    "Action",
    "ActionKind",
    "DEFAULT",
    "DeadlockError",
    "Default",
    "ParseError",
    "Schedule",
    "ScheduleError",
    "ScheduleFacts",
    "V_SCHEDULES",
    "default_stages_per_rank",
    "facts",
    "SimulationResult",
    "get_schedule",
    "kind_name",
    "names",
    "schedule_names",
    "table",
]


# The schedules on the V placement (two stages per rank: stage r and 2p-1-r
# on rank r), from the table.
V_SCHEDULES = tuple(row.name for row in table() if row.v_placement)


def default_stages_per_rank(name: object) -> int:
    """Stages per rank a schedule called ``name`` places when nothing else says
    (its table row's; 1 for a name the table does not hold)."""
    if isinstance(name, str) and name in schedule_names():
        return facts(name).default_stages_per_rank
    return 1


def kind_name(kind: ActionKind) -> str:
    """The text name of a kind: ``"F"``, ``"SEND_B"``, ``"REDUCE_GRAD"``."""
    return _C.kind_name(kind)


def names() -> list[str]:
    """Names ``get_schedule`` accepts, in the core's order (``schedule_names()``)."""
    return schedule_names()


def _count(what: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None
    if not -(2**31) <= number < 2**31:
        raise ValueError(f"{what}={number} is out of range")
    return number


def get_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """Generate the compute-only schedule ``name`` and fully validate it.

    Raises ``ValueError`` for an unknown name (listing ``names()``) or
    parameters the schedule cannot take (naming the values), ``TypeError``
    for non-integer counts.
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {name!r}")
    cpp = _C.make_schedule(
        name,
        num_ranks=_count("num_ranks", num_ranks),
        stages_per_rank=_count("stages_per_rank", stages_per_rank),
        num_microbatches=_count("num_microbatches", num_microbatches),
    )
    _C.validate(cpp)
    return Schedule(cpp)
