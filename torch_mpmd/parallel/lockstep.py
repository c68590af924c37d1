"""Ranks in lockstep: the library's collective calls checked, bounded, told of failures.

NOTE [Lockstep]: the ranks of a pipeline (every pipeline rank of every
data-parallel replica) must make the same library calls in the same order:
the executors' transfers and the library's collectives pair by order alone.
Each call that communicates therefore begins with an *exchange*: every rank
all_gathers a small record (:data:`FIELDS`): a sequence number counting the
exchanges so far, the call's kind (start-up handshake, program build, step,
forward, eval, the compile door's backward), whether it begins or ends the
call, the pipeline's step counter, a digest of the capture it runs, and
whether this rank has failed. A call runs the executor between a begin and an
end exchange (RankRuntime.run). So:

- ranks out of step (a different call, step or capture) get a PipelineError
  naming what each rank is doing, before any transfer pairs wrongly;
- a rank whose own code fails before the begin exchange (a bad argument only
  it sees, a capture or build that raises) sends its failure in place of the
  exchange its peers wait in (:func:`pipeline_call`); one that fails inside
  the executor finishes the step's transfers with stand-ins (NOTE [Draining a
  failed step] in csrc/runtime/executor.h) and sends its failure in the end
  exchange. Either way every rank raises at once: the failing rank its own
  exception, the others a PipelineError naming the failing rank and the first
  line of its exception. The ranks stay in step: the next call can run;
- a failure that may leave a peer inside some other collective (a transfer
  or collective that failed or timed out, a failure after the end exchange)
  marks the pipeline's groups unusable (:attr:`Ledger.broken`): later calls
  raise at once, saying so and what to do, instead of pairing with the wrong
  call of a peer.

The exchanges run on a gloo group of their own over all the pipeline's ranks
(created at the first exchange, shared by the ledgers of every pipeline group
over the same ranks, replaced after a failure on it): they never pair with a
collective of the user's or of the step (a broadcast on the pipeline group),
and on NCCL jobs they stay on the CPU. A failed rank's message travels in a
second all_gather, made only when some record says a rank failed. A ledger
(the sequence, the call's phase, whether the groups broke) belongs to one
pipeline group (and dp group): a new group starts afresh.

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
import functools
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PipelineError", "Ledger", "ledger_for", "pipeline_call", "describe_failure",
           "peer_gone", "record_dead", "first_death", "announce_exit",
           "all_gather", "all_reduce", "broadcast", "wait", "abandon", "KINDS",
           "Collectives", "progress", "store_gone"]


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank: a peer died or timed out, a transfer
    failed, or a stage raised. ``rank``, ``action`` (text form, e.g.
    ``"1RECV_F3"``) and ``peer`` (-1 when none) say where; the message also
    lists this rank's program with the failing step marked. When another
    rank's own code failed, ``peer`` is that rank (global rank) and the message
    names it with the first line of its exception."""

    def __init__(self, message: str, rank: int = -1, action: str = "", peer: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.peer = peer


# ---------------------------------------------------------------- bounded collectives

def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Any,
               timeout_s: float) -> Any:
    """``dist.all_gather`` (async) whose work ends within ``timeout_s`` on its
    own (NOTE [Bounded collectives]). ``group`` is a ProcessGroup."""
    opts = torch._C._distributed_c10d.AllgatherOptions()
    opts.timeout = _timedelta(timeout_s)
    return group.allgather([outputs], [tensor], opts)


def all_reduce(tensor: torch.Tensor, group: Any, timeout_s: float,
               op: Any = dist.ReduceOp.SUM) -> Any:
    """``dist.all_reduce`` (async), bounded as :func:`all_gather`."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = _timedelta(timeout_s)
    return group.allreduce([tensor], opts)


def broadcast(tensor: torch.Tensor, root: int, group: Any, timeout_s: float) -> Any:
    """``dist.broadcast`` (async) from ``root``, a rank *of the group*, bounded
    as :func:`all_gather`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = _timedelta(timeout_s)
    return group.broadcast([tensor], opts)


# The wait allows this much beyond a bounded collective's own timeout, so that
# the collective's own error (which names what it waited for) comes first and
# its work has ended when the wait raises.
_WAIT_GRACE_S = 1.0


