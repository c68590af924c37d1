"""``checkpoint.save``: check every rank's state, write it through DCP into a fresh directory, record its checksums, then point ``latest`` at it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from torch_mpmd.checkpoint.extra import EXTRA, EXTRA_PER_RANK, encode_extra
from torch_mpmd.checkpoint.layout import (LATEST, fresh_directory, fsync_dir, point_latest,
                                          prune, remove_unfinished, write_json)
from torch_mpmd.checkpoint.manifest import FORMAT, VERSION, checksums, digests, sha256_file
from torch_mpmd.checkpoint.plain import not_plain
from torch_mpmd.checkpoint.state import module_state
from torch_mpmd.checkpoint.sync import (DCPFailed, Sync, dcp_error, dcp_failed_error,
                                        distributed, named, quiet_dcp, raise_agreed,
                                        this_rank, timeout_seconds)

__all__ = ["save"]


class _RecordingSavePlanner(DefaultSavePlanner):
    """DCP's default planner that keeps this rank's final write items (what it
    writes after DCP dropped duplicates held by other ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Any] = []

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        self.items = list(plan.items)
        return plan


def _refuse_not_plain(state: Mapping[str, Any]) -> None:
    """TypeError naming the values of the state DCP would pickle that load
    could not read back (anything but tensors and plain values)."""
    bad = not_plain(state)
    if bad:
        raise TypeError(f"{len(bad)} value{'s' * (len(bad) > 1)} of the module's or optimizer's "
                        f"state cannot be saved: {named(bad)} (a checkpoint holds tensors and "
                        f"plain values: None, bool, int, float, complex, str, bytes, and "
                        f"tuples, lists, sets and dicts of them)")


def save(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike, *,
         extra: Mapping[str, Any] | None = None,
         extra_per_rank: Mapping[str, Any] | None = None,
         keep_last: int | None = None,
         timeout: float | datetime.timedelta | None = None) -> str:
    """Save ``module`` (a Pipeline, or any module), ``optimizer`` (or None) and
    the user's state under ``path``; returns the new checkpoint's directory.

    Collective: every rank calls it. ``extra`` is saved from rank 0,
    ``extra_per_rank`` from every rank (see the package docstring for what a
    value may be). The new directory becomes ``latest`` only after every rank
    finished. ``keep_last=n`` (n >= 1) then removes older checkpoints, never
    the current one; the directories of earlier saves that died part-way go
    in any case. Raises CheckpointError (on every rank) for a value that
    cannot be saved (in ``extra``, or a non-tensor value of the module's or
    optimizer's state that is not plain); a rank that dies or stalls part-way
    leaves ``latest`` as it was, and the others raise CheckpointError naming
    it. ``timeout`` (seconds or timedelta; default: the Pipeline's
    ``timeout``) bounds every wait for the other ranks (NOTE [Checkpoint
    waits] in checkpoint/sync.py). Never changes the optimizer (an optimizer
    that has not stepped yet is saved without state).
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int or None")
    root = os.fspath(path)
    with Sync(timeout_seconds(module, timeout), f"saving a checkpoint under {root!r}") as sync:
        return _save(sync, module, optimizer, root, extra, extra_per_rank, keep_last)


def _save(sync: Sync, module: torch.nn.Module, optimizer: Any, root: str,
          extra: Mapping[str, Any] | None, extra_per_rank: Mapping[str, Any] | None,
          keep_last: int | None) -> str:
    rank = this_rank()
    step = int(getattr(module, "step_count", 0))
    world = dist.get_world_size() if distributed() else 1
    manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "rank": rank,
                                "world_size": world, "step": step}
    tensors: dict[str, torch.Tensor] = {}
    problem, name = None, None
    state: dict[str, Any] = {}
    try:  # every rank checks its state and extra state; rank 0's extra is the one saved
        state = module_state(module, optimizer)
        _refuse_not_plain(state)
        saved_extra = encode_extra(extra, "extra", EXTRA, tensors)
        if rank == 0:
            manifest["extra"] = saved_extra
        else:
            tensors.clear()
        manifest["extra_per_rank"] = encode_extra(
            extra_per_rank, "extra_per_rank", f"{EXTRA_PER_RANK}.{rank}", tensors)
        manifest["sha256"] = {kind: digests(manifest.get(kind, {}))
                              for kind in ("extra", "extra_per_rank")}
        if rank == 0:
            remove_unfinished(root)
            name = fresh_directory(root, step)
    except TypeError as e:   # ours: the message names the value
        problem = str(e)
    except Exception as e:  # reported, not raised: the other ranks must hear of it
        problem = f"{type(e).__name__}: {e}"
    agreed = sync.gather([problem, name], "the check of every rank's state")
    raise_agreed([p for p, _ in agreed], f"saving a checkpoint under {root!r}")
    target = os.path.join(root, agreed[0][1])

    state.update(tensors)
    planner = _RecordingSavePlanner()
    try:
        with quiet_dcp():
            metadata = sync.run_dcp(
                lambda group: dcp.save(state, checkpoint_id=target, planner=planner,
                                       process_group=group, no_dist=group is None),
                "DCP's save")
    except CheckpointException as e:
        raise dcp_error("saving", target, e) from e
    except DCPFailed as e:   # a collective of DCP's failed: a rank left the save
        raise dcp_failed_error(e, f"saving {target}", rank,
                               f"{LATEST!r} still names the previous checkpoint; the next "
                               f"save removes {target}") from e.__cause__
    manifest["items"] = checksums(target, metadata, planner.items)
    if rank == 0:   # DCP's coordinator wrote .metadata before dcp.save returned
        manifest["sha256"][".metadata"] = sha256_file(os.path.join(target, ".metadata"))
    write_json(os.path.join(target, f"rank_{rank}.json"), manifest)
    fsync_dir(target)
    sync.barrier("every rank's manifest written")
    if rank == 0:
        point_latest(root, target)
        if keep_last is not None:
            prune(root, os.path.basename(target), keep_last)
    sync.barrier(f"{LATEST!r} updated")
    return target
