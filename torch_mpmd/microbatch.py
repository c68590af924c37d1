"""Splitting a batch into microbatches and merging outputs back.

``Pipeline.step`` splits every tensor argument, keyword argument and the
target along dim 0 into ``num_microbatches`` equal chunks; non-tensors, and
tensors wrapped in :class:`Replicate`, go whole to every microbatch. A batch
that does not divide is a ValueError naming the argument and the sizes.
A caller may instead give the microbatches themselves
(``step(microbatches=[(args, kwargs), ...], targets=[...])``), of shapes free
to differ: :func:`explicit_microbatches` checks that list, and
:func:`bucket_microbatches` pads them to a few lengths (buckets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Replicate", "split_microbatches", "first_microbatch", "split_tree",
           "check_target_batch", "explicit_microbatches", "contiguous_inputs", "contiguous_tree",
           "merge_microbatches", "bucket_length", "bucket_microbatches"]


class Replicate:
    """Marks a tensor argument that every microbatch receives whole (not split)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Replicate({self.value!r})"


def _split(value: Any, m: int, where: str, *, first_only: bool = False) -> list[Any]:
    """``value``'s m microbatches (only the first when ``first_only``)."""
    k = 1 if first_only else m
    if isinstance(value, Replicate):
        return [value.value] * k
    if not isinstance(value, torch.Tensor):
        return [value] * k
    if value.dim() == 0:
        raise ValueError(f"{where} is a 0-dim tensor, which cannot be split into "
                         f"num_microbatches={m}; wrap it in torch_mpmd.Replicate(...) to give "
                         "it whole to every microbatch")
    n = value.shape[0]
    if n == 0:  # would give empty microbatches, and a nan mean loss
        raise ValueError(f"{where} has batch size 0 (dim 0): an empty batch cannot be split "
                         f"into num_microbatches={m}; pass at least {m} samples")
    if value.numel() == 0:  # a zero-length dim: torch's own error deep in the model, or nan
        raise ValueError(f"{where} has shape {tuple(value.shape)}: a dim of length 0 gives "
                         "empty microbatches; every dim of a split input needs length >= 1 "
                         "(wrap an input that is empty on purpose in torch_mpmd.Replicate)")
    if n % m:
        raise ValueError(f"{where} has batch size {n} (dim 0), which num_microbatches={m} "
                         f"does not divide; use a batch size that is a multiple of {m}")
    if m == 1:
        return [value]
    if first_only:  # the capture's example: it keeps the dims the user marked dynamic
        first = value.narrow(0, 0, n // m)
        marked = getattr(value, "_dynamo_dynamic_indices", None)
        if marked:
            first._dynamo_dynamic_indices = set(marked)  # what mark_dynamic sets
        return [first]
    return list(value.chunk(m, dim=0))


def _batch_sizes(value: Any, where: str) -> list[tuple[str, int]]:
    """(name, dim 0) of every tensor leaf of ``value`` that is split into
    microbatches (not Replicate, not 0-dim)."""
    if isinstance(value, Replicate):
        return []
    if isinstance(value, torch.Tensor):
        return [(where, value.shape[0])] if value.dim() else []
    leaves = pytree.tree_leaves(value, is_leaf=lambda x: isinstance(x, Replicate))
    return [(f"{where} (leaf {i})", leaf.shape[0]) for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, Replicate) and leaf.dim()]


def check_target_batch(args: Sequence[Any], kwargs: Mapping[str, Any], target: Any) -> None:
    """The target's batch size (dim 0 of each split leaf) must be the inputs'
    (or a whole multiple of it: a target flattened over samples, (B*T,) for
    (B, T) inputs, splits alike) when the inputs agree on one. Split in the
    same m chunks, a smaller target would broadcast against each
    microbatch's output: a wrong loss where eager PyTorch raises a size
    mismatch. ValueError naming both."""
    inputs = [*(s for i, a in enumerate(args) for s in _batch_sizes(a, f"positional argument {i}")),
              *(s for k, v in kwargs.items() for s in _batch_sizes(v, f"keyword argument {k!r}"))]
    sizes = {n for _, n in inputs}
    if len(sizes) != 1 or 0 in sizes:  # no split input, inputs of several sizes, or empty
        return                             # ones (refused elsewhere): nothing to compare with
    (batch,) = sizes
    for where, n in _batch_sizes(target, "target"):
        if n % batch:
            raise ValueError(f"{where} has batch size {n} (dim 0), but the inputs have batch "
                             f"size {batch} ({inputs[0][0]}); each microbatch's target must "
                             "hold the same samples as its inputs: pass a target with "
                             f"{batch} rows (or wrap a per-batch value in torch_mpmd.Replicate)")


