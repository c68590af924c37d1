"""Measured finalists: the simulator proposes, the real group decides (DESIGN.md section 11).

    contenders = finalists(sheet, search.top, default=default_contender(sheet, ...), count=3)
    trials = run_trials(model, args, kwargs, target, contenders, loss_fn=..., group=..., ...)
    best = choose(trials)

The simulator prices thousands of candidates from a profile; its error on a
model it has not met (10-40% on a wide-head model) is larger than
the differences between the plans it ranks, so the plan it predicts best is
often not the fastest, and one launch in three was slower than no plan. So
``mpmd.plan`` (and ``plan="auto"``) runs a few finalists for real, as the
autotuners people trust do (Inductor's max-autotune, cuDNN's benchmark
mode):

- which (:func:`finalists`): the best by prediction; then the best of
  another microbatch count (within :data:`PREDICTION_ERROR` of it if one
  is, else the best of another count at all) and, within that error, the
  best of another schedule family (the choices the model's error makes
  uncertain); then the next best; where the best cuts inside a block, the
  same schedule cut between blocks (:func:`at_block_boundaries`); and the
  configuration a user writes first (:func:`default_contender`: 1F1B, m = 4p, the blocks split
  evenly by count), so that the choice is never measurably slower than it;
- how (:func:`run_trials`): each finalist a pipeline over the same model,
  built one at a time (its capture and first step untimed), then timed
  steps barrier to barrier, interleaved A B C A B C so that the machine's
  drift hits all alike, and more steps of those whose medians are too
  close to tell apart; all freed after the choice;
- which wins (:func:`choose`): the least median step.

NOTE [Trials leave no trace]: trials run real steps on the user's model
before its first step. They run under ``model_state_kept`` (the
parameters' gradients, buffers and RNG states restored after), never touch
an optimizer, and build their pipelines without a mesh (no sharding of the
user's parameters): the first ``step()`` of the chosen plan then returns
the loss and gradients one process would, and an optimizer built from
``pipe.parameters()`` before it holds the parameters that plan trains.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable

from torch_mpmd.planning.plan import Candidate, Plan, Trial, evaluate_plan
from torch_mpmd.planning.sheet import CostSheet
from torch_mpmd.schedules import DEFAULT, facts, schedule_names

__all__ = ["CLOSE", "DEFAULT_TRIALS", "EXTRA_STEPS", "MAX_TRIAL_STEPS", "PREDICTION_ERROR",
           "TRIAL_SECONDS", "TRIAL_STEPS",
           "choose", "default_contender", "finalists", "run_trials", "trial_seconds"]

# Finalists from the search (the default a user writes first comes beside them).
DEFAULT_TRIALS = 3
# Timed steps per finalist (after one untimed: capture, build, first run):
# at least TRIAL_STEPS, more while all rounds fit in TRIAL_SECONDS, at most
# MAX_TRIAL_STEPS.
TRIAL_STEPS = 5
TRIAL_SECONDS = 4.0
MAX_TRIAL_STEPS = 20
# More timed steps for the finalists whose medians are within CLOSE of the
# least: differences that small are within a few steps' noise on a shared
# machine (BENCHMARKS.md, "The machine's own noise").
EXTRA_STEPS = 4
CLOSE = 0.03
# The simulator's relative error on a model it has not met, after the
# launch's own calibration: candidates predicted within it of the best are
# too close for the prediction to rank (BENCHMARKS.md, the planner zoo).
PREDICTION_ERROR = 0.15
_BLOCK = re.compile(r"^(.*)\.(\d+)(?:\..*)?$")


def trial_seconds() -> float:
    """The time the timed rounds fill: ``MPMD_TRIAL_SECONDS`` where set (a
    quick launch, a test suite: at least TRIAL_STEPS steps run all the
    same), else :data:`TRIAL_SECONDS`. A value that is not a number >= 0 is
    an error naming it."""
    text = os.environ.get("MPMD_TRIAL_SECONDS")
    if text is None:
        return TRIAL_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (also nan)
        raise ValueError(f"MPMD_TRIAL_SECONDS={text!r}: expected a number of seconds >= 0")
    return value


def family(schedule: str) -> str:
    """A schedule's family for the finalists' spread (the schedule table's):
    whether it splits backward into I and W (the zero-bubble kind) or runs it
    whole."""
    return facts(schedule).family


def _blocks(units: Sequence[str]) -> list[int]:
    """Where each block of the model's longest run of numbered units starts
    (indices into ``units``; ``blocks.3`` or its first refined part
    ``blocks.3.attn``), in block order; [] when there is none."""
    starts: dict[str, dict[int, int]] = {}
    for u, name in enumerate(units):
        found = _BLOCK.match(name)
        if found:
            starts.setdefault(found.group(1), {}).setdefault(int(found.group(2)), u)
    if not starts:
        return []
    prefix = max(starts, key=lambda p: len(starts[p]))
    return [starts[prefix][i] for i in sorted(starts[prefix])]


def even_split(sheet: CostSheet, stages: int) -> list[str] | None:
    """The split a user writes first: the blocks split evenly by count (the
    embedding before them goes with the first stage, what runs after them
    with the last); None when the model has fewer blocks than stages."""
    blocks = _blocks([u.name for u in sheet.units])
    if len(blocks) < stages:
        return None
    return [sheet.units[blocks[len(blocks) * s // stages]].name for s in range(1, stages)]


def default_contender(sheet: CostSheet, *, schedule: str | None = None,
                      num_microbatches: int | None = None, stages_per_rank: int | None = None,
                      memory_limit: float | None = None) -> Candidate | None:
    """The configuration a user writes first, under the user's constraints:
    ``schedule`` (default 1F1B) at ``num_microbatches`` (default the largest
    divisor of the batch at most 4p, the m >= 4p that 1F1B guides give), the
    blocks split evenly by count; None when it is not a valid plan here (a
    split the blocks cannot give, over ``memory_limit``)."""
    name = schedule or DEFAULT.schedule
    # The stages per rank the schedule is for (the table's: 2 for the V and
    # the interleaved schedules); an unknown name fails below.
    v = stages_per_rank or (facts(name).typical_stages_per_rank if name in schedule_names() else 1)
    m = num_microbatches
    if m is None:
        m = max(d for d in range(1, min(sheet.global_batch, 4 * sheet.pp_size) + 1)
                if sheet.global_batch % d == 0)
    split = even_split(sheet, sheet.pp_size * v)
    try:
        plan = evaluate_plan(sheet, name, num_microbatches=m, stages_per_rank=v,
                             split_points=split)
    except (ValueError, RuntimeError):
        return None  # (a schedule that needs another m or v: the search's candidates stand)
    if memory_limit and max(plan.predicted_peak_bytes) > memory_limit:
        return None
    return Candidate(schedule=plan.schedule, stages_per_rank=plan.stages_per_rank,
                     num_microbatches=plan.num_microbatches, split_points=plan.split_points,
                     recompute=plan.recompute, predicted_step_s=plan.predicted_step_s,
                     predicted_peak_bytes=plan.predicted_peak_bytes)


def cuts_inside_blocks(sheet: CostSheet, c: Candidate) -> bool:
    """Whether ``c`` cuts a block of the model's numbered blocks inside it
    (at a refined unit: ``blocks.1.mlp``, NOTE [Refined units])."""
    blocks = {sheet.units[u].name for u in _blocks([x.name for x in sheet.units])}
    for name in c.split_points:
        found = _BLOCK.match(name)
        if found and name not in blocks and "." in name[len(found.group(1)) + 1:]:
            return True
    return False


def at_block_boundaries(sheet: CostSheet, c: Candidate, *, memory_limit: float | None = None
                        ) -> Candidate | None:
    """``c``'s schedule, v and m with the blocks split evenly by count, as a
    finalist beside ``c`` when ``c`` cuts inside a block (None otherwise, or
    when that split is not a valid plan here). On the zoo's MoE and Llama
    models the search's cuts inside a block ran 5-18% slower than the same
    schedule cut between blocks (BENCHMARKS.md, "plan='auto' decided by
    trials"): the cut's price is where the simulator errs."""
    if not cuts_inside_blocks(sheet, c):
        return None
    split = even_split(sheet, sheet.pp_size * c.stages_per_rank)
    if split is None or tuple(split) == tuple(c.split_points):
        return None
    try:
        plan = evaluate_plan(sheet, c.schedule, num_microbatches=c.num_microbatches,
                             stages_per_rank=c.stages_per_rank, split_points=split,
                             data_parallel=c.data_parallel)
    except (ValueError, RuntimeError):
        return None
    if memory_limit and max(plan.predicted_peak_bytes) > memory_limit:
        return None
    return Candidate(schedule=plan.schedule, stages_per_rank=plan.stages_per_rank,
                     num_microbatches=plan.num_microbatches, split_points=plan.split_points,
                     recompute=plan.recompute, predicted_step_s=plan.predicted_step_s,
                     predicted_peak_bytes=plan.predicted_peak_bytes,
                     data_parallel=plan.data_parallel)


def _fields(c: Candidate | Trial) -> tuple:
    return (c.schedule, c.stages_per_rank, c.num_microbatches, tuple(c.split_points),
            tuple(c.recompute), c.data_parallel)


def finalists(top: Sequence[Candidate], *, count: int = DEFAULT_TRIALS,
              default: Candidate | None = None, error: float = PREDICTION_ERROR,
              beside: Sequence[Candidate] = ()) -> list[tuple[Candidate, bool]]:
    """The contenders to run, each with whether it is ``default``: ``count``
    of the search's ``top`` (best first; see the module docstring), then
    ``beside`` (e.g. :func:`at_block_boundaries` of the best) and
    ``default`` (each unless it is one of them already)."""
    if count < 1 or not top:
        return []
    best = top[0].predicted_step_s
    near = [c for c in top if c.predicted_step_s <= best * (1 + error)]
    chosen = [top[0]]

    def add(pick: Callable[[Candidate], bool], among: Sequence[Candidate]) -> bool:
        for c in among:
            if len(chosen) < count and c not in chosen and pick(c):
                chosen.append(c)
                return True
        return False

    def other_m(c: Candidate) -> bool:
        return c.num_microbatches not in {x.num_microbatches for x in chosen}

    # Another m, from anywhere in the top when none is near: the simulator
    # errs most across microbatch counts (a launch priced the MoE zoo
    # model's m=1 plans at 0.46 of their measured step, and its finalists,
    # all m=1, ran 1.23x the grid's best: BENCHMARKS.md).
    if not add(other_m, near):
        add(other_m, top)
    add(lambda c: family(c.schedule) not in {family(x.schedule) for x in chosen}, near)
    for c in top:
        if len(chosen) >= count:
            break
        if c not in chosen:
            chosen.append(c)
    for c in beside:
        if all(_fields(c) != _fields(x) for x in chosen):
            chosen.append(c)
    out = [(c, False) for c in chosen]
    if default is not None:
        same = [i for i, (c, _) in enumerate(out) if _fields(c) == _fields(default)]
        if same:
            out[same[0]] = (out[same[0]][0], True)
        else:
            out.append((default, True))
    return out


def plan_of(c: Candidate | Trial, sheet: CostSheet | None = None) -> Plan:
    """The Plan a contender or trial describes (carrying ``sheet``, whose
    units a recomputing plan needs)."""
    peaks = getattr(c, "predicted_peak_bytes", ())
    return Plan(schedule=c.schedule, num_microbatches=c.num_microbatches,
                stages_per_rank=c.stages_per_rank, split_points=tuple(c.split_points),
                recompute=tuple(c.recompute), predicted_step_s=c.predicted_step_s,
                predicted_peak_bytes=tuple(peaks), data_parallel=c.data_parallel,
                sheet=sheet)


def run_trials(model: Any, args: tuple, kwargs: dict, target: Any,
               contenders: Sequence[tuple[Candidate, bool]], *, sheet: CostSheet,
               loss_fn: Any, group: Any, compile: Any, waits: Any, timeout_s: float,
               steps: int = TRIAL_STEPS, extra_steps: int = EXTRA_STEPS) -> list[Trial]:
    """Every contender run on ``group`` (the pipeline group; collective over
    it, ``waits``: its lockstep.Collectives, None for one process): built one
    at a time, one untimed step each, then ``steps`` timed steps each (more
    for fast steps: see :func:`trial_seconds`), interleaved; then as many again (at
    least ``extra_steps``), interleaved, of those whose median is within
    :data:`CLOSE` of the least (when two or more are).
    Every rank returns rank 0's timings. The model is left as it was (NOTE
    [Trials leave no trace])."""
    import torch
    import torch.distributed as dist

    import torch_mpmd  # (its public pipeline(): api imports planning, not the reverse)
    from torch_mpmd.parallel import lockstep
    from torch_mpmd.planning.calibrate import model_state_kept

    def barrier(what: str) -> None:
        # NOTE [Calibration barriers] (calibrate.py): lockstep's named barrier
        # lets ranks leave up to 20 ms apart; the timed steps' barriers are
        # the group's all-reduce alone (bounded by the timeout all the same).
        if waits is not None:
            waits.all_reduce(torch.zeros(1, device=waits.device), what, arrive=False)

    seconds = trial_seconds()  # (a bad MPMD_TRIAL_SECONDS: raised before any step)
    walls: list[list[float]] = [[] for _ in contenders]
    with model_state_kept(model):
        pipes = []
        for i, (c, _) in enumerate(contenders):
            lockstep.progress(f"building trial {i + 1} of {len(contenders)}")
            pipe = torch_mpmd.pipeline(model, loss_fn=loss_fn, plan=plan_of(c, sheet),
                                       group=group, compile=compile, timeout=timeout_s)
            if waits is not None:  # (a named barrier: names a rank that is missing)
                waits.barrier(f"the barrier before trial {i}'s first step")
            pipe.step(*args, **kwargs, target=target)  # capture, build, first transfers
            pipes.append(pipe)

        def rounds(which: list[int], count: int, first: int) -> None:
            for step in range(first, first + count):
                for i in which:
                    barrier(f"the barrier before trial {i}'s step {step}")
                    start = time.perf_counter()
                    pipes[i].step(*args, **kwargs, target=target)
                    barrier(f"the barrier after trial {i}'s step {step}")
                    walls[i].append(time.perf_counter() - start)

        def shared(what: str) -> list[list[float]]:
            if waits is not None and dist.get_world_size(waits.group) > 1:
                return waits.broadcast_json(walls, what)
            return walls

        # One round timed, then as many as fill trial_seconds() (at least
        # ``steps``, at most MAX_TRIAL_STEPS): a fast model's medians get the
        # steps its noise needs at little cost.
        rounds(list(range(len(pipes))), 1, 0)
        # Rank 0's budget too: every rank must count the same rounds.
        walls.append([seconds])
        walls = shared("the broadcast of rank 0's first trial round")
        seconds = walls.pop()[0]
        per_round = sum(w[0] for w in walls)
        total = max(steps, min(MAX_TRIAL_STEPS, int(seconds / max(per_round, 1e-9))))
        rounds(list(range(len(pipes))), total - 1, 1)
        walls = shared("the broadcast of rank 0's trial timings")
        # Where the medians are too close to tell, more steps of those alone
        # (every rank decides alike: on rank 0's timings).
        medians = [statistics.median(w) for w in walls]
        close = [i for i, m in enumerate(medians) if m <= min(medians) * (1 + CLOSE)]
        if len(close) > 1 and extra_steps > 0:
            rounds(close, max(extra_steps, total), total)
            walls = shared("the broadcast of rank 0's further trial timings")
        del pipes, pipe  # freed before the chosen plan is built
        gc.collect()
    return [Trial(schedule=c.schedule, stages_per_rank=c.stages_per_rank,
                  num_microbatches=c.num_microbatches, split_points=tuple(c.split_points),
                  recompute=tuple(c.recompute), predicted_step_s=c.predicted_step_s,
                  steps_s=tuple(float(w) for w in ws), data_parallel=c.data_parallel,
                  default=is_default)
            for (c, is_default), ws in zip(contenders, walls)]


def choose(trials: Sequence[Trial]) -> Trial:
    """The trial of least median step (on an exact tie, the one predicted
    faster)."""
    if not trials:
        raise ValueError("no trials to choose from")
    return min(trials, key=lambda t: (t.measured_step_s, t.predicted_step_s))


def as_plan(trial: Trial, trials: Sequence[Trial], search: Any, sheet: CostSheet,
            *, trials_s: float, decided_by: str = "trials") -> Plan:
    """The chosen ``trial`` as the Plan ``mpmd.plan`` returns, its search
    record carrying every trial and the trials' time."""
    peaks = evaluate_plan(sheet, trial.schedule, num_microbatches=trial.num_microbatches,
                          stages_per_rank=trial.stages_per_rank, split_points=trial.split_points,
                          recompute=trial.recompute, data_parallel=trial.data_parallel
                          ).predicted_peak_bytes
    record = dataclasses.replace(search, trials=tuple(trials), trials_s=trials_s,
                                 decided_by=decided_by)
    return dataclasses.replace(plan_of(trial), predicted_peak_bytes=peaks, search=record,
                               sheet=sheet)
