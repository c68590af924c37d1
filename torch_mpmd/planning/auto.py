"""``mpmd.plan``: measure a model, search, and the same plan on every rank.

    plan = mpmd.plan(model, (x,), loss_fn=F.cross_entropy, target=y)   # collective
    print(plan.describe())
    pipe = mpmd.pipeline(model, loss_fn=F.cross_entropy, plan=plan)
    pipe = mpmd.pipeline(model, loss_fn=..., plan="auto")               # plans at the first step

``plan`` profiles (profile.py: rank 0 measures, or loads the cached profile,
and broadcasts the sheet) and searches (``plan_from_sheet``, csrc/core/
planner.h) on pipeline rank 0, and broadcasts the plan's JSON, so every rank
returns an equal plan (data-parallel replicas all plan from global rank 0's
sheet). On a mesh with a "dp" dimension of size > 1 the sheet also has the
dp size and the all-reduce rates measured on the real dp group, and the
search chooses the data-parallel mode, "replicate" or "shard" (NOTE
[Data-parallel modes] in csrc/core/planner.h); ``pipeline(mesh=mesh,
plan=plan)`` runs it. An error (nothing fits ``memory_limit``: the planner
names the smallest predicted peak and the limit) is raised on every rank.
The search recomputes a stage only where the memory limit needs it (the
pipeline then checkpoints that stage's units: torch_mpmd/graph/recompute.py).

``replan_sentence`` and ``replan_sheet`` serve ``Pipeline.replan``: a sheet
from the stages' measured times, and what re-running the search says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from torch_mpmd.planning.plan import Plan, evaluate_plan, plan_from_sheet
from torch_mpmd.planning.profile import profile
from torch_mpmd.planning.profile_cache import write_atomic
from torch_mpmd.planning.sheet import CostSheet, Unit
from torch_mpmd.planning.trials import DEFAULT_TRIALS

__all__ = ["plan", "replan_sheet", "replan_sentence"]

_log = logging.getLogger("torch_mpmd")


def _pp_group(group: Any) -> Any:
    """The pipeline group of ``group`` (a DeviceMesh: its "pp" dimension)."""
    from torch_mpmd.config import pp_group

    names = getattr(group, "mesh_dim_names", None)
    if names is not None:
        if "pp" not in names:
            raise ValueError(f"the mesh has no 'pp' dimension (dimensions: {names})")
        return group.get_group("pp")
    return pp_group(group)


def _dp_group(group: Any) -> Any:
    """The "dp" group of a DeviceMesh ``group`` when that dimension has more
    than one rank, else None."""
    names = getattr(group, "mesh_dim_names", None)
    if not names or "dp" not in names or group.size(names.index("dp")) < 2:
        return None
    return group.get_group("dp")


def _broadcast(value: Any, group: Any, timeout_s: float, what: str) -> Any:
    """``value`` (JSON) of ``group``'s first rank, bounded and named (NOTE
    [Named waits] in named_waits.py)."""
    if group is None or dist.get_world_size(group) < 2:
        return value
    from torch_mpmd.parallel import lockstep

    return lockstep.Collectives(group, timeout_s, "planning").broadcast_json(value, what)


def plan(model: Any, example_args: Any, example_kwargs: Mapping[str, Any] | None = None, *,
         loss_fn: Callable[..., Any] | None, target: Any = None, group: Any = None,
         memory_limit: float | None = None, schedules: str | Sequence[str] | None = None,
         num_microbatches: int | Sequence[int] | None = None,
         stages_per_rank: int | Sequence[int] | None = None, compile: Any = False,
         batch_size: int | None = None, units: Sequence[str] | None = None,
         microbatch_sizes: int | Sequence[int] | None = None, cache_dir: Any = None,
         top_k: int = 5, data_parallel: str | Sequence[str] | None = None,
         timeout: Any = None, trials: int = DEFAULT_TRIALS, trials_again: bool = False
         ) -> Plan:
    """The plan with the least measured step among the finalists of the
    search for ``model`` on this pipeline group.

    ``example_args``/``example_kwargs``/``target``: one training step's batch
    (as ``pipe.step`` takes it); ``batch_size``: samples per step when it is
    not the example's (per dp replica). ``group``: the pipeline group or a
    DeviceMesh (its "pp" dimension; a "dp" dimension of size > 1 adds the
    data-parallel mode to the search); default the default group, or one
    process. ``memory_limit``: bytes per rank. ``schedules``,
    ``num_microbatches``, ``stages_per_rank`` and ``data_parallel``
    ("replicate", "shard") restrict the search (one value or a list). ``units``,
    ``microbatch_sizes``, ``compile`` and ``cache_dir``: :func:`profile`'s.
    ``trials``: finalists of the search run for real beside the
    configuration a user writes first (planning/trials.py; 0: the
    prediction decides). The decision and its trials are cached with the
    profile: a later call on the same model, batch, world and constraints
    takes it without trials, unless ``trials_again``.
    Collective: every rank calls it with the same arguments and gets an equal
    plan. The plan carries its sheet (``plan.sheet``, in memory, not in its
    JSON) for ``Pipeline.replan``, and in ``plan.search`` the trials and the
    planning's time. ``timeout`` (seconds or timedelta; default the
    pipeline's default, 60 s): every wait for the other ranks, with no
    rank making progress; a rank that stalls or died raises PipelineError
    naming it (``pipeline(plan="auto")`` passes its own ``timeout``).
    """
    from torch_mpmd.config import as_timeout
    from torch_mpmd.planning.profile import DEFAULT_TIMEOUT_S

    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"trials={trials!r} must be an int >= 0 (0: no trials)")
    started = time.perf_counter()
    timeout_s = as_timeout(DEFAULT_TIMEOUT_S if timeout is None else timeout).total_seconds()
    grp = _pp_group(group)
    dp_group = _dp_group(group)
    rank = dist.get_rank(grp) if grp is not None else 0
    sizes = microbatch_sizes
    if sizes is None and isinstance(num_microbatches, int) and not isinstance(num_microbatches, bool):
        from torch_mpmd.planning.profile import batch_size_of

        args = example_args if isinstance(example_args, tuple) else (example_args,)
        batch = batch_size_of(args, dict(example_kwargs or {}))
        if batch % num_microbatches == 0:
            sizes = batch // num_microbatches  # the one microbatch the plan can have
    replicated = (dist.is_available() and dist.is_initialized()
                  and dist.get_world_size() > (dist.get_world_size(grp) if grp is not None else 1))
    world = dist.group.WORLD if replicated else grp
    first = (dist.get_rank() == 0) if replicated else rank == 0  # reads and writes decisions

    def measured(calibrate: bool, info: dict[str, Any]) -> CostSheet:
        return profile(model, example_args, example_kwargs, loss_fn=loss_fn, target=target,
                       units=units, microbatch_sizes=sizes, compile=compile,
                       cache_dir=cache_dir, group=grp, global_batch=batch_size,
                       dp_group=dp_group, timeout=timeout_s, calibrate=calibrate, info=info)

    # A cached decision needs the units only; anything else, this launch's fit.
    info: dict[str, Any] = {}
    sheet = measured(trials == 0 or trials_again, info)
    # The decision's key beside the profile's: what the search is told, spelled
    # alike however given ("1f1b" or ["1f1b"]; no dp mode without replicas).
    settings = dict(memory_limit=float(memory_limit or 0.0), schedules=_listed(schedules),
                    num_microbatches=_listed(num_microbatches),
                    stages_per_rank=_listed(stages_per_rank),
                    data_parallel=_listed(data_parallel) if dp_group is not None else [],
                    trials=trials, batch_size=batch_size,
                    world=dist.get_world_size() if replicated else
                    (dist.get_world_size(grp) if grp is not None else 1))
    decision_path = (_decision_path(info.get("cache_path"), settings)
                     if first and trials > 0 else None)
    cached = None
    if decision_path is not None and not trials_again and decision_path.is_file():
        try:
            cached = Plan.from_json(decision_path.read_text()).to_json()
        except (ValueError, OSError):
            cached = None  # a damaged decision is made again
    cached, fitted = _broadcast([cached, bool(info.get("measured")) or trials == 0
                                 or trials_again], world, timeout_s,
                                "the broadcast of global rank 0's cached decision")
    if cached is not None:
        out = Plan.from_json(cached)
        if replicated:
            sheet = CostSheet.from_json(_broadcast(sheet.to_json(), world, timeout_s,
                                                   "the broadcast of global rank 0's sheet"))
        sheet = dataclasses.replace(sheet, memory_limit=float(memory_limit or 0.0))
        record = dataclasses.replace(out.search, decided_by="cached decision") \
            if out.search is not None else None
        return dataclasses.replace(out, sheet=sheet, search=record)
    if not fitted:  # the units came from the cache: fit them to this launch
        sheet = measured(True, {})
    if replicated:
        # Data/tensor-parallel replicas each profiled (their dp groups timed
        # together); all plan from global rank 0's sheet, so that they find
        # the same plan, or fail alike.
        sheet = CostSheet.from_json(_broadcast(sheet.to_json(), world, timeout_s,
                                               "the broadcast of global rank 0's sheet"))
    profile_s = time.perf_counter() - started
    result: tuple[str | None, tuple[str, str] | None] = (None, None)
    raised: BaseException | None = None
    if rank == 0:
        try:
            best = plan_from_sheet(sheet, memory_limit=memory_limit, schedules=schedules,
                                   num_microbatches=num_microbatches,
                                   stages_per_rank=stages_per_rank,
                                   top_k=max(top_k, _SEARCH_TOP if trials else 1),
                                   data_parallel=data_parallel)
            assert best.search is not None
            best = dataclasses.replace(best, search=dataclasses.replace(
                best.search, profile_s=profile_s))
            result = (best.to_json(), None)
        except Exception as e:  # noqa: BLE001  (every rank raises it)
            raised, result = e, (None, (type(e).__name__, str(e)))
    text, failure = _broadcast(result, grp, timeout_s, "the broadcast of rank 0's plan")
    if failure is None and replicated:  # (equal already: one sheet, a deterministic search)
        text = _broadcast(text, world, timeout_s, "the broadcast of global rank 0's plan")
    if raised is not None:
        raise raised
    if failure is not None:
        kind, message = failure
        raise (ValueError if kind == "ValueError" else RuntimeError)(message)
    # The sheet remembers the limit: Pipeline.replan searches under it too.
    sheet = dataclasses.replace(sheet, memory_limit=float(memory_limit or 0.0))
    out = Plan.from_json(text)
    out = dataclasses.replace(out, sheet=sheet, search=out.search)
    why_not = _why_no_trials(model, group, out) if trials else "trials=0"
    if why_not is None:
        out = _decide_by_trials(out, sheet, trials, model, example_args, example_kwargs,
                                target, loss_fn=loss_fn, group=grp, world=world,
                                compile=compile, timeout_s=timeout_s, constraints=dict(
                                    schedule=_one(schedules), num_microbatches=_one(
                                        num_microbatches),
                                    stages_per_rank=_one(stages_per_rank),
                                    memory_limit=memory_limit))
        if decision_path is not None:
            write_atomic(decision_path, out.to_json())
    elif trials and rank == 0:
        _log.info("torch_mpmd: mpmd.plan runs no trials: %s", why_not)
    if out.search is not None and len(out.search.top) > top_k:
        out = dataclasses.replace(out, search=dataclasses.replace(
            out.search, top=out.search.top[:top_k]))
    return out


# Candidates the search keeps for the finalists to be drawn from.
_SEARCH_TOP = 16


def _listed(value: Any) -> list[Any]:
    """A constraint as a sorted list (None: [])."""
    if value is None:
        return []
    return sorted(value, key=str) if isinstance(value, (list, tuple)) else [value]


def _one(value: Any) -> Any:
    """A constraint's single value (the default contender's), else None."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else None
    return value


