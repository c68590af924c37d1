"""Run a function on N gloo ranks (Python processes on 127.0.0.1) and collect their results.

    from dist_harness import run_ranks
    run = run_ranks(2, "pipeline_worker:grid", cases, timeout=120)
    run.results[0]      # what rank 0's function returned (JSON round-tripped)

Each rank is ``sys.executable`` running this file as a script with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a
free port) and ``OMP_NUM_THREADS=1`` set, and ``tests/`` plus the repository
root on ``PYTHONPATH``. It initializes gloo (unless ``init_process_group=False``:
then there is no process group at all, the world-size-1 degenerate case), calls
``target`` = ``"module:function"`` with the JSON-serializable ``args``, and
writes the JSON return value to a per-rank result file. A worker may also call
``partial_result(value)`` as it goes: if the rank then dies or hangs, that value
is what the parent reports for it (with ``complete[rank] = False``).

The parent waits with one hard overall timeout; on expiry it kills every rank
(each runs in its own session, so its children die too) and, with
``check=True`` (the default), fails with every rank's exit code and stderr tail.
``run.exit_times[rank]`` is when that rank's process ended by itself (seconds
from the launch; None when the harness killed it), and ``run.exit_wall(rank)``
the same on the ``time.time()`` clock, to compare with times a worker records.

A launch that expects success (``check=True``, and every :class:`GridRun`) is
served by a worker group: ranks started once in the pytest session that run
call after call, and are replaced after any call that fails (NOTE [Worker
groups]). The others get fresh processes, forked from a process that has
imported torch already (NOTE [Forked ranks]); both in tests/dist_workers.py.
``MPMD_TEST_POOL=0`` starts every rank as a new Python process.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
STDERR_TAIL = 6000  # characters of each rank's stderr kept in failure messages


@dataclasses.dataclass
class RunResult:
    """What a launch produced, one entry per rank."""

    world_size: int
    results: list[Any]          # return value (or last partial_result, or None)
    complete: list[bool]        # True when the function returned and its result was written
    returncodes: list[int | None]
    stdout: list[str]
    stderr: list[str]
    elapsed: float              # seconds from launch to the last rank ending (or the kill)
    timed_out: bool
    # Per rank: seconds from launch to its process ending by itself (None: killed).
    exit_times: list[float | None] = dataclasses.field(default_factory=list)
    started_at: float = 0.0     # time.time() at launch

    def exit_wall(self, rank: int) -> float | None:
        """When ``rank`` exited by itself, on the time.time() clock (None: killed)."""
        t = self.exit_times[rank] if rank < len(self.exit_times) else None
        return None if t is None else self.started_at + t

    def failed_ranks(self) -> list[int]:
        return [r for r in range(self.world_size)
                if self.returncodes[r] != 0 or not self.complete[r]]

    def describe(self, ranks: list[int] | None = None) -> str:
        """Exit codes of all ranks and the stderr tail of ``ranks`` (default: the failed ones)."""
        ranks = self.failed_ranks() if ranks is None else ranks
        lines = [f"world_size={self.world_size} elapsed={self.elapsed:.1f}s "
                 f"timed_out={self.timed_out} exit codes={self.returncodes}"]
        for r in ranks:
            lines.append(f"----- rank {r} (exit {self.returncodes[r]}, "
                         f"complete={self.complete[r]}) stderr tail -----")
            lines.append(tail(self.stderr[r]) or "<empty>")
        return "\n".join(lines)

    def check(self) -> RunResult:
        """Raise AssertionError naming every failing rank with its stderr tail."""
        if self.timed_out or self.failed_ranks():
            raise AssertionError("distributed launch failed: " + self.describe())
        return self


def tail(text: str, n: int = STDERR_TAIL) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank prints every thread's stack to its stderr on this signal; the
# harness sends it to the ranks still running when a launch times out, so a
# hang's failure message shows where each rank waited (not "<empty>").
STACKS_SIGNAL = signal.SIGUSR1
STACKS_GRACE = 3.0  # seconds the ranks get to print them before the kill


def stacks_on_request() -> None:
    """In a rank: print every thread's stack to stderr on ``STACKS_SIGNAL``."""
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def request_stacks(procs: list[Any]) -> None:
    """Ask every rank of ``procs`` still running for its stacks, and give
    them ``STACKS_GRACE`` seconds to print them (before they are killed)."""
    asked = False
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, STACKS_SIGNAL)
                asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(STACKS_GRACE)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank's own session: only what we started
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _rank_env(world_size: int, port: int, pg_timeout: float, init_process_group: bool,
              env: dict[str, str] | None) -> dict[str, str]:
    """The environment every rank of a launch (or of a worker group) starts with."""
    base_env = dict(os.environ)
    if sys.platform == "linux":  # gloo on loopback, whatever the hostname resolves to
        base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base_env.update(env or {})
    pythonpath = [str(TESTS_DIR), str(REPO_ROOT)]
    if base_env.get("PYTHONPATH"):
        pythonpath.append(base_env["PYTHONPATH"])
    base_env.update(
        PYTHONPATH=os.pathsep.join(pythonpath), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1", HARNESS_PG_TIMEOUT=str(pg_timeout),
        HARNESS_INIT_PG="1" if init_process_group else "0")
    return base_env