def wait(work: Any, what: str, timeout_s: float, *, rank: int,
         on_failure: Callable[[str], None] | None = None,
         explain: Callable[[], str | None] | None = None) -> None:
    """Wait for ``work`` at most ``timeout_s`` (+ a grace second); a failure or
    timeout calls ``on_failure(reason)`` (which marks the groups unusable) and
    raises PipelineError naming ``what``, and what ``explain()`` then says
    (e.g. which rank died first)."""
    cause: Exception | None = None
    try:
        ok = work.wait(timeout=_timedelta(timeout_s + _WAIT_GRACE_S))
        reason = None if ok is not False else f"timed out after {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
        cause = e
        reason = f"failed within the {timeout_s:g} s timeout: {_first_line(str(e), 500)}"
    if reason is None:
        return
    if on_failure is not None:
        on_failure(f"{what} {reason}")
    told = explain() if explain is not None else None
    raise PipelineError(f"rank {rank}: {what} {reason} (a peer that stalled or died, or "
                        f"that is in another call){'; ' + told if told else ''}{_UNUSABLE}",
                        rank=rank) from cause


_UNUSABLE = ("; the pipeline's process groups cannot be used after this: restart the job "
             "(e.g. torchrun --max-restarts=N restarts every rank; resume from the last "
             "checkpoint)")


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


# ---------------------------------------------------------------- who died first

# NOTE [Who died first]: with more than two pipeline ranks, a dead rank's
# neighbours see its connections close, but ranks further along only see their
# own neighbour stop (a timeout, or its connection closing as it exits in
# turn) and would blame it. A rank that finds a peer's connection closed
# records that peer in the job's store (the rendezvous store every rank
# shares) with the time; a rank whose wait fails reads the records of the
# pipeline's ranks and names the earliest. A store that cannot be reached
# tells something too: init_process_group's TCPStore lives in rank 0's
# process (unless torchrun's agent keeps it), so rank 0's process is gone,
# and the message names rank 0 (store_gone), though it cannot say whether
# rank 0 died first or exited after another rank's death; one that does not
# answer (its host stopped) names rank 0 as possibly stalled. Store calls
# here are bounded (_Bounded): a stopped host never answers.
_DEAD_KEY = "torch_mpmd/dead/"
_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
              "connection closed")


def peer_gone(reason: str) -> bool:
    """Whether a transfer's failure says the peer's process is gone (its
    connection closed), not that it was slow."""
    text = reason.lower()
    return any(s in text for s in _PEER_GONE)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (no default group: nothing to share)
        return None


class StoreSilent(TimeoutError):
    """The job's store did not answer within the bound (its host is stalled)."""


_STORE_LIMIT_S = 5.0           # a diagnostic read's bound


class _Bounded:
    """The job's store, each call bounded by ``limit_s``: a store whose host
    process is stopped (SIGSTOP) never answers, and the store's own timeout
    does not bound a read from it; the call then raises StoreSilent. It runs
    on a daemon thread of its own, which stays blocked (a pool's thread
    would be joined at exit, which then would wait for the store too)."""

    def __init__(self, store: Any, limit_s: float) -> None:
        self._store, self._limit = store, limit_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            box: list[Any] = []

            def run() -> None:
                try:
                    box.append((True, method(*args)))
                except BaseException as e:  # noqa: BLE001  (raised in the caller)
                    box.append((False, e))

            thread = threading.Thread(target=run, name="mpmd-store", daemon=True)
            thread.start()
            thread.join(self._limit)
            if not box:
                raise StoreSilent(f"the job's store did not answer within {self._limit:g} s")
            ok, value = box[0]
            if not ok:
                raise value
            return value

        return call


def _bounded_store(limit_s: float = _STORE_LIMIT_S) -> Any:
    store = _store()
    return None if store is None else _Bounded(store, limit_s)


def record_dead(peer: int, found_by: int) -> None:
    """Record global rank ``peer`` as dead, found by global rank ``found_by``
    (NOTE [Who died first]); the first record of a peer stays."""
    store = _bounded_store()
    if store is None:
        return
    try:
        key = f"{_DEAD_KEY}{peer}"
        if not store.check([key]):
            store.set(key, f"{time.time():.6f} {found_by}")
    except Exception:  # noqa: BLE001  (best effort)
        pass


