"""Recompute: activation checkpointing of named submodules, put on while a model is captured.

``pipeline(recompute=[fqn, ...])`` (or a plan that recomputes stages) asks
that the activations of those submodules not be kept between a microbatch's
forward and its backward, but computed again in the backward. While the
model is captured, each named submodule's forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: Dynamo
captures the region as a checkpointed one, and the stage programs keep only
its inputs and recompute the rest in B (or I and W, where a schedule splits
B), as for a model that checkpoints itself (tests/test_activation_checkpoint.py).
The module is left as it was after the capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpointed", "stage_modules"]


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, fqns: Sequence[str]) -> Iterator[None]:
    """Within the block, the submodules ``fqns`` of ``model`` run their forward
    under activation checkpointing (ValueError naming an unknown one)."""
    known = dict(model.named_modules())
    missing = [f for f in fqns if f not in known or not f]
    if missing:
        raise ValueError(f"recompute names {missing}, which are not submodules of "
                         f"{type(model).__name__}")
    patched: list[tuple[torch.nn.Module, bool, Any]] = []
    try:
        for fqn in dict.fromkeys(fqns):
            module = known[fqn]
            own = "forward" in module.__dict__
            original = module.forward

            def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False,
                                                         **kwargs)

            module.forward = forward
            patched.append((module, own, original))
        yield
    finally:
        for module, own, original in reversed(patched):
            if own:
                module.forward = original
            else:
                del module.forward


def _with_nested(units: Sequence[str], split_points: Sequence[str],
                 modules: Sequence[str] = ()) -> list[str]:
    """``units`` with the split points that are not among them (the finer cuts
    of a profile's refined units, planning/units.py): one inside a unit goes
    after that unit and the cuts inside it before it (split points come in
    model order); another goes after the last unit before it in ``modules``
    (the model's module names in registration order, when given)."""
    out = list(units)
    for point in split_points:
        if point in out:
            continue
        owner = next((u for u in reversed(out) if point.startswith(u + ".")), None)
        if owner is None and point in modules:
            rank = {name: i for i, name in enumerate(modules)}
            owner = next((u for u in reversed(out) if rank.get(u, -1) < rank[point]), None)
        if owner is None:
            raise ValueError(f"split point {point!r} is not one of the units {list(units)}: a "
                             "stage's recompute needs the units it holds")
        at = out.index(owner) + 1
        while at < len(out) and out[at].startswith(owner + "."):
            at += 1
        out.insert(at, point)
    return out


def stage_modules(units: Sequence[str], split_points: Sequence[str],
                  recompute: Sequence[bool], modules: Sequence[str] = ()) -> list[str]:
    """The modules to checkpoint for the stages that ``recompute`` flags,
    where stage k > 0 starts at unit ``split_points[k-1]`` (a plan's
    convention): each unit of such a stage, in model order. A unit cut
    further inside (a later unit or split point is its submodule) is
    checkpointed whole where all of it lies in the stage; otherwise only its
    inner units in the stage are. ValueError when a split point is neither
    a unit nor inside one nor in ``modules`` (see _with_nested), or the
    flags are not one per stage."""
    if len(recompute) != len(split_points) + 1:
        raise ValueError(f"recompute has {len(recompute)} flags for {len(split_points) + 1} "
                         "stages")
    units = _with_nested(units, split_points, modules)
    starts = [0] + [units.index(point) for point in split_points] + [len(units)]
    out: list[str] = []
    for k, flag in enumerate(recompute):
        if not flag:
            continue
        stage = units[starts[k]:starts[k + 1]]
        for i, unit in enumerate(stage):
            if any(unit.startswith(o + ".") for o in out):
                continue  # inside a unit checkpointed whole
            inner = [u for u in units if u.startswith(unit + ".")]
            if all(u in stage for u in inner):
                out.append(unit)
    return out
