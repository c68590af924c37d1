"""Worker groups and forked ranks: how tests/dist_harness.py runs a launch
without starting and importing fresh Python processes for it.

The parent side (the pytest process) and the rank side (``python
dist_harness.py --serve`` for a worker group's rank, ``--zygote`` for the
process fresh ranks are forked from) of NOTE [Worker groups] and NOTE
[Forked ranks]. ``run_ranks`` decides which one serves a launch.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dist_harness as H
import forked_python as FP

# ---------------------------------------------------------------- forked ranks

# NOTE [Forked ranks]: neither a worker group's ranks nor a launch that needs
# fresh processes (one that kills, stops or loses ranks) pay for importing
# torch in each (seconds of CPU per rank, and a pipeline call leaves process
# groups that retire its worker group): their ranks are forked from a
# zygote, one process per pytest session that imported torch,
# torch.distributed, Dynamo, Inductor, torch_mpmd and transformers (when
# installed) and does nothing else (no process group, no compile, no work of
# its own). A forked rank
# starts its own session, takes the launch's environment, files and working
# directory (a worker group's rank: a FIFO for its calls as stdin), and runs
# as a rank started by ``python dist_harness.py`` (``--serve``) would,
# down to its exit code (an uncaught exception: its traceback and 1;
# sys.exit(n): n; the exit handlers run first in both). The zygote reaps it
# and writes its exit status where the parent polls for it. A launch whose
# environment differs from the zygote's in what torch reads at import (torch,
# OpenMP, MKL, Inductor variables, PYTHONPATH), or that sets
# HARNESS_FINALIZE, starts its processes the ordinary way.

_IMPORT_TIME_PREFIXES = ("TORCH", "ATEN", "OMP", "KMP", "MKL", "PYTHON", "CUDA", "LD_", "GLOO")
_ZYGOTES: dict[tuple[tuple[str, str], ...], "_Zygote"] = {}
_ZYGOTE_LOCK = threading.Lock()


def _import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_TIME_PREFIXES) and k != "PYTHONUNBUFFERED"))


# What torchrun sets for its workers, and torchft's settings: read when they
# run, not at import.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHFT_")


def _interpreter_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What an interpreter forked for a launcher must share with the zygote
    (NOTE [Forked interpreters])."""
    return tuple((k, v) for k, v in _import_env(env) if not k.startswith(_LAUNCHER_PREFIXES))


class _Forked:
    """A rank forked by the zygote, with the subprocess.Popen methods this
    module uses (``stdin``: a worker group rank's, else None)."""

    def __init__(self, pid: int, status: Path, zygote: subprocess.Popen,
                 stdin: Any = None) -> None:
        self.pid, self.status, self.returncode, self.stdin = pid, status, None, stdin
        self.zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            zygote_gone = self.zygote.poll() is not None  # before reading the status
            text = self.status.read_text() if self.status.exists() else ""
            if text.endswith("\n"):  # written whole (os.replace)
                self.returncode = int(text)
            elif zygote_gone and not _exists(self.pid):
                # Its zygote was replaced (closed) before it ended: nobody
                # reaped it or wrote its status (a worker group's rank).
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self) -> int:
        deadline = time.monotonic() + 30
        while self.poll() is None:
            if time.monotonic() > deadline:  # the zygote itself is gone: nobody reaps
                self.returncode = -signal.SIGKILL
            time.sleep(0.005)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exists(pid: int) -> bool:
    """Whether process ``pid`` is still running (a zombie, ended but not
    reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # not Linux: no way to tell a zombie


class _Zygote:
    """The process ranks are forked from (NOTE [Forked ranks])."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(H.__file__).resolve()), "--zygote"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(H.TESTS_DIR),
            start_new_session=True)
        self.lock = threading.Lock()
        ready = self.proc.stdout.readline().split()
        if ready[:1] != [b"ready"] or len(ready) != 2:
            raise RuntimeError(f"the zygote did not start: {ready!r}")
        self.socket = ready[1].decode()  # NOTE [Forked interpreters]

    def fork(self, env: dict[str, str], workdir: Path, rank: int, *,
             serve: bool = False) -> _Forked:
        """Fork a rank; ``serve``: a worker group's, reading its calls from a
        FIFO in ``workdir`` (the returned rank's ``stdin``)."""
        status = workdir / f"exit{rank}.txt"
        request = dict(env=env, cwd=str(workdir), status=str(status),
                       stdout=str(workdir / f"stdout{rank}.txt"),
                       stderr=str(workdir / f"stderr{rank}.txt"), stdin=None)
        stdin = None
        if serve:
            fifo = workdir / f"stdin{rank}"
            os.mkfifo(fifo)
            # Read-write: opening never blocks (a rank that dies before
            # opening its end cannot hang us); the rank sees the end of its
            # input once this end is closed.
            stdin = os.fdopen(os.open(fifo, os.O_RDWR), "wb")
            request["stdin"] = str(fifo)
        try:
            with self.lock:  # one request and its answer at a time
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
                pid = int(self.proc.stdout.readline())
        except BaseException:
            if stdin is not None:
                stdin.close()
            raise
        return _Forked(pid, status, self.proc, stdin)

    def close(self) -> None:
        H._kill(self.proc)
        self.proc.wait()
        shutil.rmtree(Path(self.socket).parent, ignore_errors=True)


