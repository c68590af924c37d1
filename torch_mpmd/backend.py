"""The ``"mpmd"`` torch.compile backend.

``torch.compile(model, backend="mpmd", options={...})`` hands this backend the
Dynamo graph of ``model``'s forward; it partitions the graph into pipeline
stages (markers, ``split_points`` or a balanced split) and returns a callable
that runs them. It is registered through the ``torch_dynamo_backends`` entry
point in setup.py, and only there (a second ``register_backend`` would assert
on the duplicate name).

With no process group (or a world size of 1) every stage runs in this process,
in order, under autograd: the output is the model's and ``backward()`` gives
the model's gradients. Over several ranks the stages run as a GPipe pipeline
(compiled.py): every rank returns the full output, and ``backward()`` (called
on every rank) fills each rank's local-stage parameter gradients.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from torch_mpmd.capture import CaptureError, PlaceholderInfo
from torch_mpmd.fx_to_ir import order_mutations, to_ir
from torch_mpmd.stage import _set_path, build_stages, partition, run_stages

__all__ = ["mpmd_backend", "BACKEND_OPTIONS", "check_stage_count"]

BACKEND_OPTIONS = ("split_points", "num_stages", "num_microbatches", "stages_per_rank",
                   "timeout")
"""Keys ``options`` may hold; any other key is a ValueError naming it."""


def _check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    unknown = [k for k in options if k not in BACKEND_OPTIONS]
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for the mpmd "
                         f"backend; known options: {', '.join(BACKEND_OPTIONS)}")
    opts = dict(options)
    for key in ("num_stages", "num_microbatches", "stages_per_rank"):
        value = opts.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"option {key}={value!r} must be a positive int")
    sp = opts.get("split_points")
    if sp is not None and (isinstance(sp, str) or not isinstance(sp, Sequence)):
        raise ValueError(f"option split_points={sp!r} must be a list of module FQNs")
    return opts


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


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _mangle(fqn: str, kind: str) -> str:
    *prefix, leaf = fqn.split(".")
    parts = [f"modules_{p}" for p in prefix] + [f"{kind}_{leaf}"]
    return re.sub(r"\W", "_", "_".join(parts))


def _placeholders(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                  ) -> tuple[list[PlaceholderInfo], dict[str, torch.Tensor]]:
    """Name Dynamo's placeholders: parameters/buffers by FQN (from the names
    Dynamo gives them and its FQN table), everything else as a user input."""
    fqns = list(gm.meta.get("dynamo_flat_name_to_original_fqn", {}).values())
    # Longest suffix first: "x.weight" must not be taken for a root-level "weight".
    candidates = sorted(((f"_{_mangle(f, kind)}_", f, kind)
                         for f in fqns for kind in ("parameters", "buffers")),
                        key=lambda c: -len(c[0]))
    infos: list[PlaceholderInfo] = []
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    input_targets: list[tuple[int, str]] = []
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(nodes, example_inputs):
        target = str(node.target)
        match = next(((f, kind) for suffix, f, kind in candidates if target.endswith(suffix)),
                     None)
        if match is not None and isinstance(value, torch.Tensor) and id(value) not in seen:
            fqn, kind = match
            infos.append(PlaceholderInfo("parameter" if kind == "parameters" else "buffer", fqn))
            tensors[fqn] = value
            seen[id(value)] = fqn
        else:
            infos.append(PlaceholderInfo("input", ""))
            input_targets.append((len(infos) - 1, target))
    # Input names must be unique (the runner feeds inputs by name): a global `x`
    # (G_x_) and an argument `x_` (L_x_) both strip to "x", so a name shared by
    # several placeholders keeps the placeholder's own (unique) target instead.
    short = [re.sub(r"^[LG]_", "", t).rstrip("_") or t for _, t in input_targets]
    taken = {info.name for info in infos if info.kind != "input"}
    for (k, target), name in zip(input_targets, short):
        if short.count(name) > 1 or name in taken:
            name = target
        base, n = name, 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        infos[k] = PlaceholderInfo("input", name)
    return infos, tensors


def _check_whole_graph(gm: torch.fx.GraphModule) -> None:
    """A graph that ends at a graph break is only part of forward: refuse it."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    stack = getattr(reason, "user_stack", None) or []
    where = (f"{stack[-1].filename}:{stack[-1].lineno} (`{(stack[-1].line or '').strip()}`)"
             if stack else "an unknown line")
    raise CaptureError(
        f"the mpmd backend needs forward as one graph, but Dynamo breaks it at {where}: "
        f"{reason.reason}. Move data-dependent control flow out of forward or use torch.cond; "
        "a logging call breaks the graph too (add the logger method, e.g. "
        "logging.Logger.warning_once, to torch._dynamo.config.ignore_logging_functions). "
        "Compile with fullgraph=True to see the reason of every break.")


