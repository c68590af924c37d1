"""Meta-device models: capture without materializing, then build only this rank's part.

A module whose parameters or buffers are on the meta device (built under
``with torch.device("meta"):``) is captured and partitioned without memory:
before capture every meta tensor is replaced by a stand-in on the pipeline's
device that holds no memory (a zero scalar expanded to the shape, so Dynamo
traces real devices). After partitioning, this rank's parameters and buffers
get real storage (the same Parameter objects, so the stage modules and the
optimizer see them) and are initialized module by module: the user's
``init_fn(module)``, else the module's own ``reset_parameters()``. Weights tied
across ranks are then made equal (broadcast from the lowest rank holding them),
data-parallel replicas copy their first replica, and tensor-parallel peers
the first peer's tensors they share (NOTE [Meta-device tensor parallel]).
Other ranks' tensors stay stand-ins: per-rank parameter memory is about 1/pp
of the model's.

NOTE [Meta-device tensor parallel]: a tensor-parallel plan applied on the meta
device (``parallelize_module`` works there) gives DTensor parameters whose
local shards are meta tensors. Their stand-ins are DTensors of the same mesh,
placements, global shape and stride whose local tensor is a stand-in of the
local shape; materializing gives the local tensor storage (1/tp of the
parameter), and the broadcasts of ``synchronize`` move local shards. The
module's ``init_fn`` / ``reset_parameters()`` then runs on DTensors: an init
that must agree with a one-process model computes the full value from the
global shape and keeps its part (``distribute_tensor(value, t.device_mesh,
t.placements, src_data_rank=None)``, no communication); a random init
(``reset_parameters()``) draws on each rank, so ``synchronize`` then gives
the tensors tp peers share (plain ones, a DTensor's local shard along its
Replicate mesh dims) the first peer's values; its shards are each rank's own
draws, which need not equal a one-process model's with the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["has_meta_tensors", "replace_with_standins", "materialize", "is_standin",
           "synchronize"]


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_standin(t: torch.Tensor) -> bool:
    """A stand-in: a zero-stride expand owning one element (for a DTensor:
    its local tensor is one). Those of one element or none cannot be told
    from a value by their layout: they carry a mark (set by
    replace_with_standins, cleared by materialize)."""
    t = _local(t)
    if getattr(t, "_mpmd_standin", False):
        return True
    return t.numel() > 1 and t.dim() > 0 and all(s == 0 for s in t.stride())


def _marked(t: torch.Tensor) -> torch.Tensor:
    if _local(t).numel() <= 1:
        _local(t)._mpmd_standin = True  # see is_standin
    return t


def _standin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A stand-in for ``t``; for a DTensor, a DTensor (same mesh, placements,
    global shape and stride) whose local tensor is the stand-in of ``t``'s
    local shard (NOTE [Meta-device tensor parallel])."""
    if isinstance(t, DTensor):
        local = _marked(torch.zeros((), dtype=t.dtype, device=device)
                        .expand(t._local_tensor.shape))
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)


def replace_with_standins(module: torch.nn.Module, device: torch.device) -> None:
    """Swap every meta parameter/buffer for a zero-memory stand-in (tied ones stay tied)."""
    done: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in done:
                    done[id(p)] = _marked(torch.nn.Parameter(_standin(p, device),
                                                             requires_grad=p.requires_grad))
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in done:
                    done[id(b)] = _marked(_standin(b, device))
                mod._buffers[name] = done[id(b)]


