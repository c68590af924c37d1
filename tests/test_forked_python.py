"""The interpreters forked for launchers (tests/forked_python.py, NOTE
[Forked interpreters]): a script run through the client behaves as under
``python`` (its arguments, environment, directory, files, exit code, a
signal it dies of), a signal sent to the client reaches it, killing the
client kills it, an environment that does not fit runs real ``python``, and
torchrun restarts a worker that killed itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_harness as H

SCRIPT = r'''
import json, os, signal, sys, time
out = sys.argv[1]
mode = sys.argv[2]
def record(**extra):
    with open(out, "w") as f:
        json.dump(dict(argv=sys.argv, name=__name__, cwd=os.getcwd(), pid=os.getpid(),
                       path0=sys.path[0], flag=os.environ.get("FORK_FLAG"),
                       forked="torch" in sys.modules, **extra), f)
if mode == "exit":
    record()
    print("to stdout")
    print("to stderr", file=sys.stderr)
    sys.exit(7)
if mode == "kill":
    record()
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    def on_term(*_):
        record(term=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
    record(term=False)
    time.sleep(60)
if mode == "sleep":
    record()
    time.sleep(60)
'''

WORKER = r'''
import sys
forked = "torch" in sys.modules
import os, signal
import torch.distributed as dist
import torch_mpmd as mpmd
mpmd.init_process_group("gloo")  # a relaunch's own store keys (plain gloo's can hang)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
t = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    f.write(str([t.item(), os.environ["TORCHELASTIC_RESTART_COUNT"], forked]))
dist.destroy_process_group()
'''


def _start(tmp_path: Path, mode: str, **env: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{mode}.json"
    python, prefix, full = H.launcher(env)
    assert prefix, "no zygote: the interpreters would not be forked"
    proc = subprocess.Popen([*python, str(script), str(out), mode], env=full, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def _wait_for(path: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{path} was not written in {timeout} s")


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_script_runs_as_under_python_with_its_exit_code_and_files(tmp_path):
    proc, out = _start(tmp_path, "exit", FORK_FLAG="on")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 7, stderr
    got = json.loads(out.read_text())
    assert got["forked"], "the interpreter was started, not forked"
    assert got["argv"] == [str(tmp_path / "script.py"), str(out), "exit"]
    assert got["name"] == "__main__" and got["flag"] == "on"
    assert got["cwd"] == str(tmp_path) and got["path0"] == str(tmp_path)
    assert got["pid"] != proc.pid
    assert stdout == "to stdout\n" and stderr == "to stderr\n"


def test_a_signal_ends_the_client_as_it_ended_the_interpreter(tmp_path):
    proc, out = _start(tmp_path, "kill")
    proc.communicate(timeout=60)
    assert _wait_for(out)["forked"]
    assert proc.returncode == -signal.SIGKILL


def test_a_signal_sent_to_the_client_reaches_the_interpreter(tmp_path):
    proc, out = _start(tmp_path, "term")
    assert _wait_for(out)["term"] is False
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 3 and _wait_for(out)["term"] is True


def test_killing_the_client_kills_the_interpreter(tmp_path):
    proc, out = _start(tmp_path, "sleep")
    pid = _wait_for(out)["pid"]
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(pid), f"interpreter {pid} outlived its client"


def test_an_environment_read_at_import_that_differs_runs_python_itself(tmp_path):
    proc, out = _start(tmp_path, "exit", OMP_NUM_THREADS="2")
    proc.communicate(timeout=60)
    assert proc.returncode == 7
    got = json.loads(out.read_text())
    assert not got["forked"] and got["pid"] == proc.pid  # execv: the client became python


def test_torchrun_restarts_a_forked_worker_that_killed_itself(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    python, prefix, env = H.launcher()
    cmd = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", *prefix, str(worker), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.json").read_text() == "[3.0, '1', True]"