def launcher(env: dict[str, str] | None = None) -> tuple[list[str], list[str], dict[str, str]]:
    """How a test starts a launcher of its own (torchrun), whose processes
    are forked from the zygote where it runs (NOTE [Forked interpreters] in
    tests/forked_python.py). Returns ``(python, script_prefix, env)``:

        cmd = [*python, "-m", "torch.distributed.run", ..., *script_prefix, script, *args]

    ``python`` starts torchrun itself, ``script_prefix`` goes before the
    workers' script, and ``env`` (``os.environ`` with ``env`` over it, tests/
    and the repository on ``PYTHONPATH``, one OpenMP thread, gloo on loopback)
    is the launch's environment. Without a zygote (``MPMD_TEST_POOL=0``)
    these are plain ``python`` and an empty prefix."""
    full = _rank_env(1, 0, 0.0, True, None)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "HARNESS_PG_TIMEOUT", "HARNESS_INIT_PG"):
        del full[k]  # torchrun's to set
    zygote = _workers().zygote_for(full)
    full.update(env or {})
    if zygote is None:
        return [sys.executable], [], full
    client = str(TESTS_DIR / "forked_python.py")
    return [sys.executable, client], [client], full | {"MPMD_TEST_FORK_SOCKET": zygote.socket}


def _spawn(world_size: int, base_env: dict[str, str], workdir: Path, *,
           serve: bool = False) -> tuple[list[subprocess.Popen], list[Any]]:
    """Start the ranks, each in its own session (so a kill takes its children too),
    stdout and stderr to files in ``workdir``; ``serve``: a worker group's ranks,
    which read calls from stdin."""
    procs: list[subprocess.Popen] = []
    files = []
    zygote = _workers().zygote_for(base_env)
    try:
        for rank in range(world_size):
            rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            if zygote is not None:
                procs.append(zygote.fork(rank_env, workdir, rank, serve=serve))
                continue
            out = open(workdir / f"stdout{rank}.txt", "wb")
            err = open(workdir / f"stderr{rank}.txt", "wb")
            files += [out, err]
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())] + (["--serve"] if serve else []),
                env=rank_env, stdout=out, stderr=err, cwd=str(workdir), start_new_session=True,
                stdin=subprocess.PIPE if serve else subprocess.DEVNULL))
    except BaseException:
        for p in procs:
            _kill(p)
        for f in files:
            f.close()
        raise
    return procs, files


