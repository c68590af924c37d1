"""Symbolic shapes of a dynamic capture, made concrete per step.

A capture with symbolic sizes (``pipeline(..., dynamic=True)`` or inputs
marked with ``torch._dynamo.mark_dynamic``) gives every cross-stage value a
shape in terms of the inputs' sizes (``[2, s0, 32]``). Every rank sees the
whole batch, so every rank binds the symbols from the step's inputs and
evaluates every value's shape itself: receives are sized with no extra
message. The capture also recorded guards on the symbols (Dynamo's, and
AOTAutograd's while building the stage programs: ``s0 >= 2``,
``s0 <= 16``...); sizes that break one cannot run on this capture, and the
pipeline captures again for them (see :meth:`SymbolicShapes.violation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["SymbolicShapes"]


def _expr(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else value


class SymbolicShapes:
    """Binds the size placeholders of a split to a step's inputs.

    ``sizes``: (placeholder name, its example SymInt) per size placeholder;
    ``values``: node id -> example (fake) tensor of each cross-stage value;
    ``inputs``: input or size name -> its symbolic example (what the stage
    programs are traced with).
    """

    def __init__(self, sizes: Sequence[tuple[str, torch.SymInt]],
                 values: Mapping[int, torch.Tensor], inputs: Mapping[str, Any]) -> None:
        self.inputs = dict(inputs)
        self.names = [name for name, _ in sizes]
        self._symints = [s for _, s in sizes]
        self.exprs = [_expr(s) for _, s in sizes]
        self.values = dict(values)
        self.shape_env = next((s.node.shape_env for _, s in sizes
                               if isinstance(s, torch.SymInt)), None)
        # NOTE [Program guards]: guards recorded so far are the capture's,
        # the same on every rank (each captured the whole model); those added
        # later come from tracing this rank's stage programs (a branch on a
        # size in loss_fn, on the last stage's rank only). Which capture a
        # call takes is decided on the capture's guards alone, so that every
        # rank decides alike; sizes that break a program guard are refused
        # (:meth:`program_violation`), not captured again on one rank.
        self._capture_guards = len(self.shape_env.guards) if self.shape_env is not None else 0

    def hint_key(self) -> tuple[int, ...]:
        """The sizes the capture was made with."""
        from torch_mpmd.graph.capture import size_hint

        return tuple(size_hint(s) for s in self._symints)

    def key(self, inputs0: Mapping[str, Any]) -> tuple[int, ...]:
        """The sizes of this step (from the first microbatch's named inputs)."""
        return tuple(int(inputs0[name]) for name in self.names)

    def bindings(self, key: Sequence[int]) -> dict[Any, int]:
        """Symbol -> value; a size placeholder whose expression is not a lone
        symbol (Dynamo related it to another) binds nothing itself."""
        import sympy

        return {e: sympy.Integer(v) for e, v in zip(self.exprs, key)
                if getattr(e, "is_Symbol", False)}

    def violation(self, key: Sequence[int]) -> str | None:
        """Why sizes ``key`` cannot run on this capture (a guard it recorded
        fails), or None. Guards of the stage programs are not looked at
        (NOTE [Program guards])."""
        bound = self.bindings(key)
        for name, v in zip(self.names, key):
            if v < 2:  # symbols stand for sizes >= 2 (sizes 0 and 1 are specialized)
                return f"{name}={v}, where the capture assumes sizes of at least 2"
        for name, e, v in zip(self.names, self.exprs, key):
            got = e.xreplace(bound) if hasattr(e, "xreplace") else e
            if not getattr(got, "is_number", True) or int(got) != v:
                return f"{name}={v}, where the capture has {name} = {e}"
        if self.shape_env is None:
            return None
        return self._failed_guard(self.shape_env.guards[:self._capture_guards], bound,
                                  "the capture")

    def program_violation(self, key: Sequence[int]) -> str | None:
        """Why sizes ``key`` cannot run on this rank's stage programs: a guard
        that tracing them added fails (NOTE [Program guards]); None when none does."""
        if self.shape_env is None or len(self.shape_env.guards) <= self._capture_guards:
            return None
        return self._failed_guard(self.shape_env.guards[self._capture_guards:],
                                  self.bindings(key), "this rank's stage programs")

    def _failed_guard(self, guards: Sequence[Any], bound: Mapping[Any, int],
                      what: str) -> str | None:
        for guard in guards:
            expr = guard.expr.xreplace(bound)
            if expr.free_symbols:
                continue  # a guard on a symbol no input binds (not ours to check)
            if not bool(expr):
                return f"{what} assumed {self._named(guard.expr)}"
        return None

    def _named(self, expr: Any) -> str:
        """A guard with the inputs' sizes by name: ``x.size(1) <= 6``, not ``s50 <= 6``."""
        import sympy

        names = {e: sympy.Symbol(n) for n, e in zip(self.names, self.exprs)
                 if getattr(e, "is_Symbol", False)}
        return str(expr.xreplace(names))

    def symbolic_like(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor like ``t`` (a loss target) whose dims are the input
        sizes' symbols where they are equal at capture (the target's sequence
        dim is the input's), else static: the programs then relate the
        target to the inputs as the loss does. :meth:`expected` gives the
        shape a step's target must have."""
        from torch_mpmd.graph.capture import size_hint

        by_hint: dict[int, torch.SymInt] = {}
        for s in self._symints:
            if isinstance(s, torch.SymInt) and getattr(_expr(s), "is_Symbol", False):
                by_hint.setdefault(size_hint(s), s)
        fake_mode = next(v.fake_mode for v in [*self.values.values(), *self.inputs.values()]
                         if isinstance(v, torch.Tensor))
        shape = [by_hint.get(n, n) if n > 1 else n for n in t.shape]
        with fake_mode:
            return torch.empty(shape, dtype=t.dtype, device=t.device)

    def expected(self, fake: torch.Tensor, key: Sequence[int]) -> tuple[int, ...]:
        """The concrete shape of a symbolic example for sizes ``key``."""
        bound = self.bindings(key)
        return tuple(int(_expr(d).xreplace(bound)) if isinstance(d, torch.SymInt) else int(d)
                     for d in fake.shape)

    def concrete(self, key: Sequence[int]) -> dict[int, torch.Tensor]:
        """Node id -> an empty meta tensor of the value's shape for sizes ``key``."""
        bound = self.bindings(key)
        out = {}
        for node, value in self.values.items():
            shape = []
            for d in value.shape:
                e = _expr(d)
                if hasattr(e, "xreplace"):
                    e = e.xreplace(bound)
                    if e.free_symbols:
                        raise RuntimeError(
                            f"the shape of a cross-stage value depends on "
                            f"{sorted(map(str, e.free_symbols))}, which no input size binds")
                shape.append(int(e))
            out[node] = torch.empty(shape, dtype=value.dtype, device="meta",
                                    requires_grad=value.requires_grad and (
                                        value.is_floating_point() or value.is_complex()))
        return out
