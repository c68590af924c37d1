"""Pipeline replicas that survive each other: one torchrun job per replica,
meeting in torchft's quorum.

Each data-parallel replica is a whole pipeline (its pp ranks, and tp if on)
launched as its own torchrun job. Every rank of a replica runs a torchft
``Manager`` (group rank = its rank in the job); the managers of one replica
agree on each step through the replica's manager server, and the replicas
agree through torchft's Lighthouse. Rank r of every replica holds the same
stages, so rank r's gradients are all-reduced with rank r of the other
replicas over torchft's reconfigurable process group (gloo on CPU, its NCCL
variant on GPU), which is rebuilt whenever the quorum changes.

One :meth:`ReplicaQuorum.step`:

1. joins the step's quorum (:meth:`ReplicaQuorum.join`, synchronously: a
   replica that rejoins is healed from a live peer before its forward, and
   trains on that same step; join before drawing the batch when the healed
   data position decides it);
2. runs the pipeline step (zeroing the gradients first);
3. all-reduces, in one flat buffer, every held gradient and the loss, each
   weighted by this replica's share: its token count for a token-weighted
   loss, else 1; the weights are summed in the same buffer. The result is the
   loss and gradients of one process on the participants' batches: the mean
   of the replicas' means (equal batches) or the global token mean;
4. asks torchft whether to commit: every rank of this replica must have
   succeeded (the vote is within a replica; replicas agree through the
   all-reduce, which fails on all of them when one is gone before it ends);
   the optimizer steps only then. A step that
   is not committed leaves parameters, optimizer and data position as they
   were: the next step retries with the replicas present.

A rank that dies ends its own replica (its pipeline peers raise PipelineError,
torchrun ends and restarts the job); the other replicas' all-reduce fails or
times out, they do not commit that step, and their next quorum is formed
without the dead replica (the Lighthouse stops hearing its heartbeat). The
restarted replica rejoins at a later quorum and torchft's checkpoint
transport sends it, rank to rank, the state a live peer holds: this rank's
parameters and buffers, the optimizer's state, the pipeline's step count, the
quorum's step and any ``state=`` objects (a data loader's position, an LR
scheduler: pass it there, or the replicas' learning rates part). ``timeout``
bounds the heal's transfer too: it must exceed the time to send a rank's
state, or the survivor's vote times out.

A replica may be ``pp x dp`` with ``data_parallel="shard"`` in its job: each
rank all-reduces its rows of every parameter's gradient with the same rank of
the other replicas (sharded inside a replica, replicated across: torchft's
HSDP), and heals send rows (NOTE [Shards in a heal]).

Every replica must split the model the same way (the same schedule, stages
and split; pass ``plan=`` explicitly, not a per-launch ``plan="auto"``).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from torch.distributed.tensor import DTensor

from torch_mpmd.parallel.job_store import bounded_store
from torch_mpmd.parallel.sharding import local_grad



_START_POLL_S = 0.1  # between quorums while waiting for the replicas to start with


class Stateful(Protocol):
    """What ``state=`` holds: an object with ``state_dict``/``load_state_dict``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class QuorumStep:
    """What one :meth:`ReplicaQuorum.step` did.

    ``loss``: the participants' loss (as one process on their batches);
    ``committed``: whether the optimizer stepped; ``participants``: how many
    replicas the step's quorum held; ``step``: the quorum's committed steps
    after this one (healing sets it to the peer's); ``error``: what failed in
    a step that did not commit (a peer's all-reduce, the quorum), else None;
    ``grad_norm``: with ``max_norm``, the participants' gradient norm before
    clipping, in a committed step (else None)."""

    loss: torch.Tensor
    committed: bool
    participants: int
    step: int
    error: str | None = None  # why the step could not commit, when it failed
    grad_norm: float | None = None


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as e:  # pragma: no cover - torchft is installed by scripts/setup.sh
        raise ImportError("ReplicaQuorum needs torchft (pip install torchft==0.2.0)") from e
    return torchft