def _why_no_trials(model: Any, group: Any, best: Plan) -> str | None:
    """Why trials cannot run here (None: they can). They build pipelines
    over the user's module on the pipeline group, without a mesh: not over
    sharded parameters, tensor-parallel ones or a model still on the meta
    device. (Replicated data parallel: each replica runs the trials on its
    own pipeline group; the all-reduce they leave out is alike for all.)"""
    from torch_mpmd.parallel import meta_init

    if best.data_parallel == "shard":
        return "the search chose data_parallel='shard', which trials cannot run unsharded"
    names = tuple(getattr(group, "mesh_dim_names", None) or ())
    if "tp" in names and group.size(names.index("tp")) > 1:
        return "a tensor-parallel mesh"
    if meta_init.has_meta_tensors(model):
        return "the model is on the meta device"
    return None


def _decide_by_trials(out: Plan, sheet: CostSheet, trials: int, model: Any, example_args: Any,
                      example_kwargs: Any, target: Any, *, loss_fn: Any, group: Any,
                      world: Any, compile: Any, timeout_s: float,
                      constraints: dict[str, Any]) -> Plan:
    """The finalists of ``out``'s search run on ``group`` and the measured
    fastest as the plan (planning/trials.py); every rank returns global rank
    0's choice."""
    from torch_mpmd.parallel import lockstep
    from torch_mpmd.planning import trials as t

    assert out.search is not None
    default = t.default_contender(sheet, **constraints)
    top = [c for c in out.search.top if c.data_parallel == "replicate"]
    beside = [t.at_block_boundaries(sheet, top[0], memory_limit=constraints["memory_limit"])] \
        if top else []
    contenders = t.finalists(top, count=trials, default=default,
                             beside=[c for c in beside if c is not None])
    if len(contenders) < 2:
        return out
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        waits = None
        if group is not None and dist.get_world_size(group) > 1:
            waits = stack.enter_context(lockstep.Collectives(group, timeout_s, "plan trials"))
        ran = t.run_trials(model, args, dict(example_kwargs or {}), target, contenders,
                           sheet=sheet, loss_fn=loss_fn, group=group, compile=compile,
                           waits=waits, timeout_s=timeout_s)
    chosen = t.as_plan(t.choose(ran), ran, out.search, sheet,
                       trials_s=time.perf_counter() - started)
    if world is not group:  # replicas: global rank 0's measurements decide for all
        chosen_text = _broadcast(chosen.to_json(), world, timeout_s,
                                 "the broadcast of global rank 0's trials")
        chosen = dataclasses.replace(Plan.from_json(chosen_text), sheet=sheet)
    return chosen


