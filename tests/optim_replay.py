"""AdamW replayed on the gradients a pipeline produced: what its parameters
(and optimizer moments) must be after the steps, robust to the CPU's kernels.

Why not compare the parameters with the one-process reference's after AdamW
steps: Adam normalises each element's step, m / (sqrt(v) + eps), so where a
gradient is near zero its derivative is about 1 / eps. A last-bit difference
between two correct gradients (a tensor-parallel matmul sums in another
order than the full one; MKL picks other kernels on an AVX-512 CPU than on
AVX2) becomes a parameter difference lr / eps times larger: with lr=1e-2 and
eps=1e-5, a gradient 1e-8 off moves a weight 1e-5, and the verdict depends on
the machine. The maths only promises this much: the pipeline's gradients
equal the reference's within fp32 tolerance (compared every step), and its
optimizer applies AdamW to exactly those gradients. The second half is what
the replay checks: it starts from the reference's initial parameters and
steps AdamW on full copies of the pipeline's gradients; AdamW is elementwise,
so the pipeline's parameters (local shards, DTensors, any layout) equal the
replay's up to the rounding of the update itself, with no amplification of a
difference that is not there. A parameter without a gradient on the rank that
owns it stays at its initial value in the replay, and its comparison fails.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor (collective over a DTensor's mesh)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


class AdamWReplay:
    """AdamW over full-size copies of ``ref``'s parameters as they are now
    (build it before the first step), stepped with another model's gradients.

    Quacks like the reference module for the comparison helpers:
    ``named_parameters(remove_duplicate=False)`` lists every name (a tied
    weight under each of its names, as separate copies), and ``optimizer``
    holds the moments, keyed by those copies."""

    def __init__(self, ref: nn.Module, **adamw_kwargs: Any) -> None:
        self._params = {n: nn.Parameter(p.detach().clone())
                        for n, p in ref.named_parameters(remove_duplicate=False)}
        self.optimizer = torch.optim.AdamW(list(self._params.values()), **adamw_kwargs)

    def step(self, model: Any, *, all_ranks: bool = False) -> None:
        """One AdamW step with ``model``'s gradients (a Pipeline or module:
        anything with ``named_parameters()``), gathered to full tensors.
        Collective where gradients are DTensors: every rank calls it, in the
        same order as its other gathers. ``all_ranks``: with every rank's
        gradients (the first rank listing a name gives it; collective over
        the world), to compare against states gathered from every rank.
        Names nobody lists, or lists without a gradient, are not stepped."""
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        if all_ranks:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {n: g for n, g in grads.items() if g is not None})
            grads = {}
            for part in everyone:
                for n, g in part.items():
                    grads.setdefault(n, g)
        for name, p in self._params.items():
            g = grads.get(name)
            p.grad = None if g is None else g.detach().clone()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def named_parameters(self, remove_duplicate: bool = False
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._params.items())


def step_both(pipe: Any, opt: Any, ref: nn.Module, ropt: Any, replay: AdamWReplay,
              x: torch.Tensor, y: torch.Tensor, rows: Any,
              loss_fn: Any) -> tuple[torch.Tensor, float]:
    """One training step of ``pipe`` on its ``rows`` of the batch and of the
    reference on all of it: returns (the pipeline's loss, the worst gradient
    difference over this rank's parameters, max |a - b| / (ATOL + RTOL |b|)
    of the full gradients); then each optimizer steps and the replay steps
    on every rank's gradients (collective over the world)."""
    loss = pipe.step(x[rows], target=y[rows])
    loss_fn(ref(x), y).backward()
    want = dict(ref.named_parameters(remove_duplicate=False))
    worst = max(max_diff(full(p.grad), want[n].grad) for n, p in pipe.named_parameters())
    replay.step(pipe, all_ranks=True)
    for o in (opt, ropt):
        o.step()
        o.zero_grad()
    return loss, worst


RTOL, ATOL = 1e-4, 1e-5   # fp32, a few layers deep


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b|, scaled so that <= 1 means within (RTOL, ATOL); inf when
    one is missing or the shapes differ."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())
