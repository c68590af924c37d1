"""The Python state a loss function reads, as one comparable snapshot.

NOTE [Loss state]: a stage program traces ``loss_fn`` once, with the values
it read then: a closure's weight, a module's ``label_smoothing``, a global
flag, a helper's global. Eager PyTorch reads them at every call. The runner
keeps a snapshot of what ``loss_fn`` can reach (:func:`loss_state`) in the
key of the programs it built; a call whose snapshot differs builds the
programs for its values (or takes those built before for them). A loss that
changes state itself when called (a counter, a log list) cannot be replayed
by a traced program: the rank runs its stages under autograd, where
``loss_fn`` runs at every microbatch as in eager PyTorch.

What a snapshot reaches: a function's closure cells, defaults and the
globals its code names (and, one level down, the attributes of a global
module that its code names, e.g. ``config.WEIGHT``); a partial's arguments;
an object's attributes (a loss module's ``label_smoothing``, its buffers);
the same for the user functions and objects found there, a few levels deep.
Values compare by value (numbers, strings, tuples...), tensors and other
objects by identity and, for tensors, shape and dtype; torch's own functions
and modules by identity only.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

__all__ = ["loss_state", "describe_change"]

_MAX_DEPTH = 4       # levels of objects followed from the loss function
_MAX_ITEMS = 256     # items of one container or __dict__ looked at


def loss_state(loss_fn: Any, identities: list | None = None) -> tuple:
    """A snapshot of the Python state ``loss_fn`` can read: a tuple of
    ``(path, summary)`` pairs, equal for equal state (NOTE [Loss state]).
    ``identities``, when given, receives every object the snapshot names by
    its ``id``: while they live, an equal snapshot means the same objects."""
    if loss_fn is None:
        return ()
    out: list[tuple[str, Any]] = []
    _walk(loss_fn, "loss_fn", _Out(out, identities), 0, set())
    return tuple(out)


class _Out:
    """Where a walk writes: the snapshot's pairs, and the objects it names by id."""

    def __init__(self, pairs: list, identities: list | None) -> None:
        self.pairs, self.identities = pairs, identities

    def append(self, pair: tuple) -> None:
        self.pairs.append(pair)

    def by_id(self, path: str, summary: tuple, value: Any) -> None:
        self.pairs.append((path, summary))
        if self.identities is not None:
            self.identities.append(value)


def describe_change(before: tuple, after: tuple) -> str:
    """The first difference of two snapshots, as ``loss_fn.weight: 1.0 -> 0.5``."""
    old, new = dict(before), dict(after)
    for path, value in after:
        if path not in old:
            return f"{path} appeared ({_show(value)})"
        if not _equal(old[path], value):
            return f"{path}: {_show(old[path])} -> {_show(value)}"
    for path, value in before:
        if path not in new:
            return f"{path} disappeared (was {_show(value)})"
    return "the state loss_fn reads"


def _show(summary: Any) -> str:
    if isinstance(summary, tuple) and summary and summary[0] in ("object", "tensor"):
        return summary[1]
    text = repr(summary)
    return text if len(text) <= 60 else text[:57] + "..."


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _is_torch(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "torch" or module.startswith(("torch.", "torch_mpmd.")) or \
        isinstance(obj, types.BuiltinFunctionType)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes,
                                               torch.dtype, torch.device))


def _walk(value: Any, path: str, out: _Out, depth: int, seen: set[int]) -> None:
    if _plain(value):
        out.append((path, value))
        return
    if isinstance(value, torch.Tensor):
        out.by_id(path, ("tensor", f"a tensor of shape {tuple(value.shape)}", id(value),
                         tuple(value.shape), value.dtype), value)
        return
    if id(value) in seen or depth > _MAX_DEPTH or (
            type(value).__module__ or "").startswith("torch_mpmd."):  # (a Pipeline: its own state)
        out.by_id(path, ("object", _name(value), id(value)), value)
        return
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        out.append((path, (type(value).__name__, len(value))))
        for i, item in enumerate(value[:_MAX_ITEMS]):
            _walk(item, f"{path}[{i}]", out, depth + 1, seen)
        return
    if isinstance(value, dict):
        out.append((path, ("dict", len(value))))
        for i, (k, item) in enumerate(value.items()):
            if i >= _MAX_ITEMS:
                break
            _walk(item, f"{path}[{k!r}]", out, depth + 1, seen)
        return
    if isinstance(value, (types.ModuleType, type)) or _is_torch(value) and not isinstance(
            value, torch.nn.Module) or callable(value) and not hasattr(value, "__dict__") \
            and not isinstance(value, functools.partial):
        out.by_id(path, ("object", _name(value), id(value)), value)
        return
    if isinstance(value, functools.partial):
        out.by_id(path, ("object", "functools.partial", id(value)), value)
        _walk(value.func, f"{path}.func", out, depth + 1, seen)
        _walk(value.args, f"{path}.args", out, depth + 1, seen)
        _walk(value.keywords, f"{path}.keywords", out, depth + 1, seen)
        return
    if isinstance(value, types.MethodType):
        _walk(value.__self__, f"{path}.__self__", out, depth + 1, seen)
        _function(value.__func__, path, out, depth, seen)
        return
    if isinstance(value, types.FunctionType):
        out.by_id(path, ("object", _name(value), id(value)), value)
        _function(value, path, out, depth, seen)
        return
    # Any other object: its class, its attributes, and its class's call code.
    out.by_id(path, ("object", _name(value), id(value)), value)
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        for i, (k, item) in enumerate(attrs.items()):
            if i >= _MAX_ITEMS:
                break
            if k in ("_parameters", "_buffers", "_modules") and isinstance(item, dict):
                for name, sub in item.items():  # a module's tensors and submodules by name
                    _walk(sub, f"{path}.{name}", out, depth + 1, seen)
                continue
            if isinstance(item, dict) and k.endswith("hooks"):
                out.append((f"{path}.{k}", ("hooks", len(item))))
                continue
            _walk(item, f"{path}.{k}", out, depth + 1, seen)
    call = getattr(type(value), "forward" if isinstance(value, torch.nn.Module) else "__call__",
                   None)
    if isinstance(call, types.FunctionType) and not _is_torch(call):
        _function(call, f"{path}.{call.__name__}", out, depth, seen)


def _function(fn: types.FunctionType, path: str, out: _Out, depth: int, seen: set[int]) -> None:
    """What a Python function reads besides its arguments."""
    if _is_torch(fn):
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _walk(contents, f"{path}.<closure {name}>", out, depth + 1, seen)
    if fn.__defaults__:
        _walk(fn.__defaults__, f"{path}.<defaults>", out, depth + 1, seen)
    if fn.__kwdefaults__:
        _walk(fn.__kwdefaults__, f"{path}.<keyword defaults>", out, depth + 1, seen)
    names = _code_names(code)
    module_name = fn.__globals__.get("__name__", "?")
    for name in sorted(names):
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        where = f"global {module_name}.{name}"
        if isinstance(value, types.ModuleType):
            # ``config.WEIGHT``: the attributes of the module this code names.
            if not _is_torch(value) and value.__name__ not in ("math", "builtins"):
                for attr in sorted(names):
                    if attr in vars(value) and not attr.startswith("__"):
                        _walk(vars(value)[attr], f"{where}.{attr}", out, depth + 1, seen)
            continue
        _walk(value, where, out, depth + 1, seen)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _name(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if name is not None and not isinstance(value, torch.nn.Module):
        return f"{getattr(value, '__module__', '') or ''}.{name}".lstrip(".")
    return f"a {type(value).__qualname__}"