def split_tree(value: Any, m: int, where: str, *, first_only: bool = False) -> list[Any]:
    """One argument (a tensor, Replicate, non-tensor or container of them)
    split into its m microbatches; ``where`` names it in errors."""
    if isinstance(value, (Replicate, torch.Tensor)) or value is None:
        return _split(value, m, where, first_only=first_only)
    leaves, spec = pytree.tree_flatten(value, is_leaf=lambda x: isinstance(x, Replicate))
    k = 1 if first_only else m
    if not leaves:
        return [value] * k
    per_leaf = [_split(leaf, m, f"{where} (leaf {i})", first_only=first_only)
                for i, leaf in enumerate(leaves)]
    return [pytree.tree_unflatten([p[j] for p in per_leaf], spec) for j in range(k)]


def first_microbatch(args: Sequence[Any], kwargs: Mapping[str, Any],
                     num_microbatches: int) -> tuple[tuple, dict]:
    """``(args_0, kwargs_0)``, the first microbatch, with the errors of
    :func:`split_microbatches` (what the capture needs, without the others)."""
    m = num_microbatches
    return (tuple(split_tree(a, m, f"positional argument {i}", first_only=True)[0]
                  for i, a in enumerate(args)),
            {k: split_tree(v, m, f"keyword argument {k!r}", first_only=True)[0]
             for k, v in kwargs.items()})


def split_microbatches(args: Sequence[Any], kwargs: Mapping[str, Any], target: Any,
                       num_microbatches: int) -> list[tuple[tuple, dict, Any]]:
    """``[(args_k, kwargs_k, target_k)]`` for k in range(num_microbatches)."""
    m = num_microbatches
    split_args = [split_tree(a, m, f"positional argument {i}") for i, a in enumerate(args)]
    split_kwargs = {k: split_tree(v, m, f"keyword argument {k!r}") for k, v in kwargs.items()}
    targets = split_tree(target, m, "target") if target is not None else [None] * m
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


def explicit_microbatches(microbatches: Any, targets: Any, *, args: Sequence[Any] = (),
                          kwargs: Mapping[str, Any] | None = None, target: Any = None
                          ) -> tuple[list[tuple[tuple, dict]], list[Any]]:
    """A call's ``microbatches=`` list as ``[(args, kwargs)]`` and its
    ``targets=`` as one entry per microbatch (None each without targets).
    Each entry is a pair (tuple of positional arguments, dict of keyword
    arguments). ValueError naming the entry for anything else, for a
    ``targets`` list of another length, and for a batch (``args``,
    ``kwargs``, ``target``) passed beside the list."""
    if args or kwargs or target is not None:
        given = ", ".join(w for w, v in (("positional arguments", args), ("keyword arguments",
                                         kwargs), ("target=", target is not None)) if v)
        raise ValueError(f"microbatches= was given together with a batch ({given}): pass "
                         "either the batch (split into num_microbatches along dim 0) or the "
                         "microbatches themselves, with targets=[...] for their targets")
    if isinstance(microbatches, (torch.Tensor, Mapping)) or not isinstance(microbatches,
                                                                            Sequence):
        raise ValueError(f"microbatches= must be a list of (args, kwargs) pairs, one per "
                         f"microbatch; got a {type(microbatches).__name__}")
    if not microbatches:
        raise ValueError("microbatches= is empty: a call needs at least one microbatch")
    out: list[tuple[tuple, dict]] = []
    for i, entry in enumerate(microbatches):
        if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or
                not isinstance(entry[0], (tuple, list)) or not isinstance(entry[1], Mapping)):
            what = (f"a {type(entry).__name__} of length {len(entry)}"
                    if isinstance(entry, (tuple, list)) else f"a {type(entry).__name__}")
            raise ValueError(f"microbatches[{i}] is {what}; each microbatch is a pair (tuple "
                             "of positional arguments, dict of keyword arguments), e.g. "
                             "((input_ids,), {}) or ((), {'input_ids': ids})")
        args_i, kwargs_i = tuple(entry[0]), dict(entry[1])
        _refuse_empty(i, [*((f"positional argument {j}", a) for j, a in enumerate(args_i)),
                          *((f"keyword argument {k!r}", v) for k, v in kwargs_i.items())])
        out.append(contiguous_inputs(args_i, kwargs_i))
    if targets is None:
        return out, [None] * len(out)
    if isinstance(targets, torch.Tensor) or not isinstance(targets, Sequence):
        raise ValueError(f"targets= must be a list with one target per microbatch; got a "
                         f"{type(targets).__name__}")
    if len(targets) != len(out):
        raise ValueError(f"targets= has {len(targets)} entries for {len(out)} microbatches; "
                         "give one target per microbatch")
    for i, t in enumerate(targets):
        _refuse_empty(i, [("target", t)])
    return out, [contiguous_tree(t) for t in targets]