def _log_zygote(key: tuple[tuple[str, str], ...]) -> None:
    """A line in $MPMD_TEST_LAUNCH_LOG per zygote started (seconds of imports
    each: a test whose ranks read another setting at import starts its own)."""
    path = os.environ.get(H.LAUNCH_LOG_VAR)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=os.environ.get("PYTEST_CURRENT_TEST", ""),
                                    zygote=dict(key))) + "\n")


def zygote_for(env: dict[str, str]) -> _Zygote | None:
    """The zygote for a launch with ``env``; None: start the ranks the ordinary way."""
    if os.environ.get(H.POOL_VAR, "1") == "0" or "HARNESS_FINALIZE" in env:
        return None
    key = _import_env(env)
    with _ZYGOTE_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is not None and zygote.proc.poll() is not None:
            zygote = None
        if zygote is None:
            for old in _ZYGOTES.values():  # one at a time
                old.close()
            _ZYGOTES.clear()
            _log_zygote(key)
            try:
                zygote = _ZYGOTES[key] = _Zygote({k: v for k, v in env.items()
                                                  if not k.startswith("HARNESS_")})
            except (OSError, RuntimeError, ValueError):
                return None  # (its stderr is the session's) the ranks start as processes
        return zygote


# ---------------------------------------------------------------- worker groups

# NOTE [Worker groups]: a launch used to start fresh processes, which import
# torch (and the library, transformers, Inductor) and rendezvous gloo: seconds
# per rank before the first case. Most launches only need ranks that run a
# function and report, so they are served by a worker group instead: ranks
# started once per (world size, process group timeout, extra environment) in
# the pytest session, each holding its gloo group, that run one call after
# another. A call is a line on each rank's stdin naming the call's directory
# and target; the rank runs it as a fresh rank would (HARNESS_DIR, results and
# partial results there) and then writes done<rank>.json. Between calls a rank
# puts back what a call may change and a fresh process would not have seen:
# os.environ, the RNG states, default dtype, grad mode and thread count; the
# test-side modules (tests/*.py) are imported afresh, Dynamo's caches are
# reset. Kept on purpose: imported libraries and their in-memory caches
# (Inductor's loaded kernels) and :func:`worker_cache`. After each call every
# rank checks that its default group still works, that no torch_mpmd ledger
# is left broken or mid-call and that no other process group is left (see
# _clean_after); a call that failed, timed out or left a rank unclean gets
# the group torn down (its ranks killed), and the next call starts a new one:
# a failed case cannot poison the next. So does a group whose ranks grew past
# MAX_RANK_RSS or MAX_RANK_FDS, and the least recently used one when more
# than MAX_POOLS would be kept.
#
# Calls that look at failures (check=False: ranks that die, hang, exit early
# or are killed), calls without a process group, with the store in this
# process, or MPMD_TEST_POOL=0 get fresh processes (NOTE [Forked ranks]).

_POOLS: dict[tuple[Any, ...], "_WorkerGroup"] = {}
_POOLS_LOCK = threading.Lock()
MAX_POOLS = 2  # worker groups kept at once (each rank holds torch and its models)
# A group whose rank grew past these is replaced after its call: every call's
# process groups (gloo sockets) and allocator growth stay with the process.
MAX_RANK_RSS = 1536 << 20
MAX_RANK_FDS = 4000


