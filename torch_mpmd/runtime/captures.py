"""A pipeline's captures, kept per capture key so that a call reuses the one it fits.

Stages bake in the input shapes and every module's train/eval mode (dropout,
BatchNorm), and which parameters train (NOTE [Freezing] in session.py): each
combination has its own capture, kept so that alternating (training and
validation batches, freezing and unfreezing) does not capture again. With
symbolic sizes (``dynamic=True``) a key holds one capture per class of sizes
its guards admit: a call takes the first whose guards hold (:func:`unfit`).
Every capture also holds the Python values it was traced with (NOTE [State
guards] in graph/state_guards.py): a call whose values differ takes a capture
made with its values, or captures again, at most :data:`MAX_STATE_CAPTURES`
times per key. A capture is the pair ``(RankRuntime, SplitModel)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from torch_mpmd.runtime.rank import RankRuntime

__all__ = ["CaptureCache", "MAX_STATE_CAPTURES", "capture_key", "describe_key",
           "microbatch_misfit", "unfit"]

Capture = tuple["RankRuntime", Any]  # (the rank's runtime, its SplitModel)

# Captures one key may hold for changed Python state (as Dynamo's recompile
# limit): a value changed at every call (a counter read by forward) would
# otherwise capture, and compile, at every step.
MAX_STATE_CAPTURES = 8


class CaptureCache:
    """The captures made so far, the current one, and its key."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, list[Capture]] = {}
        self.current: Capture | None = None
        self.key: tuple | None = None

    @property
    def count(self) -> int:
        """Captures made (each kept)."""
        return sum(len(v) for v in self.by_key.values())

    def find(self, key: tuple, args0: tuple, kwargs0: dict) -> tuple[Capture | None, str | None]:
        """The capture that serves a call of key ``key`` with first microbatch
        ``(args0, kwargs0)``, made current; else None and why a capture of that
        key cannot serve it (None when there is none)."""
        why = None
        if self.current is not None and key == self.key:
            why = unfit(*self.current, args0, kwargs0)
            if why is None:
                return self.current, None
        for cached in self.by_key.get(key, ()):
            reason = unfit(*cached, args0, kwargs0)
            if reason is None:
                self.current, self.key = cached, key
                return cached, None
            why = reason
        return None, why

    def add(self, key: tuple, capture: Capture) -> None:
        """Keep a new capture for ``key`` and make it current."""
        self.by_key.setdefault(key, []).append(capture)
        self.current, self.key = capture, key

    def check_state_captures(self, key: tuple, why_unfit: str | None) -> None:
        """Refuse another capture for ``key`` (a ValueError naming the value)
        when changed Python state made :data:`MAX_STATE_CAPTURES` already."""
        if why_unfit is None or not why_unfit.startswith(_STATE_CHANGED):
            return
        made = len(self.by_key.get(key, ()))
        if made >= MAX_STATE_CAPTURES:
            raise ValueError(
                f"{why_unfit}; the pipeline has captured this model {made} times for these "
                "inputs and modes and stops here (a value changed at every call, like a "
                "counter read by forward?): keep such a value in a tensor buffer, or pass it "
                "as an input of the call")

    def why_again(self, key: tuple, why_unfit: str | None) -> str:
        """Why a call of ``key`` captures again, for the log line."""
        if why_unfit:
            if why_unfit.startswith(_STATE_CHANGED):
                return why_unfit
            return f"the dynamic capture cannot serve these sizes ({why_unfit})"
        return (f"the inputs, train/eval modes or frozen parameters changed from "
                f"{describe_key(self.key)} to {describe_key(key)}")


_STATE_CHANGED = "the Python state the capture read changed"


def capture_key(args0: Sequence[Any], kwargs0: Mapping[str, Any], dynamic: bool,
                modules: Sequence[torch.nn.Module], params: Sequence[torch.Tensor]) -> tuple:
    """The capture key of a call: its first microbatch's tensor signature,
    every module's training flag and every parameter's requires_grad."""
    return (_tensor_signature(args0, kwargs0, dynamic), tuple(m.training for m in modules),
            tuple(p.requires_grad for p in params))


