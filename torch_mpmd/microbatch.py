"""Splitting a batch into microbatches and merging outputs back.

``Pipeline.step`` splits every tensor argument, keyword argument and the
target along dim 0 into ``num_microbatches`` equal chunks; non-tensors, and
tensors wrapped in :class:`Replicate`, go whole to every microbatch. A batch
that does not divide is a ValueError naming the argument and the sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Replicate", "split_microbatches", "merge_microbatches"]


class Replicate:
    """Marks a tensor argument that every microbatch receives whole (not split)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Replicate({self.value!r})"


def _split(value: Any, m: int, where: str) -> list[Any]:
    if isinstance(value, Replicate):
        return [value.value] * m
    if not isinstance(value, torch.Tensor):
        return [value] * m
    if value.dim() == 0:
        raise ValueError(f"{where} is a 0-dim tensor, which cannot be split into "
                         f"num_microbatches={m}; wrap it in torch_mpmd.Replicate(...) to give "
                         "it whole to every microbatch")
    n = value.shape[0]
    if n % m:
        raise ValueError(f"{where} has batch size {n} (dim 0), which num_microbatches={m} "
                         f"does not divide; use a batch size that is a multiple of {m}")
    return list(value.chunk(m, dim=0)) if m > 1 else [value]


def _split_tree(value: Any, m: int, where: str) -> list[Any]:
    if isinstance(value, (Replicate, torch.Tensor)) or value is None:
        return _split(value, m, where)
    leaves, spec = pytree.tree_flatten(value, is_leaf=lambda x: isinstance(x, Replicate))
    if not leaves:
        return [value] * m
    per_leaf = [_split(leaf, m, f"{where} (leaf {i})") for i, leaf in enumerate(leaves)]
    return [pytree.tree_unflatten([p[k] for p in per_leaf], spec) for k in range(m)]


def split_microbatches(args: Sequence[Any], kwargs: Mapping[str, Any], target: Any,
                       num_microbatches: int) -> list[tuple[tuple, dict, Any]]:
    """``[(args_k, kwargs_k, target_k)]`` for k in range(num_microbatches)."""
    m = num_microbatches
    split_args = [_split_tree(a, m, f"positional argument {i}") for i, a in enumerate(args)]
    split_kwargs = {k: _split_tree(v, m, f"keyword argument {k!r}") for k, v in kwargs.items()}
    targets = _split_tree(target, m, "target") if target is not None else [None] * m
    return [(tuple(a[k] for a in split_args), {n: v[k] for n, v in split_kwargs.items()},
             targets[k]) for k in range(m)]


def merge_microbatches(outputs: Sequence[Any]) -> Any:
    """Concatenate per-microbatch outputs along dim 0 (0-dim tensors are stacked,
    non-tensors taken from the first microbatch)."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for i, first in enumerate(flat[0][0]):
        if isinstance(first, torch.Tensor):
            parts = [f[0][i] for f in flat]
            merged.append(torch.cat(parts) if first.dim() else torch.stack(parts))
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)
