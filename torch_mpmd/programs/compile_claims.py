"""Turns at compiling a stage program: of the processes on one host that
compile the same program at once, one compiles and the others load it.

NOTE [Compile claims]: the ranks of a tensor-parallel group (the same
stage, other shards of equal shape) and the replicas of data parallelism
compile the same stage programs at the same step. Inductor's FX graph cache
would give the second process the first one's program, but both look it up
before either has stored it, and both compile: on a host with fewer cores
than ranks, each compile then takes as long as all of them. So a compile
takes a claim (NOTE [Host claims]) named for what it compiles, in a folder
beside Inductor's cache; a process that waited then finds the program in
the cache (its lookup is Inductor's own, keyed as Inductor keys it: the
claim's name only decides who waits, never what is loaded).

The name: a digest of torch's version, the program's code, its inputs'
sizes, strides, dtypes and devices, and the cache key tag the program is
compiled under. Two programs that differ in what the code does not show
(a constant's value) share a name: one waits for the other, then compiles
its own. No claim where a program is not cached (Inductor's FX graph cache
off, or bypassed for this program: a mark, so that later claims of it do
not wait for a cache entry that will not come).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_mpmd.graph import host_claims

__all__ = ["compile_claim", "stats"]

_UNCACHED = ".uncached"
_stats = {"claimed": 0, "unclaimed": 0, "uncached": 0}


def stats() -> dict[str, int]:
    """Counts since the process started: compiles made holding their claim,
    compiles made without one (a holder that stopped or held it too long, no
    folder for the locks, a program marked not cached), and programs found
    not cached."""
    return dict(_stats)


def _folder() -> Path | None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = Path(cache_dir()) / "torch_mpmd_compiling"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def _name(gm: torch.fx.GraphModule, inputs: Sequence[Any], tag: str) -> str:
    def describe(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return [str(tuple(t.shape)), str(t.stride()), str(t.dtype), str(t.device)]
        return repr(type(t).__name__)

    text = json.dumps([torch.__version__, gm.code, [describe(t) for t in inputs], tag])
    return hashlib.sha256(text.encode()).hexdigest()


def _counter(name: str) -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"][name]


@contextlib.contextmanager
def compile_claim(gm: torch.fx.GraphModule, inputs: Sequence[Any], tag: str) -> Iterator[None]:
    """Held while this process compiles ``gm`` with Inductor (for ``inputs``,
    under cache key tag ``tag``): see NOTE [Compile claims]."""
    from torch._inductor import config

    folder = _folder() if config.fx_graph_cache else None
    name = _name(gm, inputs, tag) if folder is not None else ""
    if folder is None or (folder / f"{name}{_UNCACHED}").exists():
        _stats["unclaimed"] += 1
        yield
        return
    with host_claims.claim(folder / f"{name}.lock") as held:
        _stats["claimed" if held else "unclaimed"] += 1
        bypassed = _counter("fxgraph_cache_bypass")
        yield
        if _counter("fxgraph_cache_bypass") > bypassed:
            _stats["uncached"] += 1
            with contextlib.suppress(OSError):
                (folder / f"{name}{_UNCACHED}").touch()