class _WorkerGroup:
    """``world_size`` ranks started once that serve calls (NOTE [Worker groups])."""

    def __init__(self, world_size: int, pg_timeout: float, env: dict[str, str] | None) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.calls = 0
        self.dir = Path(tempfile.mkdtemp(prefix="mpmd_group_"))
        base_env = H._rank_env(world_size, H.free_port(), pg_timeout, True, env)
        self.procs, self.files = H._spawn(world_size, base_env, self.dir, serve=True)
        self.offsets = [[0, 0] for _ in range(world_size)]  # output read so far

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def worn(self) -> bool:
        """Whether a rank holds more memory or file descriptors than a group should keep."""
        for p in self.procs:
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
                rss = int(status.split("VmRSS:")[1].split()[0]) << 10
                fds = len(os.listdir(f"/proc/{p.pid}/fd"))
            except (OSError, IndexError, ValueError):
                continue  # not Linux: no limit
            if rss > MAX_RANK_RSS or fds > MAX_RANK_FDS:
                return True
        return False

    def close(self) -> None:
        for p in self.procs:
            H._kill(p)
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            p.wait()
        for f in self.files:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _output(self, rank: int, which: int) -> str:
        path = self.dir / f"{('stdout', 'stderr')[which]}{rank}.txt"
        with open(path, "rb") as f:
            f.seek(self.offsets[rank][which])
            data = f.read()
        self.offsets[rank][which] += len(data)
        return data.decode(errors="replace")

    def call(self, target: str, workdir: Path, timeout: float,
             failure_grace: float | None) -> tuple[H.RunResult, bool]:
        """Run one call; (its result, whether the group may serve another)."""
        self.calls += 1
        line = json.dumps(dict(dir=str(workdir), target=target, seq=self.calls)) + "\n"
        started_at = time.time()
        for p in self.procs:
            try:
                p.stdin.write(line.encode())
                p.stdin.flush()
            except OSError:
                pass  # a dead rank: its exit code tells
        done: list[dict[str, Any] | None] = [None] * self.world_size

        def codes() -> list[int | None]:
            out: list[int | None] = []
            for rank, p in enumerate(self.procs):
                if done[rank] is None and (workdir / f"done{rank}.json").exists():
                    done[rank] = json.loads((workdir / f"done{rank}.json").read_text())
                out.append(done[rank]["status"] if done[rank] is not None else p.poll())
            return out

        timed_out, exit_times, elapsed = H._wait(codes, self.world_size, timeout, failure_grace)
        final = codes()
        healthy = (not timed_out and all(d is not None and d["status"] == 0 and d["clean"]
                                         for d in done))
        if not healthy:  # every rank still running is killed, as a fresh launch's would be
            if timed_out:
                H.request_stacks(self.procs)
            for p in self.procs:
                H._kill(p)
            for p in self.procs:
                p.wait()
            final = [c if c is not None else p.returncode for c, p in zip(final, self.procs)]
        results, complete = H._results(workdir, self.world_size)
        stdout = [self._output(r, 0) for r in range(self.world_size)]
        stderr = [self._output(r, 1) for r in range(self.world_size)]
        run = H.RunResult(self.world_size, results, complete, final, stdout, stderr, elapsed,
                        timed_out, exit_times, started_at)
        return run, healthy


def pooled_call(world_size: int, target: str, workdir: Path, timeout: float,
                 pg_timeout: float, failure_grace: float | None,
                 env: dict[str, str] | None) -> H.RunResult | None:
    """Serve the call from a worker group (None: every group of this kind is busy)."""
    key = (world_size, pg_timeout, tuple(sorted((env or {}).items())))
    with _POOLS_LOCK:
        group = _POOLS.get(key)
        if group is not None and not group.lock.acquire(blocking=False):
            return None  # another thread's call is running on it: launch fresh
        if group is not None and not group.alive():
            _POOLS.pop(key)
            group.close()
            group.lock.release()
            group = None
        if group is None:
            while len(_POOLS) >= MAX_POOLS:  # the oldest idle group goes
                idle = [k for k, g in _POOLS.items() if not g.lock.locked()]
                if not idle:
                    break
                _POOLS.pop(idle[0]).close()
            group = _POOLS[key] = _WorkerGroup(world_size, pg_timeout, env)
            group.lock.acquire()
        else:  # most recently used last
            _POOLS[key] = _POOLS.pop(key)
    try:
        run, healthy = group.call(target, workdir, timeout, failure_grace)
        healthy = healthy and not group.worn()
    except BaseException:
        healthy = False
        raise
    finally:
        if not healthy:
            with _POOLS_LOCK:
                if _POOLS.get(key) is group:
                    del _POOLS[key]
            group.close()
        group.lock.release()
    return run