def _pipelined(gm: torch.fx.GraphModule, stages: list, signatures: list, plan: Any,
               tensors: dict[str, torch.Tensor], example_inputs: Sequence[Any],
               input_index: Mapping[str, int], opts: Mapping[str, Any]) -> Any:
    """The callable for world size > 1: a GPipe pipeline over the default group."""
    from torch_mpmd.api import _timeout
    from torch_mpmd.compiled import CompiledPipeline

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    examples = [o.meta.get("example_value") if isinstance(o, torch.fx.Node) else o for o in outs]
    pipe = CompiledPipeline(
        stages, signatures, plan, tensors, examples,
        {name: example_inputs[i] for name, i in input_index.items()},
        num_microbatches=opts.get("num_microbatches") or 1,
        timeout=_timeout(opts.get("timeout", 60.0)))

    def run(*args: Any) -> tuple:
        return pipe({name: args[i] for name, i in input_index.items()})

    run.pipeline = pipe  # type: ignore[attr-defined]
    run.stages = stages  # type: ignore[attr-defined]
    run.plan = plan  # type: ignore[attr-defined]
    return run


def mpmd_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: Mapping[str, Any] | None = None) -> Any:
    """Dynamo backend: partition ``gm`` into stages and return a callable running them.

    ``options``: ``split_points`` (module FQNs where a stage begins),
    ``num_stages``, ``stages_per_rank``, ``num_microbatches`` (see BACKEND_OPTIONS).
    In one process the whole batch runs through the stages, so
    ``num_microbatches`` only matters to the multi-rank runtime.
    """
    opts = _check_options(options)
    world = _world_size()
    num_stages = opts.get("num_stages")
    spr = opts.get("stages_per_rank")
    if spr is not None:
        if num_stages is not None and num_stages != world * spr:
            raise ValueError(f"num_stages={num_stages} disagrees with stages_per_rank={spr} "
                             f"on {world} rank(s)")
        num_stages = world * spr

    _check_whole_graph(gm)
    placeholders, tensors = _placeholders(gm, example_inputs)
    order_mutations(gm.graph)
    gm.recompile()
    ir = to_ir(gm, placeholders)
    known = sorted({".".join(f.split(".")[:k]) for f in ir.module_fqns
                    for k in range(1, f.count(".") + 2) if f})
    plan = partition(ir, split_points=opts.get("split_points"), num_stages=num_stages,
                     known_modules=known, what=f"the graph of {gm.__class__.__name__}")
    check_stage_count(plan.num_stages, world, spr)
    stages, signatures = build_stages(gm, ir, plan, placeholders, tensors,
                                      grad_enabled_at_capture=torch.is_grad_enabled())

    input_index = {info.name: i for i, info in enumerate(placeholders) if info.kind == "input"}
    tensor_index = [(i, info) for i, info in enumerate(placeholders) if info.kind != "input"]
    if world > 1:
        return _pipelined(gm, stages, signatures, plan, tensors, example_inputs, input_index,
                          opts)

    def run(*args: Any) -> tuple:
        for i, info in tensor_index:
            if args[i] is not tensors[info.name]:  # the model's tensor was replaced
                tensors[info.name] = args[i]
                for stage, sig in zip(stages, signatures):
                    if info.name in sig.parameters or info.name in sig.buffers:
                        _set_path(stage, info.name, args[i], info.kind, info.persistent)
        inputs = {name: args[i] for name, i in input_index.items()}
        return run_stages(stages, signatures, inputs)

    run.stages = stages  # type: ignore[attr-defined]
    run.stage_signatures = signatures  # type: ignore[attr-defined]
    run.plan = plan  # type: ignore[attr-defined]
    return run
