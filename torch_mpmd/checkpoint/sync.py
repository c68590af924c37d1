"""The collectives of a checkpoint's save or load, bounded and naming the rank that stalled or died, and the errors every rank raises.

NOTE [Checkpoint waits]: ``save`` and ``load`` are collective, and a rank
that stalls or dies in one must not leave the others waiting for the
process group's default timeout (30 minutes), nor with a bare gloo error.
So every collective of a save or load goes over a gloo group of the
checkpoint's own (every rank; made once per timeout, after every rank
arrived), whose default timeout is the checkpoint's: DCP's own collectives
(its plans, the gather of what each rank wrote or read) run on it too, and
end within that timeout. The exchanges of saving.py and loading.py go through
:class:`lockstep.Collectives` (NOTE [Named waits]): a rank enters one once
every rank arrived, and a rank that does not arrive, with no progress
anywhere for the timeout, is named. A failure inside DCP's collectives (a
peer that died or stalled while DCP wrote or read) names what the job's
store tells: the ranks that had not arrived, the first recorded death, or
with two ranks the other one. Either way every other rank raises a
CheckpointError saying so, and the group is abandoned (NOTE [Abandoned
groups]): the next save or load makes a new one.

The timeout bounds each wait, so one rank's writing or reading of its data,
which the others wait for in DCP's last collective, must fit in it: give
``save``/``load`` a larger ``timeout=`` for large checkpoints on slow disks.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from torch_mpmd.parallel import lockstep

__all__ = ["CheckpointError", "Sync", "DCPFailed", "timeout_seconds", "distributed", "this_rank",
           "raise_agreed", "dcp_error", "dcp_failed_error", "quiet_dcp", "named"]

_DEFAULT_TIMEOUT_S = 1800.0   # a module without a timeout: the process group's default
_SHOWN = 3                    # keys named per kind in an error's first line


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the first line says why
    (the keys, the file, the rank); every rank raises it."""


CheckpointError.__module__ = "torch_mpmd.checkpoint"   # its public home


def timeout_seconds(module: Any, timeout: float | datetime.timedelta | None) -> float:
    """``timeout`` in seconds; None: the module's (a Pipeline's ``timeout``),
    else the process group's default of 30 minutes."""
    if timeout is None:
        timeout = getattr(module, "timeout", None)
        if not isinstance(timeout, (int, float, datetime.timedelta)) or isinstance(timeout, bool):
            return _DEFAULT_TIMEOUT_S
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or a "
                         f"timedelta")
    return float(seconds)


# The checkpoint's gloo groups, by (default group, timeout): made once.
_GROUPS: dict[tuple[int, float], Any] = {}