def first_death(ranks: Iterable[int]) -> str | None:
    """The earliest recorded death among global ``ranks``, as a sentence
    ("rank 1 died first: rank 2 found its connection closed at 12:00:01.250"),
    or None when none is recorded."""
    store = _bounded_store()
    if store is None:
        return None
    found: list[tuple[float, int, int]] = []
    try:
        for r in ranks:
            key = f"{_DEAD_KEY}{r}"
            if store.check([key]):
                when, by = store.get(key).decode().split()
                found.append((float(when), r, int(by)))
    except Exception as e:  # noqa: BLE001  (the store is gone: so is its host, if a rank)
        return store_gone(e)
    if not found:
        return None
    when, dead, by = min(found)
    stamp = time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"
    return f"rank {dead} died first: rank {by} found its connection closed at {stamp}"


# ---------------------------------------------------------------- who is missing

def _store_host_rank() -> int | None:
    """The global rank whose process hosts the job's store: 0 for the TCPStore
    that init_process_group makes (env:// and tcp://), None when a torchrun
    agent hosts it (TORCHELASTIC_USE_AGENT_STORE) or it is no TCPStore."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    store = _store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return 0 if isinstance(store, dist.TCPStore) else None


def store_gone(error: BaseException) -> str:
    """What an unreachable store says about the job: NOTE [Who died first]."""
    host = _store_host_rank()
    if isinstance(error, StoreSilent):
        return (f"{error}" + (f" (it lives in rank {host}'s process: rank {host} may be "
                              "stalled)" if host is not None else ""))
    if host is None:
        return f"the job's store cannot be reached ({_first_line(str(error), 200)})"
    return (f"rank {host} is gone: the job's store, which lives in rank {host}'s process, "
            f"cannot be reached ({_first_line(str(error), 200)}; rank {host} died, or exited "
            "after a failure of its own: a store outside the ranks, as torchrun's agent keeps "
            "it, also records which rank died first)")


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
        store = _bounded_store(self.timeout_s)
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
            f"{_UNUSABLE}", rank=self.me, peer=peer) from cause

    def missing(self) -> tuple[str, int]:
        """The ranks that have not arrived at this rank's collective, with
        their last record, and the first of them (-1: none known)."""
        store = _bounded_store()
        if store is None:
            return "", -1
        out, first = [], -1
        try:
            for r in self.ranks:
                if r == self.me:
                    continue
                if store.check([f"{_LEFT_KEY}{r}"]):
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
            host = _store_host_rank()
            return store_gone(e), host if host is not None else -1
        return "; ".join(out), first

    def arrive(self, what: str) -> None:
        """Record this rank at its next collective (``what``) and wait until
        every rank of the group arrived: no arrival and no progress anywhere
        for ``timeout_s`` is a PipelineError naming the missing ranks."""
        self.seq += 1
        self._record(what)
        store = _bounded_store(self.timeout_s)
        if store is None or len(self.ranks) < 2:
            return
        try:
            count = store.add(f"{self.tag}/arrived/{self.seq}", 1)
            activity = store.add(f"{self.tag}/activity", 0)
            last = time.monotonic()
            while count < len(self.ranks):
                time.sleep(_POLL_S)
                count = store.add(f"{self.tag}/arrived/{self.seq}", 0)
                now_activity = store.add(f"{self.tag}/activity", 0)
                if now_activity != activity:
                    activity, last = now_activity, time.monotonic()
                elif time.monotonic() - last > self.timeout_s:
                    self._fail(f"waiting for the other ranks at {what}",
                               f"timed out: no rank arrived or made progress for "
                               f"{self.timeout_s:g} s")
                elif store.add(_LEFT_COUNT, 0) > 0 and self.missing()[0].find("exited") >= 0:
                    self._fail(f"waiting for the other ranks at {what}", "failed")
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001  (the store's host is gone)
            self._fail(f"waiting for the other ranks at {what}", "failed", e)

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective of the group within the timeout; a failure
        names the missing ranks (NOTE [Named waits])."""
        try:
            ok = work.wait(timeout=_timedelta(self.timeout_s + _WAIT_GRACE_S))
        except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
            self._fail(what, f"failed within the {self.timeout_s:g} s timeout: "
                       f"{_first_line(str(e), 300)}", e)
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


# ---------------------------------------------------------------- records

KINDS = {"handshake": 1, "build": 2, "step": 3, "forward": 4, "eval": 5, "backward": 6}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_BEGIN, _END = 0, 1
_MAGIC = 0x6D706D646C6B7370  # "mpmdlksp": a record, not some other collective's data
FIELDS = ("magic", "seq", "kind", "phase", "step", "digest", "failed", "p0", "p1", "p2")
_MESSAGE_BYTES = 512
_F = {name: i for i, name in enumerate(FIELDS)}


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def describe_failure(exc: BaseException) -> str:
    """The first line of what a rank sends about its failure: the exception's
    type and first line (a stage's own exception for a PipelineError that
    wraps one, with the action it ran)."""
    cause = exc.__cause__ if isinstance(exc, PipelineError) and exc.__cause__ else exc
    text = f"{type(cause).__name__}: {_first_line(str(cause))}"
    action = getattr(exc, "action", "")
    return f"{text} (in action {action})" if action and cause is not exc else text


