"""Collectives outside a pipeline call (planning, checkpoints, a meta model's
materialization), each entered once every rank arrived and named when one
does not (NOTE [Named waits]): :class:`Collectives`, :func:`progress`."""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.parallel.bounded import WAIT_GRACE_S, abandon, all_reduce, as_timedelta, broadcast
from torch_mpmd.parallel.failures import UNUSABLE, PipelineError, first_line
from torch_mpmd.parallel.job_store import (LEFT_COUNT, LEFT_KEY, POLL_S, bounded_store,
                                           store_gone, store_host_rank)

__all__ = ["Collectives", "progress"]


# NOTE [Named waits]: collectives outside a pipeline call (planning: the
# profile's broadcasts, the ping-pong, the calibration's barriers; materializing
# a meta model) wait for every rank of a group, and a rank that stalls or died
# before arriving is not named by the collective's own error. Each rank
# therefore records in the job's store, per group and purpose, how many of
# these collectives it arrived at and what it did last, and counts arrivals;
# a rank at a collective polls the count (one store read a poll) and enters
# the collective once every rank arrived, so the collective itself is quick
# and bounded by the timeout. A long local phase (rank 0 measuring while the
# others wait for its sheet) calls :func:`progress`, which counts as activity:
# a rank waits out ``timeout`` with no arrival and no progress anywhere, then
# raises PipelineError naming the ranks that did not arrive, with their last
# record (or that they exited, or that the store's host is gone).
_AT_KEY = "torch_mpmd/at/"
_ACTIVE: list["Collectives"] = []


def progress(what: str) -> None:
    """This rank is busy with ``what`` (a long local phase between named
    waits): the ranks waiting for it wait on (NOTE [Named waits])."""
    for c in _ACTIVE:
        c.note(what)


