"""Plans: the planner's choice (schedule, m, v, split, recompute, data-parallel mode) and why.

``plan_from_sheet`` runs the C++ search (csrc/core/planner.h) on a
``CostSheet`` and returns a ``Plan``: the fields ``pipeline()`` takes
(``schedule``, ``num_microbatches``, ``stages_per_rank``, ``split_points``:
the names of the units where stages 1.. start, ``data_parallel``:
"replicate" or "shard", searched when the sheet's ``dp_size`` > 1) plus
``recompute`` per stage and the predictions (``predicted_step_s``,
``predicted_peak_bytes`` per rank),
all simulated, never measured. ``evaluate_plan`` predicts a plan the caller
fixes (a published configuration, a hand-edited plan).

Contract: ``Plan.from_json(plan.to_json()) == plan`` (a plan's JSON
without ``data_parallel``, written before it existed, loads as
"replicate"); the search record
(``plan.search``: the top candidates, the rejected ones, the counts) travels
with the plan for ``describe()`` and in its JSON but takes no part in
equality. Errors are ``ValueError`` naming the values: a bad sheet, a
constraint no schedule takes, a split naming no unit, and, when nothing fits
the memory limit, the smallest predicted peak, the limit and the plan that
gave it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch_mpmd import _C
from torch_mpmd.planning.sheet import CostSheet, json_text, read_json
from torch_mpmd.schedules import default_stages_per_rank

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Candidate", "Plan", "Rejected", "SearchRecord", "Trial", "evaluate_plan",
           "plan_from_sheet"]

_GIB = float(1 << 30)
_MODES = ("replicate", "shard")  # parallel/sharding.py's DATA_PARALLEL_MODES


def _gib(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB"


@dataclass(frozen=True)
class Candidate:
    """One candidate the search kept: its fields and predictions."""

    schedule: str
    stages_per_rank: int
    num_microbatches: int
    split_points: tuple[str, ...]
    recompute: tuple[bool, ...]
    predicted_step_s: float
    predicted_peak_bytes: tuple[float, ...]
    comm_aware_split: bool = False
    data_parallel: str = "replicate"
    refined_split: bool = False     # moved by the search's local refinement


@dataclass(frozen=True)
class Rejected:
    """A candidate that lost for a reason other than its time (``step_s``: None if never simulated)."""

    schedule: str
    stages_per_rank: int
    num_microbatches: int
    reason: str
    step_s: Optional[float] = None
    max_peak_bytes: float = 0.0
    data_parallel: str = "replicate"


@dataclass(frozen=True)
class Trial:
    """A finalist run for real (planning/trials.py): its fields, its
    prediction, and its timed steps on the real group (seconds, barrier to
    barrier), whose median decided. ``default``: the configuration a user
    writes first, run beside the finalists."""

    schedule: str
    stages_per_rank: int
    num_microbatches: int
    split_points: tuple[str, ...]
    recompute: tuple[bool, ...]
    predicted_step_s: float
    steps_s: tuple[float, ...]
    data_parallel: str = "replicate"
    default: bool = False

    @property
    def measured_step_s(self) -> float:
        """The median of the timed steps."""
        return statistics.median(self.steps_s) if self.steps_s else math.inf

    def label(self) -> str:
        return (f"{self.schedule} v={self.stages_per_rank} m={self.num_microbatches} "
                f"split {_short(self.split_points)}"
                + (f" recompute {list(self.recompute)}" if any(self.recompute) else ""))


@dataclass(frozen=True)
class SearchRecord:
    """What the search saw: its best candidates, the rejected, the counts and its
    time; and what decided: the trials, the planning's phases in seconds
    (``profile_s``, ``search_s``, ``trials_s``) and ``decided_by``
    ("trials", "prediction" or "cached decision")."""

    top: tuple[Candidate, ...] = ()
    rejected: tuple[Rejected, ...] = ()
    candidates: int = 0
    simulations: int = 0
    search_s: float = 0.0
    memory_limit: float = 0.0
    trials: tuple[Trial, ...] = ()
    profile_s: float = 0.0
    trials_s: float = 0.0
    decided_by: str = "prediction"


@dataclass(frozen=True)
class Plan:
    """A pipeline plan and its simulated predictions; see the module docstring."""

    schedule: str
    num_microbatches: int
    stages_per_rank: int
    split_points: tuple[str, ...]
    recompute: tuple[bool, ...]
    predicted_step_s: float
    predicted_peak_bytes: tuple[float, ...]
    data_parallel: str = "replicate"
    search: Optional[SearchRecord] = field(default=None, compare=False, repr=False)
    # The sheet it was planned on (mpmd.plan's profile; Pipeline.replan reads it).
    # In memory only: not in the JSON, not compared.
    sheet: Optional[CostSheet] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", tuple(self.split_points))
        object.__setattr__(self, "recompute", tuple(bool(r) for r in self.recompute))
        object.__setattr__(self, "predicted_peak_bytes", tuple(float(b) for b in self.predicted_peak_bytes))
        if self.data_parallel not in _MODES:
            raise ValueError(f"data_parallel={self.data_parallel!r} must be one of "
                             f"{', '.join(map(repr, _MODES))}")
        stages = len(self.split_points) + 1
        if len(self.recompute) != stages:
            raise ValueError(f"recompute has {len(self.recompute)} flags for {stages} stages "
                             f"(split_points={list(self.split_points)})")

    # -- JSON -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("search", "sheet")}
        out["split_points"] = list(self.split_points)
        out["recompute"] = list(self.recompute)
        out["predicted_peak_bytes"] = list(self.predicted_peak_bytes)
        if self.search is not None:
            out["search"] = dataclasses.asdict(self.search)
        return out

    def to_json(self, path: Optional[PathLike] = None) -> str:
        """The plan as JSON text (with its search record); also written to ``path`` when given."""
        return json_text(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """A plan from its JSON object (``to_dict``); every field's type is
        checked first (ValueError naming the field, the value and what it
        must be), so that a hand-edited ``"100"`` is no number here."""
        values = _json_fields(cls, data, "the plan")
        search = values.pop("search", None)
        if search is not None:
            record = _json_fields(SearchRecord, search, "the plan's search")
            record["top"] = tuple(
                Candidate(**{**c, "split_points": tuple(c["split_points"]),
                             "recompute": tuple(c["recompute"]),
                             "predicted_peak_bytes": tuple(c["predicted_peak_bytes"])})
                for c in (_json_fields(Candidate, c, f"the plan's search.top[{i}]")
                          for i, c in enumerate(record.get("top", ()))))
            record["rejected"] = tuple(
                Rejected(**_json_fields(Rejected, r, f"the plan's search.rejected[{i}]"))
                for i, r in enumerate(record.get("rejected", ())))
            record["trials"] = tuple(
                Trial(**{**t, "split_points": tuple(t["split_points"]),
                         "recompute": tuple(t["recompute"]), "steps_s": tuple(t["steps_s"])})
                for t in (_json_fields(Trial, t, f"the plan's search.trials[{i}]")
                          for i, t in enumerate(record.get("trials", ()))))
            search = SearchRecord(**record)
        return cls(**values, search=search)

    @classmethod
    def from_json(cls, text_or_path: Union[str, "os.PathLike[str]"]) -> "Plan":
        """A plan from JSON text, or from the file at a path."""
        return cls.from_dict(read_json(text_or_path, "the plan"))

    # -- text -------------------------------------------------------------
    def planning_summary(self) -> str:
        """What decided and what planning cost: "decided by trials (3
        finalists and the default, measured 41.2 ms against the default's
        55.0 ms); planning 12.3 s: profile 6.1 s, search 0.05 s, trials 6.2 s"."""
        search = self.search
        if search is None:
            return "decided by prediction"
        head = f"decided by {'the ' if search.decided_by != 'trials' else ''}{search.decided_by}"
        if search.trials:
            default = [t for t in search.trials if t.default]
            mine = [t for t in search.trials
                    if (t.schedule, t.stages_per_rank, t.num_microbatches, t.split_points,
                        t.recompute) == (self.schedule, self.stages_per_rank,
                                         self.num_microbatches, self.split_points,
                                         self.recompute)]
            head += f" ({len(search.trials)} run"
            if mine:
                head += f", measured {mine[0].measured_step_s * 1e3:.1f} ms"
                if default:
                    head += f" against the default's {default[0].measured_step_s * 1e3:.1f} ms"
            head += ")"
        total = search.profile_s + search.search_s + search.trials_s
        return (f"{head}; planning {total:.1f} s: profile {search.profile_s:.1f} s, search "
                f"{search.search_s:.2f} s, trials {search.trials_s:.1f} s")

    def describe(self) -> str:
        """The plan, the top candidates and why the winner won (all simulated)."""
        peaks = ", ".join(_gib(b) for b in self.predicted_peak_bytes)
        rec = [s for s, r in enumerate(self.recompute) if r]
        lines = [
            f"plan (simulated): {self.schedule}, stages_per_rank={self.stages_per_rank}, "
            f"num_microbatches={self.num_microbatches}, data_parallel={self.data_parallel}",
            f"  split_points: {_short(self.split_points)}",
            f"  recompute: {'stages ' + ', '.join(map(str, rec)) if rec else 'none'}",
            f"  predicted step: {self.predicted_step_s:.4g} s",
            f"  predicted peak per rank: {peaks}",
        ]
        search = self.search
        if search is None:
            return "\n".join(lines)
        limit = f"memory_limit {_gib(search.memory_limit)}" if search.memory_limit else "no memory limit"
        rate = search.candidates / search.search_s if search.search_s > 0 else math.inf
        lines.append(f"search: {search.candidates} candidates, {search.simulations} simulations, "
                     f"{search.search_s * 1e3:.1f} ms ({rate:,.0f} candidates/s), {limit}")
        if search.top:
            lines.append("top candidates (least predicted step under the limit wins):")
            lines.append(f"  {'#':>2} {'schedule':<17} {'v':>2} {'m':>5} {'dp':>9} {'step s':>10} "
                         f"{'vs best':>8} {'max peak':>11} {'recompute':>9}  split")
            best = search.top[0].predicted_step_s
            for i, c in enumerate(search.top, 1):
                ratio = c.predicted_step_s / best if best > 0 else 1.0
                lines.append(
                    f"  {i:>2} {c.schedule:<17} {c.stages_per_rank:>2} {c.num_microbatches:>5} "
                    f"{c.data_parallel:>9} {c.predicted_step_s:>10.4g} {ratio:>7.3f}x "
                    f"{_gib(max(c.predicted_peak_bytes)):>11} "
                    f"{sum(c.recompute):>4}/{len(c.recompute):<4}  "
                    f"{'refined ' if c.refined_split else ''}"
                    f"{'comm-aware ' if c.comm_aware_split else ''}{_short(c.split_points)}")
        if search.trials:
            lines.extend(_trial_lines(self, search))
        faster = [r for r in search.rejected if r.step_s is not None]
        invalid = [r for r in search.rejected if r.step_s is None]
        if faster:
            lines.append("faster, but over the memory limit (rejected):")
            for r in faster:
                lines.append(f"  {r.schedule} v={r.stages_per_rank} m={r.num_microbatches} "
                             f"data_parallel={r.data_parallel}: {r.step_s:.4g} s; {r.reason}")
        if invalid:
            lines.append("not valid for this pipeline (rejected):")
            for r in invalid:
                lines.append(f"  {r.schedule} v={r.stages_per_rank}: {r.reason}")
        return "\n".join(lines)


