"""A checkpoint's manifests: per rank, a CRC32 of every item it wrote and the sha256 of its user state and of DCP's .metadata; reading them back and verifying the data.

    step_7/rank_<r>.json   {"format", "version", "rank", "world_size", "step",
                            "items": [{key, chunk, file, offset, length, crc32}],
                            "extra" (rank 0), "extra_per_rank",
                            "sha256": {"extra", "extra_per_rank", ".metadata" (rank 0)}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from torch_mpmd.checkpoint.state import section_order
from torch_mpmd.checkpoint.sync import CheckpointError, named
from torch_mpmd.parallel import lockstep

__all__ = ["FORMAT", "VERSION", "NoManifest", "digests", "sha256_file", "checksums",
           "read_manifests", "verify"]

FORMAT = "torch_mpmd.checkpoint"
VERSION = 2                                 # 2: sha256 of .metadata and of extra
_DETAIL_LINES = 10                          # problems listed in a load error
_CHUNK = 1 << 24                            # bytes read at a time for a CRC
_HEX64 = re.compile(r"[0-9a-f]{64}")


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


def digests(entries: Mapping[str, Any]) -> dict[str, str]:
    """{name: sha256} of a manifest's extra or extra_per_rank entries."""
    return {name: _digest(entry) for name, entry in entries.items()}



def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()



def checksums(target: str, metadata: Metadata, items: list[Any]) -> list[dict[str, Any]]:
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



class NoManifest(ValueError):
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


def read_manifests(target: str) -> dict[int, dict[str, Any]]:
    """Every rank's manifest, its extra / extra_per_rank checked against
    their sha256; raises NoManifest for a missing one, ValueError naming a
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
            raise NoManifest(f"{file} is missing (a checksum manifest; every completed "
                              f"save writes one per rank)") from None
        except (OSError, ValueError, RecursionError) as e:
            raise ValueError(f"{file} is not a readable manifest: {type(e).__name__}: "
                             f"{e}") from None
        if isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") != VERSION:
            raise ValueError(f"{file} is a manifest of version {m.get('version')!r}; this "
                             f"torch_mpmd reads version {VERSION} (version 1 recorded no "
                             f"sha256 of .metadata and extra: save it again with the "
                             f"torch_mpmd that wrote it, after loading it there)")
        if (not isinstance(m, dict) or m.get("format") != FORMAT or m.get("rank") != rank
                or not isinstance(m.get("world_size"), int) or m["world_size"] < 1
                or not isinstance(m.get("items"), list)
                or not all(isinstance(e, dict) and isinstance(e.get("key"), str)
                           and isinstance(e.get("crc32"), int) for e in m["items"])
                or not all(isinstance(m.get(kind, {}), dict)
                           and all(isinstance(v, dict) for v in m.get(kind, {}).values())
                           for kind in ("extra", "extra_per_rank"))
                or not _well_formed_digests(m, rank)):
            raise ValueError(f"{file} is not a manifest of rank {rank} ({FORMAT})")
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



def verify(target: str, flat: Mapping[str, Any], metadata: Metadata,
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
            held = sorted((i.fqn for i, _ in entries), key=section_order)
            problems.append(f"missing file {shown} (holds {named(held)})")
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
                            f"{named(truncated)}")
    if len(problems) > _DETAIL_LINES:
        problems[_DETAIL_LINES:] = [f"and {len(problems) - _DETAIL_LINES} more problems"]
    return problems
