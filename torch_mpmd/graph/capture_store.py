"""Captures kept on disk: other processes and later launches reuse a trace.

NOTE [Capture store]: the capture memo (capture_memo.py) keeps captures for
one process. Every rank of a job captures the same model, and a relaunch
(after a failure, the next run of a script, the next test) captures it all
again: seconds of Dynamo tracing per model and shape. The store writes each
capture the memo keeps to a folder and looks there when the memo misses.

What makes a kept capture right for a new call, and how the store checks it:

- The memo's structure key (the model's classes, structure, attribute values,
  hooks, tensor metadata, the inputs, global modes and Dynamo's config),
  written with names that mean the same objects in another process
  (names.py). A key holding an object without such a name (an instance, a
  closure, a class defined in a function, a DTensor's mesh) is not stored.
- The code the trace ran: the digest of every source file Dynamo traced
  (the model's, a library's), checked when the entry is loaded. torch's own
  files are covered by its version; an edited model file is a miss.
- The Python values the trace read (NOTE [State guards]): values as
  themselves, objects by name, checked on the new model as the memo checks
  them.
- The environment: torch's version and build, Python's, the CPU capability
  torch dispatches to and torch_mpmd's own capture code (a digest of its
  graph package and the compile door's frame module).

Not stored: dynamic captures (symbolic sizes), captures whose graph holds a
value pickle cannot write (an op outside torch, a class defined in a
function). A store that cannot be written or read (a full disk, a corrupt
entry, a folder of another user) is a miss, never an error: the capture
traces as before.

The folder: ``MPMD_CAPTURE_CACHE`` (``0`` turns the store off), else
``<tmp>/torch_mpmd_<user>/captures``, created private to the user as
Inductor's cache is. Files hold pickles: load only a folder you trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import getpass
import hashlib
import inspect
import json
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torch_mpmd.graph.names import Unnamed, name_of
from torch_mpmd.graph.state_guards import StateGuards, from_persisted

__all__ = ["claim", "directory", "disk_key", "load", "mark_unsaved", "save",
           "source_files", "stats"]

FORMAT = 1
_log = logging.getLogger(__name__)
_MAX_ENTRIES = 2000  # files kept; beyond this or _MAX_BYTES the least recently used go
_MAX_BYTES = 1 << 30
_SUFFIX = ".capture"
_LOCK = ".lock"
_UNSAVED = ".unsaved"
_CLAIM_WAIT = 300.0  # seconds a rank waits for another's trace of the same capture
_HEARTBEAT = 0.5  # seconds between a claim holder's touches of its lock file
_HEARTBEAT_STALE = 5.0  # seconds without a touch after which waiters stop waiting
_stats = {"loaded": 0, "saved": 0, "not_saved": 0, "stale": 0}
_file_digests: dict[str, tuple[tuple, str]] = {}  # path -> (its stat stamp, sha256)
_IMPORTED_AT = time.time()
_CLOCK_SLACK = 2.0  # seconds: btime's resolution, and file systems' timestamps'
_started: float | None = None
_env_digest: str | None = None
_DROPPED_META = frozenset({"grapharg", "mpmd_source", "source_fn_stack", "fwd_source_fn_stack"})


def stats() -> dict[str, int]:
    """Counts since the process started: entries loaded, saved, captures not
    saved (something in them has no name across processes) and entries found
    stale (a source file changed, a guarded value differs)."""
    return dict(_stats)


def directory() -> Path | None:
    """The store's folder, created if missing; None when the store is off
    (``MPMD_CAPTURE_CACHE=0``) or the folder is not this user's own."""
    setting = os.environ.get("MPMD_CAPTURE_CACHE", "")
    if setting == "0":
        return None
    if setting:
        path = Path(setting)
    else:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001  (no user name in a container)
            user = str(os.getuid())
        path = Path(tempfile.gettempdir()) / f"torch_mpmd_{user}" / "captures"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_uid != os.getuid():
            return None
    except OSError:
        return None
    return path


