"""The Python state a capture read, checked again at every call.

NOTE [State guards]: Dynamo specializes a graph to the Python values the
traced code reads: a module attribute (``self.temperature``), a global, a
closure cell, a config flag, a default argument. ``torch.compile`` keeps
guards on them and traces again when one changes. A pipeline runs its
capture many times, so it must do the same, or a value changed between steps
(an annealed temperature, a switched flag) is silently ignored. At capture
we keep the guards Dynamo recorded on such values (:func:`from_dynamo_guards`,
called by the capture backend, where the tracing context still holds them)
with the values they saw; each call evaluates them again
(:meth:`StateGuards.changed`) and the pipeline takes, or makes, a capture
whose values match (runtime/captures.py).

Left to other checks: the call's inputs (the capture key holds their shapes,
dtypes and non-tensor values), tensors (parameters move between devices,
shards and stand-ins; a module's tensors are read at run time, not baked
in), torch's own module globals, and global grad/device state (the runner
sets it).
"""

from __future__ import annotations

import builtins
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_mpmd.graph.names import Unnamed, name_of

__all__ = ["FrameGlobals", "StateGuards", "from_dynamo_guards", "from_persisted", "readable"]

# Guards on a value (compared by equality) and on an object (by identity).
# A closure (a function made by running a ``def`` again) is guarded as Dynamo
# guards it, by its code: the cells it reads have guards of their own.
_VALUE_KINDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})
_IDENTITY_KINDS = frozenset({"ID_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH"})
_CLOSURE_KIND = "CLOSURE_MATCH"
_TYPE_KINDS = frozenset({"TYPE_MATCH"})
_LENGTH_KINDS = frozenset({"SEQUENCE_LENGTH"})
# Sources the capture key already holds (the call's inputs) or that never
# change under a pipeline (torch's own modules and builtins, and the helpers
# Dynamo installs as globals of the traced frame: ``G['___unnamed_scope_...']``).
_SKIPPED_PREFIXES = ("L['args']", "L['kwargs']", "G['__import_torch", "G['__builtins",
                     "G['___")


def _scope_globals() -> dict[str, Any]:
    from torch._dynamo.guards import _get_closure_vars

    return {**_get_closure_vars(), "__builtins__": builtins}


class FrameGlobals(Mapping):
    """A traced frame's globals as its guards read them.

    Dynamo names a module whose globals the traced code reads by an alias it
    installs among the frame's globals (``G['__import_pkg_dot_mod'].SCALE``),
    and keeps the first module it installed under that name: after a module
    is imported again as a new object (a file edited and loaded afresh), the
    alias still names the old one. Here an alias is the module that
    ``sys.modules`` holds now, as in a new process (the capture store loads
    guards written by another process); other names are the frame's own
    globals."""

    def __init__(self, frame_globals: Mapping[str, Any]) -> None:
        self.frame_globals = frame_globals

    def __getitem__(self, key: str) -> Any:
        if key.startswith(_IMPORT_ALIAS):
            module = sys.modules.get(key[len(_IMPORT_ALIAS):].replace("_dot_", "."))
            if module is not None:
                return module
        return self.frame_globals[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.frame_globals)

    def __len__(self) -> int:
        return len(self.frame_globals)


_IMPORT_ALIAS = "__import_"


@dataclass
class _Guard:
    name: str       # Dynamo's source expression, e.g. "L['module']._modules['head'].scale"
    kind: str       # "value", "identity", "code" (a closure's), "type" or "length"
    seen: Any       # what the capture saw (an object for identity and code guards, kept alive)


