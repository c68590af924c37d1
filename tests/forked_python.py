"""A Python interpreter for launchers the tests start (torchrun and its
workers), forked from the test zygote instead of started and importing torch.

    python forked_python.py script.py args...
    python forked_python.py -m module args...

NOTE [Forked interpreters]: the tests that need torchrun itself (its worker
restarts, its handling of a dead worker) start it and its workers as real
processes, and each imported torch, Dynamo, torchft and torch_mpmd again:
about 5 s of CPU per process, two thirds of the replica tests' CPU. This
file is both ends of a cheaper start:

- the client (this file run as a script, importing nothing heavy): it
  connects to the zygote's socket (``MPMD_TEST_FORK_SOCKET``), hands over its
  argument list, environment, working directory and its stdin, stdout and
  stderr, and then stands in for the interpreter the zygote forks: it passes
  on every signal it is sent (torchrun stops workers with SIGTERM to their
  process group) and exits as the forked interpreter exited, with its code or
  by its signal. A client killed outright takes the interpreter with it (the
  interpreter watches the client's pid).
- the zygote's side (:func:`accept`): it checks that the client's
  environment matches its own in what torch reads at import (else the client
  runs ``python`` itself, as it does without a socket), forks, and in the
  child runs the script or module as ``python`` would run it as ``__main__``.

Nothing in the launch changes but the start: torchrun, its rendezvous and
restarts, the workers' environment and files are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

SOCKET_VAR = "MPMD_TEST_FORK_SOCKET"
# Relayed to the interpreter. SIGKILL and SIGSTOP cannot be caught: a client
# killed outright is seen by the interpreter's watcher.
_RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2)


def _exec_python(args: list[str]) -> None:
    """Be the interpreter ourselves (no zygote, or one that does not fit)."""
    os.execv(sys.executable, [sys.executable, "-u", *args])


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return ""
        data += chunk
    return data.decode()


def client(args: list[str]) -> None:
    """Run ``python args...`` in an interpreter forked by the zygote; never returns."""
    path = os.environ.get(SOCKET_VAR)
    if not path:
        _exec_python(args)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = dict(args=args, env=dict(os.environ), cwd=os.getcwd(), client=os.getpid())
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        answer = _read_line(sock).split()
    except OSError:
        answer = []
    if answer[:1] != ["pid"]:  # refused (another environment) or no zygote
        sock.close()
        _exec_python(args)
    pid = int(answer[1])

    def relay(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in _RELAYED:
        signal.signal(sig, relay)
    end = _read_line(sock).split()
    code = int(end[1]) if end[:1] == ["exit"] else 1  # the zygote went away: failed
    if code < 0:  # ended by a signal: end the same way
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process (none of torchrun's)
    os._exit(code)


# ---------------------------------------------------------------- the zygote's side

def listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    return server


def accept(server: socket.socket, fits: Callable[[dict], bool],
           in_child: Callable[[], None]) -> tuple[int, socket.socket] | None:
    """Take one client's request; fork its interpreter when ``fits(env)``.
    Returns (pid, connection) of the fork, or None (the client was told to
    run python itself). ``in_child``: run first in the child (the zygote's
    own file descriptors and signal handlers undone)."""
    conn, _ = server.accept()
    conn.settimeout(30)
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise OSError("client left")
            data += chunk
        request = json.loads(data)
    except (OSError, ValueError):
        conn.close()
        return None
    if len(fds) != 3 or not fits(request["env"]):
        for fd in fds:
            os.close(fd)
        conn.sendall(b"exec\n")
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        server.close()
        conn.close()
        in_child()
        _interpreter(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    return pid, conn


def report(conn: socket.socket, code: int) -> None:
    """Tell the client how its interpreter ended (it may be gone already)."""
    try:
        conn.sendall(f"exit {code}\n".encode())
    except OSError:
        pass
    conn.close()


def _watch(client_pid: int) -> None:
    """End this interpreter when its client is killed (torchrun's SIGKILL
    after a SIGTERM that was not obeyed in time)."""
    import select
    import threading

    try:
        fd = os.pidfd_open(client_pid)
    except ProcessLookupError:  # gone before we looked
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # no pidfds here: not watched
        return

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="client-watch", daemon=True).start()


def _interpreter(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -u args...``; never returns."""
    import io
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        # python -u: text straight to the files
        sys.stdout, sys.stderr = (io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115
                                                   write_through=True, line_buffering=True)
                                  for fd in (1, 2))
        for sig in _RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _watch(request["client"])
        import random
        random.seed()  # a fresh process's own seed, not the zygote's
        args = request["args"]

        def main() -> None:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]  # runpy puts the module's path first
                sys.path[0] = os.getcwd()
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
                runpy.run_path(args[0], run_name="__main__")

        code = run_as_python(main)
    except BaseException:  # noqa: BLE001  (before the script ran: said on its stderr)
        traceback.print_exc()
    finally:
        end(code)


def run_as_python(main: Callable[[], None]) -> int:
    """Run ``main`` as the interpreter runs a script and return its exit code:
    SystemExit's (its message on stderr), or 1 and the traceback for an
    uncaught exception; the exit handlers run first."""
    import atexit
    import traceback

    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (what the interpreter does with it)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def end(code: int) -> NoReturn:
    """End a forked process with ``code``, its output flushed, skipping the
    zygote's own exit handlers."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    client(sys.argv[1:])
