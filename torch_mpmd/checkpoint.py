"""Checkpoints through torch.distributed.checkpoint, under the original FQNs.

    mpmd.checkpoint.save(pipe, opt, "ckpt")     # collective: every rank calls it
    mpmd.checkpoint.load(pipe, opt, "ckpt")     # any pipeline size, or a plain module

Each rank writes its stages' parameters, buffers and optimizer state under the
module's own FQNs (DCP stores a tensor held by several ranks once), so a
checkpoint saved with one pipeline size loads into another, or into the
unsplit module in one process. Every save goes to a new directory
``path/step_<k>``; only when all ranks have finished does rank 0 replace the
small file ``path/latest`` (write, then atomic rename) to point at it, so a
save interrupted part-way leaves the previous checkpoint the latest one, whole.
An optimizer built before the first step (the whole module's parameters) is
trimmed to this rank's parameters on save and on load after capture.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

__all__ = ["save", "load", "latest"]

_LATEST = "latest"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _drop_other_ranks_parameters(module: torch.nn.Module, optimizer: Any) -> None:
    """An optimizer built before the pipeline's capture holds the whole module's
    parameters; those of other ranks' stages never get a gradient here and have
    no FQN in this rank's state dict: drop them (and their state, if any)."""
    if optimizer is None or not getattr(module, "is_captured", False):
        return
    local = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in local:
                optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if id(p) in local]


def _state(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    _drop_other_ranks_parameters(module, optimizer)
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(module, optimizer)
    state["pipeline"] = {"step": torch.tensor(getattr(module, "_mpmd_step", 0))}
    return state


def save(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike) -> str:
    """Save ``module`` (a Pipeline, or any module) and ``optimizer`` (or None)
    under ``path``; returns the new checkpoint's directory. Collective."""
    step = int(getattr(module, "_mpmd_step", 0))
    target = os.path.join(os.fspath(path), f"step_{step}")
    with _quiet():
        dcp.save(_state(module, optimizer), checkpoint_id=target, no_dist=not _distributed())
    if _distributed():
        dist.barrier()
    if not _distributed() or dist.get_rank() == 0:
        tmp = os.path.join(os.fspath(path), f".{_LATEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(os.path.basename(target) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(os.fspath(path), _LATEST))
    if _distributed():
        dist.barrier()
    return target


def latest(path: str | os.PathLike) -> str:
    """The directory of the last completed checkpoint under ``path``."""
    pointer = os.path.join(os.fspath(path), _LATEST)
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no completed checkpoint under {os.fspath(path)!r} (no "
                                f"{_LATEST!r} file)") from None
    if not name.startswith("step_") or "/" in name or not name[5:].isdigit():
        raise ValueError(f"{pointer} holds {name!r}, not a checkpoint directory name")
    return os.path.join(os.fspath(path), name)


def load(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike) -> None:
    """Load the latest checkpoint under ``path`` into ``module`` (a Pipeline of any
    size, or the unsplit module) and ``optimizer`` (or None). Collective."""
    target = latest(path)
    state = _state(module, optimizer)
    with _quiet():
        dcp.load(state, checkpoint_id=target, no_dist=not _distributed())
    module.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optim"])
    if hasattr(module, "_mpmd_step"):
        module._mpmd_step = int(state["pipeline"]["step"])
