"""The pipeline's settings, one frozen object: :class:`PipelineConfig`.

Its fields are, by construction, three lists at once:

- ``pipeline(module, **settings)``'s keyword arguments (``pipeline`` takes a
  ``PipelineConfig`` too, and its signature is built from the fields);
- the keys of ``torch.compile(fn, backend="mpmd", options={...})``: every
  field but ``loss_fn`` (the compiled function computes its loss), plus the
  backend's own ``reduction`` (:data:`BACKEND_OPTIONS`);
- the settings every rank must share, compared at start-up by the handshake
  that names the one differing (fields whose metadata has a ``shared``
  formatter; :meth:`PipelineConfig.shared_settings`).

Validation lives here and only here: a value wrong on its own is a
ValueError when the config is made (``__post_init__``); what depends on the
process groups (the pipeline size, the mesh's groups, a schedule's own
constraints at that size) is checked by :meth:`PipelineConfig.resolve`, which
``pipeline()`` and the backend both call before any rank communicates.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from torch_mpmd.parallel.data_parallel import mesh_groups
from torch_mpmd.parallel.sharding import DATA_PARALLEL_MODES
from torch_mpmd.programs.loss import loss_label
from torch_mpmd.programs.stage_programs import resolve_compiler
from torch_mpmd.schedules import (DEFAULT, Schedule, default_stages_per_rank, facts,
                                  get_schedule, schedule_names)

__all__ = ["PipelineConfig", "Resolved", "BACKEND_OPTIONS", "check_stage_count",
           "positive_int", "as_timeout", "pp_group", "check_against_plan", "PLAN_FIELDS"]

MAX_TIMEOUT_S = 1e7  # ~115 days; larger overflows the executor's clock arithmetic


def _placed_stages(schedule: Any) -> int | None:
    """The stages per rank a named schedule's placement fixes (the V
    placement: 2), by the schedule table; None for any other."""
    if isinstance(schedule, str) and schedule in schedule_names():
        row = facts(schedule)
        return row.fixed_stages_per_rank if row.v_placement else None
    return None


def _schedule_label(schedule: Any) -> str:
    return schedule if isinstance(schedule, str) else type(schedule).__name__


def _compile_label(compile: Any) -> str:
    """The compile setting as every rank spells it (a callable by its name)."""
    if callable(compile) and not isinstance(compile, bool):
        return f"{getattr(compile, '__module__', '')}.{getattr(compile, '__qualname__', '')}"
    return repr(compile)


def _plan_label(plan: Any) -> str:
    """The plan setting as every rank spells it: None, "auto", or its fields."""
    if plan is None or isinstance(plan, str):
        return repr(plan)
    return (f"{plan.schedule} v={plan.stages_per_rank} m={plan.num_microbatches} "
            f"split={list(plan.split_points)} recompute={list(plan.recompute)} "
            f"data_parallel={plan.data_parallel}")


# The settings a plan fixes, and their defaults (a default is filled from the plan).
PLAN_FIELDS = ("schedule", "num_microbatches", "stages_per_rank", "split_points",
               "data_parallel")
_PLAN_DEFAULTS = {"schedule": DEFAULT.schedule, "num_microbatches": None, "stages_per_rank": None,
                  "split_points": None, "data_parallel": "replicate"}


def _as_plan(plan: Any) -> Any:
    """``plan`` as None, "auto" or a planning.Plan (a dict, JSON text or a JSON
    file's path are read as one); a ValueError naming it otherwise."""
    if plan is None or plan == "auto":
        return plan
    from torch_mpmd.planning.plan import Plan

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        try:
            return Plan.from_json(plan)
        except OSError as e:
            raise ValueError(f"plan={plan!r} must be a Plan, 'auto', or a plan's JSON "
                             f"(text or file): {e}") from None
    raise ValueError(f"plan={plan!r} must be None, 'auto', a torch_mpmd.planning.Plan "
                     "(mpmd.plan(...)), or a plan's JSON (text or file)")


def _plan_value(plan: Any, name: str) -> Any:
    return tuple(plan.split_points) if name == "split_points" else getattr(plan, name)


def check_against_plan(plan: Any, given: dict[str, Any]) -> None:
    """A ValueError when a setting given beside a plan contradicts it, naming
    both values."""
    for name, value in given.items():
        if name not in PLAN_FIELDS or value is None:
            continue
        want = _plan_value(plan, name)
        got = tuple(value) if name == "split_points" and not isinstance(value, str) else value
        if name == "schedule" and isinstance(value, Schedule):
            got = value.name
        if got != want:
            raise ValueError(f"{name}={value!r} contradicts the plan's {name}={want!r}; drop "
                             f"one of them (or edit the plan)")


def _setting(default: Any = dataclasses.MISSING, *, option: bool = True,
             shared: Callable[[Any], str] | None = None) -> Any:
    """A field: ``option`` (a backend option key), ``shared`` (compared between
    ranks at start-up, spelled by this function)."""
    return dataclasses.field(default=default, metadata={"option": option, "shared": shared})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """What ``pipeline()`` is told: see its docstring for what each setting does.
    Frozen; ``dataclasses.replace(config, name=value)`` makes a changed copy."""

    num_microbatches: int | None = _setting(None, shared=str)
    loss_fn: Callable[..., Any] | None = _setting(None, option=False, shared=loss_label)
    schedule: str | Schedule = _setting(DEFAULT.schedule, shared=_schedule_label)
    stages_per_rank: int | None = _setting(None)
    split_points: tuple[str, ...] | None = _setting(None)
    num_stages: int | None = _setting(None)
    group: Any = _setting(None)
    mesh: Any = _setting(None)
    device: Any = _setting(None)
    timeout: float | datetime.timedelta = _setting(60.0)
    seed: int | None = _setting(None)
    lookahead: int = _setting(2)
    init_fn: Callable[[Any], None] | None = _setting(None)
    compile: Any = _setting(False, shared=_compile_label)
    bytes_cost: float | None = _setting(None, shared=str)
    startup_timeout: float | datetime.timedelta | None = _setting(None)
    dynamic: bool = _setting(False, shared=str)
    data_parallel: str = _setting("replicate", shared=str)
    reshard_after_forward: bool = _setting(False, shared=str)
    plan: Any = _setting(None, shared=_plan_label)
    memory_limit: float | None = _setting(None, shared=str)
    recompute: tuple[str, ...] | None = _setting(None, shared=str)
    plan_trials: int = _setting(3, shared=str)
    plan_again: bool = _setting(False, shared=str)

    def __post_init__(self) -> None:
        """Every check of a value on its own (ValueError naming it)."""
        self._apply_plan()
        if self.recompute is not None:
            if isinstance(self.recompute, str) or not isinstance(self.recompute, Sequence) or \
                    not all(isinstance(f, str) and f for f in self.recompute):
                raise ValueError(f"recompute={self.recompute!r} must be a list of module FQNs "
                                 "(whose activations are computed again in backward)")
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.split_points is not None:
            if isinstance(self.split_points, str) or not isinstance(self.split_points, Sequence):
                raise ValueError(f"split_points={self.split_points!r} must be a list of module "
                                 "FQNs")
            object.__setattr__(self, "split_points", tuple(self.split_points))
        resolve_compiler(self.compile)
        positive_int("num_microbatches", self.num_microbatches, optional=self.plan == "auto")
        positive_int("stages_per_rank", self.stages_per_rank, optional=True)
        positive_int("num_stages", self.num_stages, optional=True)
        positive_int("lookahead", self.lookahead)
        _check_bytes_cost(self.bytes_cost)
        as_timeout(self.timeout)
        if self.startup_timeout is not None:
            as_timeout(self.startup_timeout, "startup_timeout")
        if isinstance(self.plan_trials, bool) or not isinstance(self.plan_trials, int) or \
                self.plan_trials < 0:
            raise ValueError(f"plan_trials={self.plan_trials!r} must be an int >= 0 (the "
                             "finalists plan='auto' runs for real; 0: the prediction decides)")
        for name in ("dynamic", "reshard_after_forward", "plan_again"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.data_parallel, str) or self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel={self.data_parallel!r} must be one of "
                             f"{', '.join(map(repr, DATA_PARALLEL_MODES))}")
        if self.data_parallel == "shard" and (
                self.mesh is None or "dp" not in (self.mesh.mesh_dim_names or ())):
            whose = ("the plan's data_parallel='shard'"
                     if self.plan not in (None, "auto") and self.plan.data_parallel == "shard"
                     else "data_parallel='shard'")
            raise ValueError(f"{whose} shards over the mesh's 'dp' dimension: pass "
                             "mesh=init_device_mesh(..., mesh_dim_names=('dp', 'pp'))")
        if self.mesh is not None and self.group is not None:
            raise ValueError("pass either mesh= (dimensions from 'dp', 'pp', 'tp') or group=, "
                             "not both")
        schedule = self.schedule
        if isinstance(schedule, str) and schedule not in schedule_names() \
                and not os.path.isfile(schedule):
            raise ValueError(f"unknown schedule {schedule!r}: use one of "
                             f"{', '.join(schedule_names())}, a Schedule, or a text/CSV file")
        if not isinstance(schedule, (str, Schedule)):
            raise ValueError(f"schedule={schedule!r} must be a name "
                             f"({', '.join(schedule_names())}), a Schedule, or a text/CSV file")
        placed = _placed_stages(schedule)
        if placed is not None and self.stages_per_rank not in (None, placed):
            raise ValueError(f"schedule {schedule!r} places {placed} stages per rank; got "
                             f"stages_per_rank={self.stages_per_rank}")
        if self.num_stages is not None and self.split_points is not None \
                and self.num_stages != len(self.split_points) + 1:
            raise ValueError(f"num_stages={self.num_stages} disagrees with "
                             f"split_points={list(self.split_points)!r}, which give "
                             f"{len(self.split_points) + 1} stages")

    def _apply_plan(self) -> None:
        """NOTE [Plans in the config]: ``plan`` (a Plan) fills schedule,
        num_microbatches, stages_per_rank, split_points and data_parallel
        where they hold their defaults; a value beside it that contradicts it
        is a ValueError naming both (``from_settings`` also catches a schedule
        or data_parallel passed as its default, "1f1b" or "replicate", which a
        config made directly cannot tell from none). ``plan="auto"`` leaves
        them as given: the pipeline plans at its first step, keeping them as
        constraints (data_parallel always: the pipeline shards its parameters,
        or not, when it is built, before the optimizer takes them). Without a
        plan num_microbatches is required."""
        plan = _as_plan(self.plan)
        object.__setattr__(self, "plan", plan)
        if self.memory_limit is not None and (
                isinstance(self.memory_limit, bool) or
                not isinstance(self.memory_limit, (int, float)) or
                not math.isfinite(self.memory_limit) or self.memory_limit < 0):
            raise ValueError(f"memory_limit={self.memory_limit!r} must be None or a number of "
                             "bytes per rank >= 0")
        if plan is None:
            if self.num_microbatches is None:
                raise ValueError("num_microbatches is required (or plan=: a Plan from "
                                 "mpmd.plan(...), or 'auto')")
            return
        if plan == "auto":
            for name in ("split_points", "num_stages"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} with plan='auto': the "
                                     "plan chooses the split; give a plan (mpmd.plan(...)) "
                                     f"or drop {name}")
            return
        given = {}
        for name in PLAN_FIELDS:
            value = getattr(self, name)
            if value == _PLAN_DEFAULTS[name] and not isinstance(value, Schedule):
                object.__setattr__(self, name, _plan_value(plan, name))
            else:
                given[name] = value
        check_against_plan(plan, given)

    # ------------------------------------------------------------ the three lists
    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """pipeline()'s keyword arguments."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The settings the mpmd backend's ``options`` may hold."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["option"])

    def shared_settings(self) -> dict[str, str]:
        """The settings every rank must share, by name, as the start-up
        handshake compares them (never an address: a loss function by its name
        and a digest of its code)."""
        return {f.name: f.metadata["shared"](getattr(self, f.name))
                for f in dataclasses.fields(self) if f.metadata["shared"] is not None}

    @classmethod
    def from_settings(cls, base: PipelineConfig | None = None, /, **settings: Any
                      ) -> PipelineConfig:
        """``base`` with ``settings`` changed (or a new config of ``settings``);
        an unknown name is a TypeError listing the known ones."""
        unknown = [k for k in settings if k not in cls.setting_names()]
        if unknown:
            raise TypeError(f"unknown pipeline setting(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(cls.setting_names())}")
        if base is not None and not isinstance(base, cls):
            raise TypeError(f"expected a PipelineConfig, got {type(base).__name__}")
        plan = _as_plan(settings["plan"] if "plan" in settings else
                        base.plan if base is not None else None)
        if plan is not None and plan != "auto":
            # Named beside the plan (here, or in the base config before it had one).
            given = {k: v for k, v in settings.items() if k in PLAN_FIELDS}
            if base is not None and base.plan is None:
                given = {**{k: getattr(base, k) for k in PLAN_FIELDS
                            if getattr(base, k) != _PLAN_DEFAULTS[k]}, **given}
            check_against_plan(plan, given)
        if "plan" in settings:
            settings = {**settings, "plan": plan}
            if base is not None and base.plan not in (None, "auto"):
                # A new plan replaces what the old one filled in.
                old = {k: _PLAN_DEFAULTS[k] for k in PLAN_FIELDS
                       if getattr(base, k) == _plan_value(base.plan, k)}
                settings = {**old, **settings}
        if base is None:
            return cls(**settings)
        return dataclasses.replace(base, **settings)

    # ------------------------------------------------------------ with the groups
    @property
    def stages_per_rank_default(self) -> int:
        """Stages per rank when neither the setting nor the split fixes it."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return default_stages_per_rank(self.schedule)

    def resolve(self) -> Resolved:
        """The process groups this config names, and every check that needs
        them (stage counts against the pipeline size, the schedule's own
        constraints at that size): before any rank communicates."""
        group, dp_group, replicas = self.group, None, None
        if self.mesh is not None:
            groups = mesh_groups(self.mesh, as_timeout(self.timeout).total_seconds())
            group, dp_group, replicas = groups.pp, groups.dp, groups.replicas
        grp = pp_group(group)
        pp = dist.get_world_size(grp) if grp is not None else 1
        if self.plan != "auto":  # (auto: checked when planned, at the first step)
            self.check_schedule_at(pp)
        # A dp dimension of size 1 shards nothing: the stages run replicated.
        dp_mesh = (self.mesh["dp"] if self.data_parallel == "shard" and dp_group is not None
                   else None)
        return Resolved(group=grp, pp_size=pp, dp_group=dp_group, replicas=replicas,
                        dp_mesh=dp_mesh, timeout=as_timeout(self.timeout),
                        startup_timeout=(as_timeout(self.startup_timeout, "startup_timeout")
                                         if self.startup_timeout is not None else None))

    def schedule_at(self, stages_per_rank: int | None) -> str | Schedule:
        """The schedule run at ``stages_per_rank`` (None: not known yet): the
        one configured, except that the default schedule (``DEFAULT``: 1F1B)
        at several stages per rank is the schedule that is it at one stage
        per rank (interleaved 1F1B), as the schedule table says."""
        if self.schedule == DEFAULT.schedule and stages_per_rank and stages_per_rank > 1:
            return DEFAULT.schedule_for(stages_per_rank)
        return self.schedule

    def check_schedule_at(self, pp: int) -> None:
        """The schedule's own constraints on ``pp`` pipeline ranks (stages per
        rank, stage counts, microbatches): a ValueError naming the values."""
        schedule = self.schedule
        known_stages, source = self.num_stages, "num_stages"
        if self.split_points is not None:
            known_stages = len(self.split_points) + 1
            source = f"split_points={list(self.split_points)!r}"
        spr = self.stages_per_rank
        if known_stages is not None:
            spr = check_stage_count(known_stages, pp, self.stages_per_rank, source=source)
        schedule = self.schedule_at(spr)
        placed = _placed_stages(schedule)
        if spr is None and placed is not None:
            spr = placed
        if spr is not None and isinstance(schedule, str) and schedule in schedule_names():
            if placed is not None and spr != placed:
                raise ValueError(f"schedule {schedule!r} places {placed} stages per rank; {source} "
                                 f"give {known_stages} stages on pp_size={pp} ranks ({spr} per "
                                 "rank)")
            try:
                get_schedule(schedule, num_ranks=pp, num_microbatches=self.num_microbatches,
                             stages_per_rank=spr)
            except ValueError as e:
                where = (f" ({source} give {known_stages} stages on pp_size={pp} ranks)"
                         if known_stages is not None else "")
                raise ValueError(f"schedule {schedule!r}{where}: {e}") from None
        if isinstance(schedule, Schedule) and schedule.num_ranks != pp:
            raise ValueError(f"schedule '{schedule.name}' has {schedule.num_ranks} ranks, the "
                             f"pipeline group has pp_size={pp}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A config's process groups and timeouts, as :meth:`PipelineConfig.resolve`
    found them on this rank."""

    group: Any                      # the pipeline group (None: one process)
    pp_size: int
    dp_group: Any                   # the "dp" group of a mesh, else None
    replicas: list[list[int]] | None  # global ranks of each dp replica's pipeline
    dp_mesh: Any                    # the "dp" sub-mesh with data_parallel="shard"
    timeout: datetime.timedelta
    startup_timeout: datetime.timedelta | None


# The backend's options: the settings but loss_fn, and how the training call
# combines the microbatches' losses.
BACKEND_OPTIONS: tuple[str, ...] = PipelineConfig.option_names() + ("reduction",)


def check_stage_count(num_stages: int, pp_size: int, stages_per_rank: int | None = None,
                      *, source: str = "the markers or split points") -> int:
    """Stages per rank for ``num_stages`` stages over ``pp_size`` pipeline ranks.

    The stage count must be a multiple of the pipeline size, and an explicit
    ``stages_per_rank`` must agree with it; otherwise a ValueError names the
    numbers. Checked before any rank communicates.
    """
    if pp_size < 1:
        raise ValueError(f"pp_size={pp_size} must be >= 1")
    if num_stages % pp_size:
        raise ValueError(f"{source} define {num_stages} stages, which is not a multiple of "
                         f"the pipeline size pp_size={pp_size}; add or remove boundaries so "
                         f"every rank holds the same number of stages")
    per_rank = num_stages // pp_size
    if stages_per_rank is not None and stages_per_rank != per_rank:
        raise ValueError(f"stages_per_rank={stages_per_rank} disagrees with the {num_stages} "
                         f"stages {source} define on pp_size={pp_size} ranks "
                         f"({per_rank} per rank)")
    return per_rank


def positive_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """``value`` when it is a positive int (None too with ``optional``), else a
    ValueError naming ``name``."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def as_timeout(value: Any, name: str = "timeout") -> datetime.timedelta:
    """Seconds or a timedelta as a timedelta, positive and at most
    :data:`MAX_TIMEOUT_S`; a ValueError naming ``name`` otherwise."""
    if isinstance(value, datetime.timedelta):
        td = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        # nan, inf and huge numbers: timedelta() would fail without naming the setting
        if (isinstance(value, float) and not math.isfinite(value)) or value > MAX_TIMEOUT_S:
            raise ValueError(f"{name}={value!r} must be a finite number of seconds, positive "
                             f"and at most {MAX_TIMEOUT_S:g}")
        td = datetime.timedelta(seconds=value)
    else:
        raise ValueError(f"{name}={value!r} must be seconds (a number) or a datetime.timedelta")
    if not 0 < td.total_seconds() <= MAX_TIMEOUT_S:
        raise ValueError(f"{name}={value!r} must be positive and at most {MAX_TIMEOUT_S:g} "
                         "seconds")
    return td


def pp_group(group: Any) -> Any:
    """The pipeline group: ``group``, else the default group when one is
    initialized, else None (one process)."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _check_bytes_cost(bytes_cost: Any) -> None:
    """``bytes_cost`` is None (the partitioner's default) or a finite number
    >= 0: cost units per byte crossing a cut of a balanced split (NOTE [Bytes
    cost] in csrc/core/partition.h)."""
    if bytes_cost is None:
        return
    if (isinstance(bytes_cost, bool) or not isinstance(bytes_cost, (int, float))
            or not math.isfinite(bytes_cost) or bytes_cost < 0):
        raise ValueError(f"bytes_cost={bytes_cost!r} must be None (the default) or a finite "
                         "number >= 0: cost units per byte crossing a stage boundary")


def settings_signature(first: inspect.Parameter) -> inspect.Signature:
    """A signature ``(first, config=None, *, <every setting>)`` for a function
    taking a PipelineConfig or its settings as keywords (pipeline's)."""
    params = [first, inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                       default=None, annotation="PipelineConfig | None")]
    for f in dataclasses.fields(PipelineConfig):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=f.type))
    return inspect.Signature(params)
