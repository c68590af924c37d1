"""Cost-model conversion and the Python view of a simulation result.

Contract: :func:`cost_model` turns the keyword arguments of
``Schedule.simulate`` into a ``_C.CostModel`` and raises ``ValueError``
naming the offending key or parameter for an unknown cost key, a negative,
non-finite or non-numeric value, or a ``stage_costs`` of the wrong length.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from torch_mpmd import _C

#: Cost keys accepted by ``simulate(costs=...)`` -> field of ``_C.KindCosts``.
COST_KEYS: dict[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "backward_input",
    "W": "backward_weight",
    "REDUCE_GRAD": "reduce_grad",
    "UNSHARD": "unshard",
    "RESHARD": "reshard",
}

CostDict = Mapping[str, float]
Timeline = list[list[tuple[_C.Action, float, float]]]


def _non_negative(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what}={value!r} must be a number")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{what}={value!r} must be a finite number >= 0")
    return number


def _kind_costs(costs: Optional[CostDict], base: _C.KindCosts, where: str) -> _C.KindCosts:
    out = _C.KindCosts()
    for field in COST_KEYS.values():
        setattr(out, field, getattr(base, field))
    if costs is None:
        return out
    if not isinstance(costs, Mapping):
        raise ValueError(f"{where} must be a dict like {{'F': 1, 'B': 2}}, got {costs!r}")
    for key, value in costs.items():
        if key not in COST_KEYS:
            known = ", ".join(COST_KEYS)
            raise ValueError(f"unknown cost key {key!r} in {where}; expected one of {known}")
        setattr(out, COST_KEYS[key], _non_negative(f"{where}[{key!r}]", value))
    return out


def cost_model(
    costs: Optional[CostDict],
    stage_costs: Optional[Sequence[CostDict] | Mapping[int, CostDict]],
    num_stages: int,
    comm_latency: float,
    comm_bandwidth: float,
    message_bytes: float,
    cross_rank_reduces: Sequence[tuple[Sequence[int], float]] = (),
    action_overhead: float = 0.0,
    microbatch_costs: Optional[Sequence[float]] = None,
    num_microbatches: int = 0,
    step_overhead: float = 0.0,
) -> _C.CostModel:
    """Build a ``_C.CostModel``; ``stage_costs`` entries overlay ``costs``.

    ``stage_costs`` is either a sequence with one dict per stage or a mapping
    ``{stage: dict}`` for the stages that differ. ``cross_rank_reduces``:
    ``(stages, cost)`` per gradient sum over the ranks of several stages
    (tied weights; csrc/core/simulator.h). ``action_overhead``: the
    runtime's time per action, spent by the rank before each (NOTE [Action
    overhead] in csrc/core/simulator.h). ``microbatch_costs``: one relative
    size per microbatch (tokens, say); each microbatch's compute and transfer
    bytes scale by its size over the mean size (NOTE [Microbatch costs]), so
    the stage costs stay those of a mean microbatch. ``step_overhead``: the
    runtime's fixed time per step, outside every action, added to the
    makespan once.
    """
    model = _C.CostModel()
    model.costs = _kind_costs(costs, _C.KindCosts(), "costs")
    if stage_costs is not None:
        if isinstance(stage_costs, Mapping):
            for stage in stage_costs:
                if not isinstance(stage, int) or not 0 <= stage < num_stages:
                    raise ValueError(
                        f"stage_costs key {stage!r} is not a stage in 0..{num_stages - 1}"
                    )
            per_stage = [stage_costs.get(s) for s in range(num_stages)]
        else:
            per_stage = list(stage_costs)
            if len(per_stage) != num_stages:
                raise ValueError(
                    f"stage_costs has {len(per_stage)} entries, expected num_stages={num_stages}"
                )
        model.stage_costs = [
            _kind_costs(c, model.costs, f"stage_costs[{s}]") for s, c in enumerate(per_stage)
        ]
    model.comm_latency = _non_negative("comm_latency", comm_latency)
    model.action_overhead = _non_negative("action_overhead", action_overhead)
    model.step_overhead = _non_negative("step_overhead", step_overhead)
    model.comm_bandwidth = _non_negative("comm_bandwidth", comm_bandwidth)
    model.message_bytes = _non_negative("message_bytes", message_bytes)
    reduces = []
    for i, entry in enumerate(cross_rank_reduces):
        try:
            stages, cost = entry
            stages = [int(st) for st in stages]
        except (TypeError, ValueError):
            raise ValueError(f"cross_rank_reduces[{i}]={entry!r} must be (stages, cost)") from None
        bad = [st for st in stages if not 0 <= st < num_stages]
        if bad or len(stages) < 2:
            raise ValueError(f"cross_rank_reduces[{i}] names stages {stages}: it needs two or "
                             f"more stages in 0..{num_stages - 1}")
        reduce = _C.CrossRankReduce()
        reduce.stages = stages
        reduce.cost = _non_negative(f"cross_rank_reduces[{i}] cost", cost)
        reduces.append(reduce)
    model.cross_rank_reduces = reduces
    if microbatch_costs is not None:
        model.microbatch_scale = microbatch_scale(microbatch_costs, num_microbatches)
    return model


def microbatch_scale(microbatch_costs: Sequence[float], num_microbatches: int) -> list[float]:
    """Each microbatch's size over the mean size (NOTE [Microbatch costs]);
    ValueError naming a bad entry or a count that is not the schedule's."""
    sizes = [_non_negative(f"microbatch_costs[{i}]", c) for i, c in enumerate(microbatch_costs)]
    if len(sizes) != num_microbatches:
        raise ValueError(f"microbatch_costs has {len(sizes)} entries, the schedule "
                         f"{num_microbatches} microbatches")
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    if mean <= 0:
        raise ValueError("microbatch_costs are all 0: give each microbatch's relative size")
    return [c / mean for c in sizes]


@dataclass(frozen=True)
class SimulationResult:
    """Metrics of one simulated pipeline step (see csrc/core/simulator.h).

    ``bubble_fraction``, ``peak_activations`` and ``busy`` are per rank.
    ``timeline`` is, per rank, ``(action, start, end)`` for every action
    (a typed ``Action``) of the lowered program in order, or ``None`` unless
    ``timeline=True``.
    """

    makespan: float
    bubble_fraction: list[float]
    peak_activations: list[int]
    busy: list[float]
    messages: int
    comm_bytes: float
    timeline: Optional[Timeline] = None

    @classmethod
    def _from_cpp(
        cls, raw: _C.SimulationResult, actions: Optional[list[list[_C.Action]]]
    ) -> "SimulationResult":
        timeline = None
        if actions is not None:
            timeline = [
                [(a, start, end) for a, (start, end) in zip(row, spans)]
                for row, spans in zip(actions, raw.timeline)
            ]
        return cls(
            makespan=raw.makespan,
            bubble_fraction=list(raw.bubble_fraction),
            peak_activations=list(raw.peak_activations),
            busy=list(raw.busy),
            messages=raw.messages,
            comm_bytes=raw.comm_bytes,
            timeline=timeline,
        )