@dataclass
class StateGuards:
    """The Python values a capture depends on, and the values it saw.

    ``scope`` holds the capture's frame: ``L`` (its locals: the captured module
    under ``"module"``) and ``G`` (its globals). One compiled expression reads
    every guarded value, so a call costs one Python tuple build and compare.
    """

    guards: list[_Guard]
    scope: dict[str, Any]
    _read: Any = field(default=None, repr=False)
    _seen: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.scope.get("G"), FrameGlobals):
            self.scope = {**self.scope, "G": FrameGlobals(self.scope.get("G", {}))}
        parts = []
        for g in self.guards:
            if g.kind == "value":
                parts.append(f"({g.name})")
            elif g.kind == "identity":
                parts.append(f"id({g.name})")
            elif g.kind == "code":
                parts.append(f"id(getattr({g.name}, '__code__', None))")
            elif g.kind == "type":
                parts.append(f"id(type({g.name}))")
            else:
                parts.append(f"len({g.name})")
        source = "lambda L, G: (" + "".join(p + ", " for p in parts) + ")"
        self._read = eval(compile(source, "<torch_mpmd state guards>", "eval"), _scope_globals())
        self._seen = tuple(self._summary(g) for g in self.guards)

    @staticmethod
    def _summary(g: _Guard) -> Any:
        if g.kind == "value":
            return g.seen
        if g.kind in ("identity", "code"):
            return id(g.seen)
        if g.kind == "type":
            return id(g.seen)  # (seen is the type)
        return g.seen

    def __len__(self) -> int:
        return len(self.guards)

    def readable(self) -> "StateGuards":
        """These guards less those whose source cannot be read now: Dynamo
        installs some globals for the time of a trace only (a named tuple's
        ``___unnamed_scope_...``). Call it once the capture call returned."""
        env = _scope_globals()
        kept = []
        for g in self.guards:
            try:
                eval(g.name, env, self.scope)
            except Exception:  # noqa: BLE001
                continue
            kept.append(g)
        return self if len(kept) == len(self.guards) else StateGuards(kept, self.scope)

    def persisted(self) -> list[tuple[str, str, Any]]:
        """These guards as plain data another process can check
        (:func:`from_persisted`): a value or length as itself, what an
        identity, code or type guard saw by its name (names.py). Raises
        names.Unnamed for an object without one."""
        return [(g.name, g.kind, g.seen if g.kind in ("value", "length") else name_of(g.seen))
                for g in self.guards]

    def changed(self) -> str | None:
        """None when every guarded value is as at capture; else what changed,
        naming the value and both states (``model.temperature: 1.0 -> 2.0``)."""
        if not self.guards:
            return None
        try:
            now = self._read(self.scope["L"], self.scope["G"])
        except Exception:  # noqa: BLE001  (an attribute deleted, a key removed)
            now = None
        if now is not None and _same(now, self._seen):
            return None
        return self._describe_change()

    def _describe_change(self) -> str:
        for g in self.guards:
            try:
                value = eval(g.name, _scope_globals(), self.scope)
            except Exception as e:  # noqa: BLE001
                return f"{readable(g.name)} can no longer be read ({type(e).__name__}: {e})"
            if g.kind == "value" and not _same((value,), (g.seen,)):
                return f"{readable(g.name)}: {_short(g.seen)} -> {_short(value)}"
            if g.kind == "identity" and value is not g.seen:
                return f"{readable(g.name)}: {_short(g.seen)} -> {_short(value)} (another object)"
            if g.kind == "code" and getattr(value, "__code__", None) is not g.seen:
                return (f"{readable(g.name)}: a function of {_short(g.seen)} -> "
                        f"{_short(value)} (other code)")
            if g.kind == "type" and type(value) is not g.seen:
                return (f"{readable(g.name)}: a {g.seen.__name__} -> a "
                        f"{type(value).__name__}")
            if g.kind == "length" and len(value) != g.seen:
                return f"len({readable(g.name)}): {g.seen} -> {len(value)}"
        return "a value the capture read"  # (a value compares unequal to itself: nan)


