"""Turns between the processes of one host: one does a piece of work that the
others would repeat (a trace, a compile) while they wait, and they then find
its result in a cache on disk.

NOTE [Host claims]: the ranks of a job on one host often do the same work at
the same time: every rank captures the same model (NOTE [Capture store]),
and the ranks of a tensor-parallel group or of data-parallel replicas
compile the same stage programs (NOTE [Compile claims] in
programs/compile_claims.py). On a host with fewer cores than ranks the
copies share the cores, and each takes as long as all of them together. A
claim is an OS file lock on a file named for the work: the first process
takes it and works; the others wait for it, then look in the cache.

Never a hang: a holder that dies releases the lock (the OS does); one that
stops (a stalled or stopped process) stops touching its lock file, and a
waiter that sees no touch for ``HEARTBEAT_STALE`` seconds goes on
unclaimed, as it does after ``CLAIM_WAIT`` seconds in any case; so a peer
stalled while it works costs the others seconds, and the pipeline's own
bounds name it later. A claim only orders the work: a waiter that goes on
unclaimed, or finds nothing in the cache, does the work itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CLAIM_WAIT", "HEARTBEAT", "HEARTBEAT_STALE", "claim"]

CLAIM_WAIT = 300.0  # seconds a process waits for another's claim of the same work
HEARTBEAT = 0.5  # seconds between a claim holder's touches of its lock file
HEARTBEAT_STALE = 5.0  # seconds without a touch after which waiters stop waiting


@contextlib.contextmanager
def claim(lock: Path | None) -> Iterator[bool]:
    """Hold the claim on ``lock`` (a file, created if missing) for the block;
    yields whether it was held (False: ``lock`` is None or cannot be opened,
    or its holder stopped beating or held it past ``CLAIM_WAIT``: the block
    runs unclaimed). See NOTE [Host claims]."""
    if lock is None:
        yield False
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield False
        return
    beating = threading.Event()
    try:
        held = _acquire(fd, lock)
        if held:
            os.utime(lock)  # a beat now: the file may be old
            threading.Thread(target=_heartbeat, args=(lock, beating), daemon=True,
                             name="mpmd-host-claim").start()
        yield held
    finally:
        beating.set()
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path) -> bool:
    """Take the lock on ``fd``: True once held, False when its holder stopped
    beating or ``CLAIM_WAIT`` passed (go on without it)."""
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False
        try:
            silent = time.time() - path.stat().st_mtime
        except OSError:
            silent = 0.0
        if silent > HEARTBEAT_STALE or time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _heartbeat(path: Path, done: threading.Event) -> None:
    """Touch the lock file while the claim is held (see :func:`claim`)."""
    while True:
        try:
            os.utime(path)
        except OSError:
            pass
        if done.wait(HEARTBEAT):
            return