def close_worker_groups() -> None:
    """Kill every worker group (the end of the pytest session)."""
    with _POOLS_LOCK:
        groups = list(_POOLS.values())
        _POOLS.clear()
    for g in groups:
        g.close()
    with _ZYGOTE_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close()
        _ZYGOTES.clear()


atexit.register(close_worker_groups)


class _ProcessState:
    """What a call may change in a worker group's rank that a fresh process
    would start without (NOTE [Worker groups]), taken before the first call."""

    def __init__(self) -> None:
        import random

        import torch

        self.environ = dict(os.environ)
        self.torch_rng = torch.random.get_rng_state()
        self.python_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.modules = set(sys.modules)

    def restore(self, workdir: Path) -> None:
        import random

        import torch

        os.environ.clear()
        os.environ.update(self.environ, HARNESS_DIR=str(workdir))
        torch.random.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        # The test side's modules run afresh (their module-level state starts
        # anew); libraries stay imported. This module stays: it holds the cache.
        for name, module in list(sys.modules.items()):
            where = getattr(module, "__file__", None) or ""
            if (name not in self.modules and name != "dist_harness"
                    and Path(where).parent == H.TESTS_DIR):
                del sys.modules[name]
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()


def _clean_after(seq: int, ok: bool) -> bool:
    """Whether every rank of the group finished call ``seq`` fit to serve another:
    each says so in one all-reduce over the default group (which also proves the
    group still works)."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    lockstep = sys.modules.get("torch_mpmd.parallel.lockstep")
    # torch_mpmd keeps one ledger per pipeline group for the process's life; a
    # broken one (or one left mid-call) would refuse the next call's pipeline.
    ledgers = getattr(lockstep, "_LEDGERS", {}) if lockstep is not None else {}
    ok = ok and all(getattr(ledger, "broken", None) is None
                    and getattr(ledger, "phase", "idle") == "idle"
                    for ledger in ledgers.values())
    # A process group kept from one call makes a later call's groups differ
    # from a fresh process's: torch names a group made with
    # use_local_synchronization after its ranks and the number of live groups,
    # and a later call's group was given a live group's name ("The specified
    # group name has already been created"); destroying the groups instead
    # reuses their names with the old rendezvous keys still in the store. So
    # a call that leaves any group but the default one gets a new worker group.
    from torch.distributed import distributed_c10d as c10d

    ok = ok and len(c10d._world.pg_map) == 1
    votes = torch.tensor([int(ok), seq], dtype=torch.int64)
    try:
        dist.all_reduce(votes, async_op=True).wait(timeout=dt.timedelta(seconds=30))
    except Exception:  # noqa: BLE001  (a broken group: not fit)
        return False
    world = dist.get_world_size()
    return votes.tolist() == [world, seq * world]


def serve() -> None:
    """A worker group's rank: one call per line on stdin until stdin closes."""
    import traceback

    rank = int(os.environ["RANK"])
    H.stacks_on_request()
    H._init_group()
    state = _ProcessState()
    for line in sys.stdin:
        cmd = json.loads(line)
        workdir = Path(cmd["dir"])
        state.restore(workdir)
        status = 0
        try:
            H._write_json(workdir / f"result{rank}.json", H._call(cmd["target"], workdir))
        except BaseException:  # noqa: BLE001  (reported as a fresh rank's exit code 1)
            traceback.print_exc()
            status = 1
        clean = _clean_after(cmd["seq"], status == 0)
        sys.stdout.flush()
        sys.stderr.flush()
        H._write_json(workdir / f"done{rank}.json", dict(status=status, clean=clean))
    H._leave()  # the pytest session ended