@dataclass
class Outcome:
    """What one exchange found: every rank's record (by position in
    Ledger.ranks), the failures reported (global rank -> first line), and a
    description of how the ranks disagree (None when they agree)."""

    rows: list[list[int]]
    failures: dict[int, str] = field(default_factory=dict)
    mismatch: str | None = None


def _call_name(kind: int, phase: int, step: int) -> str:
    name = _KIND_NAMES.get(kind, f"kind {kind}")
    where = {"step": f"step {step}", "forward": f"a forward call (after step {step})",
             "eval": f"eval_step (after step {step})",
             "backward": f"a backward call (after step {step})",
             "handshake": "the start-up comparison of plans",
             "build": "waiting for the stage programs' builds"}.get(name, name)
    if name in ("step", "forward", "eval", "backward"):
        where = ("the end of " if phase == _END else "the start of ") + where
    return where


# ---------------------------------------------------------------- the ledger

_IDLE, _PREP, _RUNNING, _AFTER = "idle", "prep", "running", "after"


class Ledger:
    """Exchange state shared by every pipeline over one pipeline group (and dp
    group), in this process: the sequence number, the phase of the current
    call, and why the groups are unusable, if they are (NOTE [Lockstep]).
    ``ranks``: every rank of the pipeline (all replicas), global ranks."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self.me = dist.get_rank()
        self.group: Any = None          # the exchanges' group (gloo), got at the first exchange
        self.seq = 0
        self.broken: str | None = None
        self.phase = _IDLE
        self.call_kind = ""
        self._depth = 0
        self._groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._world = _default_group()

    # -------------------------------------------------------- naming
    def name(self, rank: int) -> str:
        """How messages name a global rank."""
        return f"rank {rank}" if self.ranks == tuple(range(len(self.ranks))) else (
            f"global rank {rank}")

    # -------------------------------------------------------- groups
    def _exchanges_group(self, timeout_s: float) -> Any:
        if self.group is None:
            self.group = _exchange_group(self.ranks, timeout_s)
        return self.group

    def uses(self, groups: Iterable[Any]) -> None:
        """Groups to abandon with the exchanges' group when the pipeline breaks."""
        for g in groups:
            if g is not None:
                self._groups.add(g)

    def break_(self, reason: str) -> None:
        """Mark the groups unusable (the first reason is kept) and abandon them;
        the exchanges' group too (a later ledger over these ranks makes another)."""
        if self.broken is None:
            self.broken = reason
        if self.group is not None and _EXCHANGE_GROUPS.get(self.ranks) is self.group:
            del _EXCHANGE_GROUPS[self.ranks]
        abandon([self.group, *self._groups])

    def check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise PipelineError(f"{self.name(self.me)}: cannot run {what}: an earlier call "
                                f"failed ({_first_line(self.broken, 600)}){_UNUSABLE}",
                                rank=self.me)

    # -------------------------------------------------------- exchanges
    def exchange(self, kind: str, *, timeout_s: float, phase: int = _BEGIN, step: int = -1,
                 digest: int = 0, payload: Sequence[int] = (0, 0, 0),
                 failure: str | None = None) -> Outcome:
        """One exchange (NOTE [Lockstep]): every rank's record, the failures
        they report and whether they agree. Raises PipelineError (and marks the
        groups unusable) only when the exchange itself fails or times out."""
        where = _call_name(KINDS[kind], phase, step)
        what = f"waiting for the other ranks at {where} (exchange #{self.seq}, all_gather)"
        try:
            group = self._exchanges_group(timeout_s)
        except Exception as e:  # noqa: BLE001
            reason = (f"{_first_line(str(e))}; found waiting for them at {where}"
                      if isinstance(e, RanksLeft) else
                      f"the other ranks did not arrive at {where} within {timeout_s:g} s "
                      f"(creating the group of the ranks' exchanges: {_first_line(str(e))})")
            self.break_(reason)
            raise PipelineError(f"{self.name(self.me)}: {reason} (a peer that stalled or died, "
                                f"or that is in another call){_UNUSABLE}", rank=self.me) from e
        record = torch.tensor([_MAGIC, self.seq, KINDS[kind], phase, step, digest,
                               self.me if failure is not None else -1, *payload],
                              dtype=torch.int64)
        rows = torch.zeros(len(self.ranks), len(FIELDS), dtype=torch.int64)
        wait(all_gather(list(rows.unbind(0)), record, group, timeout_s), what, timeout_s,
             rank=self.me, on_failure=self.break_,
             explain=lambda: first_death(r for r in self.ranks if r != self.me))
        self.seq += 1
        table = rows.tolist()
        outcome = Outcome(table)
        if any(row[_F["failed"]] != -1 for row in table):
            outcome.failures = self._messages(table, failure, group, timeout_s)
        outcome.mismatch = self._disagreement(table)
        return outcome

    def _messages(self, table: list[list[int]], failure: str | None, group: Any,
                  timeout_s: float) -> dict[int, str]:
        """Second round: the failed ranks' first lines."""
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if failure is not None:
            data = failure.encode("utf-8", "replace")[:_MESSAGE_BYTES]
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.zeros(len(self.ranks), _MESSAGE_BYTES, dtype=torch.uint8)
        wait(all_gather(list(everyone.unbind(0)), mine, group, timeout_s),
             "the exchange of failure messages (all_gather)", timeout_s, rank=self.me,
             on_failure=self.break_)
        out = {}
        for i, row in enumerate(table):
            if row[_F["failed"]] != -1:
                raw = bytes(everyone[i].tolist()).rstrip(b"\0")
                out[self.ranks[i]] = raw.decode("utf-8", "replace") or "(no message)"
        return out

    def _disagreement(self, table: list[list[int]]) -> str | None:
        def state(row: list[int]) -> tuple:
            return (row[_F["magic"]], row[_F["seq"]], row[_F["kind"]], row[_F["phase"]],
                    row[_F["step"]])

        def describe(i: int, row: list[int]) -> str:
            if row[_F["magic"]] != _MAGIC:
                return f"{self.name(self.ranks[i])}: not an exchange (another collective)"
            return (f"{self.name(self.ranks[i])}: {_call_name(row[2], row[3], row[4])} "
                    f"(exchange #{row[1]})")

        if len({state(r) for r in table}) > 1:
            listing = "; ".join(describe(i, r) for i, r in enumerate(table))
            return f"the ranks are not in the same call: {listing}"
        digests = {r[_F["digest"]] for r in table if r[_F["digest"]] != 0}
        if len(digests) > 1:
            listing = ", ".join(f"{self.name(self.ranks[i])}: {r[_F['digest']] & (2**64 - 1):016x}"
                                for i, r in enumerate(table))
            return ("the ranks run different captures of the model (their inputs' shapes, "
                    "train/eval modes or frozen parameters differ: freeze and unfreeze on "
                    f"every rank alike; capture digests {listing})")
        return None

    # -------------------------------------------------------- a call's exchanges
    def begin(self, kind: str, *, timeout_s: float, step: int, digest: int,
              microbatches: tuple[int, int, int] = (0, 0, 0),
              pipelines: Sequence[Sequence[int]] = (),
              values: tuple[Sequence[str], Sequence[int]] = ((), ())) -> None:
        """The begin exchange of a call that runs the executor: raises
        PipelineError when a rank failed before it or the ranks disagree.
        ``microbatches``: (count, digest of their sizes and value labels,
        digest of their contents) of this rank's call, which must be the same
        on every rank of each of ``pipelines`` (global ranks; data-parallel
        replicas may be given different microbatches). ``values``: each
        microbatch value's label and digest (NOTE [Microbatch contents] in
        runtime/rank.py), exchanged only when the contents differ, to name
        the first value that does."""
        self.check_usable(kind)
        outcome = self.exchange(kind, timeout_s=timeout_s, step=step, digest=digest,
                                payload=microbatches)
        self.phase = _RUNNING
        self.raise_for(outcome, kind, ended=False)
        differ = self._microbatch_disagreement(outcome.rows, pipelines)
        if differ is None and self._contents_differ(outcome.rows, pipelines):
            differ = self._first_different_value(outcome.rows, pipelines, values, timeout_s)
        if differ is not None:  # found before any transfer: every rank raises, still in step
            err = PipelineError(f"{self.name(self.me)}: {kind} not run: {differ}; the ranks "
                                "are still in step and the pipeline can be called again.",
                                rank=self.me)
            err._mpmd_settled = True
            raise err

    def _pipeline_rows(self, table: list[list[int]], pipelines: Sequence[Sequence[int]]
                       ) -> list[dict[int, list[int]]]:
        return [{r: table[self.ranks.index(r)] for r in ranks if r in self.ranks}
                for ranks in pipelines]

    def _microbatch_disagreement(self, table: list[list[int]],
                                 pipelines: Sequence[Sequence[int]]) -> str | None:
        p0 = _F["p0"]
        for rows in self._pipeline_rows(table, pipelines):
            if len({(row[p0], row[p0 + 1]) for row in rows.values()}) > 1:
                listing = ", ".join(f"{self.name(r)}: {row[p0]} microbatch(es), sizes "
                                    f"{row[p0 + 1] & (2**64 - 1):016x}"
                                    for r, row in rows.items())
                return ("the ranks of one pipeline were given different microbatches (every "
                        "rank of a pipeline must be given the same microbatch list, or the "
                        f"same batch: {listing})")
        return None

    def _contents_differ(self, table: list[list[int]],
                         pipelines: Sequence[Sequence[int]]) -> bool:
        p2 = _F["p2"]
        return any(len({row[p2] for row in rows.values()}) > 1
                   for rows in self._pipeline_rows(table, pipelines))

    def _first_different_value(self, table: list[list[int]], pipelines: Sequence[Sequence[int]],
                               values: tuple[Sequence[str], Sequence[int]],
                               timeout_s: float) -> str:
        """Every rank saw some pipeline's contents differ (the same table):
        all exchange their values' digests (their count first, then the
        digests padded to the largest) and name the first value that differs
        (count, sizes and labels agree within the pipeline, so positions
        match)."""
        labels, digests = values
        group = self._exchanges_group(timeout_s)
        n = len(self.ranks)
        counts = torch.zeros(n, 1, dtype=torch.int64)
        wait(all_gather(list(counts.unbind(0)), torch.tensor([len(digests)]), group, timeout_s),
             "the exchange of microbatch digest counts (all_gather)", timeout_s, rank=self.me,
             on_failure=self.break_)
        width = max(1, int(counts.max()))
        mine = torch.zeros(width, dtype=torch.int64)
        mine[:len(digests)] = torch.tensor(list(digests), dtype=torch.int64)
        everyone = torch.zeros(n, width, dtype=torch.int64)
        wait(all_gather(list(everyone.unbind(0)), mine, group, timeout_s),
             "the exchange of microbatch digests (all_gather)", timeout_s, rank=self.me,
             on_failure=self.break_)
        p2 = _F["p2"]
        for rows in self._pipeline_rows(table, pipelines):
            if len({row[p2] for row in rows.values()}) < 2:
                continue
            ranks = list(rows)
            columns = everyone[[self.ranks.index(r) for r in ranks]]
            differs = (columns != columns[:1]).any(0).nonzero().flatten().tolist()
            # The labels are this rank's; a rank of another pipeline reports
            # the position (its own labels may differ from that pipeline's).
            mine_here = self.me in ranks
            k = differs[0] if differs else 0
            what = (labels[k] if mine_here and k < len(labels) else f"value #{k}")
            return (f"the ranks of one pipeline were given different microbatch contents: "
                    f"{what} differs between {', '.join(self.name(r) for r in ranks)} "
                    f"(digests {', '.join(f'{int(c[k]) & (2**64 - 1):016x}' for c in columns)}"
                    f"; {len(differs)} of {int(counts[self.ranks.index(ranks[0])])} values "
                    "differ). Every rank of a pipeline must be given the same batch, or the "
                    "same microbatch list, contents included: a step would run one rank's "
                    "inputs with another's targets")
        return "the ranks of one pipeline were given different microbatch contents"

    def end(self, kind: str, *, timeout_s: float, step: int, digest: int,
            failure: str | None = None, payload: Sequence[int] = (0, 0, 0)) -> Outcome:
        """The end exchange (``payload``: three int64 of this rank's, e.g. the
        loss, read back from the outcome's rows). A rank that failed
        (``failure``, its first line) gets the outcome back, the other ranks'
        failures in it; the others raise PipelineError when any rank failed."""
        outcome = self.exchange(kind, timeout_s=timeout_s, phase=_END, step=step, digest=digest,
                                payload=payload, failure=failure)
        self.phase = _AFTER
        if failure is None:
            self.raise_for(outcome, kind, ended=True)
        return outcome

    def raise_for(self, outcome: Outcome, kind: str, *, ended: bool) -> None:
        """PipelineError for the failures or the disagreement an exchange found
        (every rank raises at the same exchange: the ranks stay in step)."""
        others = {r: m for r, m in outcome.failures.items() if r != self.me}
        if self.phase != _IDLE and self.call_kind:
            kind = self.call_kind  # the user's call (an exchange inside it may be the handshake)
        if others:
            first = min(others)
            listing = "; ".join(f"{self.name(r)} failed: {m}" for r, m in sorted(others.items()))
            consequence = (
                "This rank ended the step on stand-in values from that rank: its gradients "
                "of this step are wrong (call zero_grad() before the next step)" if ended
                and kind == "step" else
                "This rank's call ended early" if ended else "Nothing ran on this rank")
            err = PipelineError(
                f"{self.name(self.me)}: {kind} abandoned because {listing}\n{consequence}; "
                "the ranks are still in step and the pipeline can be called again.",
                rank=self.me, peer=first)
            err._mpmd_settled = True  # every rank raises here
            raise err
        if outcome.mismatch is not None:
            self.break_(outcome.mismatch)
            err = PipelineError(
                f"{self.name(self.me)}: {outcome.mismatch}. Every rank must make the same "
                f"pipeline calls (step, forward, eval_step) in the same order with inputs of "
                f"the same shapes{_UNUSABLE}", rank=self.me)
            err._mpmd_settled = True
            raise err

    # -------------------------------------------------------- calls (pipeline_call)
    def begin_call(self, kind: str) -> bool:
        """Enter a pipeline call; False for a call made inside another (it
        shares the outer call's phase)."""
        self._depth += 1
        if self._depth > 1:
            return False
        self.phase = _PREP
        self.call_kind = kind
        return True

    def end_call(self, outer: bool) -> None:
        self._depth -= 1
        if outer:
            self.phase = _IDLE

    def call_failed(self, exc: BaseException, timeout_s: float) -> None:
        """This rank's call raised ``exc``. Before the call's begin exchange its
        peers wait in an exchange: they are sent the failure (NOTE
        [Lockstep]); later, a peer may wait in another collective, so the
        groups are marked unusable. Exceptions every rank raised together are
        left alone."""
        if getattr(exc, "_mpmd_settled", False) or self.broken is not None:
            return
        if self.phase != _PREP:
            self.break_(f"{self.name(self.me)} failed during {self.call_kind} after its "
                        f"transfers began: {describe_failure(exc)}")
            return
        try:
            outcome = self.exchange(self.call_kind, timeout_s=timeout_s,
                                    failure=describe_failure(exc))
        except PipelineError as e:  # the peers did not come: they are told by their timeout
            _note(exc, f"torch_mpmd: telling the other ranks of this failure failed: {e}")
            return
        others = {r: m for r, m in outcome.failures.items() if r != self.me}
        told = "the other ranks were told of this failure and raise PipelineError"
        if others:
            told += "; " + "; ".join(f"{self.name(r)} failed too: {m}"
                                     for r, m in sorted(others.items()))
        _note(exc, f"torch_mpmd: {told}")
        exc._mpmd_settled = True


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


