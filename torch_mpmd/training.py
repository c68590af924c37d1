"""What a training loop needs around ``Pipeline.step`` over a whole rank: the
global gradient norm, and the mean loss every rank returns (the loss of one
microbatch is :mod:`torch_mpmd.programs.loss`).

Gradient clipping over a pipeline (:func:`clip_grad_norm_`): each rank holds
its stages' gradients only, so the norm of all of them is reduced over the
pipeline ranks. A parameter used by stages on several ranks (tied embeddings)
has the same summed gradient on each of them after a step: only the first of
those ranks counts it. Data-parallel replicas hold the same averaged
gradients after a step: the norm is one replica's, never reduced over "dp".
Tensor-parallel and sharded data-parallel gradients (DTensors) count each
shard once (NOTE [Norm over tensor parallel]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_mpmd.parallel.sharding import local_grad

if TYPE_CHECKING:
    from torch_mpmd.runtime.rank import RankRuntime

__all__ = ["clip_grad_norm_", "counted_parameters", "step_loss", "grads_before",
           "scale_step_grads"]


# NOTE [Token-weighted losses]: a ``loss_fn`` returning ``(sum of token
# losses, token count)`` makes the step's loss the sum over every microbatch
# (and data-parallel replica) divided by the total count, as one process
# computes it on the whole batch, where a mean of per-microbatch means would
# weigh a short microbatch's tokens more. The total is known only after the
# last forward, while a pipeline's first backwards run before it, so each
# microbatch's backward starts from the gradient of its sum (its loss
# tangent is [1, 0]: runner._loss_grad), and the step's gradient increment
# is scaled at the end by dp / (global count) (dp: the replicas' gradient
# average). Gradients accumulated before the step (no zero_grad) are left as
# they were: their values are kept aside when there are any (grads_before).
# Gradient hooks see the unscaled increments.


def step_loss(rt: "RankRuntime", device: torch.device) -> tuple[torch.Tensor, float | None]:
    """The loss of the call just run on every rank of the pipeline and the
    data-parallel replicas, and for token-weighted losses the global token
    count (else None): the mean of the microbatches' losses averaged over the
    replicas (they step on equal-sized batches), or the global sum of token
    losses over the global count. Computed on the last stage's rank.
    Collective over pp and dp."""
    value, count, weighted = rt.call_loss(device)
    if rt.dp_group is not None:
        totals = torch.tensor([value, count], dtype=torch.float64, device=device)
        rt.wait(rt.all_reduce(totals, rt.dp_group), "the data-parallel loss all_reduce")
        value, count = totals.tolist()
        if not weighted:
            value /= dist.get_world_size(rt.dp_group)
    if not weighted:
        return torch.tensor(value, dtype=torch.float32, device=device), None
    if count == 0:
        raise ValueError("the token-weighted loss counts 0 tokens in the whole batch (every "
                         "microbatch's loss_fn returned count 0); its mean is undefined")
    return torch.tensor(value / count, dtype=torch.float32, device=device), count


def grads_before(params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The gradients ``params`` hold before a step (copies), for
    :func:`scale_step_grads`."""
    return {id(p): p.grad.detach().clone() for p in params if p.grad is not None}


@torch.no_grad()
def scale_step_grads(params: list[torch.Tensor], before: Mapping[int, torch.Tensor],
                     factor: float) -> None:
    """Scale the gradient each parameter gained in the step by ``factor``
    (what it held before, ``before[id(p)]``, is kept as it was)."""
    for p in params:
        if p.grad is None:
            continue
        prev = before.get(id(p))
        if prev is None:
            p.grad.mul_(factor)
        else:
            p.grad.sub_(prev).mul_(factor).add_(prev)


# ------------------------------------------------------------------ the global norm