def _forked_rank(request: dict[str, Any]) -> None:
    """In a child of the zygote: become the rank a fresh process would be
    (NOTE [Forked ranks]); never returns."""
    import random

    code = 1
    try:
        os.setsid()
        os.dup2(os.open(request["stdin"] or os.devnull, os.O_RDONLY), 0)
        # The zygote's sys.stdin may hold buffered requests of other ranks.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the process's stdin)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        H.stacks_on_request()  # after the dup2: the dump goes to this rank's stderr
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # a fresh process's own seed, not the zygote's
        # A worker group's rank serves (and ends with os._exit(0)).
        code = FP.run_as_python(serve if request["stdin"] is not None else H._rank_main)
    finally:
        FP.end(code)


def zygote_main() -> None:
    """Import what every rank imports, then fork a rank per request on stdin,
    answer its pid, and write its exit status once it ends (NOTE [Forked ranks])."""
    import selectors

    # Before the imports, which may set variables of their own.
    own = _interpreter_env(os.environ)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch_mpmd  # noqa: F401
    from torch_mpmd.programs.vec_isa import vec_isa_ok

    # The package's modules too: `import torch_mpmd` imports none of them
    # (its names are lazy), and every rank forked imported them again, 0.2-0.4
    # s each under load, about 200 ranks a run (a sampling profile of the
    # suite: BENCHMARKS.md, "Where the suite's CPU goes, sampled").
    for name in ("api", "compile.door", "compile.backend", "planning.auto", "checkpoint",
                 "parallel.quorum", "parallel.launch", "packing", "ordering", "trace"):
        importlib.import_module(f"torch_mpmd.{name}")
    # What torch imports on first use by a capture or a compile.
    import torch.distributed.tensor.experimental  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401

    vec_isa_ok()  # NOTE [A probe per machine]: known here, for every rank forked
    try:  # 2.3 s per rank that builds a Hugging Face model, paid here once
        import transformers
        import transformers.modeling_utils  # noqa: F401

        # The tests' architectures (transformers imports each on first use).
        for arch in ("LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                     "MixtralForCausalLM", "Qwen2MoeForCausalLM"):
            getattr(transformers, arch, None)
    except ImportError:
        pass
    try:  # the replica tests' interpreters (NOTE [Forked interpreters])
        import torchft.manager  # noqa: F401
    except ImportError:
        pass
    # NOTE [Frozen heap]: the imports' objects leave the collector's view.
    # A forked rank shares the zygote's pages until it writes one, and a
    # full collection writes to every object it tracks: without this, each
    # rank's first full collection copied about 120 MB of the zygote's heap
    # (30,000 page faults, 0.37 s of CPU), and every later one traversed it.
    gc.collect()
    gc.freeze()
    H.collect_less_often()
    # Where torchrun and its workers ask for an interpreter (NOTE [Forked
    # interpreters]); the folder is removed when the zygote ends (or by the
    # parent, which kills it).
    folder = tempfile.mkdtemp(prefix="mpmd_zygote_")
    server = FP.listen(os.path.join(folder, "fork.sock"))
    # A rank's exit status goes to a file (a str here), an interpreter's to
    # its client's connection.
    children: dict[int, Any] = {}
    out = sys.stdout.buffer
    out.write(f"ready {server.getsockname()}\n".encode())
    out.flush()
    # A child's exit wakes the loop (SIGCHLD through a pipe), not a timer:
    # polling every few milliseconds cost about a minute of CPU per suite.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(server, selectors.EVENT_READ)

    def in_child() -> None:  # the rank's own children are its own
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        for held in children.values():
            if not isinstance(held, str):
                held.close()

    while True:
        for pid, path in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                if isinstance(path, str):
                    tmp = path + ".tmp"
                    with open(tmp, "w") as f:
                        f.write(f"{code}\n")
                    os.replace(tmp, path)
                else:
                    FP.report(path, code)
                del children[pid]
        ready = [key.fileobj for key, _ in selector.select(timeout=1.0)]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
        if server in ready:
            forked = FP.accept(server, lambda env: _interpreter_env(env) == own, in_child)
            if forked is not None:
                children[forked[0]] = forked[1]
        if sys.stdin not in ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break  # the pytest session ended
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            server.close()
            in_child()
            _forked_rank(request)
        children[pid] = request["status"]
        out.write(f"{pid}\n".encode())
        out.flush()
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)