# Ledgers by (pipeline group, dp group) name; the exchanges' groups by ranks.
_LEDGERS: dict[tuple[str, str], Ledger] = {}
_EXCHANGE_GROUPS: dict[tuple[int, ...], Any] = {}


def _exchange_group(ranks: tuple[int, ...], timeout_s: float) -> Any:
    """The gloo group of the exchanges over ``ranks`` (NOTE [Lockstep]): made
    once (collective over ``ranks`` only; its rendezvous bounded by the
    timeout), again after a failure on it or a new default group. A rank that
    left the job before arriving fails it at once (NOTE [Ranks that left])."""
    group = _EXCHANGE_GROUPS.get(ranks)
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        _await_arrivals(ranks, timeout_s)
        group = dist.new_group(list(ranks), timeout=_timedelta(timeout_s), backend="gloo",
                               use_local_synchronization=True)
        _EXCHANGE_GROUPS[ranks] = group
    return group


# NOTE [Ranks that left]: a rank whose process exits before it joins the
# pipeline (its script ended, or raised, before its first step) would leave
# the others waiting out the timeout in the first exchange. Every process
# that imported torch_mpmd records at exit, in the job's store, that it left
# (torch_mpmd/__init__.py; while its default group still exists). Before the
# exchanges' group is made, each rank records its arrival and polls the
# store until all ranks arrived (then the group's own rendezvous is quick),
# one of them is recorded as gone (an error at once, naming it), or the
# timeout passes. The keys carry a count of the groups made over these
# ranks, so a later group (after a failure) waits for fresh arrivals.
_LEFT_KEY = "torch_mpmd/left/"
_ARRIVALS: dict[tuple[int, ...], int] = {}
_POLL_S = 0.02