# NOTE [Plan JSON types]: what each field of a plan's JSON (and of its search
# record) must hold. A hand-edited plan is read by Plan.from_dict; without
# these checks a string "100" where bytes go became 100.0 or failed deep in
# float() ("could not convert string to float"), "false" for a recompute flag
# became True, and a bytes string became one entry per character.
_JSON_KINDS: dict[str, str] = {
    "schedule": "str", "num_microbatches": "count", "stages_per_rank": "count",
    "split_points": "str list", "recompute": "bool list", "predicted_step_s": "number",
    "predicted_peak_bytes": "number list", "data_parallel": "str", "search": "object",
    "comm_aware_split": "bool", "refined_split": "bool", "reason": "str",
    "step_s": "number or null", "max_peak_bytes": "number",
    "top": "object list", "rejected": "object list", "candidates": "int",
    "simulations": "int", "search_s": "number", "memory_limit": "number",
    "trials": "object list", "profile_s": "number", "trials_s": "number", "decided_by": "str",
    "steps_s": "number list", "default": "bool",
}
_KIND_WORDS = {"str": "a string", "count": "an int >= 1", "int": "an int >= 0",
               "number": "a number", "bool": "true or false", "object": "a JSON object",
               "number or null": "a number or null"}
_LIST_WORDS = {"str list": "a list of strings", "bool list": "a list of true/false flags",
               "number list": "a list of numbers", "object list": "a list of JSON objects"}