class Collectives:
    """Bounded collectives over one process group outside a pipeline call,
    each entered once every rank arrived and named when one does not (NOTE
    [Named waits]). ``purpose`` names them in messages ("profiling");
    every rank of ``group`` makes the same calls in the same order."""

    _made: dict[str, int] = {}

    def __init__(self, group: Any, timeout_s: float, purpose: str) -> None:
        self.group, self.timeout_s, self.purpose = group, float(timeout_s), purpose
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.me = dist.get_rank()
        name = f"{purpose}/{group.group_name}"
        gen = Collectives._made[name] = Collectives._made.get(name, 0) + 1
        self.tag = f"{_AT_KEY}{name}/{gen}"
        self.seq = 0                    # collectives arrived at
        self.notes = 0
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    def __enter__(self) -> "Collectives":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)

    def _record(self, what: str) -> None:
        store = bounded_store(self.timeout_s)
        if store is not None:
            try:
                store.set(f"{self.tag}/rank{self.me}", f"{self.seq} {time.time():.3f} {what}")
                store.add(f"{self.tag}/activity", 1)
            except Exception:  # noqa: BLE001  (best effort: the collective still bounds)
                pass

    def note(self, what: str) -> None:
        """:func:`progress` of this rank, at most one store write a second."""
        now = time.monotonic()
        if now - getattr(self, "_noted", 0.0) >= 1.0:
            self._noted = now
            self._record(f"busy: {what}")

    def _fail(self, what: str, reason: str, cause: BaseException | None = None) -> None:
        abandon([self.group])
        named, peer = self.missing()
        raise PipelineError(
            f"rank {self.me}: {self.purpose}: {what} {reason}{'; ' + named if named else ''}"
            f"{UNUSABLE}", rank=self.me, peer=peer) from cause

    def missing(self) -> tuple[str, int]:
        """The ranks that have not arrived at this rank's collective, with
        their last record, and the first of them (-1: none known)."""
        store = bounded_store()
        if store is None:
            return "", -1
        out, first = [], -1
        try:
            for r in self.ranks:
                if r == self.me:
                    continue
                if store.check([f"{LEFT_KEY}{r}"]):
                    out.append(f"rank {r} exited (its process ended)")
                elif not store.check([f"{self.tag}/rank{r}"]):
                    out.append(f"rank {r} never arrived at any of {self.purpose}'s collectives")
                else:
                    seq, when, last = store.get(f"{self.tag}/rank{r}").decode().split(" ", 2)
                    if int(seq) >= self.seq:  # it arrived here (or beyond)
                        continue
                    ago = time.time() - float(when)
                    out.append(f"rank {r} has not arrived (its last record, {ago:.1f} s ago: "
                               f"{last})")
                first = r if first == -1 else first
        except Exception as e:  # noqa: BLE001  (the store's host is gone or stalled)
            host = store_host_rank()
            return store_gone(e), host if host is not None else -1
        return "; ".join(out), first

    def arrive(self, what: str) -> None:
        """Record this rank at its next collective (``what``) and wait until
        every rank of the group arrived: no arrival and no progress anywhere
        for ``timeout_s`` is a PipelineError naming the missing ranks."""
        self.seq += 1
        self._record(what)
        store = bounded_store(self.timeout_s)
        if store is None or len(self.ranks) < 2:
            return
        try:
            count = store.add(f"{self.tag}/arrived/{self.seq}", 1)
            activity = store.add(f"{self.tag}/activity", 0)
            last = time.monotonic()
            while count < len(self.ranks):
                time.sleep(POLL_S)
                count = store.add(f"{self.tag}/arrived/{self.seq}", 0)
                now_activity = store.add(f"{self.tag}/activity", 0)
                if now_activity != activity:
                    activity, last = now_activity, time.monotonic()
                elif time.monotonic() - last > self.timeout_s:
                    self._fail(f"waiting for the other ranks at {what}",
                               f"timed out: no rank arrived or made progress for "
                               f"{self.timeout_s:g} s")
                elif store.add(LEFT_COUNT, 0) > 0 and self.missing()[0].find("exited") >= 0:
                    self._fail(f"waiting for the other ranks at {what}", "failed")
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001  (the store's host is gone)
            self._fail(f"waiting for the other ranks at {what}", "failed", e)

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective of the group within the timeout; a failure
        names the missing ranks (NOTE [Named waits])."""
        try:
            ok = work.wait(timeout=as_timedelta(self.timeout_s + WAIT_GRACE_S))
        except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
            self._fail(what, f"failed within the {self.timeout_s:g} s timeout: "
                       f"{first_line(str(e), 300)}", e)
        else:
            if ok is False:
                self._fail(what, f"timed out after {self.timeout_s:g} s")

    # -------------------------------------------------------- the collectives
    def all_reduce(self, tensor: torch.Tensor, what: str, op: Any = dist.ReduceOp.SUM,
                   *, arrive: bool = True) -> torch.Tensor:
        if arrive:
            self.arrive(what)
        self.wait(all_reduce(tensor, self.group, self.timeout_s, op), what)
        return tensor

    def barrier(self, what: str) -> None:
        self.all_reduce(torch.zeros(1, device=self.device), what)

    def broadcast_json(self, value: Any, what: str) -> Any:
        """``value`` of the group's first rank, as JSON (no pickle), on every rank."""
        self.arrive(what)
        if dist.get_world_size(self.group) < 2:
            return value
        first = self.me == self.ranks[0]
        data = json.dumps(value).encode() if first else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.wait(broadcast(size, 0, self.group, self.timeout_s), f"{what} (its size)")
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if first:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        self.wait(broadcast(buf, 0, self.group, self.timeout_s), what)
        return json.loads(bytes(buf.cpu().tolist()).decode()) if not first else value

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """To global rank ``peer`` (arrive first, once per exchange of messages)."""
        self.wait(dist.isend(tensor, peer, group=self.group), what)

    def recv(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        self.wait(dist.irecv(tensor, peer, group=self.group), what)