class RanksLeft(RuntimeError):
    """Ranks of the pipeline exited before joining it (NOTE [Ranks that left])."""


_LEFT_COUNT = "torch_mpmd/left_count"


def announce_exit() -> None:
    """Record in the job's store that this rank's process is exiting
    (NOTE [Ranks that left]); best effort, silent."""
    try:
        if dist.is_initialized():
            store = _store()
            store.set(f"{_LEFT_KEY}{dist.get_rank()}", f"{time.time():.6f}")
            store.add(_LEFT_COUNT, 1)
    except Exception:  # noqa: BLE001  (the store may be gone already)
        pass


def _await_arrivals(ranks: tuple[int, ...], timeout_s: float) -> None:
    # Two store round trips a poll whatever the number of ranks: a counter of
    # arrivals, and the job's count of departures (which ranks left is read
    # only once that count says some did). Each store call is bounded: a
    # stopped store host would never answer.
    store = _bounded_store(timeout_s)
    if store is None or len(ranks) < 2:
        return
    gen = _ARRIVALS[ranks] = _ARRIVALS.get(ranks, 0) + 1
    tag = hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]
    arrived = f"torch_mpmd/arrived/{tag}/{gen}"
    try:
        count = store.add(arrived, 1)
    except Exception:  # noqa: BLE001  (no store to poll: the group's rendezvous decides)
        return
    me = dist.get_rank()
    deadline = time.monotonic() + timeout_s
    while count < len(ranks) and time.monotonic() < deadline:
        gone = []
        if store.add(_LEFT_COUNT, 0) > 0:
            gone = [r for r in ranks if r != me and store.check([f"{_LEFT_KEY}{r}"])]
        if gone:
            raise RanksLeft(
                f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} left the job "
                "(the process exited) before joining the pipeline: every rank must make the "
                "same pipeline calls")
        time.sleep(_POLL_S)
        count = store.add(arrived, 0)
    if count < len(ranks):  # the group's rendezvous would only wait as long again
        raise RuntimeError(f"wait timeout after {timeout_s:g} s: {count} of the {len(ranks)} "
                           "ranks arrived")