class ReplicaQuorum:
    """This rank's place in a quorum of pipeline replicas (module docstring).

    ``pipe``: this job's pipeline (its ranks are one replica); ``optimizer``:
    the user's, over ``pipe.parameters()``; ``replica_id``: this replica's
    number, the same on all its ranks and different between replicas (a
    restarted replica keeps its number); ``lighthouse``: the Lighthouse's
    address (default: ``$TORCHFT_LIGHTHOUSE``); ``min_replicas``: the
    fewest replicas a step may commit with; ``timeout``: the bound of the
    cross-replica all-reduce, the commit vote and a heal's transfer (default:
    the pipeline's timeout); ``quorum_timeout``: the bound of waiting for a
    quorum (default: ``timeout``); ``state``: named objects healed with the
    model (e.g. ``{"data": loader}``, with ``state_dict``/``load_state_dict``);
    ``start_replicas``: how many replicas the first step waits for;
    ``max_norm``: clip the participants' gradient to this global norm
    (``norm_type``) before the optimizer steps, as
    ``torch.nn.utils.clip_grad_norm_`` on one process would (NOTE [Clipping
    after the average]).

    NOTE [Starting as one]: a Lighthouse forms a quorum from half of the
    replicas it hears, so replicas launched together can start as separate
    quorums of one, each training its own model for a few steps until they
    meet and one is healed over (its steps discarded). With
    ``start_replicas=k`` a replica that has no committed step (a new job, or
    a restarted replica not yet healed) skips steps whose quorum holds fewer
    than k replicas: no pipeline step, no commit. A healed replica is past
    step 0 and steps with any quorum.

    Every rank of the job must construct it after ``torch.distributed`` is
    initialised (``dist.init_process_group``) and call :meth:`step` the same
    number of times with its batch."""

    def __init__(self, pipe: Any, optimizer: torch.optim.Optimizer, *, replica_id: int,
                 lighthouse: str | None = None, min_replicas: int = 1,
                 timeout: datetime.timedelta | None = None,
                 quorum_timeout: datetime.timedelta | None = None,
                 state: dict[str, Stateful] | None = None,
                 start_replicas: int = 1, max_norm: float | None = None,
                 norm_type: float = 2.0) -> None:
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise ValueError(f"replica_id={replica_id!r}: must be an int >= 0, the same on "
                             "every rank of a replica")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) \
                or min_replicas < 1:
            raise ValueError(f"min_replicas={min_replicas!r}: must be an int >= 1")
        if isinstance(start_replicas, bool) or not isinstance(start_replicas, int) \
                or start_replicas < 1:
            raise ValueError(f"start_replicas={start_replicas!r}: must be an int >= 1")
        if max_norm is not None and not (isinstance(max_norm, (int, float))
                                         and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"max_norm={max_norm!r}: must be a number > 0 (or None: no "
                             "clipping)")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise ValueError(f"norm_type={norm_type!r}: must be a number (2.0, or inf, as "
                             "torch.nn.utils.clip_grad_norm_ takes)")
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("ReplicaQuorum needs the Lighthouse's address: lighthouse=... or "
                             "$TORCHFT_LIGHTHOUSE (start one with `torchft_lighthouse "
                             "--min_replicas 1`)")
        for name, obj in (state or {}).items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"state[{name!r}]={type(obj).__name__}: needs state_dict() and "
                                 "load_state_dict() to be healed with the model")
        if pipe.session.meta and not pipe.is_captured:
            raise ValueError("ReplicaQuorum with a meta-device model needs its first step "
                             "first: a heal before it would load into the stand-ins that "
                             "materialization then replaces (run pipe.step once, or build "
                             "the model on a real device)")
        if not dist.is_initialized():
            raise ValueError("ReplicaQuorum needs torch.distributed initialised "
                             "(dist.init_process_group under torchrun): its ranks are one "
                             "replica's pipeline")
        ft = _torchft()
        self.pipe = pipe
        self.optimizer = optimizer
        self.replica_id = replica_id
        self._state = dict(state or {})
        timeout = timeout or pipe.timeout
        self.timeout = timeout
        self._joined = False
        self.start_replicas = start_replicas
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        host, port = self._replica_store(timeout)
        self._manager = ft.Manager(
            pg=(ft.ProcessGroupNCCL(timeout=timeout) if pipe.device.type == "cuda"
                else ft.ProcessGroupGloo(timeout=timeout)),
            load_state_dict=self._load, state_dict=self._save,
            min_replica_size=min_replicas, use_async_quorum=False,
            timeout=timeout, quorum_timeout=quorum_timeout or timeout,
            connect_timeout=timeout, rank=dist.get_rank(), world_size=dist.get_world_size(),
            store_addr=host, store_port=port,
            lighthouse_addr=lighthouse, replica_id=f"mpmd_replica_{replica_id}")

    def _replica_store(self, timeout: datetime.timedelta) -> tuple[str, int]:
        """A TCPStore of this launch of the replica, hosted by its rank 0.

        NOTE [A store per launch]: torchft's manager keeps its keys (the manager
        server's address) unprefixed in the store it is given. torchrun's store
        outlives a restart of the job, so a restarted rank would read the dead
        launch's address. Rank 0 hosts a new store and publishes where in the
        job's store, under a key naming the launch (each read bounded by
        ``timeout``: a rank 0 that died is an error, not a hang). Its host
        name is also the address other replicas use to reach this replica's
        store when they reconfigure their groups."""
        launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"torch_mpmd/replica_store/{launch}"
        job = bounded_store(timeout.total_seconds())
        self._store = None
        if dist.get_rank() == 0:
            self._store = dist.TCPStore(socket.gethostname(), 0, dist.get_world_size(),
                                        is_master=True, timeout=timeout,
                                        wait_for_workers=False)
            job.set(key, f"{socket.gethostname()}:{self._store.port}")
        host, _, port = job.get(key).decode().rpartition(":")
        return host, int(port)

    # ------------------------------------------------------------ healing
    def _save(self) -> dict[str, Any]:
        """What a rejoining replica's same rank receives from this one."""
        return {"model": _portable(self.pipe.state_dict()),
                "optimizer": _portable(self.optimizer.state_dict()),
                "pipeline_step": self.pipe.step_count,
                "state": {name: obj.state_dict() for name, obj in self._state.items()}}

    def _load(self, saved: dict[str, Any]) -> None:
        # Before its first step the pipeline holds the whole module and loads
        # the peer's rank's entries into it (its stages will share them).
        mine = self.pipe.state_dict()
        model = {k: _rewrap(v, mine.get(k), f"the model's {k!r}")
                 for k, v in saved["model"].items()}
        self.pipe.load_state_dict(model, strict=self.pipe.is_captured)
        optim = saved["optimizer"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if optim["state"] and max(optim["state"]) >= len(params):
            raise ValueError(f"heal: the peer's optimizer holds state for parameter "
                             f"{max(optim['state'])}, this rank's has {len(params)} parameters: "
                             "every replica must build its optimizer over the same parameters")
        optim["state"] = {i: {k: _rewrap(v, params[i], f"the optimizer's state {k!r} of "
                                            f"parameter {i}", same_layout=False)
                              for k, v in s.items()}
                          for i, s in optim["state"].items()}
        self.optimizer.load_state_dict(optim)
        self.pipe.step_count = saved["pipeline_step"]
        for name, obj in self._state.items():
            obj.load_state_dict(saved["state"][name])

    # ------------------------------------------------------------ stepping
    @property
    def step_count(self) -> int:
        """Committed steps of the quorum (healing sets it to the peer's)."""
        return self._manager.current_step()

    def join(self) -> int:
        """Join the next step's quorum; a replica behind the others is healed
        here (its ``state=`` objects too). Returns the number of replicas in
        the quorum. Call it before drawing the step's batch when a healed data
        position decides the batch; :meth:`step` joins itself otherwise."""
        if self._joined:
            raise RuntimeError("join() called twice without a step() between")
        self._manager.start_quorum()
        self._joined = True
        return self._manager.num_participants()

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> QuorumStep:
        """One training step of this replica in the quorum (module docstring).
        After a committed step each held parameter's ``.grad`` is the
        participants' gradient the optimizer stepped on; after one that did not
        commit it is this replica's own, and the optimizer did not step. A
        failure of this replica's pipeline raises PipelineError (the replica
        ends and torchrun restarts it); a quorum not formed within
        ``quorum_timeout`` raises torchft's error."""
        m = self._manager
        if not self._joined:
            self.join()
        self._joined = False
        if m.current_step() == 0 and m.num_participants() < self.start_replicas:
            # NOTE [Starting as one]: every rank of the quorum's replicas sees
            # the same count and skips alike; the vote then fails.
            waiting = (f"{m.num_participants()} of the {self.start_replicas} replicas to "
                       "start with")
            m.report_error(RuntimeError(waiting))
            committed = m.should_commit()
            time.sleep(_START_POLL_S)  # a replica alone would otherwise spin on the quorum
            return QuorumStep(loss=torch.tensor(float("nan")), committed=committed,
                              participants=m.num_participants(), step=m.current_step(),
                              error=waiting)
        self.optimizer.zero_grad()
        grad_norm = None
        loss = self.pipe.step(*args, target=target, **kwargs)
        tokens = self.pipe.last_token_count
        weight = 1.0 if tokens is None else float(tokens)
        named = [(n, p) for n, p in self.pipe.named_parameters() if p.grad is not None]
        grads = [local_grad(p) for _, p in named]
        self._check_layout(named, grads)
        flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads] +
                         [torch.tensor([float(loss) * weight, weight], device=loss.device)])
        flat[:-2] *= weight
        m.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        failed = m.errored()
        committed = m.should_commit()
        if committed:
            flat[:-1] /= flat[-1]
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
            if self.max_norm is not None:
                # NOTE [Clipping after the average]: every replica now holds the
                # participants' gradient, so its norm over this replica's ranks
                # is the global one; clipping before the all-reduce would clip
                # each replica's own gradient, which no single process does.
                # All ranks of the replica are here alike (the vote passed).
                grad_norm = float(self.pipe.clip_grad_norm_(self.max_norm, self.norm_type))
            self.optimizer.step()
            loss = flat[-2].clone().to(loss.dtype)
        return QuorumStep(loss=loss, committed=committed, participants=m.num_participants(),
                          step=m.current_step(),
                          error=None if failed is None else str(failed.original_exception),
                          grad_norm=grad_norm)

    def _check_layout(self, named: list, grads: list[torch.Tensor]) -> None:
        """NOTE [Replicas split alike]: rank r's gradients are summed element
        by element with rank r's of the other replicas, so they must be the
        same parameters in the same order. Gloo does not check: a longer
        buffer on one side gives the other a wrong sum without an error. Every
        step sums a fingerprint of this rank's layout (names, shapes, dtypes)
        and a count first; unequal layouts are an error on every replica,
        before any gradient is exchanged."""
        text = ";".join(f"{n}:{tuple(g.shape)}:{g.dtype}" for (n, _), g in zip(named, grads))
        mine = zlib.crc32(text.encode())
        check = torch.tensor([mine, 1], dtype=torch.int64, device=self.pipe.device)
        self._manager.allreduce(check, reduce_op=dist.ReduceOp.SUM).wait()
        if self._manager.errored() is None and int(check[0]) != mine * int(check[1]):
            raise ValueError(
                f"replica {self.replica_id} rank {dist.get_rank()}: the replicas' rank "
                f"{dist.get_rank()} hold different parameters ({len(grads)} here, "
                f"{sum(g.numel() for g in grads)} elements, layout fingerprint {mine}; the "
                f"{int(check[1])} replicas' fingerprints sum to {int(check[0])}): every "
                "replica must split the model the same way (schedule, stages and split; "
                "pass plan= or split_points= rather than a per-launch plan='auto')")

    def shutdown(self) -> None:
        """Leave the quorum: stop this rank's manager and its servers."""
        self._manager.shutdown(wait=False)


