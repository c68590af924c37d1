"""The job's store as a witness of the ranks: who died first, which ranks
left, and where the store itself is gone; every store call bounded.

The job's store is the rendezvous store every rank shares
(``init_process_group``'s). NOTE [Who died first] and NOTE [Ranks that left]
say what the ranks record in it and read back.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from torch_mpmd.parallel.failures import first_line

__all__ = ["peer_gone", "record_dead", "first_death", "store_gone", "store_host_rank",
           "bounded_store", "StoreSilent", "announce_exit", "await_arrivals", "RanksLeft",
           "LEFT_KEY", "LEFT_COUNT", "POLL_S"]


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


def bounded_store(limit_s: float = _STORE_LIMIT_S) -> Any:
    """The job's store, each call bounded by ``limit_s`` (raising StoreSilent
    past it); None without a default process group."""
    store = _store()
    return None if store is None else _Bounded(store, limit_s)


def record_dead(peer: int, found_by: int) -> None:
    """Record global rank ``peer`` as dead, found by global rank ``found_by``
    (NOTE [Who died first]); the first record of a peer stays."""
    store = bounded_store()
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
    store = bounded_store()
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


def store_host_rank() -> int | None:
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
    host = store_host_rank()
    if isinstance(error, StoreSilent):
        return (f"{error}" + (f" (it lives in rank {host}'s process: rank {host} may be "
                              "stalled)" if host is not None else ""))
    if host is None:
        return f"the job's store cannot be reached ({first_line(str(error), 200)})"
    return (f"rank {host} is gone: the job's store, which lives in rank {host}'s process, "
            f"cannot be reached ({first_line(str(error), 200)}; rank {host} died, or exited "
            "after a failure of its own: a store outside the ranks, as torchrun's agent keeps "
            "it, also records which rank died first)")


# NOTE [Ranks that left]: a rank whose process exits before it joins the
# pipeline (its script ended, or raised, before its first step) would leave
# the others waiting out the timeout in the first exchange. Every process
# that imported torch_mpmd records at exit, in the job's store, that it left
# (torch_mpmd/__init__.py; while its default group still exists). Before the
# exchanges' group is made (lockstep.py), each rank records its arrival and polls the
# store until all ranks arrived (then the group's own rendezvous is quick),
# one of them is recorded as gone (an error at once, naming it), or the
# timeout passes. The keys carry a count of the groups made over these
# ranks, so a later group (after a failure) waits for fresh arrivals.
LEFT_KEY = "torch_mpmd/left/"
_ARRIVALS: dict[tuple[int, ...], int] = {}
POLL_S = 0.02


class RanksLeft(RuntimeError):
    """Ranks of the pipeline exited before joining it (NOTE [Ranks that left])."""


LEFT_COUNT = "torch_mpmd/left_count"


def announce_exit() -> None:
    """Record in the job's store that this rank's process is exiting
    (NOTE [Ranks that left]); best effort, silent."""
    try:
        if dist.is_initialized():
            store = _store()
            store.set(f"{LEFT_KEY}{dist.get_rank()}", f"{time.time():.6f}")
            store.add(LEFT_COUNT, 1)
    except Exception:  # noqa: BLE001  (the store may be gone already)
        pass


def await_arrivals(ranks: tuple[int, ...], timeout_s: float) -> None:
    """Before the exchanges' group over ``ranks`` is made: wait until every
    rank arrived (NOTE [Ranks that left]); RanksLeft naming a rank that left
    the job, RuntimeError when the timeout passes first."""
    # Two store round trips a poll whatever the number of ranks: a counter of
    # arrivals, and the job's count of departures (which ranks left is read
    # only once that count says some did). Each store call is bounded: a
    # stopped store host would never answer.
    store = bounded_store(timeout_s)
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
        if store.add(LEFT_COUNT, 0) > 0:
            gone = [r for r in ranks if r != me and store.check([f"{LEFT_KEY}{r}"])]
        if gone:
            raise RanksLeft(
                f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} left the job "
                "(the process exited) before joining the pipeline: every rank must make the "
                "same pipeline calls")
        time.sleep(POLL_S)
        count = store.add(arrived, 0)
    if count < len(ranks):  # the group's rendezvous would only wait as long again
        raise RuntimeError(f"wait timeout after {timeout_s:g} s: {count} of the {len(ranks)} "
                           "ranks arrived")