def counted_parameters(rt: "RankRuntime", local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``local`` (this rank's) whose gradients this rank counts
    in the global norm: a parameter that stages on several ranks use counts on
    the lowest of those ranks only (each holds the same summed gradient)."""
    skip: set[int] = set()
    for p in rt.model.plan.parameters:
        ranks = {rt.stage_to_rank[s] for s in p.stages}
        t = rt.model.tensors.get(p.fqn)
        if t is not None and len(ranks) > 1 and rt.rank != min(ranks):
            skip.add(id(rt.user_param(t)))
    return [p for p in local if id(p) not in skip]


def _combine(local: torch.Tensor, norm_type: float, rt: "RankRuntime", group: Any = None,
             what: str = "the pipeline ranks") -> torch.Tensor:
    """The global norm from this rank's norm of its counted gradients, reduced
    over the pipeline ranks (or ``group``) in float64: a p-th power of a
    float32 norm can overflow. The same value on every rank."""
    group = group if group is not None else rt.group
    if group is None or dist.get_world_size(group) == 1:
        return local
    x = local.double()
    if math.isinf(norm_type):
        op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    else:
        op = dist.ReduceOp.SUM
        if norm_type != 0:  # ||g|| = (sum over ranks of ||g_r||^p)^(1/p); the 0-"norm" counts
            x = x.pow(norm_type)
    rt.wait(rt.all_reduce(x, group, op), f"the global gradient norm (all_reduce over {what})")
    if not math.isinf(norm_type) and norm_type != 0:
        x = x.pow(1.0 / norm_type)
    return x.to(local.dtype)


def clip_grad_norm_(rt: "RankRuntime", parameters: list[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, foreach: bool | None = None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``parameters`` (this rank's, deduplicated) so that
    the norm of every gradient of the model, over all stages, is at most
    ``max_norm``; return that total norm (float32, on every rank the same).
    Collective over the pipeline group. Non-finite norms behave as in
    ``torch.nn.utils.clip_grad_norm_``: with ``error_if_nonfinite`` every rank
    raises the same RuntimeError, else the gradients are scaled by a nan or
    zero factor as torch's would be."""
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    grads = [p.grad for p in counted_parameters(rt, parameters) if p.grad is not None]
    tensor_parallel = any(isinstance(g, DTensor) for g in grads)
    if tensor_parallel:
        local = _mixed_norm(rt, grads, norm_type, foreach)
    elif grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
        local = local.to(device=rt.device, dtype=torch.float32)
    else:  # the identity of the reduction: no gradients contribute nothing
        local = torch.full((), math.inf if norm_type == -math.inf else 0.0,
                           dtype=torch.float32, device=rt.device)
    total = _combine(local, norm_type, rt)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from all pipeline stages is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    if tensor_parallel:  # torch's scaling, on local parts (foreach cannot mix the kinds)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        every = [g for p in parameters if (g := local_grad(p)) is not None]
        if every:
            torch._foreach_mul_(every, coef.to(every[0].device))
        return total
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total


def _mixed_norm(rt: "RankRuntime", grads: list[torch.Tensor], norm_type: float,
                foreach: bool | None) -> torch.Tensor:
    """The norm of this pipeline rank's gradients when some are DTensors
    (tensor parallel, sharded data parallel), combined over the DTensors'
    sharded mesh dims: the same on every peer.

    NOTE [Norm over tensor parallel]: each rank takes the norm of the local
    parts it is the one to count: along every mesh dim some gradient is
    sharded on (and the norm reduced over), a gradient whole along it (a
    Replicate placement there, a DTensor on another mesh, a plain tensor)
    counts on that dim's first rank only; empty shards (a dim with fewer rows
    than ranks) count nothing.
    These norms are then combined over each mesh dim a DTensor is sharded
    on ("dp", "tp"), by the library's bounded all-reduce (_combine), and by
    the caller over the pipeline ranks."""
    groups: dict[str, Any] = {}  # mesh dims some gradient is sharded on
    coords: dict[str, int] = {}  # this rank's coordinate on each mesh dim seen
    for g in grads:
        if isinstance(g, DTensor):
            mesh, names = g.device_mesh, g.device_mesh.mesh_dim_names or ()
            for i, placement in enumerate(g.placements):
                coords[names[i]] = mesh.get_local_rank(i)
                if placement.is_shard():
                    groups.setdefault(names[i], mesh.get_group(i))
    counted: list[torch.Tensor] = []
    for g in grads:
        sharded_on: set[str] = set()
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names or ()
            sharded_on = {names[i] for i, pl in enumerate(g.placements) if pl.is_shard()}
        # Whole along a reduced dim (Replicate there, or not on it at all):
        # counted by that dim's first rank only.
        if all(coords[n] == 0 for n in groups if n not in sharded_on):
            counted.append(g._local_tensor if isinstance(g, DTensor) else g)
    counted = [t for t in counted if t.numel() > 0]
    if counted:
        local = torch.nn.utils.get_total_norm(counted, norm_type, False, foreach)
        local = local.to(device=rt.device, dtype=torch.float32)
    else:
        local = torch.full((), math.inf if norm_type == -math.inf else 0.0,
                           dtype=torch.float32, device=rt.device)
    for name in sorted(groups):  # every peer holds the same parameters: the same groups
        local = _combine(local, norm_type, rt, group=groups[name], what=f'the "{name}" ranks')
    return local
