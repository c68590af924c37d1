"""One call of a pipeline on this rank, whatever its kind: ``run_step`` (README, Architecture).

Every call kind runs through :func:`run_step`: ``Pipeline.step`` ("step"),
``eval_step`` ("eval") and the forward call ("forward"), and the compile
door's training call (a step), its forward part ("forward", keeping the
autograd state for backward) and its backward part ("backward"). It does,
once for all of them, what each call needs around the executor: size the
transfers for the call's shapes, save the user's RNG state (stages reseed
per stage and microbatch) and put it back, start the runner's step, post
and finish the data-parallel reductions, run the executor (in lockstep with
the other ranks: ``RankRuntime.run``), count the step, and record the call's
trace and peaks in the pipeline's :class:`CallHistory`, or forget the last
record when the call failed (its trace is partial). No other module starts
a runner's step or runs an executor.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from torch_mpmd.runtime import trace

if TYPE_CHECKING:
    from torch_mpmd.runtime.rank import RankRuntime

__all__ = ["run_step", "CallHistory", "RngState", "Part", "STEP", "EVAL", "FORWARD",
           "FORWARD_KEEPING_GRAPH", "BACKWARD", "STATS_WINDOW"]

STATS_WINDOW = 20  # completed calls a pipeline keeps the trace of, by default


class RngState:
    """The RNG state to put back after a call: stages reseed per (stage,
    microbatch), which must not change the user's random stream."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        self.device = device

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class CallHistory:
    """What this rank's completed calls did: the pipeline's step counter, the
    last ``window`` calls' records (trace.StepRecord: the executor's trace
    and the call's peaks) and the last call's collectives. Local, no
    communication."""

    def __init__(self, window: int = STATS_WINDOW) -> None:
        self.step = 0                       # training steps taken (the seeds' step)
        self.records: collections.deque[trace.StepRecord] = collections.deque(maxlen=window)
        self.last: trace.StepRecord | None = None
        self._last_stats: dict[str, Any] | None = None
        self._last_collectives: dict[str, Any] | None = None

    @property
    def window(self) -> int:
        return self.records.maxlen or STATS_WINDOW

    @window.setter
    def window(self, value: int) -> None:
        self.records = collections.deque(self.records, maxlen=value)

    def record(self, rt: "RankRuntime", executor: Any) -> None:
        """The call just run by ``executor``: a copy of its trace (one tensor)
        and peaks, which the executor's next run overwrites; the metrics are
        derived when asked for (a Python walk over every action would cost
        each call as much as ~100 actions)."""
        kind = rt.kind_of(executor)
        sharded = rt.shards is not None and rt.dp is not None
        record = trace.StepRecord(kind, int(rt.runner.step), rt.rank, rt.programs(kind),
                                  executor.trace_array, executor.counters,
                                  dict(rt.runner.peak_bytes),
                                  tuple(_first_shape(named) for named in rt.runner.inputs),
                                  peak_held_bytes=rt.runner.peak_total,
                                  peak_gathered_bytes=rt.dp.peak_gathered if sharded else 0,
                                  peak_live_bytes=(rt.runner.peak_live if sharded
                                                   else rt.runner.peak_total))
        self.records.append(record)
        self.last = record
        self._last_stats = None
        collectives = rt.dp.report() if sharded else {}
        if rt.tied is not None and kind == "step":
            collectives["tied_all_reduce"] = rt.tied.report()
        self._last_collectives = collectives or None

    def forget(self) -> None:
        """The last call failed: nothing describes it (Pipeline.last_step_stats
        is empty until the next call completes)."""
        self.last = None
        self._last_stats = None

    def last_stats(self) -> dict[str, Any]:
        """Pipeline.last_step_stats: the last completed call's statistics."""
        if self.last is None:
            return {}
        if self._last_stats is None:
            self._last_stats = self.last.stats()
            if self._last_collectives is not None:
                self._last_stats["collectives"] = self._last_collectives
        return self._last_stats


