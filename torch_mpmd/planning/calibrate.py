"""The runtime's own costs, measured on the real group.

A profile times the model's stage programs one by one; what the runtime adds
around them (the executor's dispatch, posting and processing transfers, the
step's begin and end exchanges, the loss's broadcast) is measured here by
running the model itself as a pipeline on the group the plan is for: 1F1B,
the profile's units split evenly by count over the p ranks, at the
profile's microbatch, two warm-up steps and ``steps`` timed ones, barrier
to barrier (:func:`measure_runtime`). From their timelines (runtime/trace.py):

- ``step_overhead``: a step's wall time outside its actions
  (``trace.step_overhead``), median;
- ``transfer_latency``: what a message takes beyond its bytes on the link:
  the median time from a send's begin to its receive's end
  (``trace.transfer_latencies``) less the mean message's bytes over the
  link's bandwidth; at least the ping-pong's latency;
- ``action_overhead``: the gaps between a rank's actions and the sends'
  posting (``trace.action_overhead``), median: the start of the fit below.

NOTE [Fitted action overhead]: the profile times each unit's programs alone,
in one process; in the pipeline the same programs run inside the runtime,
beside the other ranks' (which share the machine), and the runtime spends
time per action that a timeline cannot separate from a program's span (a
RECV's processing, the executor's bookkeeping). The gaps alone price an
action at 37 us on the example GPT where the step says 127 us (BENCHMARKS.md,
"The planner against measured steps"), and with them the planner
under-prices schedules of many short actions: it chose 8 microbatches where
4 ran faster. So :func:`fit_sheet` fits the price per action (at least the
timelines' reading): the one at which the planner's own prediction of the
calibration run (the profile's unit costs, the measured step overhead and
transfer latency, the same split and microbatches) equals its measured
median step. Every plan is then predicted on that footing. Before that fit,
the units' times are scaled by one factor, the run's compute actions' spans
over the profile's prediction of them: the programs run slower beside the
other ranks than alone (on two shared CPU cores, 10-15%), which grows with
the work and not with the actions, and a price per action that took it in
came out at 300-600 us and made the planner choose the fewest microbatches.
A second run at half the microbatch, to tell the two apart from steps
alone, moved the price by hundreds of microseconds between identical
calibrations (steps vary by a few percent); the spans, summed over every
action of every step, do not. (Those steps were timed between barriers that
polled the store every 20 ms: NOTE [Calibration barriers].)

Those barriers were why the predictions' error grew with m on a wide-head model (the
wide-head GPT's sheet predicted zero_bubble m=2 at 1.13 of its measured
step and m=16 at 1.48): the skew they left inside the run was priced per
action, and the plans of many microbatches paid it once per action. With
plain all-reduce barriers the one run's fit is flat over m = 2..16 on the
six models of scripts/bench_plan_zoo.py (BENCHMARKS.md, "Predicted against
measured: the planner zoo"). ``measure_runtime(second=True)`` also runs 1F1B
at 2m, stepped in turn with the first, and fits the price per action from
the difference of the two (NOTE [Two microbatch counts]); on the zoo it was
no better than one run (the difference of two medians of a few steps is
noisy on a shared machine) and it builds a second pipeline, so it is off by
default.

The calibration runs the programs the profile timed: FX, or compiled as
``compile=`` compiles them (its two stages compile once more, on their own
ranks at once; the profile's unit programs are other graphs). Fitted on FX
runs, a sheet of Inductor programs predicted 0.81 of the measured step: the
runtime's costs around a compiled program are not those around an FX one.
:func:`fit_action_overhead` is the same fit on measured stage times (no
profile), for scripts/bench_predict.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

__all__ = ["RuntimeCosts", "fit_action_overhead", "fit_sheet", "measure_runtime"]


@dataclasses.dataclass(frozen=True)
class RuntimeCosts:
    """Seconds: per action (the timelines' reading), per step outside the
    actions, per transfer; and the calibration run itself (its split, its
    microbatch count and median step, for :func:`fit_sheet`)."""

    action_overhead: float
    step_overhead: float
    transfer_latency: float
    split_points: tuple[str, ...] = ()
    num_microbatches: int = 0       # 0: no calibration ran
    step_wall: float = 0.0          # its median step, barrier to barrier
    compute_seconds: float = 0.0    # a step's compute actions' spans, all ranks, median
    # The second run, at twice the microbatches (0: none; NOTE [Two microbatch counts]).
    second_microbatches: int = 0
    second_wall: float = 0.0


def fit_action_overhead(schedule: Any, rows: Sequence[Any], wall_s: float, *,
                        latency_s: float, step_s: float) -> float:
    """The time per action (seconds) at which the simulator's run of
    ``schedule`` on the measured ``rows`` (every step's timelines, flattened:
    each stage's mean F/B/I/W) takes ``wall_s``, with ``latency_s`` per
    transfer and ``step_s`` per step (bisection to 1e-9 of the bracket;
    0 when the schedule is that slow without any)."""
    from torch_mpmd.runtime.trace import action_overhead, simulate_measured

    def predicted(overhead_s: float) -> float:
        return simulate_measured(schedule, rows, comm_latency_s=latency_s,
                                 action_overhead_s=overhead_s, step_overhead_s=step_s,
                                 statistic="mean").makespan * 1e-3

    hi = max(action_overhead(rows), 1e-6)
    while predicted(hi) < wall_s and hi < 1.0:
        hi *= 2
    return _bisect(predicted, wall_s, 0.0, hi)


def batch_size_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The leading size of the first tensor among the inputs (the batch)."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("the example inputs hold no tensor with a batch dimension")


@contextlib.contextmanager
def model_state_kept(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model may run (forward, backward): after it, its
    parameters' gradients, its buffers and the RNG states are as before."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, g in grads.items():
                p.grad = g
            for b, was in zip(model.buffers(), buffers):
                b.copy_(was)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _message_bytes(pipe: Any) -> float:
    """The bytes one transfer of the calibration pipeline carries, on the
    mean over its cuts: every value crossing the cut, for one microbatch."""
    split = pipe.split
    cuts = [0.0] * max(1, pipe.num_stages - 1)
    for v in split.plan.cross_stage_values:
        for cut in range(v.producer_stage, max(v.consumer_stages)):
            cuts[cut] += v.bytes
    return statistics.fmean(cuts)


def _timed_steps(pipe: Any, waits: Any, args: tuple, kwargs: dict, target: Any, steps: int
                 ) -> tuple[list[float], list[Any]]:
    """Two warm-up steps (capture, build, first transfers), then ``steps``
    timed barrier to barrier (``waits``: lockstep.Collectives over the
    pipeline group): their walls and every rank's timelines."""
    return _timed_rounds([pipe], waits, args, kwargs, target, steps)[0]


def _timed_rounds(pipes: Sequence[Any], waits: Any, args: tuple, kwargs: dict, target: Any,
                  steps: int) -> list[tuple[list[float], list[Any]]]:
    """:func:`_timed_steps` of several pipelines, stepped in turn (A B A B
    ...: the machine's drift hits all alike); per pipeline its walls and
    timelines."""
    out: list[tuple[list[float], list[Any]]] = [([], []) for _ in pipes]
    waits.barrier("the barrier before the calibration's steps")  # names a missing rank

    def barrier(what: str) -> None:
        # NOTE [Calibration barriers]: a named barrier (lockstep's arrive)
        # polls the store every 20 ms, so a rank leaves it up to 20 ms after
        # the other: that skew fell inside the steps' walls and timelines
        # (a latency-bound model's calibration measured 24 ms per step
        # outside the actions where its steps spend 2), and the fit priced it
        # per action. The timed steps' barriers are the group's all-reduce
        # alone, still bounded by the timeout.
        waits.all_reduce(torch.zeros(1, device=waits.device), what, arrive=False)

    for step in range(2 + steps):
        for pipe, (walls, rows) in zip(pipes, out):
            barrier(f"the barrier before calibration step {step}")
            start = time.perf_counter()
            pipe.step(*args, **kwargs, target=target)
            barrier(f"the barrier after calibration step {step}")
            wall = time.perf_counter() - start
            if step >= 2:
                walls.append(wall)
                rows.append(pipe.timelines())  # every rank's (collective)
    return out


def measure_runtime(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, *,
                    loss_fn: Any, group: Any, units: Sequence[str], num_microbatches: int,
                    link: tuple[float, float], steps: int = 10,
                    compile: Any = False, waits: Any = None,
                    second: bool = False) -> RuntimeCosts:
    """The runtime's costs running ``model`` on ``group`` (a pipeline group of
    at least two ranks; collective over it): see the module docstring.
    ``units``: the profile's (the split cuts at every ``len(units) / p``-th);
    ``link``: the ping-pong's (latency s, bandwidth B/s); ``compile``: the
    stage programs' compiler, as ``pipeline(compile=)`` takes it; ``waits``:
    the lockstep.Collectives over ``group`` that bound every wait (default:
    made here, with the pipeline's default timeout), whose timeout the
    calibration pipeline takes. ``second``: also run ``2 * num_microbatches``
    (where the batch divides into them), stepped in turn with the first
    (NOTE [Two microbatch counts]). The model's gradients, buffers and the
    RNG state are left as they were."""
    from torch_mpmd.parallel import lockstep

    if waits is None:
        waits = lockstep.Collectives(group, 60.0, "calibration")
    import torch_mpmd  # (its public pipeline(): api imports planning, not the reverse)
    from torch_mpmd.runtime import trace

    pp = dist.get_world_size(group)
    split = [units[len(units) * k // pp] for k in range(1, pp)]
    counts = [num_microbatches]
    if second and batch_size_of(args, kwargs) % (2 * num_microbatches) == 0:
        counts.append(2 * num_microbatches)
    with model_state_kept(model):  # the calibration leaves no trace in the model
        # One model for both pipelines: each builds its own programs from it.
        pipes = [torch_mpmd.pipeline(model, loss_fn=loss_fn, schedule="1f1b",
                                     num_microbatches=m, group=group, split_points=split,
                                     compile=compile, timeout=waits.timeout_s)
                 for m in counts]
        runs = _timed_rounds(pipes, waits, args, kwargs, target, steps)
        message = _message_bytes(pipes[0])
    walls, rows = runs[0]
    latency, bandwidth = link
    arrivals = [t for r in rows for t in trace.transfer_latencies(r)]
    if arrivals:  # what a message takes beyond its bytes on the link
        on_link = message / bandwidth if bandwidth > 0 else 0.0
        latency = max(latency, statistics.median(arrivals) - on_link)
    costs = RuntimeCosts(
        action_overhead=statistics.median(trace.action_overhead(r) for r in rows),
        step_overhead=statistics.median(trace.step_overhead(w, r) for w, r in zip(walls, rows)),
        transfer_latency=latency, split_points=tuple(split),
        num_microbatches=num_microbatches, step_wall=statistics.median(walls),
        compute_seconds=statistics.median(
            sum(end - start for row in r for action, start, end in row if action.is_compute)
            for r in rows),
        second_microbatches=counts[1] if len(counts) > 1 else 0,
        second_wall=statistics.median(runs[1][0]) if len(counts) > 1 else 0.0)
    # One answer for every rank (each timed its own walls): rank 0's.
    sent = waits.broadcast_json(dataclasses.asdict(costs), "the broadcast of rank 0's "
                                "calibration")
    return RuntimeCosts(**{**sent, "split_points": tuple(sent["split_points"])})


def _bisect(f: Any, target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the increasing ``f`` reaches ``target`` (an end
    when it does not cross there)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


_TIMES = ("forward", "backward_input", "backward_weight", "forward_fixed",
          "backward_input_fixed", "backward_weight_fixed")


def fit_sheet(sheet: Any, costs: RuntimeCosts, batch: int) -> Any:
    """``sheet`` (measured units, the calibration's step and link constants)
    fitted to the calibration run (NOTE [Fitted action overhead]): its unit
    times scaled to the compute the run's actions measured, and the action
    overhead at which the planner's own prediction of the run (1F1B, its
    split, ``batch`` samples in its microbatches) equals its measured median
    step, at least what the timelines measured."""
    from torch_mpmd.planning.plan import evaluate_plan

    if not costs.num_microbatches:
        return sheet
    m, wall = costs.num_microbatches, costs.step_wall
    split = list(costs.split_points)
    # As the calibration ran: this batch, one replica (its pipeline group only).
    at = dataclasses.replace(sheet, global_batch=batch, memory_limit=0.0, dp_size=1)
    # The profile's compute of the run: every unit's F, I and W per microbatch
    # (NOTE [Microbatch scaling]), times the microbatches.
    ratio = batch / m / sheet.reference_microbatch
    profiled = m * sum(getattr(u, kind + "_fixed") + (getattr(u, kind) - getattr(u, kind + "_fixed"))
                       * ratio for u in sheet.units
                       for kind in ("forward", "backward_input", "backward_weight"))
    scale = min(2.0, max(0.5, costs.compute_seconds / profiled)) \
        if costs.compute_seconds > 0 and profiled > 0 else 1.0
    units = [dataclasses.replace(u, **{name: getattr(u, name) * scale for name in _TIMES})
             for u in sheet.units]
    at = dataclasses.replace(at, units=units)

    def predicted(overhead_s: float) -> float:
        return evaluate_plan(dataclasses.replace(at, action_overhead=overhead_s), "1f1b",
                             num_microbatches=m, split_points=split).predicted_step_s

    if costs.second_microbatches and costs.second_wall > 0:
        return _fit_two(sheet, at, costs, split)
    top = max(costs.action_overhead, 1e-6)
    while predicted(top) < wall and top < 1.0:
        top *= 2
    fitted = _bisect(predicted, wall, costs.action_overhead, top)
    return dataclasses.replace(sheet, units=units, action_overhead=fitted)


def _fit_two(sheet: Any, at: Any, costs: RuntimeCosts, split: list[str]) -> Any:
    """NOTE [Two microbatch counts]: one run cannot tell a cost per action
    from a cost per step: a price per action fitted to one run takes in
    whatever of the step the prediction lacks, and the plans of more
    microbatches (more actions) pay it again for each. With the same
    pipeline also run at twice the microbatches (``costs.second_*``; the
    runs stepped in turn, so the machine's drift hits both alike), the
    difference of the two steps prices the actions alone: the action
    overhead ``a`` is where the planner's predicted difference of the two
    (step overhead 0; ``at``: the sheet with its units scaled) equals the
    measured one, at least the timelines' reading, and the step overhead
    the mean of what each run's step leaves beyond its prediction at that
    ``a``. A difference of two medians of a few steps is noisy on a shared
    machine: where that step overhead comes out below the timelines' own
    reading (the wall outside the actions, which is really spent), it stays
    at that reading and ``a`` is the mean of what each run alone asks on top
    of it (on the deep narrow zoo model, a loaded machine: 3.9 ms per action
    from the difference, 1.4 ms so, and the predicted / measured ratio flat
    over m = 2..16 at 1.04, 1.00, 1.01, 1.01)."""
    from torch_mpmd.planning.plan import evaluate_plan

    counts = (costs.num_microbatches, costs.second_microbatches)
    walls = (costs.step_wall, costs.second_wall)
    bare = dataclasses.replace(at, step_overhead=0.0)

    def steps(overhead_s: float) -> tuple[float, float]:
        return tuple(evaluate_plan(dataclasses.replace(bare, action_overhead=overhead_s),
                                   "1f1b", num_microbatches=m, split_points=split
                                   ).predicted_step_s for m in counts)

    def difference(overhead_s: float) -> float:
        one, two = steps(overhead_s)
        return two - one

    floor = costs.action_overhead
    target = walls[1] - walls[0]
    top = max(floor, 1e-6)
    while difference(top) < target and top < 1.0:
        top *= 2
    fitted = _bisect(difference, target, floor, top)
    step = statistics.fmean(w - p for w, p in zip(walls, steps(fitted)))
    if step < costs.step_overhead:
        # Below what the timelines measured outside the actions: the
        # difference was noise (two medians of a few steps each on a shared
        # machine). The step overhead stays at that reading, and the price
        # per action is what each run asks on top of it, the mean of the two.
        step = costs.step_overhead

        def alone(i: int) -> float:
            def one(overhead_s: float) -> float:
                return steps(overhead_s)[i] + step
            hi = max(floor, 1e-6)
            while one(hi) < walls[i] and hi < 1.0:
                hi *= 2
            return _bisect(one, walls[i], floor, hi)
        fitted = statistics.fmean(alone(i) for i in range(2))
    return dataclasses.replace(sheet, units=at.units, action_overhead=fitted,
                               step_overhead=step)