def _leaves(value: Any, where: str) -> list[tuple[str, Any]]:
    """(name, leaf) of ``value``'s leaves, Replicate's kept whole, named as
    ``_batch_sizes`` names them."""
    if isinstance(value, (Replicate, torch.Tensor)) or value is None:
        return [(where, value)]
    leaves = pytree.tree_leaves(value, is_leaf=lambda x: isinstance(x, Replicate))
    return [(f"{where} (leaf {j})", leaf) for j, leaf in enumerate(leaves)]


def _refuse_empty(i: int, named: Sequence[tuple[str, Any]]) -> None:
    """Microbatch ``i``'s tensors (inputs or target, by name) with no element:
    zero rows or a zero-length dim would fail deep in the model with torch's
    own error (or give a nan loss) naming no microbatch. ValueError naming
    the microbatch, the input and its shape, before any communication."""
    for name, value in named:
        for where, leaf in _leaves(value, name):
            if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.numel() == 0:
                what = "zero rows" if leaf.shape[0] == 0 else "a dim of length 0"
                raise ValueError(f"microbatch {i}: {where} has shape {tuple(leaf.shape)}, "
                                 f"{what}: every microbatch needs at least one row and every "
                                 "dim a length >= 1 (leave empty microbatches out of the list)")


def contiguous_tree(value: Any) -> Any:
    """``value`` with each tensor leaf (Replicate's too) in dense row-major
    layout: a copy of those that are not, the others as they are.

    NOTE [Contiguous microbatches]: a microbatch made as a slice (``x[:, :n]``
    of an ``(B, T)`` batch) keeps the batch's strides, ``(T, 1)``. Under
    ``dynamic=True`` Dynamo then makes its stride ``T`` a symbol of its own,
    which is no input size, so the capture cannot feed it; and a program
    traced on one layout may ``view`` an input that another layout cannot.
    Every microbatch is given in the layout its sizes alone determine."""
    if isinstance(value, torch.Tensor):
        return value if value.stride() == _dense_strides(value.shape) else \
            value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, Replicate):
        inner = contiguous_tree(value.value)
        return value if inner is value.value else Replicate(inner)
    leaves, spec = pytree.tree_flatten(value, is_leaf=lambda x: isinstance(x, Replicate))
    if len(leaves) == 1 and leaves[0] is value:  # not a container: nothing to lay out
        return value
    dense = [contiguous_tree(leaf) for leaf in leaves]
    if all(d is leaf for d, leaf in zip(dense, leaves)):
        return value  # the caller's own container, untouched
    return pytree.tree_unflatten(dense, spec)


