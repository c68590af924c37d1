"""Pipeline x data parallel: the dp side of a rank's runtime.

With ``pipeline(..., mesh=DeviceMesh)`` whose dimensions are named from
("dp", "pp", "tp") (:func:`mesh_groups`), each pipeline stage is replicated
over the dp dimension; every replica steps on its own batch (tensor-parallel
peers, along "tp", step on the same batch and reduce nothing here). At each stage's REDUCE_GRAD action (right after its
last backward of the step) this rank starts an asynchronous all-reduce of the
stage's parameter gradients over its dp group, so the reduction overlaps the
rest of the schedule; the step waits for them at its end and averages. A
parameter shared by several stages of this rank is reduced once, at the last
of their REDUCE_GRAD actions. Only the step's own increment is reduced, so
gradients accumulated over earlier steps (no zero_grad) are not counted twice.
Parameters shared with stages on other pipeline ranks (tied weights) are
reduced by the same action's tied sum instead (tied.py), over pp and dp at
once.

NOTE [Groups over replicas]: ``dist.new_group`` is collective over the whole
world, so a subgroup one replica needs (tied weights on some of its pipeline
ranks) is created for every replica, in the same order on every rank. Its
rendezvous waits as long as the default group's timeout (30 min by
default) for a rank that never comes: every rank of the world first arrives
within the pipeline's timeout (:func:`_world_arrived`), so a rank that died
or stalled before is a PipelineError on the others, not a hang.

NOTE [Groups kept]: the groups made here are kept for the world that made
them, by their rank lists: every pipeline over the same ranks (a model built
again, the planner's profile, calibration and trials) shares them. A gloo
group holds sockets and a thread that wakes every 10 ms; made per pipeline
built, they were never freed (72 such threads on two ranks after
tests/test_plan_auto.py, 6% of its CPU spent in them). Every rank asks for
the same lists in the same order (it must: ``new_group`` is collective), so
every rank finds or makes them alike; a new default group (a new world)
makes them again, and so does a failure that abandoned one of them (NOTE
[Abandoned groups]: every rank of the failed pipeline abandons its groups).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.parallel import bounded, lockstep
from torch_mpmd.parallel.failures import PipelineError
from torch_mpmd.parallel.job_store import await_arrivals
from torch_mpmd.parallel.sharding import local_grad, set_local_grad

__all__ = ["DataParallel", "MESH_DIMS", "MeshGroups", "flat_increments", "local_part",
           "mesh_groups", "release_kept_groups", "replica_group", "tied_group"]


MESH_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class MeshGroups:
    """What a pipeline takes from its DeviceMesh (:func:`mesh_groups`).

    ``pp``: this rank's pipeline group (its ranks along "pp"); ``dp``: this
    rank's data-parallel group (None without a "dp" dim of size > 1);
    ``tp``: likewise along "tp". ``replicas``: the global ranks of every
    pipeline replica, indexed by pp rank, one replica per (dp, tp)
    coordinate in row-major (dp, tp) order, the same list on every rank;
    ``sizes``: dim name -> size, every name of MESH_DIMS (1 when absent)."""

    pp: Any
    dp: Any
    tp: Any
    replicas: list[list[int]]
    sizes: dict[str, int]


def _world_arrived(timeout_s: float | None, what: str) -> None:
    """Every rank of the world reached ``what`` (groups about to be made)
    within ``timeout_s`` (None: no bound of ours); PipelineError otherwise,
    naming a rank that left the job where the job's store knows one."""
    if timeout_s is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        await_arrivals(tuple(range(dist.get_world_size())), timeout_s)
    except RuntimeError as e:  # (RanksLeft names them; else how many arrived)
        raise PipelineError(f"rank {dist.get_rank()}: {what}: {e}",
                            rank=dist.get_rank()) from None


