"""Collectives bounded by their own timeout, the wait that names what failed,
and abandoning the groups after a failure.

NOTE [Bounded collectives]: every collective the library issues carries the
wait's timeout as its own (c10d options ``timeout``), so that work on a
group's worker thread ends within the timeout even when nobody waits for it
any more: a gloo group's destructor waits for that work, and with the
process-group timeout (30 min by default) the process would not exit.

NOTE [Abandoned groups]: after a failure that may leave work in flight (a
collective issued by code that did not bound it, a peer that stalls), the
groups the pipeline uses are aborted where the backend can (NCCL) and kept
alive until the process exits (``_runtime.keep_until_exit``): gloo has no
abort in torch 2.13, and destroying a group joins its worker threads, which
first wait out their work. The process then exits at once; the groups are
unusable anyway.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.parallel.failures import UNUSABLE, PipelineError, first_line

__all__ = ["as_timedelta", "all_gather", "all_reduce", "broadcast", "wait", "abandon", "abandoned",
           "WAIT_GRACE_S"]


def as_timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as the timedelta c10d options and waits take."""
    return datetime.timedelta(seconds=seconds)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any,
               timeout_s: float) -> Any:
    """``dist.all_gather`` (async) whose work ends within ``timeout_s`` on its
    own (NOTE [Bounded collectives]). ``group`` is a ProcessGroup."""
    opts = torch._C._distributed_c10d.AllgatherOptions()
    opts.timeout = as_timedelta(timeout_s)
    return group.allgather([outputs], [tensor], opts)


def all_reduce(tensor: torch.Tensor, group: Any, timeout_s: float,
               op: Any = dist.ReduceOp.SUM) -> Any:
    """``dist.all_reduce`` (async), bounded as :func:`all_gather`."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = as_timedelta(timeout_s)
    return group.allreduce([tensor], opts)


def broadcast(tensor: torch.Tensor, root: int, group: Any, timeout_s: float) -> Any:
    """``dist.broadcast`` (async) from ``root``, a rank *of the group*, bounded
    as :func:`all_gather`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = as_timedelta(timeout_s)
    return group.broadcast([tensor], opts)


# The wait allows this much beyond a bounded collective's own timeout, so that
# the collective's own error (which names what it waited for) comes first and
# its work has ended when the wait raises.
WAIT_GRACE_S = 1.0


def wait(work: Any, what: str, timeout_s: float, *, rank: int,
         on_failure: Callable[[str], None] | None = None,
         explain: Callable[[], str | None] | None = None) -> None:
    """Wait for ``work`` at most ``timeout_s`` (+ a grace second); a failure or
    timeout calls ``on_failure(reason)`` (which marks the groups unusable) and
    raises PipelineError naming ``what``, and what ``explain()`` then says
    (e.g. which rank died first)."""
    cause: Exception | None = None
    try:
        ok = work.wait(timeout=as_timedelta(timeout_s + WAIT_GRACE_S))
        reason = None if ok is not False else f"timed out after {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
        cause = e
        reason = f"failed within the {timeout_s:g} s timeout: {first_line(str(e), 500)}"
    if reason is None:
        return
    if on_failure is not None:
        on_failure(f"{what} {reason}")
    told = explain() if explain is not None else None
    raise PipelineError(f"rank {rank}: {what} {reason} (a peer that stalled or died, or "
                        f"that is in another call){'; ' + told if told else ''}{UNUSABLE}",
                        rank=rank) from cause


_ABANDONED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def abandoned(group: Any) -> bool:
    """Whether :func:`abandon` was given ``group`` (a group kept for reuse
    is then made again: NOTE [Groups kept] in data_parallel.py)."""
    try:
        return group in _ABANDONED
    except TypeError:  # not weakly referenceable: never given to abandon()
        return False


def abandon(groups: Iterable[Any]) -> None:
    """NOTE [Abandoned groups]: abort each group where the backend can, and keep
    gloo groups alive until exit so that destroying them cannot wait out work
    still running on their worker threads."""
    from torch_mpmd import _runtime

    seen: set[int] = set()
    for g in groups:
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        try:
            _ABANDONED.add(g)
        except TypeError:  # not weakly referenceable (no group of torch's)
            pass
        try:
            backend = dist.get_backend(g)
        except Exception:  # noqa: BLE001  (destroyed already)
            continue
        try:
            if backend == "gloo":
                _runtime.keep_until_exit(g.group_name)
            else:  # NCCL's abort ends its in-flight work (untested on CPU-only machines)
                g.abort()
        except Exception:  # noqa: BLE001  (best effort: the failure is reported anyway)
            pass