def materialize(module: torch.nn.Module, local: Iterable[torch.Tensor],
                init_fn: Callable[[torch.nn.Module], None] | None,
                device: torch.device) -> int:
    """Give this rank's stand-ins real storage and initialize their modules;
    returns the bytes allocated. Raises ValueError naming a module that holds
    this rank's tensors but cannot be initialized."""
    fresh: set[int] = set()
    allocated = 0
    for t in local:
        if is_standin(t) and id(t) not in fresh:
            held = _local(t)   # a DTensor: its local shard gets the storage
            held.data = torch.empty(held.shape, dtype=held.dtype, device=device)
            held.__dict__.pop("_mpmd_standin", None)
            fresh.add(id(t))
            allocated += held.numel() * held.element_size()
    for name, mod in module.named_modules():
        own = [t for t in list(mod._parameters.values()) + list(mod._buffers.values())
               if t is not None]
        mine = [t for t in own if id(t) in fresh]
        if not mine:
            continue
        if any(is_standin(t) for t in own):
            raise ValueError(
                f"module {name or type(module).__name__!r} has tensors on this rank's stages "
                "and on other ranks' stages, so it cannot be initialized here; move the stage "
                "boundary, or build the model on a real device")
        with torch.no_grad():
            if init_fn is not None:
                init_fn(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            elif mod._parameters or any(id(b) in fresh for b in mod._buffers.values()):
                raise ValueError(
                    f"module {name or type(module).__name__!r} ({type(mod).__name__}) has no "
                    "reset_parameters(); pass pipeline(..., init_fn=fn) to initialize the "
                    "tensors of a meta-device model")
    return allocated


def _replica_groups(local: list[torch.Tensor], tp_group: Any) -> list[Any]:
    """The groups over which this rank's plain tensors are replicated by
    tensor parallelism: ``tp_group``, else every mesh dim's group of the
    DTensors among ``local`` (tp peers hold the same stages, so they find the
    same groups in the same order)."""
    if tp_group is not None:
        return [tp_group]
    groups: dict[str, Any] = {}
    for t in local:
        if isinstance(t, DTensor):
            for dim in range(t.device_mesh.ndim):
                pg = t.device_mesh.get_group(dim)
                groups.setdefault(pg.group_name, pg)
    return list(groups.values())


def synchronize(tied_groups: Iterable[tuple[Any, list[torch.Tensor]]], dp_group: Any,
                local: Iterable[torch.Tensor], runtime: Any = None, tp_group: Any = None
                ) -> None:
    """Tied weights equal across pipeline ranks, replicas equal to their first;
    with tensor parallelism, what tp peers must hold alike (plain tensors, a
    DTensor's local shard along its Replicate mesh dims) equal to the first
    peer's: a random init (``reset_parameters()``) draws on each rank.
    ``tp_group``: the pipeline mesh's "tp" group (default: the groups of the
    DTensors' meshes found among ``local``).
    Every broadcast is bounded by the ``runtime``'s timeout (a RankRuntime;
    without one, lockstep's default of 60 s) and waited for by its ``wait``
    (NOTE [Bounded collectives] in bounded.py); before a group's first
    broadcast every rank of it arrives, so that one that stalled or died
    materializing is named (NOTE [Named waits])."""
    from torch_mpmd.parallel import lockstep

    local = list(local)
    timeout_s = runtime.timeout_s if runtime is not None else 60.0
    arrived: set[str] = set()

    def broadcast(t: torch.Tensor, pg: Any, what: str) -> None:
        text = f"the broadcast of the materialized {what} from their first rank"
        if pg.group_name not in arrived:
            arrived.add(pg.group_name)
            lockstep.Collectives(pg, timeout_s, "materializing the meta model").arrive(text)
        work = lockstep.broadcast(t, 0, pg, timeout_s)
        if runtime is None:
            lockstep.wait(work, text, timeout_s, rank=dist.get_rank(),
                          on_failure=lambda _: lockstep.abandon([pg]))
        else:
            runtime.wait(work, text)

    with torch.no_grad():
        for pg, params in tied_groups:
            for p in params:
                broadcast(_local(p).data, pg, "tied parameters")
        if dp_group is not None:
            for t in local:   # a DTensor's local shard, to the replicas' same shard
                broadcast(_local(t).data, dp_group, "parameters and buffers to the replicas")
        plain_groups = _replica_groups(local, tp_group)
        for t in local:
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                groups = [mesh.get_group(d) for d, pl in enumerate(t.placements)
                          if pl.is_replicate() and mesh.size(d) > 1]
            else:
                groups = [pg for pg in plain_groups if dist.get_world_size(pg) > 1]
            for pg in groups:
                broadcast(_local(t).data, pg, "tensors the tensor-parallel peers share")