def _wait(codes: Any, world_size: int, timeout: float,
          failure_grace: float | None) -> tuple[bool, list[float | None], float]:
    """Poll ``codes()`` (a list of exit codes, None while running) until every rank
    ended, ``timeout`` passed, or ``failure_grace`` passed after a non-zero code:
    (timed out, per rank seconds to its end, elapsed seconds)."""
    start = time.monotonic()
    first_failure: float | None = None
    exit_times: list[float | None] = [None] * world_size
    timed_out = False
    while True:
        now_codes = codes()
        now = time.monotonic()
        for rank, code in enumerate(now_codes):
            if code is not None and exit_times[rank] is None:
                exit_times[rank] = now - start
        if all(c is not None for c in now_codes):
            break
        if first_failure is None and any(c not in (None, 0) for c in now_codes):
            first_failure = now
        if now - start > timeout:
            timed_out = True
            break
        if (first_failure is not None and failure_grace is not None
                and now - first_failure > failure_grace):
            break
        time.sleep(0.02)
    return timed_out, exit_times, time.monotonic() - start


def _results(workdir: Path, world_size: int) -> tuple[list[Any], list[bool]]:
    """Each rank's result (or last partial result) and whether it was complete."""
    results, complete = [], []
    for rank in range(world_size):
        final = workdir / f"result{rank}.json"
        partial = workdir / f"partial{rank}.json"
        if final.exists():
            results.append(json.loads(final.read_text()))
            complete.append(True)
        else:
            results.append(json.loads(partial.read_text()) if partial.exists() else None)
            complete.append(False)
    return results, complete


def _log_launch(run: RunResult, target: str, how: str) -> None:
    """One JSON line per launch in $MPMD_TEST_LAUNCH_LOG, when set (to measure the suite)."""
    path = os.environ.get(LAUNCH_LOG_VAR)
    if path:
        line = dict(test=os.environ.get("PYTEST_CURRENT_TEST", ""), target=target,
                    world=run.world_size, how=how, elapsed=round(run.elapsed, 2))
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


POOL_VAR = "MPMD_TEST_POOL"            # "0": every launch starts fresh processes
LAUNCH_LOG_VAR = "MPMD_TEST_LAUNCH_LOG"  # a file: one JSON line per launch
PROFILE_VAR = "MPMD_TEST_PROFILE"  # a directory: each rank's cProfile stats of each call


def _workers() -> Any:
    """tests/dist_workers.py (imported late: it imports this module)."""
    import dist_workers

    return dist_workers


def close_worker_groups() -> None:
    """Kill every worker group and the zygote (the end of the pytest session)."""
    if "dist_workers" in sys.modules:
        _workers().close_worker_groups()


def run_ranks(world_size: int, target: str, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 60.0, init_process_group: bool = True,
              failure_grace: float | None = 20.0, env: dict[str, str] | None = None,
              check: bool = True, agent_store: bool = False,
              pooled: bool | None = None) -> RunResult:
    """Run ``target`` ("module:function" importable from tests/) on ``world_size`` ranks.

    ``timeout``: hard limit for the whole launch, after which every rank is killed.
    ``pg_timeout``: the process group timeout (seconds) given to init_process_group.
    ``failure_grace``: once some rank has exited non-zero, the others get this many
    seconds to finish before they are killed (None: wait for the overall timeout).
    ``check``: raise AssertionError (with the failing ranks' stderr) unless every rank
    exited 0 with a complete result.
    ``agent_store``: the rendezvous store lives in this process, as torchrun's
    agent hosts it (TORCHELASTIC_USE_AGENT_STORE), not in rank 0's: it
    outlives any rank.
    ``pooled``: served by a worker group (NOTE [Worker groups]); None: when
    ``check`` (a call that inspects failures gets fresh processes). Never
    without a process group or with ``agent_store``, nor with MPMD_TEST_POOL=0.
    """
    if ":" not in target:
        raise ValueError(f"target={target!r} must be 'module:function'")
    if not init_process_group and world_size != 1:
        raise ValueError("init_process_group=False needs world_size=1")
    json.dumps(args)  # fail here, not in the children, on non-JSON arguments
    if pooled is None:
        pooled = check
    pooled = (pooled and init_process_group and not agent_store
              and os.environ.get(POOL_VAR, "1") != "0"
              and "HARNESS_FINALIZE" not in (env or {}))
    workdir = Path(tempfile.mkdtemp(prefix="mpmd_ranks_"))
    (workdir / "args.json").write_text(json.dumps(list(args)))
    try:
        run = None
        if pooled:
            run = _workers().pooled_call(world_size, target, workdir, timeout, pg_timeout,
                               failure_grace, env)
        how = "pooled" if run is not None else "fresh"
        if run is None:
            run = _fresh_launch(world_size, target, workdir, timeout, pg_timeout,
                                init_process_group, failure_grace, env, agent_store)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _log_launch(run, target, how)
    return run.check() if check else run