def _decision_path(cache_path: Any, settings: dict[str, Any]) -> Path | None:
    """Where the decision for ``settings`` (the search's constraints, the
    world) is cached, beside its profile's entry."""
    if cache_path is None:
        return None
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    return Path(cache_path).with_name(f"{Path(cache_path).stem}.decision-"
                                      f"{digest.hexdigest()[:16]}.json")


# ------------------------------------------------------------------ replan


def _unit_ranges(sheet: CostSheet, split_points: Sequence[str]) -> list[range]:
    starts = [0] + [sheet.index_of(n) for n in split_points] + [len(sheet.units)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def replan_sheet(times: Mapping[int, Mapping[str, float]], *, profile_sheet: CostSheet | None,
                 split_points: Sequence[str], num_stages: int, global_batch: int,
                 num_microbatches: int, pp_size: int, memory_limit: float | None = None
                 ) -> CostSheet:
    """A sheet from measured per-stage medians (``{stage: {"F", "B", "I", "W"}}``,
    every stage of the pipeline) at microbatches of ``global_batch /
    num_microbatches`` samples.

    With ``profile_sheet`` (whose units the current ``split_points`` name),
    each stage's measured F, I and W are shared among its units in proportion
    to their profiled costs and the profile's bytes are kept; a stage that ran
    B only, and the first stage (whose I computes nothing), has its backward
    split into I and W in the profile's ratio. Without one the
    stages are the units (named by the split points; stage 0 ``"stage 0"``),
    with I and W half of B each where only B ran, and no bytes."""
    missing = [s for s in range(num_stages) if s not in times]
    if missing:
        raise ValueError(f"no measured times for stages {missing}")
    mb = max(1, global_batch // num_microbatches)

    def fiw(stage: int, ratio_i: float) -> tuple[float, float, float]:
        t = times[stage]
        f = t.get("F", 0.0)
        if stage > 0 and ("I" in t or "W" in t):
            return f, t.get("I", 0.0), t.get("W", 0.0)
        # B alone; or the first stage, whose I computes nothing (the model's
        # inputs carry no gradient: NOTE [The first stage's backward] in
        # csrc/core/planner_model.cpp), so its measured split says nothing of its
        # units' own, which another split may need.
        b = t["B"] if "B" in t else t.get("I", 0.0) + t.get("W", 0.0)
        return f, b * ratio_i, b * (1 - ratio_i)

    if profile_sheet is None:
        names = ["stage 0", *split_points] if len(split_points) == num_stages - 1 else \
            [f"stage {s}" for s in range(num_stages)]
        units = []
        for s in range(num_stages):
            f, i, w = fiw(s, 0.5)
            units.append(Unit(name=names[s], forward=f, backward_input=i, backward_weight=w))
        return CostSheet(units=units, global_batch=global_batch, pp_size=pp_size,
                         reference_microbatch=mb,
                         action_overhead=_default("DEFAULT_ACTION_OVERHEAD_S"),
                         link_latency=_default("DEFAULT_LINK_LATENCY_S"),
                         link_bandwidth=_default("DEFAULT_LINK_BANDWIDTH"),
                         memory_limit=memory_limit or 0.0)
    ranges = _unit_ranges(profile_sheet, split_points)
    if len(ranges) != num_stages:
        raise ValueError(f"split_points {list(split_points)} give {len(ranges)} stages; the "
                         f"pipeline has {num_stages}")
    scale = mb / profile_sheet.reference_microbatch  # profile bytes at this microbatch
    units = list(profile_sheet.units)
    for s, rng in enumerate(ranges):
        us = [profile_sheet.units[u] for u in rng]
        pf = sum(u.forward for u in us)
        pi = sum(u.backward_input for u in us)
        pw = sum(u.backward_weight for u in us)
        f, i, w = fiw(s, pi / (pi + pw) if pi + pw > 0 else 0.5)
        for u in rng:
            p = profile_sheet.units[u]
            forward = f * (p.forward / pf if pf > 0 else 1 / len(rng))
            b_in = i * (p.backward_input / pi if pi > 0 else 1 / len(rng))
            b_w = w * (p.backward_weight / pw if pw > 0 else 1 / len(rng))
            units[u] = dataclasses.replace(
                p, forward=forward, backward_input=b_in, backward_weight=b_w,
                # The profile's fixed parts, within the measured times.
                forward_fixed=min(p.forward_fixed, forward),
                backward_input_fixed=min(p.backward_input_fixed, b_in),
                backward_weight_fixed=min(p.backward_weight_fixed, b_w),
                saved_bytes=p.saved_bytes * scale, output_bytes=p.output_bytes * scale)
    return dataclasses.replace(profile_sheet, units=tuple(units), global_batch=global_batch,
                               pp_size=pp_size, reference_microbatch=mb,
                               input_bytes=profile_sheet.input_bytes * scale,
                               memory_limit=memory_limit or 0.0)


def _default(name: str) -> float:
    from torch_mpmd.planning import profile as p
    return float(getattr(p, name))


def replan_sentence(sheet: CostSheet, *, schedule: str, num_microbatches: int,
                    stages_per_rank: int, split_points: Sequence[str],
                    memory_limit: float | None = None,
                    data_parallel: str = "replicate") -> tuple[Plan, str]:
    """The best plan on ``sheet`` and a sentence comparing it with the current
    plan (``data_parallel``: its mode) evaluated on the same sheet."""
    current = evaluate_plan(sheet, schedule, num_microbatches=num_microbatches,
                            stages_per_rank=stages_per_rank, split_points=list(split_points),
                            data_parallel=data_parallel)
    best = plan_from_sheet(sheet, memory_limit=memory_limit)
    best = dataclasses.replace(best, sheet=sheet, search=best.search)
    now = (f"{schedule}, v={stages_per_rank}, m={num_microbatches}, split "
           f"{list(split_points)}")
    if sheet.dp_size > 1:
        now += f", data_parallel={data_parallel}"
    same = (best.schedule, best.stages_per_rank, best.num_microbatches,
            tuple(best.split_points), best.data_parallel) == (
                schedule, stages_per_rank, num_microbatches, tuple(split_points), data_parallel)
    if same or best.predicted_step_s >= current.predicted_step_s:
        return best, (f"the current plan ({now}) is predicted the fastest: "
                      f"{current.predicted_step_s * 1e3:.3g} ms a step (simulated from the "
                      "measured stage times)")
    gain = 1 - best.predicted_step_s / current.predicted_step_s
    dp = f", data_parallel={best.data_parallel}" if sheet.dp_size > 1 else ""
    return best, (f"a different plan is predicted faster: {best.schedule}, "
                  f"v={best.stages_per_rank}, m={best.num_microbatches}, split "
                  f"{list(best.split_points)}{dp}: {best.predicted_step_s * 1e3:.3g} ms a step "
                  f"against the current plan's ({now}) {current.predicted_step_s * 1e3:.3g} ms, "
                  f"{gain:.1%} less (simulated from the measured stage times)")