def _dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def contiguous_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor leaf dense and row-major (NOTE
    [Contiguous microbatches]): a copy only of those that are not."""
    return (tuple(contiguous_tree(a) for a in args),
            {k: contiguous_tree(v) for k, v in kwargs.items()})


def bucket_length(length: int, *, multiple: int | None = None,
                  buckets: Sequence[int] | None = None) -> int:
    """The bucket ``length`` pads to: the next multiple of ``multiple``, or
    the smallest of ``buckets`` that holds it (ValueError when none does)."""
    if (multiple is None) == (buckets is None):
        raise ValueError("give exactly one of multiple= (pad to a multiple) or buckets= (a list "
                         "of lengths)")
    if multiple is not None:
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"multiple={multiple!r} must be a positive int")
        return -(-length // multiple) * multiple
    fits = [b for b in buckets if b >= length]  # type: ignore[union-attr]
    if not fits:
        raise ValueError(f"a microbatch of length {length} fits none of buckets="
                         f"{sorted(buckets)}; add a bucket of at least {length}")  # type: ignore
    return min(fits)


def _has_dim(t: torch.Tensor, dim: int) -> bool:
    return -t.dim() <= dim < t.dim()


def bucket_microbatches(microbatches: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
                        targets: Sequence[Any] | None = None, *, multiple: int | None = None,
                        buckets: Sequence[int] | None = None, dim: int = 1,
                        fill: int | float | Mapping[Any, int | float] = 0,
                        target_fill: int | float = -100, uniform: bool = False
                        ) -> tuple[list[tuple[tuple, dict]], list[Any]]:
    """Explicit microbatches padded along ``dim`` to a few lengths (buckets),
    so that programs see few shapes: with ``dynamic=False`` one capture (and
    compile) per bucket, none once every bucket was seen; with Inductor,
    kernels specialized to few sizes.

    A microbatch's length is the size in ``dim`` of its first tensor
    argument; every tensor argument and target with that size in ``dim`` is
    padded to the bucket (``bucket_length``) with ``fill`` (one value, or a
    mapping from positional index or keyword name to its value, default 0)
    and targets with ``target_fill`` (-100: ignored by cross entropy), others
    pass unchanged. ``uniform``: every microbatch pads to the largest bucket
    of the call (a static capture runs one shape per call). The loss must
    ignore the padded positions (labels of -100), and the model must not
    let real positions see them (causal attention with padding at the end,
    or a mask): then padding changes neither loss nor gradients."""
    import torch.nn.functional as F

    targets = list(targets) if targets is not None else [None] * len(microbatches)
    if len(targets) != len(microbatches):
        raise ValueError(f"targets has {len(targets)} entries for {len(microbatches)} "
                         "microbatches")
    lengths = []
    for i, (args, kwargs) in enumerate(microbatches):
        first = next((v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)),
                     None)
        if first is None or not _has_dim(first, dim):
            raise ValueError(f"microbatch {i} has no tensor argument with a dim {dim} to "
                             "bucket by")
        lengths.append(first.shape[dim])
    padded_to = [bucket_length(n, multiple=multiple, buckets=buckets) for n in lengths]
    if uniform:
        padded_to = [max(padded_to)] * len(padded_to)

    def pad(value: Any, n: int, to: int, value_fill: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not _has_dim(value, dim) \
                or value.shape[dim] != n or to == n:
            return value
        d = dim % value.dim()
        widths = [0, 0] * (value.dim() - 1 - d) + [0, to - n]
        return F.pad(value, widths, value=value_fill)

    def fill_of(key: Any) -> Any:
        return fill.get(key, 0) if isinstance(fill, Mapping) else fill

    out, out_targets = [], []
    for (args, kwargs), target, n, to in zip(microbatches, targets, lengths, padded_to):
        out.append((tuple(pad(a, n, to, fill_of(i)) for i, a in enumerate(args)),
                    {k: pad(v, n, to, fill_of(k)) for k, v in kwargs.items()}))
        out_targets.append(pytree.tree_map(lambda t: pad(t, n, to, target_fill), target)
                           if target is not None else None)
    return out, out_targets