def _json_kind_error(kind: str, value: object) -> Optional[str]:
    """What ``value`` must be, when it is not of ``kind`` (None when it is)."""
    if kind.endswith(" list"):
        if not isinstance(value, (list, tuple)):
            return _LIST_WORDS[kind]
        return None  # the entries are checked one by one
    ok = {"str": lambda v: isinstance(v, str),
          "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
          "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": lambda v: isinstance(v, bool),
          "object": lambda v: isinstance(v, Mapping),
          "number or null": lambda v: v is None or (isinstance(v, (int, float))
                                                    and not isinstance(v, bool))}[kind]
    return None if ok(value) else _KIND_WORDS[kind]


def _json_fields(cls: type, data: object, where: str) -> dict[str, Any]:
    """``data``, the JSON object of a ``cls`` (Plan, Candidate, Rejected,
    SearchRecord), checked: a mapping, no unknown key, every field without a
    default there, each of its kind (NOTE [Plan JSON
    types]). ValueError naming the field, the value given and what it must be."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "sheet"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in {where}; known: {', '.join(sorted(fields))}")
    missing = sorted(n for n, f in fields.items() if n not in data
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where} has no {missing[0]!r}")
    for name, value in data.items():
        kind = _JSON_KINDS[name]
        if cls is Rejected and kind == "count":
            kind = "int"  # 0: rejected for every count (a schedule refused before any m)
        items = list(enumerate(value)) if kind.endswith(" list") and \
            isinstance(value, (list, tuple)) else []
        for label, v, k in [(name, value, kind),
                            *((f"{name}[{j}]", v, kind[:-5]) for j, v in items)]:
            want = _json_kind_error(k, v)
            if want is not None:
                raise ValueError(f"{where}: {label}={v!r} ({type(v).__name__}) must be {want}")
    return dict(data)


def _trial_lines(plan: "Plan", search: SearchRecord) -> list[str]:
    """describe()'s table of the trials: predicted, measured, which won."""
    lines = [f"trials ({search.decided_by} decided; planning: profile {search.profile_s:.1f} s, "
             f"search {search.search_s:.2f} s, trials {search.trials_s:.1f} s), the median "
             "of each finalist's steps, run interleaved, wins:",
             f"  {'':1} {'measured ms':>11} {'predicted ms':>12} {'pred/meas':>9}  finalist"]
    for t in search.trials:
        chosen = (t.schedule, t.stages_per_rank, t.num_microbatches, t.split_points,
                  t.recompute) == (plan.schedule, plan.stages_per_rank, plan.num_microbatches,
                                   plan.split_points, plan.recompute)
        measured = t.measured_step_s
        lines.append(f"  {'*' if chosen else ' '} {measured * 1e3:>11.1f} "
                     f"{t.predicted_step_s * 1e3:>12.1f} "
                     f"{t.predicted_step_s / measured if measured > 0 else math.nan:>9.2f}  "
                     f"{t.label()}{' (the default a user writes first)' if t.default else ''}")
    return lines


