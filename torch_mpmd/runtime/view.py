"""What one rank runs, to look at: :class:`RankView` (``Pipeline.inspect()``).

A snapshot taken when asked for, over the rank's current capture: its local
stages and their modules, its programs as typed actions for each kind of
call, the stage programs it runs (and, when it runs the autograd runner
instead, why), the activation bytes its runner holds now, and what crosses
each stage edge per microbatch. Reading it communicates nothing and changes
nothing; the ``runner`` and ``data_parallel`` it names are the live objects
the executor calls (for tools that wrap their methods, as a memory probe does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_mpmd.schedules import Action

if TYPE_CHECKING:
    from torch_mpmd.runtime.rank import RankRuntime

__all__ = ["RankView", "CALL_KINDS"]

# The kinds of call whose programs a view lists ("backward" is the compile
# door's backward part; "eval" runs the forward part's actions).
CALL_KINDS = ("step", "forward", "backward")


@dataclasses.dataclass(frozen=True)
class RankView:
    """This rank's part of a captured pipeline (see the module docstring)."""

    rank: int                                   # in the pipeline group
    pp_size: int
    local_stages: tuple[int, ...]
    stages: Mapping[int, torch.nn.Module]       # local stage -> its GraphModule
    actions: Mapping[str, tuple[Action, ...]]   # call kind -> this rank's program
    programs: Mapping[int, Any]                 # local stage -> StagePrograms ({}: autograd)
    fallback_reason: str | None                 # why programs were not used; None: they were
    held_bytes: Mapping[int, int]               # local stage -> activation bytes held now
    transfers: Mapping[str, tuple[tuple[int, ...], ...]]  # "0->1", "1->0 grad" -> shapes
    captures: int                               # captures this pipeline has made
    runner: Any                                 # the StageRunner the executor calls
    data_parallel: Any                          # the rank's dp side (replicas or shards), or None

    @property
    def uses_programs(self) -> bool:
        """Whether training steps run functional stage programs (else autograd)."""
        return bool(self.programs) and self.fallback_reason is None

    @classmethod
    def of(cls, rt: RankRuntime, *, captures: int) -> RankView:
        runner = rt.runner
        programs = runner.programs or {}  # built at the first training step
        shapes = {f"{c}->{p} grad" if grad else f"{p}->{c}":
                  tuple(tuple(t.shape) for t in specs)
                  for (p, c, grad), specs in rt.layout.specs().items() if specs}
        return cls(rank=rt.rank, pp_size=rt.pp_size, local_stages=tuple(rt.local_stages),
                   stages={s: rt.model.stages[s] for s in rt.local_stages},
                   actions={kind: tuple(rt.programs(kind)[rt.rank]) for kind in CALL_KINDS},
                   programs=dict(programs), fallback_reason=runner.fallback_reason,
                   held_bytes=dict(runner.live_bytes),
                   transfers=shapes, captures=captures, runner=runner, data_parallel=rt.dp)