def _file_digest(path: str) -> str | None:
    """sha256 of the file's bytes (kept while its stat says it is unchanged:
    ctime too, which any write or utime moves)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    known = _file_digests.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
    _file_digests[path] = (stamp, digest)
    return digest


def _process_start() -> float:
    """When this process's code could first have been read: the process's
    start (Linux), or this module's import (inherited by a forked process),
    whichever is earlier."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime, field 22
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return min(_IMPORTED_AT, boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def _environment() -> str:
    """torch, Python, the CPU capability and torch_mpmd's capture code."""
    global _env_digest
    if _env_digest is None:
        here = Path(__file__).resolve().parent
        own = sorted(str(p) for p in here.glob("*.py"))
        own.append(str(here.parent / "compile" / "frame.py"))
        parts = [FORMAT, torch.__version__, torch.version.git_version, sys.version,
                 torch.backends.cpu.get_cpu_capability(),
                 [(Path(p).name, _file_digest(p)) for p in own]]
        _env_digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    return _env_digest


def disk_key(key: tuple | None) -> str | None:
    """The file name stem for the memo's structure ``key``, or None when
    something in it has no name across processes (or the store is off)."""
    if key is None or directory() is None:
        return None
    try:
        named = name_of(key)
    except (Unnamed, RecursionError) as e:
        _log.debug("capture not stored: %s", e)
        return None
    text = json.dumps([_environment(), named], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def source_files(traced_code: Iterable[types.CodeType], output_spec: Any) -> tuple[str, ...]:
    """The source files of the code a trace ran (Dynamo's traced code
    objects), whose digests an entry records. A dataclass's generated
    methods (the ``__init__`` of a model's output class) have no file: their
    source is the class's fields, so the files of the classes in the return
    value's structure (``output_spec``) stand for them."""
    files: set[str] = set()
    dataclass_code = False
    for code in traced_code:
        if code.co_filename == "<string>" and code.co_qualname.startswith("__create_fn__"):
            dataclass_code = True
        else:
            files.add(code.co_filename)
    todo = [output_spec] if dataclass_code and output_spec is not None else []
    while todo:
        node = todo.pop()
        kind = getattr(node, "type", None)
        if isinstance(kind, type) and kind.__module__ not in ("builtins", "collections"):
            try:
                files.add(inspect.getfile(kind))
            except (TypeError, OSError):
                files.add(f"<no file for {kind.__qualname__}>")  # never stored
        todo.extend(node.children() if hasattr(node, "children") else ())
    return tuple(sorted(files))


def _started_at() -> float:
    global _started
    if _started is None:
        _started = _process_start()
    return _started


def _traced_files(files: Iterable[str]) -> dict[str, str] | None:
    """Digest of each traced source file outside torch; None when one cannot
    be read, or was changed since this process started: the code the trace
    ran may then be the file's old text, and a later process reading the new
    text must not load its graph."""
    started = _started_at()
    torch_dir = str(Path(torch.__file__).resolve().parent) + os.sep
    out = {}
    for f in sorted(set(files)):
        if f.startswith(torch_dir) or f.startswith("<frozen "):  # torch's, Python's own
            continue
        digest = _file_digest(f)
        if digest is None:  # "<string>", a file gone since it was imported
            _log.debug("capture not stored: %s cannot be read", f)
            return None
        try:
            changed = os.stat(f).st_mtime > started - _CLOCK_SLACK
        except OSError:
            return None
        if changed:
            _log.debug("capture not stored: %s changed since this process started", f)
            return None
        out[f] = digest
    return out


@contextlib.contextmanager
def claim(stem: str | None) -> Iterator[None]:
    """Held while this process looks up, and perhaps traces and saves, the
    capture under ``stem``: the ranks of a job that capture one model at once
    take turns, so one traces and the others load its entry (on a host with
    fewer cores than ranks the traces would otherwise share the cores).

    Never a hang: a holder that dies releases the claim (an OS file lock);
    one that stops (a stalled or stopped process) stops its heartbeat, and a
    waiter that sees no beat for ``_HEARTBEAT_STALE`` seconds goes on
    unclaimed and traces itself, as it does after ``_CLAIM_WAIT`` seconds
    in any case; so a peer stalled while capturing costs the others seconds,
    and the pipeline's own bounds name it later. A capture that could not be
    saved leaves a mark, and later claims of it do not wait (claims of
    processes started before the mark: a later launch may save it)."""
    folder = directory()
    if stem is None or folder is None or _marked_unsaved(folder / f"{stem}{_UNSAVED}"):
        yield
        return
    path = folder / f"{stem}{_LOCK}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    beating = threading.Event()
    try:
        if _acquire(fd, path):
            os.utime(path)  # a beat now: the file may be old
            beater = threading.Thread(target=_heartbeat, args=(path, beating), daemon=True,
                                      name="mpmd-capture-claim")
            beater.start()
        yield
    finally:
        beating.set()
        os.close(fd)  # releases the lock


def _marked_unsaved(mark: Path) -> bool:
    """Whether ``mark`` (see :func:`mark_unsaved`) was made since this
    process started: a mark of an earlier launch (whose capture could not be
    saved then: a file just edited) must not stop this launch's ranks from
    taking turns."""
    try:
        return mark.stat().st_mtime >= _started_at() - _CLOCK_SLACK
    except OSError:
        return False


def _acquire(fd: int, path: Path) -> bool:
    """Take the lock on ``fd``: True once held, False when its holder stopped
    beating or ``_CLAIM_WAIT`` passed (go on without it)."""
    start = time.monotonic()
    deadline = start + _CLAIM_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False
        # Silence counts from this wait's start too: a holder beats just
        # after it takes the lock, and until then the file bears the time of
        # its last use (an earlier launch), which is not a stopped holder.
        try:
            silent = min(time.time() - path.stat().st_mtime, time.monotonic() - start)
        except OSError:
            silent = 0.0
        if silent > _HEARTBEAT_STALE or time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _heartbeat(path: Path, done: threading.Event) -> None:
    """Touch the lock file while the claim is held (see :func:`claim`)."""
    while True:
        try:
            os.utime(path)
        except OSError:
            pass
        if done.wait(_HEARTBEAT):
            return


# ------------------------------------------------------------------ writing

def _pickler() -> type:
    """torch's GraphPickler (fake tensors by their metadata, ops by name),
    which also clears the fake mode of every tensor description nested in a
    fake tensor's (a view's base, a parameter's grad): torch 2.13 clears it
    on the outer one only, and a fake mode cannot be pickled."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.meta_utils import MetaTensorDesc
    from torch.fx import _graph_pickler as gp

    def without_mode(desc: Any) -> Any:
        # Every description nested in this one too: a view's base, a
        # parameter's grad (a capture after a training step), a subclass's
        # inner tensors.
        nested = {}
        for field in dataclasses.fields(desc):
            value = getattr(desc, field.name)
            if isinstance(value, MetaTensorDesc):
                nested[field.name] = without_mode(value)
            elif isinstance(value, dict) and any(isinstance(v, MetaTensorDesc)
                                                 for v in value.values()):
                nested[field.name] = {k: without_mode(v) if isinstance(v, MetaTensorDesc)
                                      else v for k, v in value.items()}
        return dataclasses.replace(desc, fake_mode=None, **nested)

    class Pickler(gp.GraphPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, FakeTensor):
                data = gp._TensorPickleData(self._meta_tensor_describer, obj)
                data.metadata = without_mode(data.metadata)
                return type(data).unpickle, (data, self._unpickle_state)
            return super().reducer_override(obj)

    return Pickler


def _options() -> Any:
    from torch.fx._graph_pickler import Options

    return Options(ops_filter=None, node_metadata_key_filter=lambda k: k not in _DROPPED_META)


def save(stem: str | None, template: Any, files: Iterable[str]) -> bool:
    """Write ``template`` (a capture the memo keeps) under ``stem``
    (:func:`disk_key`) with the digests of the traced ``files``. Does
    nothing (and returns False) when the capture cannot be written
    faithfully."""
    folder = directory()
    if stem is None or folder is None:
        return False
    if template.state is None or any(p.kind == "size" for p in template.placeholders):
        _stats["not_saved"] += 1
        return False
    try:
        digests = _traced_files(files)
        guards = template.state.persisted()
        if digests is None:
            raise Unnamed("a traced file cannot be read")
        header = pickle.dumps({"files": digests, "guards": guards})
        body = _pickler().dumps(dataclasses.replace(template, state=None), _options())
    except Exception as e:  # noqa: BLE001  (Unnamed, an object pickle cannot write)
        _log.debug("capture not stored: %s: %s", type(e).__name__, e)
        _stats["not_saved"] += 1
        return False
    entry = hashlib.sha256(header).hexdigest()[:16]
    path = folder / f"{stem}-{entry}{_SUFFIX}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            f.write(body)
        os.replace(tmp, path)  # readers see a whole entry or none
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    _stats["saved"] += 1
    (folder / f"{stem}{_UNSAVED}").unlink(missing_ok=True)
    _prune(folder)
    return True


def mark_unsaved(stem: str | None) -> None:
    """Note that the capture under ``stem`` was not saved: later claims of it
    do not wait for an entry that will not come."""
    folder = directory()
    if stem is None or folder is None:
        return
    try:
        (folder / f"{stem}{_UNSAVED}").touch()
    except OSError:
        pass


def _prune(folder: Path) -> None:
    """Keep the folder under ``_MAX_ENTRIES`` entries and ``_MAX_BYTES``:
    beyond either, the least recently used go, down to 3/4 of both."""
    try:
        entries = [(p.stat(), p) for p in folder.iterdir()
                   if p.suffix in (_SUFFIX, _LOCK, _UNSAVED)]
    except OSError:
        return
    total = sum(st.st_size for st, _ in entries)
    if len(entries) <= _MAX_ENTRIES and total <= _MAX_BYTES:
        return
    entries.sort(key=lambda e: e[0].st_mtime)
    count = len(entries)
    for st, p in entries:  # the least recently used first (a load touches its entry)
        if count <= _MAX_ENTRIES * 3 // 4 and total <= _MAX_BYTES * 3 // 4:
            break
        p.unlink(missing_ok=True)
        count -= 1
        total -= st.st_size


# ------------------------------------------------------------------ reading

def load(stem: str | None, module: torch.nn.Module, capture_globals: dict) -> Any:
    """A stored capture under ``stem`` whose source files and guarded values
    hold for ``module`` now, as a memo template (its state bound to
    ``module``), or None."""
    folder = directory()
    if stem is None or folder is None:
        return None
    for path in sorted(folder.glob(f"{stem}-*{_SUFFIX}")):
        try:
            template = _read(path, module, capture_globals)
        except Exception as e:  # noqa: BLE001  (a corrupt or foreign entry: a miss)
            _log.debug("stored capture %s not read: %s: %s", path.name, type(e).__name__, e)
            template = None
        if template is not None:
            try:
                os.utime(path)  # recently used: pruned last
            except OSError:
                pass
            _stats["loaded"] += 1
            return template
    return None


def _read(path: Path, module: torch.nn.Module, capture_globals: dict) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = pickle.loads(data[8:8 + size])
    files: Mapping[str, str] = header["files"]
    if any(_file_digest(f) != digest for f, digest in files.items()):
        _stats["stale"] += 1
        return None
    state = from_persisted(header["guards"], {"L": {"module": module}, "G": capture_globals})
    if state is None:
        _stats["stale"] += 1
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's pytree on an old TreeSpec
        template = GraphPickler.loads(data[8 + size:], FakeTensorMode())
    # The memo's template holds no model: its guards see the frame's globals only.
    template.state = StateGuards(state.guards, {"L": {}, "G": {}})
    return template