def _short(names: Sequence[str], keep: int = 6) -> str:
    if len(names) <= keep:
        return "[" + ", ".join(names) + "]"
    return "[" + ", ".join(names[:keep]) + f", ... ({len(names)} cuts)]"


def _as_list(what: str, value: object, kind: type) -> list:
    if value is None:
        return []
    if isinstance(value, kind):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        out = list(value)
        if all(isinstance(x, kind) and not isinstance(x, bool) for x in out):
            return out
    raise ValueError(f"{what}={value!r} must be a {kind.__name__} or a list of them")


def _candidate(sheet: CostSheet, c: _C.PlanCandidate) -> Candidate:
    return Candidate(
        schedule=c.schedule,
        stages_per_rank=c.stages_per_rank,
        num_microbatches=c.num_microbatches,
        split_points=tuple(sheet.units[i].name for i in c.stage_starts[1:]),
        recompute=tuple(c.recompute),
        predicted_step_s=c.step_seconds,
        predicted_peak_bytes=tuple(c.peak_bytes),
        comm_aware_split=c.comm_aware_split,
        data_parallel=c.data_parallel,
        refined_split=c.refined_split,
    )


def _plan(c: Candidate, search: Optional[SearchRecord]) -> Plan:
    return Plan(schedule=c.schedule, num_microbatches=c.num_microbatches,
                stages_per_rank=c.stages_per_rank, split_points=c.split_points,
                recompute=c.recompute, predicted_step_s=c.predicted_step_s,
                predicted_peak_bytes=c.predicted_peak_bytes, data_parallel=c.data_parallel,
                search=search)


