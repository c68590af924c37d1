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


def stage_modules(units: Sequence[str], split_points: Sequence[str],
                  recompute: Sequence[bool]) -> list[str]:
    """The units (module FQNs, in model order) of the stages that
    ``recompute`` flags, where stage k > 0 starts at unit ``split_points[k-1]``
    (a plan's convention). ValueError when a split point is not a unit or
    the flags are not one per stage."""
    if len(recompute) != len(split_points) + 1:
        raise ValueError(f"recompute has {len(recompute)} flags for {len(split_points) + 1} "
                         "stages")
    starts = [0]
    for point in split_points:
        if point not in units:
            raise ValueError(f"split point {point!r} is not one of the units {list(units)}: a "
                             "stage's recompute needs the units it holds")
        starts.append(units.index(point))
    starts.append(len(units))
    return [u for k, flag in enumerate(recompute) if flag for u in units[starts[k]:starts[k + 1]]]
