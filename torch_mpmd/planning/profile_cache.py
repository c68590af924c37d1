"""The profile cache: its key, where it lives, and its entries (see profile.py's docstring,
"Cache", and NOTE [Relative profiles]: an entry holds the units as measured, unfitted)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["cache_dir_of", "profile_key", "read_entry", "write_atomic", "write_entry"]


def _describe_value(value: Any) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    return [str(spec), [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                        for t in leaves]]


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return cls.__qualname__


def _loss_label(loss_fn: Any) -> str:
    from torch_mpmd.programs.loss import loss_label
    return loss_label(loss_fn)


def _compile_key(compile: Any) -> str:
    if callable(compile) and not isinstance(compile, bool):
        return f"{getattr(compile, '__module__', '')}.{getattr(compile, '__qualname__', '')}"
    return repr(compile)


# How a profile is measured, in the key: a cached profile measured otherwise
# (other units refined, fields a newer sheet prices) is measured again.
# Bump it when that changes.
_METHOD = 4  # 4: entries hold the units unfitted (NOTE [Relative profiles])


def profile_key(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
                target: Any, *, loss_fn: Any, units: Sequence[str], sizes: Sequence[int],
                compile: Any, pp_size: int, device: str, dp_size: int = 1) -> str:
    """The cache key (a sha256 hex digest) of a profile; see the module docstring."""
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__)
    what = {
        "classes": [(c.__module__, c.__qualname__, _source(c)) for c in classes],
        "params": [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "training": model.training,
        "args": _describe_value(tuple(args)), "kwargs": _describe_value(dict(kwargs)),
        "target": _describe_value(target), "loss": _loss_label(loss_fn),
        "units": list(units), "sizes": list(sizes), "compile": _compile_key(compile),
        "pp_size": pp_size, "device": device, "torch": torch.__version__,
        "method": _METHOD,
    }
    if dp_size > 1:  # (keys of profiles without data parallel stay as they were)
        what["dp_size"] = dp_size
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def cache_dir_of(cache_dir: Any) -> Path | None:
    """The cache's folder (``cache_dir=False``: None, no cache)."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = os.environ.get("MPMD_PROFILE_CACHE") or \
            os.path.join(os.path.expanduser("~"), ".cache", "torch_mpmd", "profiles")
    return Path(cache_dir)


def read_entry(path: Path | None) -> str | None:
    """The units sheet's JSON of the entry at ``path`` (None: no entry, or a
    damaged one, which is measured again)."""
    from torch_mpmd.planning.sheet import CostSheet

    if path is None or not path.is_file():
        return None
    try:
        text = json.loads(path.read_text())["units_sheet"]
        CostSheet.from_json(text)
    except (ValueError, KeyError, OSError, TypeError):
        return None
    return text


def write_entry(path: Path | None, key: str, units_sheet: str) -> None:
    """The cache entry: the units as measured, before this launch's fit."""
    if path is not None:
        write_atomic(path, json.dumps({"key": key, "units_sheet": units_sheet}))


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all (a reader never sees half);
    nothing on a read-only cache (what was measured or decided is still
    returned)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        pass
