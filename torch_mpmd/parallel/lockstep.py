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

The rest of the ranks' bounded communication lives beside this module and is
importable from it too: the collectives bounded by their own timeout and
the abandoning of groups (bounded.py: NOTE [Bounded collectives] and NOTE
[Abandoned groups] in bounded.py), PipelineError and the text of failures
(failures.py), the job's store as a witness of which rank died or left
(NOTE [Who died first] in job_store.py, NOTE [Ranks that left] in
job_store.py), and the named waits of collectives outside a call (NOTE
[Named waits] in named_waits.py).
"""

from __future__ import annotations

import datetime
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from torch_mpmd.parallel.bounded import (abandon, all_gather, all_reduce, as_timedelta,
                                         broadcast, wait)
from torch_mpmd.parallel.failures import (UNUSABLE, PipelineError, add_note,
                                          describe_failure, first_line, is_settled,
                                          settle)
from torch_mpmd.parallel.job_store import (RanksLeft, StoreSilent, announce_exit,
                                           await_arrivals, first_death, peer_gone,
                                           record_dead, store_gone)
from torch_mpmd.parallel.named_waits import Collectives, progress

__all__ = ["PipelineError", "Ledger", "ledger_for", "pipeline_call", "describe_failure",
           "peer_gone", "record_dead", "first_death", "announce_exit",
           "all_gather", "all_reduce", "broadcast", "wait", "abandon", "KINDS",
           "Collectives", "progress", "store_gone", "first_line", "as_timedelta",
           "settle", "is_settled", "payload", "FIELDS", "Outcome", "UNUSABLE",
           "PAYLOAD", "StoreSilent", "RanksLeft"]


# ---------------------------------------------------------------- records

KINDS = {"handshake": 1, "build": 2, "step": 3, "forward": 4, "eval": 5, "backward": 6}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_BEGIN, _END = 0, 1
_MAGIC = 0x6D706D646C6B7370  # "mpmdlksp": a record, not some other collective's data
FIELDS = ("magic", "seq", "kind", "phase", "step", "digest", "failed", "p0", "p1", "p2")
_MESSAGE_BYTES = 512
_F = {name: i for i, name in enumerate(FIELDS)}
PAYLOAD = slice(_F["p0"], _F["p2"] + 1)  # the three int64 a caller puts in a record


def payload(row: Sequence[int]) -> list[int]:
    """The three int64 a rank put in its record (:meth:`Ledger.exchange`'s
    ``payload``), from a row of :attr:`Outcome.rows`."""
    return list(row[PAYLOAD])


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
                                f"failed ({first_line(self.broken, 600)}){UNUSABLE}",
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
            reason = (f"{first_line(str(e))}; found waiting for them at {where}"
                      if isinstance(e, RanksLeft) else
                      f"the other ranks did not arrive at {where} within {timeout_s:g} s "
                      f"(creating the group of the ranks' exchanges: {first_line(str(e))})")
            self.break_(reason)
            raise PipelineError(f"{self.name(self.me)}: {reason} (a peer that stalled or died, "
                                f"or that is in another call){UNUSABLE}", rank=self.me) from e
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
        runtime/contents.py), exchanged only when the contents differ, to name
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
            raise settle(err)

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
            raise settle(err)  # every rank raises here
        if outcome.mismatch is not None:
            self.break_(outcome.mismatch)
            err = PipelineError(
                f"{self.name(self.me)}: {outcome.mismatch}. Every rank must make the same "
                f"pipeline calls (step, forward, eval_step) in the same order with inputs of "
                f"the same shapes{UNUSABLE}", rank=self.me)
            raise settle(err)

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
        if is_settled(exc) or self.broken is not None:
            return
        if self.phase != _PREP:
            self.break_(f"{self.name(self.me)} failed during {self.call_kind} after its "
                        f"transfers began: {describe_failure(exc)}")
            return
        try:
            outcome = self.exchange(self.call_kind, timeout_s=timeout_s,
                                    failure=describe_failure(exc))
        except PipelineError as e:  # the peers did not come: they are told by their timeout
            add_note(exc, f"torch_mpmd: telling the other ranks of this failure failed: {e}")
            return
        others = {r: m for r, m in outcome.failures.items() if r != self.me}
        told = "the other ranks were told of this failure and raise PipelineError"
        if others:
            told += "; " + "; ".join(f"{self.name(r)} failed too: {m}"
                                     for r, m in sorted(others.items()))
        add_note(exc, f"torch_mpmd: {told}")
        settle(exc)


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


# Ledgers by (pipeline group, dp group) name; the exchanges' groups by ranks.
_LEDGERS: dict[tuple[str, str], Ledger] = {}
_EXCHANGE_GROUPS: dict[tuple[int, ...], Any] = {}


def _exchange_group(ranks: tuple[int, ...], timeout_s: float) -> Any:
    """The gloo group of the exchanges over ``ranks`` (NOTE [Lockstep]): made
    once (collective over ``ranks`` only; its rendezvous bounded by the
    timeout), again after a failure on it or a new default group. A rank that
    left the job before arriving fails it at once (NOTE [Ranks that left] in
    job_store.py)."""
    group = _EXCHANGE_GROUPS.get(ranks)
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        await_arrivals(ranks, timeout_s)
        group = dist.new_group(list(ranks), timeout=as_timedelta(timeout_s), backend="gloo",
                               use_local_synchronization=True)
        _EXCHANGE_GROUPS[ranks] = group
    return group


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


class LockstepParty(Protocol):
    """What :func:`pipeline_call` reads of the object whose methods it guards
    (the pipeline's session, torch_mpmd/session.py): its groups and bound."""

    group: Any                                   # the pipeline group (None: one rank)
    dp_group: Any                                # the data-parallel group, or None
    replicas: Sequence[Sequence[int]] | None     # global ranks of each replica's pipeline
    timeout: datetime.timedelta                  # bounds every wait of a call


def pipeline_call(kind: str) -> Callable[[Callable], Callable]:
    """Decorator of the methods of a :class:`LockstepParty` that communicate
    (a step, a forward, an eval, the door's backward, planning): a call
    refuses to start on unusable groups, and a failure of this rank's own
    code before the call's begin exchange is sent to the other ranks (NOTE
    [Lockstep]). A call inside another guarded call is part of it."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self: LockstepParty, *args: Any, **kwargs: Any) -> Any:
            ledger = ledger_for(self.replicas, self.group, self.dp_group)
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