def ledger_for(replicas: Sequence[Sequence[int]] | None, group: Any,
               dp_group: Any = None) -> Ledger | None:
    """The ledger of the pipeline over ``group`` (and ``dp_group``), whose
    replicas hold these global ranks (without replicas: ``group``'s ranks);
    None for one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if replicas is None:
        replicas = [dist.get_process_group_ranks(group) if group is not None else [0]]
    ranks = tuple(sorted({r for replica in replicas for r in replica}))
    if len(ranks) < 2:
        return None
    key = (getattr(group, "group_name", ""), getattr(dp_group, "group_name", ""))
    ledger = _LEDGERS.get(key)
    if ledger is None or ledger._world is not _default_group() or ledger.ranks != ranks:
        ledger = _LEDGERS[key] = Ledger(ranks)  # a new group, or a new world
    return ledger


def pipeline_call(kind: str) -> Callable[[Callable], Callable]:
    """Decorator of the Pipeline methods that communicate (``step``, ``forward``,
    ``eval_step``): a call refuses to start on unusable groups, and a failure
    of this rank's own code before the call's begin exchange is sent to the
    other ranks (NOTE [Lockstep]). Reads the pipeline's ``_mpmd_group``,
    ``_mpmd_dp_group``, ``_mpmd_replicas`` and ``timeout``."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            ledger = ledger_for(self._mpmd_replicas, self._mpmd_group, self._mpmd_dp_group)
            if ledger is None:
                return fn(self, *args, **kwargs)
            ledger.check_usable(kind)
            outer = ledger.begin_call(kind)
            try:
                return fn(self, *args, **kwargs)
            except BaseException as e:
                if outer:
                    ledger.call_failed(e, self.timeout.total_seconds())
                raise
            finally:
                ledger.end_call(outer)

        return call

    return wrap
