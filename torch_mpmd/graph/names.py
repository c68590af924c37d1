"""Names that mean the same Python object in another process.

The capture store (capture_store.py) keeps captures on disk, keyed by what the
in-process capture memo keys them by. That key holds some objects by identity
(a module's class, a function set as an attribute, a hook), and the state
guards hold what an identity guard saw. An identity means nothing in another
process, so each such object is written as a name that means the same object
there: a class, function or builtin by its module and qualified name, a
function's code by a digest of its bytecode and constants, a module by its
name, a function by those and what it closes over, a functools.partial by
its function and arguments. An object without such a name (an instance,
a class defined inside a function, a DTensor's mesh) raises
:class:`Unnamed`, and the capture is then kept in the process only.

A name is plain data (JSON), so it can be hashed into a file name or
compared after loading. Two objects with the same name are interchangeable
for a capture: the code of their files is checked separately (the store
records a digest of every source file the trace read).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from typing import Any

import torch

__all__ = ["Unnamed", "code_digest", "name_of"]


class Unnamed(Exception):
    """An object that has no name meaning the same object in another process."""


_TORCH_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_BUILTIN_TYPES = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                  types.MethodDescriptorType, types.MethodWrapperType,
                  types.ClassMethodDescriptorType)


def code_digest(code: types.CodeType) -> str:
    """A digest of what ``code`` does: its bytecode, constants (nested code
    too), names and argument layout. Not its line numbers."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_qualname, c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount,
                       c.co_flags, c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)
                      ).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(repr((type(const).__name__, const)).encode())

    feed(code)
    return h.hexdigest()


def _qualified(obj: Any, kind: str) -> list:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise Unnamed(f"a {kind} without a module or qualified name: {obj!r}")
    if "<locals>" in qualname:
        # A class defined inside a function: each run of the def is another
        # class, whose methods may close over other values.
        raise Unnamed(f"{kind} {qualname} is defined inside a function")
    return [kind, module, qualname]


_MAX_DEPTH = 16


def name_of(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain data that names the same value in another process.

    Plain values by value (a float by its repr: -0.0 and nan stay distinct),
    containers item by item, and classes, functions, builtins, code and
    modules by name; anything else raises :class:`Unnamed`."""
    if value is None or type(value) in (bool, int, str):
        return value
    if _depth > _MAX_DEPTH:
        raise Unnamed("a value nested too deep (a cycle?)")
    if type(value) is float or type(value) is complex:
        return [type(value).__name__, repr(value)]
    if type(value) is bytes:
        return ["bytes", value.hex()]
    if isinstance(value, enum.Enum):
        return ["enum", name_of(type(value), _depth + 1), value.name]
    if isinstance(value, _TORCH_VALUES):
        return [type(value).__name__, str(value)]
    if isinstance(value, torch.Size):
        return ["Size", list(value)]
    if type(value) in (tuple, list):
        return [type(value).__name__, [name_of(v, _depth + 1) for v in value]]
    if type(value) in (set, frozenset):
        items = [name_of(v, _depth + 1) for v in value]
        return [type(value).__name__, sorted(items, key=repr)]
    if type(value) is dict:
        return ["dict", [[name_of(k, _depth + 1), name_of(v, _depth + 1)]
                         for k, v in value.items()]]
    if isinstance(value, type):
        return _qualified(value, "class")
    if isinstance(value, types.FunctionType):
        # What a function does: its code, defaults and closure values (a
        # decorator's wrapper closes over the function it wraps), and the
        # globals of its module, which the trace's guards check. So one
        # defined inside a function is named too: a def run again is the
        # same function unless a value it closes over differs.
        cells = []
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(["empty cell"])
                continue
            cells.append(name_of(contents, _depth + 1))
        return ["function", value.__module__, value.__qualname__, code_digest(value.__code__),
                name_of(value.__defaults__, _depth + 1),
                name_of(value.__kwdefaults__, _depth + 1), cells]
    if type(value) is functools.partial and not vars(value):
        # What it runs: its function and the arguments bound (Gemma2's
        # activation, an initializer a model keeps). A subclass, or one with
        # attributes of its own, may do more: unnamed.
        return ["partial", name_of(value.func, _depth + 1), name_of(value.args, _depth + 1),
                name_of(value.keywords, _depth + 1)]
    if isinstance(value, types.CodeType):
        return ["code", value.co_filename, value.co_qualname, code_digest(value)]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, _BUILTIN_TYPES):
        owner = getattr(value, "__self__", None)
        if owner is not None and not isinstance(owner, (type, types.ModuleType)):
            raise Unnamed(f"a builtin method bound to a {type(owner).__name__}")
        if owner is None:  # a method descriptor (str.join): its class
            owner = getattr(value, "__objclass__", None)
        if isinstance(owner, type):
            return ["builtin of", name_of(owner, _depth + 1), value.__name__]
        return _qualified(value, "builtin")
    raise Unnamed(f"a {type(value).__name__} object")
