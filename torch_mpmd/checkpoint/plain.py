"""Reading a checkpoint without running code from it: restricted unpicklers, plain-value checks, DCP's metadata read and checked.

DCP pickles its ``.metadata`` and every non-tensor item; unpickling may call
any function the file names. These unpicklers resolve only the names a
checkpoint holds (DCP's metadata dataclasses, torch.Size, dtypes and layouts;
the builtins of plain values) and refuse any other before calling anything.
:class:`VerifiedReader` and :class:`PlainLoadPlanner` make DCP's own load use
them.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

__all__ = ["MAX_PLAIN_DEPTH", "not_plain", "read_metadata", "read_plain_items",
           "VerifiedReader", "PlainLoadPlanner"]

# DCP pickles .metadata and every non-tensor item (the optimizer's param-group
# options: lr, betas, ...), and unpickling may call any function the file
# names. We unpickle both with unpicklers that resolve only the names listed
# here: the dataclasses of DCP's metadata, torch's dtypes and layouts, and the
# few builtins plain values need. Any other name is refused before anything
# is called. Tensors' data are read by DCP with torch.load(weights_only=True).

_MD = "torch.distributed.checkpoint.metadata"


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
MAX_PLAIN_DEPTH = 100
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
    MAX_PLAIN_DEPTH, more than _MAX_PLAIN_VALUES values once shared
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
            if depth > MAX_PLAIN_DEPTH:
                return f"a value nested more than {MAX_PLAIN_DEPTH} levels deep"
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


def not_plain(state: Mapping[str, Any], prefix: str = "") -> list[str]:
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
        if isinstance(value, (Mapping, list)) and len(stack) > MAX_PLAIN_DEPTH:
            out.append(f"{at}... (a value nested more than {MAX_PLAIN_DEPTH} levels deep)")
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



def read_metadata(target: str, manifests: dict[int, dict[str, Any]] | None) -> Metadata:
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


def read_plain_items(target: str, flat: Mapping[str, Any], metadata: Metadata) -> list[str]:
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


class VerifiedReader(FileSystemReader):
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


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item is read with the
    plain values' names only, not torch.load(weights_only=False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _read_plain_item(value.read(), repr(fqn))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
