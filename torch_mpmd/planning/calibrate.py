"""The runtime's own costs, measured on the real group (issue 21, item 1).

A profile times the model's stage programs one by one; what the runtime adds
around them (the executor's dispatch, posting and processing transfers, the
step's begin and end exchanges, the loss's broadcast) is measured here by
running the model itself as a pipeline on the group the plan is for: 1F1B,
the profile's units split evenly by count over the p ranks, at the
profile's microbatch, two warm-up steps and ``steps`` timed ones, barrier
to barrier. From their timelines (runtime/trace.py):

- ``action_overhead``: per action, the gaps between a rank's actions and
  the sends' posting (``trace.action_overhead``), median over the steps;
- ``step_overhead``: a step's wall time outside its actions
  (``trace.step_overhead``), median;
- ``transfer_latency``: what a message takes beyond its bytes on the link:
  the median time from a send's begin to its receive's end
  (``trace.transfer_latencies``) less the mean message's bytes over the
  link's bandwidth; at least the ping-pong's latency.

These are the constants with which the simulator predicted every schedule of
the example GPT within 8% (BENCHMARKS.md, "The planner against measured
steps"). The stages run as FX programs whatever ``compile`` the plan is for:
the runtime's time per action does not depend on what runs inside it, and
compiling the model twice would double the profile's cost.
:func:`fit_action_overhead` is the other reading (the time per action at
which the simulated step equals a measured one), for scripts/bench_predict.py.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["RuntimeCosts", "fit_action_overhead", "measure_runtime"]


@dataclasses.dataclass(frozen=True)
class RuntimeCosts:
    """Seconds: per action, per step outside the actions, per transfer."""

    action_overhead: float
    step_overhead: float
    transfer_latency: float


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

    lo, hi = 0.0, max(action_overhead(rows), 1e-6)
    while predicted(hi) < wall_s and hi < 1.0:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < wall_s else (lo, mid)
    return (lo + hi) / 2


def _message_bytes(pipe: Any) -> float:
    """The bytes one transfer of the calibration pipeline carries, on the
    mean over its cuts: every value crossing the cut, for one microbatch."""
    split = pipe.split
    cuts = [0.0] * max(1, pipe.num_stages - 1)
    for v in split.plan.cross_stage_values:
        for cut in range(v.producer_stage, max(v.consumer_stages)):
            cuts[cut] += v.bytes
    return statistics.fmean(cuts)


def measure_runtime(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, *,
                    loss_fn: Any, group: Any, units: Sequence[str], num_microbatches: int,
                    link: tuple[float, float], steps: int = 6) -> RuntimeCosts:
    """The runtime's costs running ``model`` on ``group`` (a pipeline group of
    at least two ranks; collective over it): see the module docstring.
    ``units``: the profile's (the split cuts at every ``len(units) / p``-th);
    ``link``: the ping-pong's (latency s, bandwidth B/s). The model's
    gradients, buffers and the RNG state are left as they were."""
    from torch_mpmd.api import pipeline
    from torch_mpmd.runtime import trace

    pp = dist.get_world_size(group)
    split = [units[len(units) * k // pp] for k in range(1, pp)]
    grads = {p: p.grad for p in model.parameters()}
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    walls, rows = [], []
    try:
        pipe = pipeline(model, loss_fn=loss_fn, schedule="1f1b",
                        num_microbatches=num_microbatches, group=group, split_points=split)
        for step in range(2 + steps):  # two warm-up steps: capture, build, first transfers
            dist.barrier(group=group)
            start = time.perf_counter()
            pipe.step(*args, **kwargs, target=target)
            dist.barrier(group=group)
            wall = time.perf_counter() - start
            if step >= 2:
                walls.append(wall)
                rows.append(pipe.timelines())  # every rank's (collective)
        message = _message_bytes(pipe)
    finally:
        with torch.no_grad():  # the calibration leaves no trace in the model
            for p, g in grads.items():
                p.grad = g
            for b, was in zip(model.buffers(), buffers):
                b.copy_(was)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    latency, bandwidth = link
    arrivals = [t for r in rows for t in trace.transfer_latencies(r)]
    if arrivals:  # what a message takes beyond its bytes on the link
        latency = max(latency, statistics.median(arrivals) - message / bandwidth)
    costs = RuntimeCosts(
        action_overhead=statistics.median(trace.action_overhead(r) for r in rows),
        step_overhead=statistics.median(trace.step_overhead(w, r) for w, r in zip(walls, rows)),
        transfer_latency=latency)
    # One answer for every rank (each timed its own walls): rank 0's.
    box = [costs]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
