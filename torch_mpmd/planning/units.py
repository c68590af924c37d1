"""Finer units inside a unit that is too big: graph-level cuts.

A profile's units are the model's blocks and the parts before and after them
(profile.find_units). When one unit alone takes more than a balanced stage
(its F + B above the step's total over the pipeline size), no split of
whole units balances the pipeline; :func:`refine` cuts such a unit where
its own submodules start, one level down, so that the planner can put a
stage boundary inside it: a Transformer block at its attention and MLP, the
part after the blocks at its head. Every cut is still a module FQN, so the
plan's ``split_points`` stay a list ``pipeline(split_points=...)`` takes.

The order is the order of the modules' first calls in one forward
(:func:`call_order`), not their registration: Hugging Face's Llama block
registers its input norm after its MLP and calls it first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from torch_mpmd import _C

__all__ = ["call_order", "coarse", "inner_cuts", "refine", "too_big"]


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def call_order(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, int]:
    """Each submodule's FQN and the position of its first call in one forward
    of ``model`` on ``args``/``kwargs`` (without grad). The caller keeps the
    model's buffers and the RNG state if they must not move."""
    order: dict[str, int] = {}

    def seen(name: str) -> Any:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            order.setdefault(name, len(order))
        return hook

    hooks = [module.register_forward_pre_hook(seen(name))
             for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return order


def inner_cuts(model: torch.nn.Module, order: dict[str, int], unit: str,
               next_unit: str | None) -> list[str]:
    """Where the unit starting at ``unit`` can be cut, one level down, in
    call order (``order``: :func:`call_order`): the topmost modules with
    parameters first called after ``unit`` and before ``next_unit`` (the
    end when None), but not ``unit``'s first-called submodule chain (they
    start where it starts) nor the ancestors of ``next_unit``. A unit that
    is not called (or not found) has none."""
    if unit not in order:
        return []
    begin = order[unit]
    end = order.get(next_unit, len(order)) if next_unit is not None else len(order)
    modules = dict(model.named_modules())
    first, at = set(), unit
    while True:  # what unit calls first, what that calls first, ...: they start with it
        inside = [n for n in order if n.startswith(at + ".") and "." not in n[len(at) + 1:]]
        if not inside:
            break
        at = min(inside, key=order.__getitem__)
        first.add(at)
    cuts: list[str] = []
    for name in sorted((n for n in order if begin < order[n] < end), key=order.__getitem__):
        if name in first or not _has_parameters(modules[name]):
            continue
        if next_unit is not None and next_unit.startswith(name + "."):
            continue  # holds the next unit: not inside this one
        if any(name.startswith(c + ".") for c in cuts):
            continue  # below a cut already taken: one level at a time
        cuts.append(name)
    return cuts


def too_big(costs: Sequence[float], pp_size: int) -> list[int]:
    """The indices of the units whose cost is more than the total over
    ``pp_size`` (a balanced stage's share) when there are at least two."""
    total = sum(costs)
    if len(costs) < 2 or total <= 0:
        return []
    return [i for i, c in enumerate(costs) if c > total / pp_size]


def coarse(costs: Sequence[float], pp_size: int, tolerance: float = 0.05) -> list[int]:
    """The indices of the units inside which a balanced split's boundary
    falls, where whole units are too coarse to balance the pipeline: for
    ``parts`` = ``pp_size`` and 2 x ``pp_size`` (one stage per rank, and the
    V schedules' two), when the exact min-max split of whole units into
    ``parts`` leaves its largest part more than ``tolerance`` above the
    total over ``parts``, each unit whose span of the running total holds a
    point k x total / ``parts`` strictly inside.

    Why beside :func:`too_big`: a unit need not outweigh a stage to stop the
    split from balancing. Nine like units on two ranks split 5:4 at best
    (a Transformer's blocks plus a head as heavy as one), 11% over an even
    half, and four stages of a V schedule of them 3:2:2:2, 33% over."""
    total = sum(costs)
    if len(costs) < 2 or total <= 0 or pp_size < 2:
        return []  # one rank: nothing to balance
    ends = list(itertools.accumulate(costs))
    out: set[int] = set()
    for parts in (pp_size, 2 * pp_size):
        if parts > len(costs):
            continue
        starts = list(_C.min_max_split([float(c) for c in costs], parts)) + [len(costs)]
        largest = max(sum(costs[a:b]) for a, b in zip(starts, starts[1:]))
        if largest <= (1 + tolerance) * total / parts:
            continue
        for k in range(1, parts):
            point = k * total / parts
            out.update(i for i, end in enumerate(ends)
                       if end - costs[i] < point < end and costs[i] > 0)
    return sorted(out)


def refine(model: torch.nn.Module, order: dict[str, int], units: Sequence[str],
           which: Sequence[int]) -> list[str]:
    """``units`` with each unit of index in ``which`` followed by its
    :func:`inner_cuts`."""
    out: list[str] = []
    for i, unit in enumerate(units):
        out.append(unit)
        if i in which:
            out += inner_cuts(model, order, unit, units[i + 1] if i + 1 < len(units) else None)
    return out