def mesh_groups(mesh: Any, timeout_s: float | None = None) -> MeshGroups:
    """The groups and replicas of a DeviceMesh whose dims are named from
    ("dp", "pp", "tp"), in any order; any of them may be left out (size 1).

    NOTE [Pipeline replicas]: every (dp, tp) coordinate runs its own copy of
    the pipeline over "pp": its point-to-point transfers, lockstep records
    and tied-weight groups are its own. Tensor-parallel peers run the same
    stage programs, whose DTensor collectives (inside the programs) pair up
    over "tp"; only "dp" replicas reduce gradients (DataParallel). A mesh
    without "pp" gives every rank a one-rank pipeline group (created on every
    rank in rank order: ``new_group`` is collective). ``timeout_s``: how long
    the other ranks may take to arrive (NOTE [Groups over replicas])."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in MESH_DIMS]
    if not names or unknown:
        what = (f"dimension(s) {', '.join(map(repr, unknown))} that torch_mpmd does not know"
                if unknown else "no dimension names")
        raise ValueError(f"mesh has {what} (dims {names or '(unnamed)'}, shape "
                         f"{tuple(mesh.mesh.shape)}); name its dims from 'dp', 'pp' and 'tp', "
                         "e.g. init_device_mesh(..., mesh_dim_names=('dp', 'pp', 'tp'))")
    sizes = {n: (mesh.size(names.index(n)) if n in names else 1) for n in MESH_DIMS}
    # The rank table with dims ordered (dp, tp, pp), absent ones of size 1:
    # each row of the flattened (dp * tp, pp) table is a replica.
    table = mesh.mesh
    order = [names.index(n) for n in ("dp", "tp", "pp") if n in names]
    table = table.permute(*order).reshape(sizes["dp"] * sizes["tp"], sizes["pp"])
    replicas = table.tolist()

    def group(name: str) -> Any:
        return mesh.get_group(name) if name in names and sizes[name] > 1 else None

    pp = mesh.get_group("pp") if "pp" in names else None
    if pp is None:  # a one-rank pipeline per rank (see the NOTE)
        groups = _groups_over("pipeline", replicas, timeout_s,
                              "the one-rank pipeline groups of a mesh without 'pp'")
        me = dist.get_rank()
        pp = next(g for replica, g in zip(replicas, groups) if replica[0] == me)
    return MeshGroups(pp=pp, dp=group("dp"), tp=group("tp"), replicas=replicas, sizes=sizes)


_KEPT: dict[tuple[str, tuple[tuple[int, ...], ...]], list[Any]] = {}
_KEPT_WORLD: list[Any] = [None]  # the default group the kept groups belong to


def _groups_over(role: str, rank_lists: Sequence[Sequence[int]], timeout_s: float | None,
                 what: str) -> list[Any]:
    """One group per list of global ranks, in order (NOTE [Groups kept]): made
    once per world and ``role`` (groups of other roles over the same ranks are
    other groups: NCCL's two direction groups must be), every rank of the
    world arriving first (NOTE [Groups over replicas]); a rank's entry for a
    list it is not in is torch's non-member value."""
    if _KEPT_WORLD[0] is not dist.group.WORLD:
        _KEPT.clear()
        _KEPT_WORLD[0] = dist.group.WORLD
    key = (role, tuple(tuple(int(r) for r in ranks) for ranks in rank_lists))
    groups = _KEPT.get(key)
    if groups is None or any(bounded.abandoned(g) for g in groups):
        _world_arrived(timeout_s, what)
        groups = _KEPT[key] = [dist.new_group(list(ranks)) for ranks in key[1]]
    return groups


def release_kept_groups() -> None:
    """Forget the kept groups, so that they go while the interpreter still
    runs (NOTE [Release at exit] in runtime/rank.py); later calls make them
    again."""
    _KEPT.clear()
    _KEPT_WORLD[0] = None


def replica_group(role: str, pp_ranks: Sequence[int], replicas: Sequence[Sequence[int]],
                  my_replica: int, timeout_s: float | None = None) -> Any:
    """The group of pipeline ranks ``pp_ranks`` in this rank's replica, kept
    for ``role`` (NOTE [Groups kept], NOTE [Groups over replicas];
    ``timeout_s``: the bound of the arrival)."""
    lists = [[replica[r] for r in pp_ranks] for replica in replicas]
    groups = _groups_over(role, lists, timeout_s,
                          f"the groups of pipeline ranks {list(pp_ranks)} of every replica")
    return groups[my_replica]


def tied_group(pp_ranks: Sequence[int], replicas: Sequence[Sequence[int]], my_replica: int,
               dp_size: int, timeout_s: float | None = None) -> tuple[Any, list[int]]:
    """The group that sums tied gradients (tied.py): pipeline ranks
    ``pp_ranks`` of every dp replica at this rank's tp coordinate, and its
    global ranks. One is kept per tp coordinate (NOTE [Groups kept], NOTE
    [Groups over replicas]); replicas are in row-major (dp, tp) order
    (MeshGroups)."""
    tp = len(replicas) // dp_size
    lists = [sorted(replicas[d * tp + t][r] for d in range(dp_size) for r in pp_ranks)
             for t in range(tp)]
    groups = _groups_over("tied sums", lists, timeout_s,
                          f"the tied-weight groups of pipeline ranks {list(pp_ranks)}")
    mine = my_replica % tp
    return groups[mine], lists[mine]


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``: a DTensor's local shard, else ``p``."""
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else p


def flat_increments(params: Sequence[torch.nn.Parameter], before: dict[int, torch.Tensor],
                    divisor: int) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
    """Per dtype, in order of first appearance: the parameters and one flat
    buffer of their step's gradient increments (this rank's parts; ``.grad``
    minus ``before[id(p)]`` when there is one, zeros for a missing ``.grad``)
    divided by ``divisor``. One buffer per dtype: concatenating a stage's fp32
    and bf16 gradients would promote them."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(local_part(p).dtype, []).append(p)
    out = []
    for group in by_dtype.values():
        parts = []
        for p in group:
            g = local_grad(p)
            g = g if g is not None else torch.zeros_like(local_part(p))
            prev = before.get(id(p))
            parts.append((g - prev if prev is not None else g).reshape(-1))
        flat = torch.cat(parts)
        if divisor > 1:
            flat.div_(divisor)
        out.append((group, flat))
    return out


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
        self._before = {id(p): g.clone() for ps in self.params.values() for p in ps
                        if (g := local_grad(p)) is not None}

    def reduce(self, stage: int) -> None:
        """REDUCE_GRAD(stage): start the all-reduce of the stage's gradient
        increments (averaged over dp), one flat buffer per dtype."""
        for params, flat in flat_increments(self.params.get(stage, []), self._before, self.size):
            # Its work ends within the timeout even if the step fails before
            # waiting for it (NOTE [Bounded collectives] in bounded.py).
            work = lockstep.all_reduce(flat, self.group, self.timeout.total_seconds())
            self._pending.append((work, flat, params))

    def end_step(self, wait: Any) -> None:
        """Wait for every reduction (``wait(work, what)`` bounds it) and write the
        averaged gradients back."""
        for work, flat, params in self._pending:
            wait(work, f"the data-parallel gradient all_reduce ({len(params)} tensors)")
            offset = 0
            for p in params:
                local = local_part(p)
                n = local.numel()
                avg = flat[offset:offset + n].view_as(local)
                offset += n
                before = self._before.get(id(p))
                set_local_grad(p, avg.clone() if before is None else before + avg)
        self._pending = []