def _fresh_launch(world_size: int, target: str, workdir: Path, timeout: float,
                  pg_timeout: float, init_process_group: bool, failure_grace: float | None,
                  env: dict[str, str] | None, agent_store: bool) -> RunResult:
    """Start ``world_size`` new processes for this one call and wait for them."""
    port = free_port()
    base_env = _rank_env(world_size, port, pg_timeout, init_process_group, env)
    base_env.update(HARNESS_TARGET=target, HARNESS_DIR=str(workdir))
    store = None
    if agent_store:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
        base_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    procs: list[subprocess.Popen] = []
    files: list[Any] = []
    started_at = time.time()
    try:
        procs, files = _spawn(world_size, base_env, workdir)
        timed_out, exit_times, elapsed = _wait(lambda: [p.poll() for p in procs],
                                               world_size, timeout, failure_grace)
        if timed_out:
            request_stacks(procs)
        for p in procs:
            _kill(p)
        for p in procs:
            p.wait()
    finally:
        for p in procs:
            _kill(p)
        for f in files:
            f.close()
        del store  # the agent store (if any) closes with the launch

    results, complete = _results(workdir, world_size)
    stdout = [(workdir / f"stdout{r}.txt").read_text(errors="replace") for r in range(world_size)]
    stderr = [(workdir / f"stderr{r}.txt").read_text(errors="replace") for r in range(world_size)]
    return RunResult(world_size, results, complete, [p.returncode for p in procs],
                     stdout, stderr, elapsed, timed_out, exit_times, started_at)


# ---------------------------------------------------------------- inside a rank

class GridRun:
    """One launch of a grid worker running every case (a launch costs seconds
    of imports per rank); tests look their case up with :meth:`results`.

    ``target`` is ``"module:grid"``, a function taking the case list and
    returning ``{case id: result}``; a rank that died left its progress under
    ``task`` (pipeline_worker.grid's partial results)."""

    def __init__(self, world_size: int, target: str, cases: list[dict[str, Any]], task: str,
                 timeout: float = 900.0) -> None:
        self.world_size, self.target, self.cases, self.task = world_size, target, cases, task
        self.timeout = timeout
        self.run: RunResult | None = None

    def results(self, case_id: str) -> list[dict[str, Any]]:
        """Every rank's result of one case; a pytest failure naming the ranks
        that gave none or raised (with their tracebacks)."""
        import pytest

        if self.run is None:
            self.run = run_ranks(self.world_size, self.target, self.cases,
                                 timeout=self.timeout, check=False, pooled=True)
        run = self.run
        ranks = [(res.get(self.task, res) if isinstance(res, dict) else {}).get(case_id)
                 for res in run.results]
        missing = [r for r, res in enumerate(ranks) if res is None]
        if missing:
            pytest.fail(f"{case_id}: no result from ranks {missing}\n{run.describe(missing)}")
        errors = [(r, res["error"]) for r, res in enumerate(ranks) if res["error"]]
        if errors:
            pytest.fail(f"{case_id}: raised on ranks {[r for r, _ in errors]}\n" + "\n".join(
                f"----- rank {r} -----\n{tail(err)}" for r, err in errors))
        return ranks


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # atomic: the parent never reads half a file


def partial_result(value: Any) -> None:
    """Record ``value`` as this rank's result so far (reported if the rank never returns).

    A no-op outside a harness rank, so worker functions also run in-process.
    """
    workdir = os.environ.get("HARNESS_DIR")
    if workdir:
        _write_json(Path(workdir) / f"partial{os.environ['RANK']}.json", value)