# ------------------------------------------------------------ heal payloads
# NOTE [Shards in a heal]: with data_parallel="shard" inside a replica the
# parameters and the optimizer's moments are DTensors over the job's own
# mesh. A heal goes from rank r of one replica to rank r of another, which
# holds the same rows of every parameter on a mesh of the same shape but its
# own process groups; so a DTensor travels as its local rows and layout, and
# the receiver wraps the rows on its own mesh (that of its tensor in the same
# place). The sender's mesh object never crosses.

@dataclass(frozen=True)
class _Shard:
    """A DTensor in a heal: this rank's rows and their layout."""

    local: torch.Tensor
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    mesh: tuple[int, ...]  # the sender's mesh shape


def _portable(tree: Any) -> Any:
    """``tree`` with every tensor copied (the transport serializes them later,
    while this rank steps on) and every DTensor as a :class:`_Shard`."""
    def one(t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):
            return _Shard(t.to_local().detach().clone(), tuple(t.placements), tuple(t.shape),
                          tuple(t.stride()), tuple(t.device_mesh.shape))
        return t.detach().clone()
    return pytree.tree_map_only(torch.Tensor, one, tree)


def _rewrap(value: Any, like: Any, what: str, same_layout: bool = True) -> Any:
    """A received value for the place where this rank holds ``like``: a
    :class:`_Shard` becomes a DTensor on ``like``'s mesh, laid out as sent.
    ``same_layout``: ``like`` must be laid out as the shard was (a parameter;
    not an optimizer's state, which may be of another shape than its
    parameter)."""
    if not isinstance(value, _Shard):
        return value
    if not isinstance(like, DTensor) or tuple(like.device_mesh.shape) != value.mesh or (
            same_layout and (tuple(like.placements) != value.placements
                             or tuple(like.shape) != value.shape
                             or like.to_local().shape != value.local.shape)):
        have = (f"a DTensor {tuple(like.shape)} (rows {tuple(like.to_local().shape)}) placed "
                f"{tuple(like.placements)} on a mesh of {tuple(like.device_mesh.shape)}"
                if isinstance(like, DTensor) else type(like).__name__)
        raise ValueError(f"heal: {what} came as a shard of {value.shape} (rows "
                         f"{tuple(value.local.shape)}) placed {value.placements} on a mesh of "
                         f"{value.mesh}, where this rank holds {have}: every replica must lay "
                         "the model out the same way (mesh, data_parallel, split)")
    return DTensor.from_local(value.local.to(like.device), like.device_mesh, value.placements,
                              run_check=False, shape=value.shape, stride=value.stride)
