"""Checkpoints through torch.distributed.checkpoint, under the original FQNs.

    mpmd.checkpoint.save(pipe, opt, "ckpt",                      # collective
                         extra={"step": i, "lr_scheduler": sched, "data": loader_state},
                         extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    got = mpmd.checkpoint.load(pipe, opt, "ckpt",                # collective
                               extra={"lr_scheduler": sched},
                               extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    got["extra"]["step"], got["extra"]["data"], got["step"], got["directory"]

Each rank writes its stages' parameters, buffers and optimizer state under the
module's own FQNs (DCP stores a tensor held by several ranks once), so a
checkpoint saved with one pipeline size loads into another, or into the
unsplit module in one process.

User state (``extra``): a value with ``state_dict()``/``load_state_dict()``
(DCP's Stateful: an LR scheduler, a stateful data loader, :class:`RNGState`)
is saved through its ``state_dict()`` and restored in place by ``load`` when
passed there under the same name; any other value (ints, floats, strings,
lists, tuples, dicts, tensors) is saved and comes back in ``load``'s result.
``extra`` is saved once, from rank 0; ``extra_per_rank`` once per rank (the
RNG) and restored on the rank of the same number. Non-tensor values are stored
as JSON (tagged for tuples, bytes and non-string dict keys), tensors through
DCP: nothing of ours is pickled.

Loading runs no code from the checkpoint. Besides ``extra`` (above), a
checkpoint carries tensors and plain values only: None, bool, int, float,
complex, str, bytes, and tuples, lists, sets and dicts of them (the
optimizer's param-group options, what a module's state dict holds besides
tensors); ``save`` refuses anything else in the module's or optimizer's state,
naming the key. DCP pickles its
``.metadata`` and every non-tensor item; ``load`` reads them with unpicklers
that resolve only the names those hold (DCP's metadata dataclasses, torch.Size,
dtypes and layouts; the builtins of plain values) and refuses any other name
before calling anything, naming the file (and key). Tensor data are read with
``torch.load(weights_only=True)``.

NOTE [Checkpoint layout]
------------------------

    path/latest                   "step_7.1\\n": the current checkpoint (atomic rename)
    path/step_7/                  an older save of step 7, untouched by later ones
    path/step_7.1/.metadata       DCP's index (rank 0)
    path/step_7.1/__<r>_0.distcp  DCP's data written by rank r
    path/step_7.1/rank_<r>.json   rank r's manifest: a CRC32 of every item it
                                  wrote (key, file, byte range), its
                                  extra_per_rank state, and on rank 0 ``extra``;
                                  a sha256 of each extra entry and, on rank 0,
                                  of .metadata

Every save goes to a directory that did not exist: ``step_<k>``, or
``step_<k>.<n>`` (n one past the highest) when a save of step k exists, so a
save never writes into what ``latest`` names. Only when every rank has written
its data and manifest does rank 0 replace ``latest`` (write, fsync, rename), so
a save that dies part-way, on any rank, leaves the previous checkpoint current
and whole. Each save first removes the directories of saves that died
part-way (a step directory without every rank's manifest, never the one
``latest`` names), and a rank whose save fails because another died raises a
CheckpointError saying so. ``keep_last=n`` then removes all but the current
and the n-1 most recently completed checkpoints.

``load`` checks before it reads anything (and every rank raises the same
error, whose first line names the problem): with ``strict`` (the default) the
checkpoint's model and optimizer keys must be exactly those of the module and
optimizer over all ranks, with the same shapes; every file it reads must be
there; every item it reads must match the CRC32 recorded at save, else the
error names the key and the file; ``.metadata`` must match its sha256 (checked
before it is read) and every ``extra`` / ``extra_per_rank`` entry its own, else
the error names the file and the entry. A load is all or nothing: one that
fails anywhere (also inside DCP's read, or in a Stateful's load_state_dict)
leaves the module, the optimizer, the step counter and the Stateful objects
exactly as they were (load's _Undo). Neither save nor load ever calls the
optimizer's step() (_no_optimizer_step). Every wait for the other ranks is
bounded by ``timeout=`` (NOTE [Checkpoint waits] in checkpoint_sync.py). The optimizer's param-group options (lr,
initial_lr, ...) are stored per parameter and not compared: those both have
load. The CRC32 covers each item's bytes as written (read back after the save), and
load reads the bytes of the items it needs once more to verify them before DCP
does; tensors of the user's state come back on the CPU.

An optimizer built before the first step (the whole module's parameters) is
trimmed to this rank's parameters on save and on load after capture.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import hashlib
import io
import json
import numbers
import os
import pathlib
import pickle
import random
import re
import shutil
import warnings
import zipfile
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner,
                                          FileSystemReader)
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from torch_mpmd.checkpoint_sync import CheckpointError, DCPFailed, Sync, timeout_seconds
from torch_mpmd.parallel import lockstep

__all__ = ["save", "load", "latest", "RNGState", "CheckpointError"]

_LATEST = "latest"
_FORMAT = "torch_mpmd.checkpoint"
_VERSION = 2                                 # 2: sha256 of .metadata and of extra
_NAME = re.compile(r"step_(\d+)(?:\.(\d+))?")
_SECTIONS = ("model", "optim", "pipeline")   # checked for unexpected keys (in this order)
_EXTRA = "extra"                             # DCP keys of extra tensors: extra.<name>.<i>
_EXTRA_PER_RANK = "extra_per_rank"           # extra_per_rank.<rank>.<name>.<i>
_SHOWN = 3                                   # keys named per kind in an error's first line
_DETAIL_LINES = 10                           # problems listed in a load error
_CHUNK = 1 << 24                             # bytes read at a time for a CRC


class RNGState:
    """The random number generators of this process as a Stateful, for
    ``extra_per_rank``: torch's CPU generator, every CUDA device's (when CUDA is
    initialized at save), and Python's ``random``."""

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return {"cpu": torch.get_rng_state(), "cuda": list(cuda), "python": random.getstate()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"] and torch.cuda.is_available():
            for device, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, device)
        random.setstate(state["python"])


# ----------------------------------------------------------------- helpers

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _raise_agreed(problems: list[str | None], what: str) -> None:
    """Raise on every rank when any rank reported a problem (``problems`` as
    gathered by ``Sync.gather``): the first line is the first failing rank's."""
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if not failed:
        return
    rank, first = failed[0]
    head, _, rest = first.partition("\n")
    where = f" (rank {rank})" if len(problems) > 1 else ""
    lines = [f"{what}: {head}{where}"] + ([rest] if rest else [])
    lines += [f"rank {r}: {p}" for r, p in failed[1:]]
    raise CheckpointError("\n".join(lines))