def plan_from_sheet(
    sheet: CostSheet,
    *,
    memory_limit: Optional[float] = None,
    schedules: Union[None, str, Sequence[str]] = None,
    num_microbatches: Union[None, int, Sequence[int]] = None,
    stages_per_rank: Union[None, int, Sequence[int]] = None,
    recompute: bool = True,
    top_k: int = 5,
    data_parallel: Union[None, str, Sequence[str]] = None,
    refine_split: bool = True,
) -> Plan:
    """The plan with the least simulated step whose predicted peak fits.

    ``memory_limit`` (bytes per rank; 0 for none) overrides the sheet's.
    ``schedules``, ``num_microbatches``, ``stages_per_rank`` and
    ``data_parallel`` ("replicate", "shard"; default both when the sheet's
    ``dp_size`` > 1) restrict the search to the given values (one or a
    list); ``recompute=False`` never recomputes. ``top_k`` candidates are
    kept for ``describe()``. ``refine_split=False`` keeps the min-max splits
    (NOTE [Split refinement] in csrc/core/planner_split.cpp: the finalists' splits
    moved where the simulated step is shorter).
    """
    if not isinstance(sheet, CostSheet):
        raise ValueError(f"sheet must be a CostSheet, got {type(sheet).__name__}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be an int >= 1")
    options = _C.SearchOptions()
    options.schedules = _as_list("schedules", schedules, str)
    options.microbatch_counts = _as_list("num_microbatches", num_microbatches, int)
    options.stages_per_rank = _as_list("stages_per_rank", stages_per_rank, int)
    options.allow_recompute = bool(recompute)
    options.data_parallel = _as_list("data_parallel", data_parallel, str)
    options.top_k = top_k
    options.refine_split = bool(refine_split)
    cpp = sheet.to_cpp(memory_limit)
    result = _C.plan_pipeline(cpp, options)
    search = SearchRecord(
        top=tuple(_candidate(sheet, c) for c in result.top),
        rejected=tuple(Rejected(r.schedule, r.stages_per_rank, r.num_microbatches, r.reason,
                                None if math.isnan(r.step_seconds) else r.step_seconds,
                                r.max_peak_bytes, r.data_parallel) for r in result.rejected),
        candidates=result.candidates,
        simulations=result.simulations,
        search_s=result.search_seconds,
        memory_limit=cpp.memory_limit,
    )
    return _plan(_candidate(sheet, result.best), search)


def evaluate_plan(
    sheet: CostSheet,
    schedule: str,
    *,
    num_microbatches: int,
    stages_per_rank: Optional[int] = None,
    split_points: Optional[Sequence[str]] = None,
    recompute: Optional[Sequence[bool]] = None,
    data_parallel: str = "replicate",
) -> Plan:
    """The simulated step and peak of one plan the caller fixes (no limit applied).

    ``split_points``: unit names where stages 1.. start (``None``: the
    min-max split on F + I + W); ``stages_per_rank``: ``None`` takes the
    schedule's default (the schedule table's: 2 for the V schedules, else
    1); ``recompute``: per stage (``None``: none); ``data_parallel``:
    "replicate" or "shard" over the sheet's ``dp_size``.
    """
    if not isinstance(sheet, CostSheet):
        raise ValueError(f"sheet must be a CostSheet, got {type(sheet).__name__}")
    v = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
    stages = sheet.pp_size * v
    if split_points is None:
        weights = [u.forward + u.backward_input + u.backward_weight for u in sheet.units]
        starts = list(_C.min_max_split(weights, stages))
    else:
        names = list(split_points)
        if len(names) != stages - 1:
            raise ValueError(f"split_points has {len(names)} names; pp_size={sheet.pp_size} x "
                             f"stages_per_rank={v} stages need {stages - 1}")
        starts = [0] + [sheet.index_of(n) for n in names]
    flags = [bool(r) for r in recompute] if recompute is not None else []
    if data_parallel not in _MODES:
        raise ValueError(f"data_parallel={data_parallel!r} must be one of "
                         f"{', '.join(map(repr, _MODES))}")
    c = _C.evaluate_plan(sheet.to_cpp(), schedule, v, num_microbatches, starts, flags,
                         data_parallel)
    return _plan(_candidate(sheet, c), None)
