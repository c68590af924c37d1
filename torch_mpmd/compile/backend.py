"""The ``"mpmd"`` torch.compile backend: the second door to ``pipeline()``.

``torch.compile(fn, backend="mpmd", options={...})`` hands this backend the
Dynamo graph of ``fn`` (a function such as forward + loss, or a module's
forward). ``options`` takes pipeline()'s settings (``schedule``,
``num_microbatches``, ``split_points``, ``stages_per_rank``, ``num_stages``,
``mesh``/``group``, ``timeout``, ``seed``, ``lookahead``, ``compile``,
``bytes_cost``, ``plan``, ...: every field of :class:`torch_mpmd.PipelineConfig`
but ``loss_fn``), checked by the same code (the config's), plus ``reduction`` ("mean",
the default, or "sum": how the training call combines the microbatches'
losses). ``plan="auto"`` plans at the first training call from its batch
(the plan fields among the options, e.g. ``schedule``, are constraints of the
search; door.py). The backend returns a :class:`torch_mpmd.door.Door`, which pipelines
``fn`` itself through pipeline()'s capture, split, stage programs and runtime
(door.py says what a call runs). It is registered through the
``torch_dynamo_backends`` entry point in setup.py, and only there (a second
``register_backend`` would assert on the duplicate name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from torch_mpmd.config import BACKEND_OPTIONS, PipelineConfig, check_stage_count
from torch_mpmd.graph.capture import CaptureError
from torch_mpmd.graph.hf import recorders_install_while_tracing
from torch_mpmd.schedules import DEFAULT

# BACKEND_OPTIONS: the keys ``options`` may hold (the config's fields but
# ``loss_fn``, and ``reduction``); any other key is a ValueError naming it.
__all__ = ["mpmd_backend", "BACKEND_OPTIONS", "check_stage_count"]

def _skip_logging_calls() -> None:
    """Let Dynamo drop logging.Logger calls from traced code instead of breaking
    the graph there, as pipeline()'s capture does: library code logs in forward
    (transformers' ``warning_once`` in its losses), and the door needs one
    graph. Done when this backend is looked up, before Dynamo traces, so it
    applies to every torch.compile in the process (documented in README)."""
    from torch_mpmd.graph.capture import logging_functions

    torch._dynamo.config.ignore_logging_functions = logging_functions()
    # Likewise transformers' lazy output recorders (NOTE [Recorders while tracing]).
    recorders_install_while_tracing()


_skip_logging_calls()

def _check_options(options: Mapping[str, Any] | None) -> tuple[PipelineConfig, str]:
    """The pipeline's config and the reduction from ``options`` (checked
    whole: the config's own checks and those that need the groups)."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    unknown = [k for k in options if k not in BACKEND_OPTIONS]
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for the mpmd "
                         f"backend; known options: {', '.join(BACKEND_OPTIONS)}")
    opts = dict(options)
    reduction = opts.pop("reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"option reduction={reduction!r} must be 'mean' or 'sum'")
    if opts.get("plan") is None:  # (a plan, or "auto", fills the schedule and microbatches)
        # pipeline()'s default schedule (PipelineConfig.schedule_at: at several
        # stages per rank, interleaved); the whole batch as one microbatch.
        opts.setdefault("num_microbatches", DEFAULT.num_microbatches)
        opts.setdefault("schedule", DEFAULT.schedule)
    config = PipelineConfig(**opts)
    config.resolve()
    return config, reduction


def _check_whole_graph(gm: torch.fx.GraphModule) -> None:
    """A graph that ends at a graph break is only part of the function: refuse it."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    stack = getattr(reason, "user_stack", None) or []
    where = (f"{stack[-1].filename}:{stack[-1].lineno} (`{(stack[-1].line or '').strip()}`)"
             if stack else "an unknown line")
    raise CaptureError(
        f"the mpmd backend needs the compiled function as one graph, but Dynamo breaks it at "
        f"{where}: {reason.reason}. Move data-dependent control flow out of it or use "
        "torch.cond; a logging call breaks the graph too (add the logger method, e.g. "
        "logging.Logger.warning_once, to torch._dynamo.config.ignore_logging_functions). "
        "Compile with fullgraph=True to see the reason of every break.")


def mpmd_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: Mapping[str, Any] | None = None) -> Any:
    """Dynamo backend: pipeline the compiled function (see the module docstring).

    Options are checked first (a ValueError names a bad key or value), then
    the graph (a graph break is a CaptureError naming the source line).
    Nothing is captured or communicated until the first call.
    """
    from torch_mpmd.compile.door import Door

    config, reduction = _check_options(options)
    if "dynamic" not in (options or {}) and any(isinstance(v, torch.SymInt)
                                                 for v in example_inputs):
        # Dynamo traced with symbolic sizes (dynamic=True, mark_dynamic, or a
        # recompile after a shape change): the pipeline's capture is symbolic too.
        config = dataclasses.replace(config, dynamic=True)
    _skip_logging_calls()  # for the next traces, if a library added Logger methods since
    _check_whole_graph(gm)
    return Door(gm, example_inputs, config, reduction, given=tuple(options or ()))