def _dcp_error(what: str, target: str, exc: CheckpointException) -> CheckpointError:
    """DCP's CheckpointException puts the cause at the end of a traceback:
    lead with it instead."""
    failures = sorted(exc.failures.items())
    rank, (cause, _) = failures[0]
    head, _, rest = str(cause).partition("\n")
    others = [r for r, _ in failures[1:]]
    more = f" (and on ranks {others})" if others else ""
    return CheckpointError(f"{what} {target} failed on rank {rank}{more}: "
                           f"{type(cause).__name__}: {head}" + (f"\n{rest}" if rest else ""))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_other_ranks_parameters(module: torch.nn.Module, optimizer: Any) -> None:
    """An optimizer built before the pipeline's capture holds the whole module's
    parameters; those of other ranks' stages never get a gradient here and have
    no FQN in this rank's state dict: drop them (and their state, if any)."""
    if optimizer is None or not getattr(module, "is_captured", False):
        return
    local = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in local:
                optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if id(p) in local]


# The optimizer's state and param-group options keyed by parameter FQN
# (optim.param_groups.<fqn>.lr), not by group number: ranks holding different
# parameters then never write the same key with different values (DCP would
# keep one rank's), and any split of the module reads the keys of its own.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def _no_optimizer_step() -> Iterator[None]:
    """DCP's get/set_optimizer_state_dict first "initialize" an optimizer that
    has no state yet by calling its step() with zero gradients: an AdamW so
    treated has step=1 and moments, and later training differs from a run
    that never saved. A checkpoint must never change the optimizer: this turns
    that step off for the calls inside (the state stays empty: saved as none;
    load makes the state the checkpoint holds, see _optimizer_templates)."""
    real = dcp_state_dict._init_optim_state
    dcp_state_dict._init_optim_state = lambda optim: None
    try:
        yield
    finally:
        dcp_state_dict._init_optim_state = real