def _tensor_signature(args: Sequence[Any], kwargs: Mapping[str, Any],
                      dynamic: bool = False) -> tuple:
    """The capture key of a call's inputs: shapes and dtypes, None in the dims
    that are dynamic (every dim with ``dynamic``, else the dims marked with
    torch._dynamo.mark_dynamic), and the non-tensor values."""
    if (not dynamic and not kwargs and all(type(a) is torch.Tensor for a in args)
            and not any(hasattr(a, "_dynamo_dynamic_indices") for a in args)):
        return tuple((tuple(a.shape), a.dtype) for a in args)  # the common case
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    return tuple((_masked_shape(x, dynamic), x.dtype) if isinstance(x, torch.Tensor)
                 else repr(x) for x in leaves)


def _masked_shape(t: torch.Tensor, dynamic: bool) -> tuple:
    marked = getattr(t, "_dynamo_dynamic_indices", ())
    return tuple(None if dynamic or d in marked else n for d, n in enumerate(t.shape))


def unfit(runtime: RankRuntime, split: Any, args0: tuple, kwargs0: dict) -> str | None:
    """Why ``split`` cannot run these inputs: a Python value the capture read
    changed (NOTE [State guards]), or, with symbolic sizes, a static dim
    differs or a guard on the sizes fails; None when it can."""
    state = split.captured.state
    changed = state.changed() if state is not None else None
    if changed is not None:
        return f"{_STATE_CHANGED}: {changed}"
    if not split.sizes:
        return None
    try:
        named = split.named_inputs(args0, kwargs0)
    except ValueError as e:
        return str(e).splitlines()[0]
    shapes = runtime.model.shapes
    return shapes.violation(shapes.key(named))


def describe_key(sig: tuple | None) -> str:
    """A capture key for a log line: the input shapes and dtypes, the modes."""
    if sig is None:
        return "nothing"
    tensors, modes, trainable = sig
    shapes = ", ".join(f"{tuple(t[0])} {str(t[1]).replace('torch.', '')}"
                       if isinstance(t, tuple) else str(t) for t in tensors)
    frozen = len(trainable) - sum(trainable)
    return (f"[{shapes}] ({'training' if all(modes) else 'eval' if not any(modes) else 'mixed'}"
            f"{f', {frozen} of {len(trainable)} parameters frozen' if frozen else ''})")


def microbatch_misfit(runtime: RankRuntime, split: Any, inputs: Sequence[Mapping[str, Any]],
                      targets: Sequence[Any]) -> str | None:
    """Why a capture made from the first of a call's explicit microbatches
    (their named inputs) cannot run them all, naming the microbatch and the
    values; None when it can. A static capture runs one shape: every
    microbatch must have the first's input and target shapes. A dynamic one
    runs every size its guards admit, with the static dims and dtypes of
    the first."""
    first = inputs[0]
    shapes = runtime.model.shapes
    for i, named in enumerate(inputs[1:], start=1):
        for name, value in named.items():
            ref = first.get(name)
            if not isinstance(value, torch.Tensor) or not isinstance(ref, torch.Tensor):
                continue
            if value.dtype != ref.dtype:
                return (f"microbatch {i}'s input {name!r} is {value.dtype}, microbatch 0's "
                        f"{ref.dtype}: every microbatch needs the dtypes of the first")
            if shapes is None and value.shape != ref.shape:
                return (f"microbatch {i}'s input {name!r} has shape {tuple(value.shape)}, "
                        f"microbatch 0's {tuple(ref.shape)}: microbatches of different shapes "
                        "need pipeline(dynamic=True) (one capture for every size), or pad them "
                        "to one shape")
            example = shapes.inputs.get(name) if shapes is not None else None
            if isinstance(example, torch.Tensor):
                for d, (n, want) in enumerate(zip(value.shape, example.shape)):
                    if isinstance(want, int) and n != want:
                        return (f"microbatch {i}'s input {name!r} has size {n} in dim {d}, "
                                f"where the capture (from microbatch 0) is specialized to "
                                f"{want}; keep that dim at {want} in every microbatch")
        if shapes is not None:
            why = shapes.violation(shapes.key(named))
            if why is not None:
                return (f"microbatch {i}'s sizes cannot run on the capture made from "
                        f"microbatch 0: {why}")
    if shapes is None and targets and targets[0] is not None:
        ref = [tuple(t.shape) if isinstance(t, torch.Tensor) else t
               for t in pytree.tree_leaves(targets[0])]
        for i, t in enumerate(targets[1:], start=1):
            got = [tuple(x.shape) if isinstance(x, torch.Tensor) else x
                   for x in pytree.tree_leaves(t)]
            if got != ref:
                return (f"targets[{i}] has shapes {got}, targets[0] {ref}: with dynamic=False "
                        "every microbatch has the first's shapes")
    return None