def _group(timeout_s: float, what: str) -> Any:
    key = (id(dist.group.WORLD), timeout_s)
    group = _GROUPS.get(key)
    if group is None:
        # Every rank arrives first (named when one does not); the group's own
        # rendezvous is then quick.
        with lockstep.Collectives(dist.group.WORLD, timeout_s, "checkpoint") as waits:
            try:
                waits.arrive(f"{what}: making the checkpoint's process group")
            except lockstep.PipelineError as e:
                raise CheckpointError(f"{what}: {e}") from e
        world = dist.get_world_size()
        group = dist.new_group(list(range(world)), backend="gloo",
                               timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        _GROUPS[key] = group
    return group


class Sync:
    """The collectives of one save or load (``what`` names it in errors):
    bounded by ``timeout_s`` and named (NOTE [Checkpoint waits]). Without a
    process group (or with one rank) every collective is local."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s, self.what = timeout_s, what
        self.distributed = (dist.is_available() and dist.is_initialized()
                            and dist.get_world_size() > 1)
        self.group: Any = None
        self.waits: lockstep.Collectives | None = None

    def __enter__(self) -> "Sync":
        if self.distributed:
            self.group = _group(self.timeout_s, self.what)
            self.waits = lockstep.Collectives(self.group, self.timeout_s, "checkpoint")
            self.waits.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.waits is not None:
            self.waits.__exit__(*exc)

    def _failed(self, e: lockstep.PipelineError) -> CheckpointError:
        self._abandon()
        return CheckpointError(f"{self.what}: {e}")

    def _abandon(self) -> None:
        lockstep.abandon([self.group])
        for key, group in list(_GROUPS.items()):
            if group is self.group:
                del _GROUPS[key]

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order."""
        if not self.distributed:
            return [json.loads(json.dumps(value))]
        assert self.waits is not None
        data = json.dumps(value).encode()
        n = len(self.waits.ranks)
        try:
            self.waits.arrive(what)
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
            self.waits.wait(lockstep.all_gather(sizes, size, self.group, self.timeout_s),
                            f"{what} (sizes)")
            longest = max(int(s) for s in sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            outs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
            self.waits.wait(lockstep.all_gather(outs, mine, self.group, self.timeout_s), what)
        except lockstep.PipelineError as e:
            raise self._failed(e) from e
        return [json.loads(o[:int(s)].numpy().tobytes().decode()) for o, s in zip(outs, sizes)]

    def barrier(self, what: str) -> None:
        if self.distributed:
            assert self.waits is not None
            try:
                self.waits.barrier(what)
            except lockstep.PipelineError as e:
                raise self._failed(e) from e

    def run_dcp(self, fn: Callable[[Any], Any], what: str) -> Any:
        """``fn(process_group)`` (None without one), every rank arrived first:
        a call of DCP, whose collectives run on the checkpoint's group. A
        failed collective of DCP's raises :class:`DCPFailed` (its ``blame``
        names the rank, as far as known); DCP's own CheckpointException (a
        rank's failure, gathered by DCP) passes."""
        if not self.distributed:
            return fn(None)
        assert self.waits is not None
        try:
            self.waits.arrive(what)
        except lockstep.PipelineError as e:
            raise self._failed(e) from e
        try:
            return fn(self.group)
        except CheckpointException:
            raise
        except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
            blame = self.blame(str(e))
            self._abandon()
            raise DCPFailed(blame) from e

    def blame(self, reason: str) -> str:
        """Who made a collective fail, from what the job's store tells (NOTE
        [Checkpoint waits])."""
        assert self.waits is not None
        named, _ = self.waits.missing()
        if named:
            return named
        told = lockstep.first_death(self.waits.ranks)
        if told:
            return told
        others = [r for r in self.waits.ranks if r != self.waits.me]
        if len(others) == 1:
            if lockstep.peer_gone(reason):
                lockstep.record_dead(others[0], self.waits.me)
                return f"rank {others[0]} closed its connection (its process died)"
            return (f"rank {others[0]} did not answer within the {self.timeout_s:g} s timeout "
                    f"(it stalled or died)")
        return f"one of ranks {others} stalled or died (the job's store does not say which)"


class DCPFailed(RuntimeError):
    """A collective of DCP's failed; ``args[0]`` says who made it fail."""


# ----------------------------------------------------- ranks and errors

def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def this_rank() -> int:
    return dist.get_rank() if distributed() else 0


def raise_agreed(problems: list[str | None], what: str) -> None:
    """Raise on every rank when any rank reported a problem (``problems`` as
    gathered by ``Sync.gather``): the first line is the first failing rank's."""
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if not failed:
        return
    rank, first = failed[0]
    head, _, rest = first.partition("\n")
    where = f" (rank {rank})" if len(problems) > 1 else ""
    lines = [f"{what}: {head}{where}"] + ([rest] if rest else [])
    lines += [f"rank {r}: {p}" for r, p in failed[1:]]
    raise CheckpointError("\n".join(lines))


def dcp_error(what: str, target: str, exc: CheckpointException) -> CheckpointError:
    """DCP's CheckpointException puts the cause at the end of a traceback:
    lead with it instead."""
    failures = sorted(exc.failures.items())
    rank, (cause, _) = failures[0]
    head, _, rest = str(cause).partition("\n")
    others = [r for r, _ in failures[1:]]
    more = f" (and on ranks {others})" if others else ""
    return CheckpointError(f"{what} {target} failed on rank {rank}{more}: "
                           f"{type(cause).__name__}: {head}" + (f"\n{rest}" if rest else ""))


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_failed_error(e: "DCPFailed", doing: str, rank: int, after: str) -> CheckpointError:
    """The CheckpointError of a collective of DCP's that failed (``e``, from
    :meth:`Sync.run_dcp`): ``doing`` (e.g. "saving step_3") failed on
    ``rank``, who made it fail, then ``after`` (what state that leaves)."""
    cause = e.__cause__
    head = str(cause).strip().partition("\n")[0]
    return CheckpointError(f"{doing} failed on rank {rank}: {type(cause).__name__}: {head}; "
                           f"{e.args[0]} ({after})")


def named(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")

