"""A checkpoint directory's layout: step directories, the ``latest`` pointer, removing unfinished and old saves.

See NOTE [Checkpoint layout] in torch_mpmd/checkpoint/__init__.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

__all__ = ["LATEST", "latest", "point_latest", "fresh_directory", "remove_unfinished",
           "prune", "fsync_dir", "write_json"]

LATEST = "latest"
_NAME = re.compile(r"step_(\d+)(?:\.(\d+))?")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def fresh_directory(root: str, step: int) -> str:
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


def remove_unfinished(root: str) -> None:
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


def prune(root: str, current: str, keep_last: int) -> None:
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



def latest(path: str | os.PathLike) -> str:
    """The directory of the last completed checkpoint under ``path``."""
    pointer = os.path.join(os.fspath(path), LATEST)
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no completed checkpoint under {os.fspath(path)!r} (no "
                                f"{LATEST!r} file)") from None
    if not _NAME.fullmatch(name):
        raise ValueError(f"{pointer} holds {name!r}, not a checkpoint directory name")
    return os.path.join(os.fspath(path), name)


def point_latest(root: str, target: str) -> None:
    """Make ``root/latest`` name ``target`` (write, fsync, rename: a reader
    sees the old name or the new one, never part of one)."""
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(os.path.basename(target) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)