def _state(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    _drop_other_ranks_parameters(module, optimizer)
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        with _no_optimizer_step():
            state["optim"] = get_optimizer_state_dict(module, optimizer, options=_OPTIM)
    state["pipeline"] = {"step": torch.tensor(getattr(module, "step_count", 0))}
    return state


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def _crc_ranges(path: str, ranges: list[tuple[int, int]]) -> list[int | None]:
    """CRC32 of each (offset, length) byte range of ``path``; None for a range
    past the end of the file."""
    out: list[int | None] = []
    with open(path, "rb") as f:
        for offset, length in ranges:
            f.seek(offset)
            crc, left = 0, length
            while left:
                lockstep.progress("checksumming the checkpoint's data")   # NOTE [Named waits]
                block = f.read(min(left, _CHUNK))
                if not block:
                    break
                crc = zlib.crc32(block, crc)
                left -= len(block)
            out.append(None if left else crc)
    return out


def _digest(value: Any) -> str:
    """sha256 of a JSON value in one canonical spelling (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _digests(entries: Mapping[str, Any]) -> dict[str, str]:
    """{name: sha256} of a manifest's extra or extra_per_rank entries."""
    return {name: _digest(entry) for name, entry in entries.items()}


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------ extra state as JSON
#
# JSON values stand for themselves; the rest is tagged: {"__tuple__": [...]},
# {"__dict__": [[key, value], ...]} (keys that are not all strings, or that
# collide with a tag), {"__bytes__": base64}, and {"__tensor__": dcp_key,
# "dtype": "float32", "shape": [...]} whose data DCP stores under dcp_key.

_TAGS = ("__tuple__", "__dict__", "__bytes__", "__tensor__")


def _encode(value: Any, where: str, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = value.detach()
        return {"__tensor__": key, "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", prefix, tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", prefix, tensors)
                              for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(t in value for t in _TAGS):
            return {k: _encode(v, f"{where}[{k!r}]", prefix, tensors) for k, v in value.items()}
        return {"__dict__": [[_encode(k, f"{where} key {k!r}", prefix, tensors),
                              _encode(v, f"{where}[{k!r}]", prefix, tensors)]
                             for k, v in value.items()]}
    raise TypeError(f"{where}: a value of type {type(value).__name__} cannot be saved "
                    f"(JSON values, tuples, bytes, tensors and dicts/lists of them, or "
                    f"an object with state_dict()/load_state_dict())")


def _walk_tensors(value: Any, where: str, found: dict[str, torch.Tensor], depth: int = 0) -> None:
    """Empty tensors for the tensor references in an encoded value (DCP loads
    into them); raises ValueError on a malformed reference or a value nested
    deeper than a checkpoint's plain values may be."""
    if depth > _MAX_PLAIN_DEPTH:
        raise ValueError(f"{where} is nested more than {_MAX_PLAIN_DEPTH} levels deep: refused")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _walk_tensors(v, f"{where}[{i}]" if depth < 8 else where, found, depth + 1)
    elif isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            shape = value.get("shape")
            if (not isinstance(value["__tensor__"], str) or not isinstance(dtype, torch.dtype)
                    or not isinstance(shape, list)
                    or not all(isinstance(s, int) and s >= 0 for s in shape)):
                raise ValueError(f"{where}: malformed tensor entry {value!r}")
            found[value["__tensor__"]] = torch.empty(shape, dtype=dtype)
        else:
            for k, v in value.items():
                _walk_tensors(v, f"{where}[{k!r}]" if depth < 8 else where, found, depth + 1)


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__dict__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__dict__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _encode_extra(values: Mapping[str, Any] | None, where: str, prefix: str,
                  tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{name: {"state_dict": ...}} for a Stateful, {name: {"value": ...}} otherwise."""
    out: dict[str, Any] = {}
    for name, value in (values or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"{where} names must be strings, not {name!r}")
        at = f"{where}[{name!r}]"
        if _is_stateful(value):
            out[name] = {"state_dict": _encode(value.state_dict(), f"{at}.state_dict()",
                                               f"{prefix}.{name}", tensors)}
        else:
            out[name] = {"value": _encode(value, at, f"{prefix}.{name}", tensors)}
    return out


# ------------------------------------------------ reading without running code
#
# DCP pickles .metadata and every non-tensor item (the optimizer's param-group
# options: lr, betas, ...), and unpickling may call any function the file
# names. We unpickle both with unpicklers that resolve only the names listed
# here: the dataclasses of DCP's metadata, torch's dtypes and layouts, and the
# few builtins plain values need. Any other name is refused before anything
# is called. Tensors' data are read by DCP with torch.load(weights_only=True).

_MD = "torch.distributed.checkpoint.metadata"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class _Refused(pickle.UnpicklingError):
    """A pickle names something a checkpoint never holds (args[0] says what)."""


def _layout(name: str) -> torch.layout:
    """torch.strided (or another layout) from its str(); what a pickle of
    TensorProperties calls torch.serialization._get_layout for."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise _Refused(f"an unknown layout {name!r}")
    return layouts[name]


def _latin1(text: str, encoding: str) -> bytes:
    """bytes as protocol 2 pickles them (torch.save's): _codecs.encode(text,
    'latin1'), admitted for that encoding only."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _builtins(**names: Any) -> dict[tuple[str, str], Any]:
    """``names`` under both module names pickle uses for builtins (protocol 2
    writes ``__builtin__``)."""
    return {(module, n): v for module in ("builtins", "__builtin__") for n, v in names.items()}


# Plain values: None, bool, int, float, complex, str, bytes, and tuples, lists,
# sets and dicts of them; the pickle of one needs only these names.
_PLAIN_NAMES: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1,
    ("collections", "OrderedDict"): OrderedDict,
    **_builtins(set=set, frozenset=frozenset, complex=complex)}

# What DCP's Metadata holds: its dataclasses, the file reader's _StorageInfo,
# torch.Size, dtypes, layouts, and the checkpoint's path (StorageMeta).
_METADATA_NAMES: dict[tuple[str, str], Any] = {
    **{(_MD, n): getattr(dcp_metadata, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    ("torch.serialization", "_get_layout"): _layout,
    **{(m, n): path for m in ("pathlib", "pathlib._local")
       for n, path in (("PosixPath", pathlib.PurePosixPath),
                       ("PurePosixPath", pathlib.PurePosixPath),
                       ("WindowsPath", pathlib.PureWindowsPath),
                       ("PureWindowsPath", pathlib.PureWindowsPath))},
    **_PLAIN_NAMES}


class _NamesUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the names of ``names`` and no
    persistent ids (tensor storages)."""

    def __init__(self, data: bytes, names: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._names = names

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._names[(module, name)]
        except (KeyError, TypeError):
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a tensor's storage (a persistent id)")


def _unpickle(data: bytes, names: Mapping[tuple[str, str], Any], where: str) -> Any:
    """Unpickle ``data`` resolving only ``names``; ValueError naming ``where``
    and what it refers to when it refers to anything else (nothing it names
    is called) or is not a pickle."""
    try:
        return _NamesUnpickler(data, names).load()
    except _Refused as e:
        raise ValueError(f"{where} refers to {e.args[0]}, which a checkpoint never holds: "
                         f"refused (loading a checkpoint never runs code from it)") from None
    except Exception as e:
        raise ValueError(f"{where} is not a readable pickle: {type(e).__name__}: {e}") from None


_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (tuple, list, set, frozenset, dict, OrderedDict)
# Plain values in a checkpoint are param-group options and what a module's
# state holds besides tensors: a few levels and values. A pickle's shared
# references make a 1 KB file a list nested 40 levels whose expansion has
# 2^40 values; deepcopy, == and repr of it (optimizer.load_state_dict compares
# and copies options) would never end: refused past these.
_MAX_PLAIN_DEPTH = 100
_MAX_PLAIN_VALUES = 1_000_000
_SHOWN_DEPTH = 8


def _children(value: Any) -> Iterator[Any]:
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            yield k
            yield v
    else:
        yield from value


def _plain_problem(value: Any) -> str | None:
    """None when ``value`` is a plain value (exact types, not subclasses),
    else what is wrong: a type that is not plain, nesting deeper than
    _MAX_PLAIN_DEPTH, more than _MAX_PLAIN_VALUES values once shared
    references are expanded, a container holding itself. Linear in the
    number of distinct containers and their entries (each shared one walked
    once, its expanded size and depth computed once: a memo by id), without
    recursion."""
    done: dict[int, tuple[int, int] | None] = {}   # id -> (values, depth); None: being walked
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        obj, walked = stack.pop()
        kind = type(obj)
        if kind in _SCALARS:
            continue
        if kind not in _CONTAINERS:
            return f"a {kind.__module__}.{kind.__qualname__}"
        if walked:
            size, depth = 1, 1
            for c in _children(obj):
                cs, cd = (1, 0) if type(c) in _SCALARS else done[id(c)]  # type: ignore[misc]
                size, depth = size + cs, max(depth, cd + 1)
            if depth > _MAX_PLAIN_DEPTH:
                return f"a value nested more than {_MAX_PLAIN_DEPTH} levels deep"
            if size > _MAX_PLAIN_VALUES:
                return (f"a value of more than {_MAX_PLAIN_VALUES:,} entries once its shared "
                        f"references are expanded")
            done[id(obj)] = (size, depth)
            continue
        if id(obj) in done:
            if done[id(obj)] is None:   # an ancestor: only a walk down from it gets here
                return f"a {kind.__name__} that contains itself"
            continue
        done[id(obj)] = None
        stack.append((obj, True))
        stack.extend((c, False) for c in _children(obj))
    return None


def _not_plain(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The values of a state dict that DCP would pickle (neither tensors nor
    mappings or lists it walks into) and that are not plain: "key (what)"."""
    out: list[str] = []
    # Depth first in the state's order, with a stack of iterators, not
    # recursion: a deep state is an error naming its key, not a RecursionError.
    # Keys past _SHOWN_DEPTH levels are not spelled out (a deep value's name
    # would be thousands of ".0").
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [(prefix, iter(state.items()))]
    while stack:
        at_prefix, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        key, value = entry
        at = f"{at_prefix}{key}" if len(stack) <= _SHOWN_DEPTH else at_prefix.rstrip(".")
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (Mapping, list)) and len(stack) > _MAX_PLAIN_DEPTH:
            out.append(f"{at}... (a value nested more than {_MAX_PLAIN_DEPTH} levels deep)")
        elif isinstance(value, Mapping):
            stack.append((f"{at}.", iter(value.items())))
        elif isinstance(value, list):
            stack.append((f"{at}.", iter(enumerate(value))))
        else:
            problem = _plain_problem(value)
            if problem is not None:
                out.append(f"{at} ({problem})")
    return out


def _read_plain_item(blob: bytes, where: str) -> Any:
    """A non-tensor item as DCP writes it (torch.save's zip archive around a
    pickle), read with the plain values' names only; ValueError naming
    ``where`` for anything else."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        pickles = [n for n in archive.namelist()
                   if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ValueError(f"{len(pickles)} data.pkl records")
        data = archive.read(pickles[0])
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ValueError(f"{where} is not a value saved by torch.save: {e}") from None
    value = _unpickle(data, _PLAIN_NAMES, where)
    problem = _plain_problem(value)
    if problem is not None:
        raise ValueError(f"{where} holds {problem}, not a plain value: refused")
    return value


def _check_metadata(metadata: Any, where: str) -> Metadata:
    """``metadata`` if it has the shape of DCP's Metadata (every data file a
    plain name in the checkpoint's directory), else ValueError naming ``where``."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{where} is not DCP's metadata (a {type(metadata).__name__})")
    kinds = (TensorStorageMetadata, BytesStorageMetadata)
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(md, kinds):
            raise ValueError(f"{where}: entry {key!r} is a {type(md).__name__}, not DCP's")
    for index, info in metadata.storage_data.items():
        file = getattr(info, "relative_path", None)
        if (not isinstance(index, MetadataIndex)
                or not isinstance(info, dcp_filesystem._StorageInfo)
                or not isinstance(file, str) or file in ("", ".", "..")
                or os.path.basename(file) != file or "\\" in file
                or not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length))):
            raise ValueError(f"{where}: storage entry {index!r} -> {info!r} is not an item "
                             f"in a file of the checkpoint's directory")
    return metadata


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_metadata(target: str, manifests: dict[int, dict[str, Any]] | None) -> Metadata:
    """DCP's .metadata of ``target``: its sha256 checked against rank 0's
    manifest first (when there are manifests), then read with the metadata's
    names only. ValueError naming the file for a missing, changed or
    refused one."""
    file = os.path.join(target, ".metadata")
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{file} is missing") from None
    if manifests is not None:
        want = manifests[0]["sha256"][".metadata"]
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise ValueError(f"{file} does not match the sha256 recorded in rank_0.json at save "
                             f"(sha256 {got[:16]}..., saved {want[:16]}...): it changed "
                             f"after the save; not read")
    return _check_metadata(_unpickle(data, _METADATA_NAMES, file), file)


def _read_plain_items(target: str, flat: Mapping[str, Any], metadata: Metadata) -> list[str]:
    """Read every non-tensor item of ``flat`` with the plain values' names
    only (after its checksum was verified): the problems, naming key and file."""
    problems = []
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        md = metadata.state_dict_metadata.get(index.fqn)
        if index.fqn not in flat or not isinstance(md, BytesStorageMetadata):
            continue
        where = f"{index.fqn!r} in {os.path.join(os.path.basename(target), info.relative_path)}"
        if info.transform_descriptors:
            problems.append(f"{where} is stored with transforms {info.transform_descriptors}, "
                            f"which torch_mpmd never writes")
            continue
        with open(os.path.join(target, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            _read_plain_item(blob, where)
        except ValueError as e:
            problems.append(str(e))
    return problems


class _VerifiedReader(FileSystemReader):
    """DCP's file reader, handed the metadata ``load`` verified and read,
    instead of unpickling .metadata again."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._verified = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._verified.storage_meta is None:
            self._verified.storage_meta = StorageMeta()
        self._verified.storage_meta.load_id = self.load_id
        return self._verified


class _PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item is read with the
    plain values' names only, not torch.load(weights_only=False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _read_plain_item(value.read(), repr(fqn))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# --------------------------------------------------------------------- save

class _RecordingSavePlanner(DefaultSavePlanner):
    """DCP's default planner that keeps this rank's final write items (what it
    writes after DCP dropped duplicates held by other ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Any] = []

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        self.items = list(plan.items)
        return plan


def _fresh_directory(root: str, step: int) -> str:
    """Create and name a directory for a save of ``step`` that no save used:
    step_<k>, else step_<k>.<n> with n one past the highest."""
    os.makedirs(root, exist_ok=True)
    taken = [m for m in map(_NAME.fullmatch, os.listdir(root))
             if m is not None and int(m.group(1)) == step]
    while True:
        n = max((int(m.group(2) or 0) + 1 for m in taken), default=0)
        name = f"step_{step}" if n == 0 else f"step_{step}.{n}"
        try:
            os.mkdir(os.path.join(root, name))
            return name
        except FileExistsError:
            taken.append(_NAME.fullmatch(name))


def _finished(directory: str) -> bool:
    """Whether a save wrote every rank's manifest into ``directory`` (rank 0's
    names the number of ranks)."""
    try:
        with open(os.path.join(directory, "rank_0.json"), encoding="utf-8") as f:
            world = json.load(f).get("world_size")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(world, int) and world >= 1 and all(
        os.path.exists(os.path.join(directory, f"rank_{r}.json")) for r in range(world))


def _remove_unfinished(root: str) -> None:
    """Remove the directories of saves that died part-way (a rank killed
    during the save): every step directory without all its manifests, but
    never the one ``latest`` names."""
    if not os.path.isdir(root):
        return
    try:
        current = os.path.basename(latest(root))
    except (OSError, ValueError):
        current = None
    for name in os.listdir(root):
        if name != current and _NAME.fullmatch(name) and \
                not _finished(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _prune(root: str, current: str, keep_last: int) -> None:
    """Remove checkpoint directories but ``current`` and the keep_last-1 most
    recently completed others (a save completes when every rank's manifest is
    written; ordered by rank 0's); directories of saves that never completed
    go too."""
    done, dead = [], []
    for name in os.listdir(root):
        if name == current or not _NAME.fullmatch(name):
            continue
        if _finished(os.path.join(root, name)):
            done.append((os.stat(os.path.join(root, name, "rank_0.json")).st_mtime_ns, name))
        else:
            dead.append(name)
    done.sort(reverse=True)
    for _, name in done[keep_last - 1:]:
        dead.append(name)
    for name in dead:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _refuse_not_plain(state: Mapping[str, Any]) -> None:
    """TypeError naming the values of the state DCP would pickle that load
    could not read back (anything but tensors and plain values)."""
    bad = _not_plain(state)
    if bad:
        raise TypeError(f"{len(bad)} value{'s' * (len(bad) > 1)} of the module's or optimizer's "
                        f"state cannot be saved: {_named(bad)} (a checkpoint holds tensors and "
                        f"plain values: None, bool, int, float, complex, str, bytes, and "
                        f"tuples, lists, sets and dicts of them)")


def save(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike, *,
         extra: Mapping[str, Any] | None = None,
         extra_per_rank: Mapping[str, Any] | None = None,
         keep_last: int | None = None,
         timeout: float | datetime.timedelta | None = None) -> str:
    """Save ``module`` (a Pipeline, or any module), ``optimizer`` (or None) and
    the user's state under ``path``; returns the new checkpoint's directory.

    Collective: every rank calls it. ``extra`` is saved from rank 0,
    ``extra_per_rank`` from every rank (see the module docstring for what a
    value may be). The new directory becomes ``latest`` only after every rank
    finished. ``keep_last=n`` (n >= 1) then removes older checkpoints, never
    the current one; the directories of earlier saves that died part-way go
    in any case. Raises CheckpointError (on every rank) for a value that
    cannot be saved (in ``extra``, or a non-tensor value of the module's or
    optimizer's state that is not plain); a rank that dies or stalls part-way
    leaves ``latest`` as it was, and the others raise CheckpointError naming
    it. ``timeout`` (seconds or timedelta; default: the Pipeline's
    ``timeout``) bounds every wait for the other ranks (NOTE [Checkpoint
    waits] in checkpoint_sync.py). Never changes the optimizer (an optimizer
    that has not stepped yet is saved without state).
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int or None")
    root = os.fspath(path)
    with Sync(timeout_seconds(module, timeout), f"saving a checkpoint under {root!r}") as sync:
        return _save(sync, module, optimizer, root, extra, extra_per_rank, keep_last)


def _save(sync: Sync, module: torch.nn.Module, optimizer: Any, root: str,
          extra: Mapping[str, Any] | None, extra_per_rank: Mapping[str, Any] | None,
          keep_last: int | None) -> str:
    rank = _rank()
    step = int(getattr(module, "step_count", 0))
    world = dist.get_world_size() if _distributed() else 1
    manifest: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "rank": rank,
                                "world_size": world, "step": step}
    tensors: dict[str, torch.Tensor] = {}
    problem, name = None, None
    state: dict[str, Any] = {}
    try:  # every rank checks its state and extra state; rank 0's extra is the one saved
        state = _state(module, optimizer)
        _refuse_not_plain(state)
        saved_extra = _encode_extra(extra, "extra", _EXTRA, tensors)
        if rank == 0:
            manifest["extra"] = saved_extra
        else:
            tensors.clear()
        manifest["extra_per_rank"] = _encode_extra(
            extra_per_rank, "extra_per_rank", f"{_EXTRA_PER_RANK}.{rank}", tensors)
        manifest["sha256"] = {kind: _digests(manifest.get(kind, {}))
                              for kind in ("extra", "extra_per_rank")}
        if rank == 0:
            _remove_unfinished(root)
            name = _fresh_directory(root, step)
    except TypeError as e:   # ours: the message names the value
        problem = str(e)
    except Exception as e:  # reported, not raised: the other ranks must hear of it
        problem = f"{type(e).__name__}: {e}"
    agreed = sync.gather([problem, name], "the check of every rank's state")
    _raise_agreed([p for p, _ in agreed], f"saving a checkpoint under {root!r}")
    target = os.path.join(root, agreed[0][1])

    state.update(tensors)
    planner = _RecordingSavePlanner()
    try:
        with _quiet():
            metadata = sync.run_dcp(
                lambda group: dcp.save(state, checkpoint_id=target, planner=planner,
                                       process_group=group, no_dist=group is None),
                "DCP's save")
    except CheckpointException as e:
        raise _dcp_error("saving", target, e) from e
    except DCPFailed as e:   # a collective of DCP's failed: a rank left the save
        cause = e.__cause__
        head = str(cause).strip().partition("\n")[0]
        raise CheckpointError(f"saving {target} failed on rank {rank}: {type(cause).__name__}: "
                              f"{head}; {e.args[0]} ({_LATEST!r} still names the previous "
                              f"checkpoint; the next save removes {target})") from cause
    manifest["items"] = _checksums(target, metadata, planner.items)
    if rank == 0:   # DCP's coordinator wrote .metadata before dcp.save returned
        manifest["sha256"][".metadata"] = _sha256_file(os.path.join(target, ".metadata"))
    _write_json(os.path.join(target, f"rank_{rank}.json"), manifest)
    _fsync_dir(target)
    sync.barrier("every rank's manifest written")
    if rank == 0:
        tmp = os.path.join(root, f".{_LATEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(os.path.basename(target) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, _LATEST))
        _fsync_dir(root)
        if keep_last is not None:
            _prune(root, os.path.basename(target), keep_last)
    sync.barrier(f"{_LATEST!r} updated")
    return target


def _checksums(target: str, metadata: Metadata, items: list[Any]) -> list[dict[str, Any]]:
    """The manifest entries of the items this rank wrote: the CRC32 of each
    one's bytes as written (read back from its file)."""
    per_file: dict[str, list[tuple[Any, Any]]] = {}
    for item in items:
        info = metadata.storage_data[item.index]
        per_file.setdefault(info.relative_path, []).append((item.index, info))
    out = []
    for file, entries in per_file.items():
        crcs = _crc_ranges(os.path.join(target, file), [(i.offset, i.length) for _, i in entries])
        for (index, info), crc in zip(entries, crcs):
            if crc is None:
                raise CheckpointError(f"saving {target}: {file} ends before the bytes of "
                                      f"{index.fqn!r} (offset {info.offset}, length {info.length})")
            out.append({"key": index.fqn,
                        "chunk": None if index.offset is None else list(index.offset),
                        "file": file, "offset": info.offset, "length": info.length,
                        "crc32": crc})
    return out


# --------------------------------------------------------------------- load

def latest(path: str | os.PathLike) -> str:
    """The directory of the last completed checkpoint under ``path``."""
    pointer = os.path.join(os.fspath(path), _LATEST)
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no completed checkpoint under {os.fspath(path)!r} (no "
                                f"{_LATEST!r} file)") from None
    if not _NAME.fullmatch(name):
        raise ValueError(f"{pointer} holds {name!r}, not a checkpoint directory name")
    return os.path.join(os.fspath(path), name)


class _NoManifest(ValueError):
    """A checkpoint without a manifest (not saved by torch_mpmd, or a save
    that died): ``load(strict=False)`` reads it without checksums."""


def _check_digests(file: str, m: dict[str, Any]) -> None:
    """ValueError naming each entry of a manifest's extra / extra_per_rank
    added, removed or changed since the save (against its sha256)."""
    changed = []
    for kind in ("extra", "extra_per_rank"):
        entries, saved = m.get(kind, {}), m["sha256"][kind]
        for name in sorted(set(entries) | set(saved), key=str):
            if name not in saved:
                changed.append(f"{kind}[{name!r}] was added")
            elif name not in entries:
                changed.append(f"{kind}[{name!r}] was removed")
            elif _digest(entries[name]) != saved[name]:
                changed.append(f"{kind}[{name!r}] was changed")
    if changed:
        raise ValueError(f"{file} was edited after the save: {', '.join(changed)} (against "
                         f"the sha256 recorded at save)")


def _well_formed_digests(m: dict[str, Any], rank: int) -> bool:
    sums = m.get("sha256")
    return (isinstance(sums, dict)
            and all(isinstance(sums.get(kind), dict)
                    and all(isinstance(v, str) for v in sums[kind].values())
                    for kind in ("extra", "extra_per_rank"))
            and (rank != 0 or (isinstance(sums.get(".metadata"), str)
                               and _HEX64.fullmatch(sums[".metadata"]) is not None)))


def _read_manifests(target: str) -> dict[int, dict[str, Any]]:
    """Every rank's manifest, its extra / extra_per_rank checked against
    their sha256; raises _NoManifest for a missing one, ValueError naming a
    malformed or edited one."""
    manifests: dict[int, dict[str, Any]] = {}
    world = None
    rank = 0
    while world is None or rank < world:
        file = os.path.join(target, f"rank_{rank}.json")
        try:
            with open(file, encoding="utf-8") as f:
                m = json.load(f)
        except FileNotFoundError:
            raise _NoManifest(f"{file} is missing (a checksum manifest; every completed "
                              f"save writes one per rank)") from None
        except (OSError, ValueError, RecursionError) as e:
            raise ValueError(f"{file} is not a readable manifest: {type(e).__name__}: "
                             f"{e}") from None
        if isinstance(m, dict) and m.get("format") == _FORMAT and m.get("version") != _VERSION:
            raise ValueError(f"{file} is a manifest of version {m.get('version')!r}; this "
                             f"torch_mpmd reads version {_VERSION} (version 1 recorded no "
                             f"sha256 of .metadata and extra: save it again with the "
                             f"torch_mpmd that wrote it, after loading it there)")
        if (not isinstance(m, dict) or m.get("format") != _FORMAT or m.get("rank") != rank
                or not isinstance(m.get("world_size"), int) or m["world_size"] < 1
                or not isinstance(m.get("items"), list)
                or not all(isinstance(e, dict) and isinstance(e.get("key"), str)
                           and isinstance(e.get("crc32"), int) for e in m["items"])
                or not all(isinstance(m.get(kind, {}), dict)
                           and all(isinstance(v, dict) for v in m.get(kind, {}).values())
                           for kind in ("extra", "extra_per_rank"))
                or not _well_formed_digests(m, rank)):
            raise ValueError(f"{file} is not a manifest of rank {rank} ({_FORMAT})")
        try:
            _check_digests(file, m)
        except RecursionError:
            raise ValueError(f"{file}: an extra entry is nested too deep to check: "
                             f"refused") from None
        if world is None:
            world = m["world_size"]
        manifests[rank] = m
        rank += 1
    return manifests


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _compared(key: str) -> bool:
    """Whether strict load compares ``key``: the model, the optimizer's state
    and the pipeline's, but not the optimizer's param-group options (lr,
    initial_lr, ...: those both have load, the rest keep their values)."""
    return key.split(".", 1)[0] in _SECTIONS and not key.startswith("optim.param_groups.")


def _section_order(key: str) -> int:
    head = key.split(".", 1)[0]
    return _SECTIONS.index(head) if head in _SECTIONS else len(_SECTIONS)


def _verify(target: str, flat: Mapping[str, Any], metadata: Metadata,
            manifests: dict[int, dict[str, Any]] | None, strict: bool) -> list[str]:
    """Problems with the items this rank would read: missing files, bytes
    that do not match their CRC32, items without one (``strict``)."""
    recorded: dict[tuple[str, tuple | None], dict[str, Any]] = {}
    for m in (manifests or {}).values():
        for e in m["items"]:
            chunk = None if e.get("chunk") is None else tuple(e["chunk"])
            recorded[(e.get("key"), chunk)] = e
    per_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in flat:
            per_file.setdefault(info.relative_path, []).append((index, info))
    problems = []
    for file, entries in sorted(per_file.items()):
        shown = os.path.join(os.path.basename(target), file)
        if not os.path.exists(os.path.join(target, file)):
            held = sorted((i.fqn for i, _ in entries), key=_section_order)
            problems.append(f"missing file {shown} (holds {_named(held)})")
            continue
        checked, truncated = [], []
        for index, info in entries:
            e = recorded.get((index.fqn, None if index.offset is None else tuple(index.offset)))
            if e is None:
                if strict and manifests is not None:
                    problems.append(f"no checksum recorded for {index.fqn!r} in {shown}")
            elif (e.get("file"), e.get("offset"), e.get("length")) != \
                    (file, info.offset, info.length):
                problems.append(f"{index.fqn!r}: the manifest's byte range ({e.get('file')} "
                                f"{e.get('offset')}+{e.get('length')}) is not DCP's "
                                f"({file} {info.offset}+{info.length})")
            else:
                checked.append((index, info, e["crc32"]))
        crcs = _crc_ranges(os.path.join(target, file), [(i.offset, i.length) for _, i, _ in checked])
        for (index, info, want), got in zip(checked, crcs):
            if got is None:
                truncated.append(index.fqn)
            elif got != want:
                problems.append(f"checksum mismatch for {index.fqn!r} in {shown} "
                                f"(crc32 {got:#010x}, saved {want:#010x}): the file is corrupt")
        if truncated:
            problems.append(f"{shown} is truncated: it ends before the bytes of "
                            f"{_named(truncated)}")
    if len(problems) > _DETAIL_LINES:
        problems[_DETAIL_LINES:] = [f"and {len(problems) - _DETAIL_LINES} more problems"]
    return problems


def _raise_key_issues(reports: list[dict[str, Any]], metadata: Metadata | None,
                      strict: bool, what: str) -> None:
    """Raise on every rank, from every rank's report, for keys the checkpoint
    lacks, keys in it that no rank's module or optimizer has (``strict``), and
    shapes that differ: all named in the first line."""
    def union(lists: Any) -> list[str]:
        return sorted(dict.fromkeys(k for keys in lists for k in keys), key=_section_order)

    missing = union(r["missing"] for r in reports)
    mismatched = union(r["mismatched"] for r in reports)
    unexpected: list[str] = []
    if strict and metadata is not None and all(r["keys"] is not None for r in reports):
        wanted = {k for r in reports for k in r["keys"]}
        sections = {k.split(".", 1)[0] for k in wanted}
        unexpected = union([[k for k in metadata.state_dict_metadata
                             if _compared(k) and k.split(".", 1)[0] in sections
                             and k not in wanted]])
    issues = []
    if missing:
        issues.append(f"{len(missing)} key{'s' * (len(missing) > 1)} missing from the "
                      f"checkpoint: {_named(missing)}")
    if unexpected:
        issues.append(f"{len(unexpected)} key{'s' * (len(unexpected) > 1)} in the checkpoint "
                      f"but not in the module or optimizer: {_named(unexpected)}")
    if mismatched:
        issues.append(f"{len(mismatched)} shape mismatch{'es' * (len(mismatched) > 1)}: "
                      f"{_named(mismatched)}")
    if issues:
        hint = "\nload(..., strict=False) loads the keys both have" if missing or unexpected else ""
        raise CheckpointError(f"{what}: " + "; ".join(issues) + hint)


class _Undo:
    """What a load changes, kept to put back when the load fails, so that a
    failed load leaves everything exactly as it was: the optimizer's state
    and param groups (the objects: load gives the optimizer new ones and
    never writes into these), the step counter, the module's parameters,
    buffers and extra state (:meth:`keep_module`: a copy on the host, taken
    just before DCP reads into them: memory for one more copy of this rank's
    module state while load runs, never on the device) and each Stateful's
    ``state_dict()`` (:meth:`keep_stateful`: a deep copy, before the first
    is restored)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.module, self.optimizer = module, optimizer
        self.step_count = getattr(module, "step_count", None)
        self.model: dict[str, Any] | None = None
        self.stateful: list[tuple[Any, Any]] = []
        if optimizer is not None:
            self.optim_state = optimizer.state
            self.groups = optimizer.param_groups
            self.group_items = [dict(g) for g in self.groups]

    def keep_module(self) -> None:
        self.model = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                      else copy.deepcopy(v) for k, v in self.module.state_dict().items()}

    def keep_stateful(self, objs: list[Any]) -> None:
        self.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in objs]

    def restore(self) -> None:
        if self.optimizer is not None:
            self.optimizer.state = self.optim_state
            self.optimizer.param_groups = self.groups
            for group, items in zip(self.groups, self.group_items):
                group.clear()
                group.update(items)
        if self.step_count is not None:
            self.module.step_count = self.step_count
        # The module's and each Stateful's own load_state_dict put them back:
        # one that raises now does not keep the others from theirs.
        undo = [(self.module, self.model)] if self.model is not None else []
        for obj, saved in undo + self.stateful:
            try:
                obj.load_state_dict(saved)
            except Exception as e:  # noqa: BLE001  (the load's own error is the one raised)
                warnings.warn(f"checkpoint.load failed, and putting back the state of a "
                              f"{type(obj).__name__} failed too: {type(e).__name__}: {e}")


def _state_template(param: torch.Tensor, md: TensorStorageMetadata) -> torch.Tensor:
    """An empty tensor for one saved optimizer entry of ``param``: laid out
    as the parameter where it has the parameter's (global) shape, so a
    moment of a DTensor parameter (tensor parallel, sharded data parallel) is
    a DTensor of its placements, as the optimizer's own step would make it;
    a plain tensor of the saved shape otherwise (a step counter)."""
    size = tuple(md.size)
    if tuple(param.shape) == size and size != ():
        return torch.empty_like(param.detach(), dtype=md.properties.dtype)
    return torch.empty(size, dtype=md.properties.dtype)


def _optimizer_templates(module: torch.nn.Module, optimizer: Any, metadata: Metadata) -> None:
    """Give ``optimizer`` a new state that holds, for each of its parameters
    whose state the checkpoint holds, empty tensors of the saved shapes and
    dtypes (None for a non-tensor entry) under the saved names, for DCP to
    read into; the others get no state, as ``optimizer.load_state_dict`` of
    the saved state leaves them. (DCP would instead make state by calling
    the optimizer's step(): _no_optimizer_step.) The state replaced is the
    _Undo's, untouched."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = {next(iter(dcp_state_dict._get_fqns(module, name))): p
              for name, p in module.named_parameters() if id(p) in held}
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("optim.state."):
            continue
        path = key[len("optim.state."):].split(".")   # fqn, then the entry's (nested) name
        for cut in range(len(path) - 1, 0, -1):
            p = params.get(".".join(path[:cut]))
            if p is not None:
                entry = state[p]
                for part in path[cut:-1]:
                    entry = entry.setdefault(part, {})
                entry[path[-1]] = (_state_template(p, md)
                                   if isinstance(md, TensorStorageMetadata) else None)
                break
    optimizer.state = state


def load(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike, *,
         extra: Mapping[str, Any] | None = None,
         extra_per_rank: Mapping[str, Any] | None = None,
         strict: bool = True,
         timeout: float | datetime.timedelta | None = None) -> dict[str, Any]:
    """Load the latest checkpoint under ``path`` into ``module`` (a Pipeline of
    any size, or the unsplit module), ``optimizer`` (or None) and the Stateful
    objects of ``extra`` / ``extra_per_rank`` (restored in place through
    ``load_state_dict``; names the checkpoint lacks are errors). Collective.

    Returns ``{"directory": the checkpoint loaded, "step": the pipeline's step
    at save, "extra": {name: value} for every plain (non-Stateful) value of
    the saved ``extra``, "extra_per_rank": the same for this rank's}``.

    All or nothing: a load that fails, at any point (a check below, an item
    DCP refuses, a peer that dies, a Stateful's ``load_state_dict`` that
    raises), leaves the module's parameters, buffers and extra state, the
    optimizer's state and param groups, the step counter and every Stateful
    exactly as they were. The optimizer's state becomes the checkpoint's (a
    parameter it holds no state for has none, as an optimizer before its
    first step), made without calling the optimizer's step().

    Raises CheckpointError on every rank, before anything is loaded, when a
    file is missing, an item's bytes do not match the CRC32 recorded at save
    (naming the key and the file), ``.metadata`` or an extra entry does not
    match its sha256, ``.metadata`` or a non-tensor item refers to anything a
    checkpoint never holds (refused unread: loading runs no code) or is not
    a plain value (nested too deep or too large once expanded), or with
    ``strict`` (the default) when the checkpoint's model/optimizer keys or
    shapes differ from the module's and optimizer's over all ranks.
    ``strict=False`` loads the keys both have (checksums are still verified
    where recorded; a checkpoint without manifests, e.g. one saved by DCP
    alone, loads unverified, but its pickles are still read as above).
    ``timeout`` (seconds or timedelta; default: the Pipeline's ``timeout``)
    bounds every wait for the other ranks: a rank that stalls or dies makes
    the others raise CheckpointError naming it (NOTE [Checkpoint waits] in
    checkpoint_sync.py).
    """
    target = latest(path)
    what = f"loading checkpoint {target}"
    with Sync(timeout_seconds(module, timeout), what) as sync:
        undo = _Undo(module, optimizer)
        try:
            return _load(sync, undo, module, optimizer, target, extra, extra_per_rank, strict)
        except BaseException:
            undo.restore()
            raise


def _load(sync: Sync, undo: _Undo, module: torch.nn.Module, optimizer: Any, target: str,
          extra: Mapping[str, Any] | None, extra_per_rank: Mapping[str, Any] | None,
          strict: bool) -> dict[str, Any]:
    rank = _rank()
    what = f"loading checkpoint {target}"
    state: dict[str, Any] = {}
    # What this rank tells the others before anything is read: a problem (a
    # missing manifest, file or key, a bad checksum), its keys (for the keys
    # no rank wants), and its missing and shape-mismatched keys.
    report: dict[str, Any] = {"problem": None, "keys": None, "missing": [], "mismatched": []}
    metadata: Metadata | None = None
    extra_tensors: dict[str, torch.Tensor] = {}
    restore: list[tuple[Any, Any]] = []   # (Stateful, its encoded state_dict)
    plain: dict[str, dict[str, Any]] = {"extra": {}, "extra_per_rank": {}}
    has_optim = False
    try:
        manifests: dict[int, dict[str, Any]] | None = None
        try:
            manifests = _read_manifests(target)
        except _NoManifest:
            if strict or extra or extra_per_rank:
                raise
        metadata = _read_metadata(target, manifests)
        has_optim = optimizer is not None and any(
            k.startswith("optim.") for k in metadata.state_dict_metadata)
        if optimizer is not None and strict and not has_optim:
            raise ValueError("the checkpoint holds no optimizer state (saved with "
                             "optimizer=None): pass optimizer=None to load the rest, or "
                             "strict=False to keep the optimizer as it is")
        _drop_other_ranks_parameters(module, optimizer)
        if has_optim:
            _optimizer_templates(module, optimizer, metadata)
        state = _state(module, optimizer if has_optim else None)
        manifest_of = {"extra": os.path.join(os.path.basename(target), "rank_0.json"),
                       "extra_per_rank": os.path.join(os.path.basename(target),
                                                      f"rank_{rank}.json")}
        for kind, asked, saved in (
                ("extra", extra, (manifests or {}).get(0, {}).get("extra", {})),
                ("extra_per_rank", extra_per_rank,
                 (manifests or {}).get(rank, {}).get("extra_per_rank", {}))):
            for name, obj in (asked or {}).items():
                if not _is_stateful(obj):
                    raise TypeError(f"load(..., {kind}=) takes objects with load_state_dict() "
                                    f"to restore; {name!r} is a {type(obj).__name__} (plain "
                                    f"values come back in load's result)")
                if "state_dict" not in saved.get(name, {}):
                    held = sorted(n for n, v in saved.items() if "state_dict" in v)
                    whose = "" if kind == "extra" else f" of rank {rank}"
                    raise KeyError(f"{kind}[{name!r}]: the checkpoint holds no state{whose} "
                                   f"under that name (it holds {held})")
                _walk_tensors(saved[name]["state_dict"], f"{kind}[{name!r}] of {manifest_of[kind]}",
                              extra_tensors)
                restore.append((obj, saved[name]["state_dict"]))
            for name, entry in saved.items():
                if "value" in entry:
                    _walk_tensors(entry["value"], f"{kind}[{name!r}] of {manifest_of[kind]}",
                                  extra_tensors)
                    plain[kind][name] = entry["value"]
        state.update(extra_tensors)
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata)   # DCP's flattening: its keys
        flat = planner.state_dict
        saved_md = metadata.state_dict_metadata
        if strict:
            report["missing"] = [k for k in flat if k not in saved_md and _compared(k)]
        for k, v in flat.items():
            md = saved_md.get(k)
            if md is None:
                continue
            if isinstance(v, torch.Tensor) != isinstance(md, TensorStorageMetadata):
                report["mismatched"].append(f"{k} (a tensor in only one of them)")
            elif isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(md.size):
                report["mismatched"].append(
                    f"{k} (checkpoint {list(md.size)}, module {list(v.shape)})")
        report["keys"] = [k for k in flat if _compared(k)]
        if not report["missing"] and not report["mismatched"]:
            issues = _verify(target, flat, metadata, manifests, strict)
            issues = issues or _read_plain_items(target, flat, metadata)
            if issues:
                report["problem"] = "\n".join(issues)
    except (ValueError, KeyError, TypeError) as e:   # ours: the message says it
        report["problem"] = e.args[0] if isinstance(e, KeyError) else str(e)
    except Exception as e:  # reported, not raised: the other ranks must hear of it
        report["problem"] = f"{type(e).__name__}: {e}"
    reports = sync.gather(report, "the checks of every rank's part of the checkpoint")
    _raise_key_issues(reports, metadata, strict, what)
    _raise_agreed([r["problem"] for r in reports], what)
    assert metadata is not None
    undo.keep_module()
    try:
        with _quiet():
            # Partial: the checks above decided which differences are errors.
            sync.run_dcp(lambda group: dcp.load(
                state, checkpoint_id=target, storage_reader=_VerifiedReader(target, metadata),
                planner=_PlainLoadPlanner(allow_partial_load=True), process_group=group,
                no_dist=group is None), "DCP's load")
    except CheckpointException as e:
        raise _dcp_error("loading", target, e) from e
    except DCPFailed as e:
        cause = e.__cause__
        head = str(cause).strip().partition("\n")[0]
        raise CheckpointError(f"loading {target} failed on rank {rank}: "
                              f"{type(cause).__name__}: {head}; {e.args[0]} (the module, "
                              f"optimizer and extra state are as they were)") from cause
    if has_optim:
        with _no_optimizer_step():
            set_optimizer_state_dict(module, optimizer, state["optim"], options=_OPTIM)
    undo.keep_stateful([obj for obj, _ in restore])
    for obj, encoded in restore:
        obj.load_state_dict(_decode(encoded, extra_tensors))
    module.load_state_dict(state["model"])
    if hasattr(module, "step_count"):
        module.step_count = int(state["pipeline"]["step"])
    return {"directory": target, "step": int(state["pipeline"]["step"]),
            "extra": {n: _decode(v, extra_tensors) for n, v in plain["extra"].items()},
            "extra_per_rank": {n: _decode(v, extra_tensors)
                               for n, v in plain["extra_per_rank"].items()}}