def error_text() -> str:
    """The current exception's traceback, its middle cut when long (results travel as JSON)."""
    import traceback

    text = traceback.format_exc()
    return text if len(text) < 6000 else text[:1500] + "\n...\n" + text[-4500:]


def run_grid(cases: list[dict[str, Any]], handlers: dict[str, Any], *,
             key: str | None = None) -> dict[str, Any]:
    """In a worker rank: run each case by ``handlers[case["kind"]](case)``, with
    Dynamo's caches reset between cases; {case id: result} where a result
    holds ``error`` (None, or the traceback: one failing case does not hide
    the others) and ``seconds``. Recorded as a partial result after each
    case (under ``key`` when given, and then returned as ``{key: ...}``)."""
    import torch

    out: dict[str, Any] = {}
    for case in cases:
        start = time.perf_counter()
        torch._dynamo.reset()
        try:
            res = handlers[case["kind"]](case)
            res.setdefault("error", None)
        except Exception:
            res = {"error": error_text()}
        res["seconds"] = round(time.perf_counter() - start, 2)
        out[case["id"]] = res
        partial_result({key: out} if key else out)
    return {key: out} if key else out


def worker_cache(key: Any, build: Any) -> Any:
    """``build()``, made once per rank process and kept across the calls a worker
    group serves (NOTE [Worker groups]); in a fresh launch, once per launch.
    For what many cases would build alike (a Hugging Face model's weights):
    callers must not change the value (copy it first)."""
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = build()
    return _WORKER_CACHE[key]


_WORKER_CACHE: dict[Any, Any] = {}


def collect_less_often() -> None:
    """NOTE [Collections in tests]: the cyclic collector runs less often in
    the suite's processes (pytest's, the zygote's and every rank's). Captures,
    joint traces and compiles allocate millions of objects, and by default a
    collection ran every 700 of them: perf over tests/test_plan_auto.py put
    11% of all CPU in the collector. With the first threshold at 20,000 the
    file took 147 s of user CPU against 158 s (BENCHMARKS.md, "The collector
    and leaked gloo groups"); garbage in cycles lives a little longer, nothing
    else changes."""
    import gc

    gc.set_threshold(20_000, 10, 10)


def _init_group() -> None:
    import torch.distributed as dist

    if os.environ["HARNESS_INIT_PG"] == "1":
        pg_timeout = datetime.timedelta(seconds=float(os.environ["HARNESS_PG_TIMEOUT"]))
        dist.init_process_group("gloo", timeout=pg_timeout)


def _call(target: str, workdir: Path) -> Any:
    module_name, func_name = target.split(":")
    args = json.loads((workdir / "args.json").read_text())
    func = getattr(importlib.import_module(module_name), func_name)
    profile_dir = os.environ.get(PROFILE_VAR)
    if not profile_dir:
        return func(*args)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(func, *args)
    finally:
        profiler.dump_stats(os.path.join(profile_dir, f"{func_name}.{os.getpid()}."
                                         f"{time.time():.0f}.rank{os.environ['RANK']}.pstats"))


def _rank_main() -> None:
    stacks_on_request()
    collect_less_often()
    rank = int(os.environ["RANK"])
    workdir = Path(os.environ["HARNESS_DIR"])
    import torch.distributed as dist

    _init_group()
    value = _call(os.environ["HARNESS_TARGET"], workdir)
    _write_json(workdir / f"result{rank}.json", value)
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ.get("HARNESS_FINALIZE") == "1":
        return  # exit through interpreter finalization (to reproduce the abort below)
    _leave()


def _leave() -> None:
    # The rank's work is done and reported. Run the exit handlers (torch_mpmd's
    # NOTE [Release at exit] among them), then leave without interpreter
    # finalization: a gloo group freed during finalization has aborted ranks
    # after their work ("terminate called without an active exception"), which
    # is not what these tests check.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Running this file as a script puts tests/ (its directory) first on sys.path,
    # ahead of anything else; the target's module is then importable by name.
    if sys.argv[1:] == ["--serve"]:
        _workers().serve()
    elif sys.argv[1:] == ["--zygote"]:
        _workers().zygote_main()
    else:
        _rank_main()
