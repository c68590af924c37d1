"""An order of microbatches of different sizes that shortens the pipeline step.

With microbatches of different lengths (``step(microbatches=[...])``) the
step's time depends on their order: a long microbatch in the warm-up holds
every later stage back, one in the cool-down leaves the earlier ranks idle.
:func:`microbatch_order` simulates the schedule with each microbatch's cost
in proportion to its size (NOTE [Microbatch costs] in
csrc/core/simulator.h) and returns the best of a few orders (as given,
shortest first, longest first) improved by swapping neighbours while the
simulator predicts a shorter step. The order changes nothing else: losses
(a mean over microbatches, or token-weighted) and gradients do not depend on
it, and every rank computes the same order from the same sizes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch_mpmd.schedules import Schedule, get_schedule

__all__ = ["MicrobatchOrder", "microbatch_order", "microbatch_sizes"]

T = TypeVar("T")


@dataclass(frozen=True)
class MicrobatchOrder:
    """``order[k]``: the index (in the given list) of the microbatch to run
    k-th; ``predicted``: the simulated step of each order tried, in units of
    a mean microbatch's forward (keys "given", "shortest first", "longest
    first", "chosen")."""

    order: list[int]
    predicted: dict[str, float] = field(default_factory=dict)

    def apply(self, items: Sequence[T]) -> list[T]:
        """``items`` (microbatches, targets: one per microbatch) in this order."""
        if len(items) != len(self.order):
            raise ValueError(f"the order is for {len(self.order)} microbatches, got "
                             f"{len(items)} items")
        return [items[i] for i in self.order]

    @property
    def speedup(self) -> float:
        """Predicted step as given over the chosen order's."""
        return self.predicted["given"] / self.predicted["chosen"]


def microbatch_sizes(microbatches: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[int]:
    """Each microbatch's size as the element count of its first tensor
    argument (its tokens, for token ids): what :func:`microbatch_order`
    weighs by default."""
    import torch

    sizes = []
    for i, (args, kwargs) in enumerate(microbatches):
        first = next((v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)), None)
        if first is None:
            raise ValueError(f"microbatch {i} has no tensor argument to size it by; pass "
                             "sizes= to microbatch_order")
        sizes.append(first.numel())
    return sizes


def _checked_sizes(sizes: Any) -> list[float]:
    """``sizes`` as a list of floats: a sequence of finite numbers >= 0
    (ValueError naming the index, the type and the value otherwise)."""
    if sizes is None or isinstance(sizes, (str, bytes, Mapping)) or \
            not isinstance(sizes, Iterable):
        raise ValueError(f"sizes must be a list of numbers, one per microbatch (its tokens, "
                         f"say; microbatch_sizes(microbatches) gives them), got "
                         f"{type(sizes).__name__} {sizes!r}")
    out = []
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) \
                or s < 0:
            raise ValueError(f"sizes[{i}] is {type(s).__name__} {s!r}; each size is a finite "
                             "number >= 0 (the microbatch's tokens, say: "
                             "microbatch_sizes(microbatches) gives them)")
        out.append(float(s))
    return out


def microbatch_order(sizes: Sequence[float], *, schedule: str | Schedule = "1f1b",
                     pp_size: int = 2, stages_per_rank: int = 1,
                     costs: Mapping[str, float] | None = None,
                     max_swaps: int = 200) -> MicrobatchOrder:
    """The order of microbatches of relative ``sizes`` (tokens, say) that the
    simulator predicts to give the shortest step under ``schedule`` (a name,
    with ``pp_size`` and ``stages_per_rank``, or a Schedule for
    ``len(sizes)`` microbatches). ``costs``: a mean microbatch's stage costs
    (``Schedule.simulate``'s keys; default F 1, B 2, I 1, W 1).
    ``max_swaps``: the most neighbour swaps tried after the best start."""
    sizes = _checked_sizes(sizes)
    m = len(sizes)
    if m == 0:
        raise ValueError("microbatch_order needs at least one microbatch size")
    sched = schedule if isinstance(schedule, Schedule) else get_schedule(
        schedule, num_ranks=pp_size, num_microbatches=m, stages_per_rank=stages_per_rank)
    if sched.num_microbatches != m:
        raise ValueError(f"schedule '{sched.name}' has {sched.num_microbatches} microbatches, "
                         f"sizes {m}")
    lowered = sched if sched.is_lowered else sched.lower()

    def step(order: Sequence[int]) -> float:
        return lowered.simulate(costs, microbatch_costs=[sizes[i] for i in order]).makespan

    given = list(range(m))
    starts = {"given": given,
              "shortest first": sorted(given, key=lambda i: (sizes[i], i)),
              "longest first": sorted(given, key=lambda i: (-sizes[i], i))}
    predicted = {name: step(order) for name, order in starts.items()}
    best_name = min(predicted, key=lambda k: (predicted[k], k != "given"))
    best, best_t = list(starts[best_name]), predicted[best_name]
    tries = 0
    improved = True
    while improved and tries < max_swaps:
        improved = False
        for k in range(m - 1):
            if tries >= max_swaps:
                break
            if sizes[best[k]] == sizes[best[k + 1]]:
                continue
            tries += 1
            cand = best[:k] + [best[k + 1], best[k]] + best[k + 2:]
            t = step(cand)
            if t < best_t - 1e-12:
                best, best_t, improved = cand, t, True
    predicted["chosen"] = best_t
    return MicrobatchOrder(best, predicted)
