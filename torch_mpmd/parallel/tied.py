"""Tied weights across pipeline ranks: their gradient sum is part of REDUCE_GRAD.

A parameter read by stages on several pipeline ranks (a token embedding tied
to the unembedding: the first and the last stage) gets a partial gradient on
each of them; every copy must step with the sum. For each set of pipeline
ranks sharing parameters (a *tied group*) this rank posts one asynchronous
all-reduce of the step's gradient increments of the group's parameters,
divided by the dp size, over the group's pipeline ranks in every dp replica:
the sum over "pp" and the mean over "dp" in one collective. It is posted by
the REDUCE_GRAD action of the rank's last stage (in program order) that reads
a parameter of the group, right behind that stage's own dp reduction, and the
step waits for it at its end, with the dp reductions. The parameters of tied
groups are left out of the stages' dp reductions (DataParallel,
ShardedStages), so each gradient is reduced once.

With sharded data parallel the compute parameters' full gradients are summed
(the step's own: ShardedStages clears them every step) and each rank adds its
own rows (its dp shard's) to the shard's gradient: an all-reduce of the full
tensor where a reduce-scatter would move half the bytes, the price of one
collective for both dims, paid for the few tensors that are tied.

NOTE [A group of its own]: the sum runs on a process group that carries
nothing else. Its member ranks post it at different points of their programs
(the first stage's rank after its last backward, the last stage's rank much
earlier). On NCCL a collective issued on the communicator that carries the
pipeline's transfers would hold back the transfers queued behind it until
every member has posted it, and posting waits for those transfers: a
deadlock. On a group of its own the collective only waits, off the ranks'
critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_mpmd.parallel import lockstep
from torch_mpmd.parallel.data_parallel import flat_increments, local_part
from torch_mpmd.parallel.sharding import ParamShards, ShardedStages, local_grad, set_local_grad, shard_rows

__all__ = ["TiedGroup", "TiedSums"]


@dataclass
class TiedGroup:
    """One tied group as this rank sees it."""

    group: Any                 # process group: the tied pp ranks of every dp replica
    ranks: list[int]           # its global ranks (for errors)
    params: list[torch.nn.Parameter]  # this rank's compute parameters of the group
    stage: int                 # the local stage whose REDUCE_GRAD posts the sum
    pp_ranks: tuple[int, ...]  # the pipeline ranks sharing them


class TiedSums:
    """The tied groups' sums of one rank (see the module docstring).

    ``dp_size``: the replicas averaged over; ``shards``: the ParamShards of
    sharded data parallel (None: the parameters are the user's own);
    ``timeout_s`` bounds each collective's work."""

    def __init__(self, groups: Sequence[TiedGroup], dp_size: int, timeout_s: float,
                 shards: ParamShards | None = None) -> None:
        self.groups = list(groups)
        self.dp_size = dp_size
        self.timeout_s = timeout_s
        self.shards = shards
        self.params = [p for g in self.groups for p in g.params]  # reduced here, not by dp
        self._before: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter], TiedGroup]] = []
        self._posted: list[tuple[int, int]] = []  # this step's (stage, bytes), for report()

    def begin_step(self) -> None:
        self._pending = []
        self._posted = []
        # Replicated parameters accumulate .grad over steps: only the step's
        # increment is summed. Sharded ones get fresh compute gradients.
        self._before = ({} if self.shards is not None else
                        {id(p): g.clone() for p in self.params
                         if (g := local_grad(p)) is not None})

    def reduce(self, stage: int) -> None:
        """REDUCE_GRAD(stage): post the sums this stage's action carries."""
        for g in self.groups:
            if g.stage != stage:
                continue
            # In the group's (FQN) order, one buffer per dtype, as on every
            # member rank.
            for params, flat in flat_increments(g.params, self._before, self.dp_size):
                if self.shards is not None:
                    for p in params:
                        p.grad = None  # a compute gradient: its rows go to the shard
                work = lockstep.all_reduce(flat, g.group, self.timeout_s)
                self._posted.append((stage, flat.numel() * flat.element_size()))
                self._pending.append((work, flat, params, g))

    def end_step(self, wait: Callable[[Any, str], None]) -> None:
        """Wait for the step's sums (``wait(work, what)`` bounds each) and write
        them back: into the parameters' gradients, or the shards' rows."""
        pending, self._pending = self._pending, []
        for work, flat, params, g in pending:
            wait(work, f"the sum of tied parameter gradients ({len(params)} tensors) over "
                       f"pipeline ranks {list(g.pp_ranks)} (global ranks {g.ranks}, all_reduce)")
            offset = 0
            for p in params:
                local = local_part(p)
                total = flat[offset:offset + local.numel()].view(local.shape)
                offset += local.numel()
                if not p.requires_grad:  # frozen on the module (NOTE [Freezing] in session.py)
                    continue
                if self.shards is not None:
                    ShardedStages.add_grad(self.shards.of[id(p)], shard_rows(self.shards, p, total))
                else:
                    before = self._before.get(id(p))
                    set_local_grad(p, total.clone() if before is None else before + total)

    def report(self) -> dict[str, Any]:
        """The last step's sums on this rank: how many, their bytes, the
        actions that posted them (``"3REDUCE_GRAD"``) and the global ranks of
        each group."""
        return {"count": len(self._posted), "bytes": sum(b for _, b in self._posted),
                "posted_by": [f"{stage}REDUCE_GRAD" for stage, _ in self._posted],
                "groups": [list(g.ranks) for g in self.groups]}

    def abandon(self) -> None:
        """Forget a failed step's sums (their works keep their buffers)."""
        self._pending = []