def _first_shape(named: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of a microbatch's first tensor input (() when it has none)."""
    for value in named.values():
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
    return ()


@dataclass(frozen=True)
class Part:
    """Which part of the schedule a call runs and how (run_step's ``part``).

    ``executor``: "step" (the whole schedule), "forward" or "backward"
    (RankRuntime's executors). ``training``: keep autograd state for
    backward. ``eval_loss``: the last stage computes the loss (eval_step).
    ``outputs_as_roots``: the last stage's outputs are backward's roots (the
    door's forward part). ``begins``: the call starts the runner's step (a
    backward part continues its forward part's). ``reduces``: data-parallel
    gradient reductions are posted and finished. ``counts``: the call is a
    training step of the pipeline's counter. ``grad``: the grad mode of the
    run: "caller" (as called), "enable", or "functional_off" (off when the
    runner runs functional programs, which need no autograd graph: one
    switch for the whole step instead of one per action)."""

    executor: str
    training: bool
    eval_loss: bool = False
    outputs_as_roots: bool = False
    begins: bool = True
    reduces: bool = False
    counts: bool = False
    grad: str = "caller"


STEP = Part("step", training=True, reduces=True, counts=True, grad="functional_off")
EVAL = Part("forward", training=False, eval_loss=True)
FORWARD = Part("forward", training=False)
# The door's forward part runs inside an autograd Function's forward (grad off).
FORWARD_KEEPING_GRAPH = Part("forward", training=True, outputs_as_roots=True, counts=True,
                             grad="enable")
BACKWARD = Part("backward", training=True, begins=False, reduces=True)


def defer_parameter_hooks(rt: "RankRuntime") -> None:
    """The parameters' gradient hooks of ``rt``'s calls run after the call, by
    the caller (the compile door runs them in its loss's backward): a hooked
    parameter does not send a stage to the autograd runner."""
    rt.runner.hooks_run_later = True


_EXECUTORS = {"step": "executor", "forward": "forward_executor",
              "backward": "backward_executor"}


def run_step(rt: "RankRuntime", part: Part, history: CallHistory, device: torch.device, *,
             inputs: Sequence[Mapping[str, Any]] = (), targets: Sequence[Any] = (),
             loss_fn: Callable[..., Any] | None = None,
             output_grads: Sequence[Sequence[Any]] | None = None) -> None:
    """Run ``part`` of this rank's program for one call (module docstring).

    ``inputs``: the microbatches' named inputs (capture names); ``targets``
    and ``loss_fn`` for the calls that compute the loss; ``output_grads``
    (BACKWARD after FORWARD_KEEPING_GRAPH): per microbatch, the gradient of
    each of the last stage's flat outputs (None: none). Raises what the
    executor run raised (PipelineError, or this rank's own exception), after
    putting back the RNG state and forgetting the last record; the runner's
    state of a failed call is ended by RankRuntime.run. The caller ends the
    runner's step where it reads its outputs or losses first."""
    # By name: the forward and backward executors are built on first use only.
    executor = getattr(rt, _EXECUTORS[part.executor])
    rng = None
    if part.begins:
        rt.use_microbatches(inputs)
        rt.use_contents(inputs, targets)  # compared in the begin exchange (rt.run)
        rng = RngState(device)
        rt.runner.begin_step(inputs, targets, loss_fn, rt.seed, history.step,
                             training=part.training, outputs_as_roots=part.outputs_as_roots,
                             eval_loss=part.eval_loss)
    if output_grads is not None:
        rt.runner.output_grads = [list(g) for g in output_grads]
    if part.reduces:
        rt.begin_reductions()
    try:
        if part.grad == "enable":
            grad: Any = torch.enable_grad()
        elif part.grad == "functional_off" and rt.runner.functional:
            grad = torch.no_grad()
        else:
            grad = contextlib.nullcontext()
        with grad:
            rt.run(executor)
    except BaseException:
        history.forget()  # its executor's trace is partial now
        raise
    finally:
        if rng is not None:
            rng.restore()
    if part.reduces:
        rt.end_reductions()
    if part.counts:
        history.step += 1
    history.record(rt, executor)