def _same(a: tuple, b: tuple) -> bool:
    """Tuples equal item by item, with types (1 and True and 1.0 differ)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if type(x) is not type(y):
            return False
        try:
            if not bool(x == y):
                return False
        except Exception:  # noqa: BLE001  (an __eq__ that does not give a bool)
            return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_PATTERNS = [
    (re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]"), r".\1"),
    (re.compile(r"^L\['module'\]"), "model"),
    (re.compile(r"^L\['([^']+)'\]"), r"\1"),
    (re.compile(r"^G\['([^']+)'\]"), r"global \1"),
]


def readable(name: str) -> str:
    """A guard's source as a user reads it: ``model.blocks.0.scale``,
    ``global SCALE``, ``loss_fn.label_smoothing``."""
    name = _IMPORTED.sub(lambda m: m.group(1).replace("_dot_", ".") + ".", name)
    for pattern, replacement in _PATTERNS:
        name = pattern.sub(replacement, name)
    return name


_IMPORTED = re.compile(r"^G\['__import_([^']+)'\]\.")  # a module Dynamo installed as a global


def from_dynamo_guards(guards: Iterable[Any], scope: Mapping[str, Any]) -> StateGuards:
    """The state guards among Dynamo's ``guards`` (the tracing context's
    ``dynamo_guards``), with the values they see now in ``scope`` (``L``, ``G``).

    Call it while tracing (before the traced code's side effects run): the
    values seen are those the graph was traced with. A guard whose source
    cannot be read here is left out (Dynamo reads some through its own
    frame state); one whose value is a tensor too (see the module docstring).
    """
    scope = {**scope, "G": FrameGlobals(scope["G"])}
    kept: dict[tuple[str, str], _Guard] = {}
    env = _scope_globals()
    for guard in guards:
        kind_name = guard.create_fn_name()
        if kind_name in _VALUE_KINDS:
            kind = "value"
        elif kind_name in _IDENTITY_KINDS:
            kind = "identity"
        elif kind_name in _TYPE_KINDS:
            kind = "type"
        elif kind_name in _LENGTH_KINDS:
            kind = "length"
        else:
            continue
        name = guard.name
        if not name or name.startswith(_SKIPPED_PREFIXES) or (name, kind) in kept:
            continue
        try:
            value = eval(name, env, scope)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(value, (torch.Tensor, torch.nn.Module)) or kind == "type" and (
                issubclass(type(value), (torch.Tensor, torch.nn.Module))):
            continue  # tensors: see the module docstring; modules: their own attributes are guarded
        if kind == "value" and not _plain(value):
            continue
        if kind == "identity" and kind_name == _CLOSURE_KIND and type(value) is types.FunctionType:
            kind, value = "code", value.__code__
        seen = type(value) if kind == "type" else len(value) if kind == "length" else value
        kept[(name, kind)] = _Guard(name, kind, seen)
    return StateGuards(list(kept.values()), scope)


def _plain(value: Any) -> bool:
    """A value an equality guard can compare and keep: Python scalars, strings,
    dtypes, devices, and tuples of them."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes,
                                           torch.dtype, torch.device, torch.memory_format,
                                           torch.layout)):
        return True
    if type(value) is tuple:
        return all(_plain(v) for v in value)
    return False


def from_persisted(items: Iterable[tuple[str, str, Any]], scope: Mapping[str, Any]
                   ) -> StateGuards | None:
    """Guards written by :meth:`StateGuards.persisted`, bound to ``scope``
    (``L``, ``G``) and seeing its objects; None unless every one holds there:
    each value equal, each identity, code or type guard reading an object of
    the same name."""
    scope = {**scope, "G": FrameGlobals(scope["G"])}
    env = _scope_globals()
    guards = []
    for name, kind, seen in items:
        if kind not in ("value", "length"):
            try:
                now = eval(name, env, scope)
            except Exception:  # noqa: BLE001
                return None
            obj = (getattr(now, "__code__", None) if kind == "code" else
                   type(now) if kind == "type" else now)
            try:
                if name_of(obj) != seen:
                    return None
            except Unnamed:
                return None
            seen = obj
        guards.append(_Guard(name, kind, seen))
    state = StateGuards(guards, scope)
    return state if state.changed() is None else None
