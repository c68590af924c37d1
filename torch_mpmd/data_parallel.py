"""Pipeline x data parallel: the dp side of a rank's runtime.

With ``pipeline(..., mesh=DeviceMesh)`` whose dimensions are named ("dp",
"pp"), each pipeline stage is replicated over the dp dimension; every replica
steps on its own batch. At each stage's REDUCE_GRAD action (right after its
last backward of the step) this rank starts an asynchronous all-reduce of the
stage's parameter gradients over its dp group, so the reduction overlaps the
rest of the schedule; the step waits for them at its end and averages. A
parameter shared by several stages of this rank is reduced once, at the last
of their REDUCE_GRAD actions. Only the step's own increment is reduced, so
gradients accumulated over earlier steps (no zero_grad) are not counted twice.

NOTE [Groups over replicas]: ``dist.new_group`` is collective over the whole
world, so a subgroup one replica needs (tied weights on some of its pipeline
ranks) is created for every replica, in the same order on every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd import lockstep

__all__ = ["DataParallel", "mesh_groups", "new_replica_group"]


def mesh_groups(mesh: Any) -> tuple[Any, Any, list[list[int]]]:
    """(pp group, dp group or None, global ranks of every replica by pp rank) of
    a DeviceMesh with dimensions ("dp", "pp") or just ("pp",)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or not set(names) <= {"dp", "pp"}:
        raise ValueError(f"mesh must have dimensions named ('dp', 'pp') or ('pp',); got "
                         f"{names or 'no names'} (init_device_mesh(..., mesh_dim_names=...))")
    table = mesh.mesh
    if names == ("pp", "dp"):
        table = table.transpose(0, 1)
    replicas = table.reshape(-1, table.shape[-1]).tolist() if table.dim() > 1 else [
        table.tolist()]
    pp = mesh.get_group("pp")
    dp = mesh.get_group("dp") if "dp" in names and mesh.size(names.index("dp")) > 1 else None
    return pp, dp, replicas


def new_replica_group(pp_ranks: Sequence[int], replicas: Sequence[Sequence[int]],
                      my_replica: int) -> Any:
    """The group of pipeline ranks ``pp_ranks`` in this rank's replica (NOTE
    [Groups over replicas])."""
    mine = None
    for i, replica in enumerate(replicas):
        g = dist.new_group([replica[r] for r in pp_ranks])
        if i == my_replica:
            mine = g
    return mine


class DataParallel:
    """Per-step dp gradient reduction of one rank's stages (see the module docstring)."""

    def __init__(self, group: Any, stage_params: dict[int, list[torch.nn.Parameter]],
                 reduce_order: Sequence[int], timeout_s: float) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        owner: dict[int, int] = {}
        by_id: dict[int, torch.nn.Parameter] = {}
        for stage in reduce_order:  # the last REDUCE_GRAD of a shared parameter wins
            for p in stage_params.get(stage, []):
                owner[id(p)] = stage
                by_id[id(p)] = p
        self.params: dict[int, list[torch.nn.Parameter]] = {}
        for pid, stage in owner.items():
            self.params.setdefault(stage, []).append(by_id[pid])
        self._before: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter]]] = []

    def begin_step(self) -> None:
        self._pending = []
        self._before = {id(p): p.grad.clone() for ps in self.params.values() for p in ps
                        if p.grad is not None}

    def reduce(self, stage: int) -> None:
        """REDUCE_GRAD(stage): start the all-reduce of the stage's gradient increments."""
        params = self.params.get(stage, [])
        if not params:
            return
        parts = []
        for p in params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            before = self._before.get(id(p))
            parts.append((g - before if before is not None else g).reshape(-1))
        flat = torch.cat(parts).div_(self.size)
        # Its work ends within the timeout even if the step fails before
        # waiting for it (NOTE [Bounded collectives] in lockstep.py).
        work = lockstep.all_reduce(flat, self.group, self.timeout.total_seconds())
        self._pending.append((work, flat, params))

    def end_step(self, wait: Any) -> None:
        """Wait for every reduction (``wait(work, what)`` bounds it) and write the
        averaged gradients back."""
        for work, flat, params in self._pending:
            wait(work, f"the data-parallel gradient all_reduce ({len(params)} tensors)")
            offset = 0
            for p in params:
                n = p.numel()
                avg = flat[offset:offset + n].view_as(p)
                offset += n
                before = self._before.get(id(p))
                p.grad = avg.clone() if before is None else before + avg
        self._pending = []
