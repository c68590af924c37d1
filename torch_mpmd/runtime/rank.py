"""What one rank builds from a capture: schedule, runner, transport, executor.

:class:`RankRuntime` is the per-capture state of a :class:`~torch_mpmd.Pipeline`
(api.py): the split model, the lowered schedule, this rank's stages, the
C++ executor over the c10d transport, the process groups of tied weights.
It also holds the collective steps around an executor run: the start-up
handshake (plan hashes), the exchanges that keep the ranks in step (NOTE
[Lockstep] in lockstep.py), the waits for the gradient reductions that
REDUCE_GRAD posts (dp; tied weights: tied.py) and the broadcast of the loss
and outputs from the last stage's rank. Every wait is bounded: by
``timeout``, or at a capture by ``startup_timeout``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import struct
import json
import re
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from torch_mpmd import _runtime
from torch_mpmd.parallel import lockstep
from torch_mpmd.parallel.data_parallel import DataParallel, new_replica_group, new_tied_group
from torch_mpmd.parallel.sharding import ParamShards, ShardedStages
from torch_mpmd.runtime.program_runner import ProgramRunner
from torch_mpmd.parallel.lockstep import PipelineError
from torch_mpmd.programs.stage_programs import Compiler
from torch_mpmd.graph.shapes import SymbolicShapes
from torch_mpmd.runtime.runner import EdgeLayout
from torch_mpmd.schedules import (V_SCHEDULES, Action, ActionKind, Schedule, get_schedule,
                                  kind_name, names as schedule_names)
from torch_mpmd.graph.stage import SplitModel, StageSignature
from torch_mpmd.parallel.tied import TiedGroup, TiedSums

__all__ = ["PipelineError", "RankRuntime", "StagedModel", "resolve_schedule",
           "forward_only_text", "backward_only_text", "loss_summary"]


# Default least wait for the other ranks' compiled (Inductor) program builds,
# which can take minutes longer on one rank than another; startup_timeout= sets it.
_COMPILED_BUILD_TIMEOUT_S = 1800.0
_K = ActionKind
# The kinds of each part of a step a call runs (kind_of): "forward" and "eval"
# run the forward part, "backward" (the compile door) the rest, "step" all.
_PART_KINDS = {
    "forward": (_K.FORWARD, _K.SEND_F, _K.RECV_F),
    "backward": (_K.FULL_BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT, _K.SEND_B, _K.RECV_B,
                 _K.REDUCE_GRAD),
}
_PART_KINDS["eval"] = _PART_KINDS["forward"]
_SETTING_CHARS = 300  # of a setting's value, in the start-up mismatch error


def _part(schedule: Schedule, part: str) -> Schedule:
    """The forward or backward part of a lowered schedule (Schedule.part: a
    subsequence of a valid program keeps every channel's order, NOTE [Channel
    order], and forwards depend only on forwards, so it runs too)."""
    return schedule.part(_PART_KINDS[part], name=f"{schedule.name}-{part}")


LossSummary = tuple[float, float, bool]  # (value, count, token-weighted)


def loss_summary(losses: Sequence[torch.Tensor]) -> LossSummary:
    """The microbatches' losses as ``(value, count, weighted)``: the mean of
    scalar losses (count 0, not weighted), or for token-weighted ``[sum,
    count]`` losses the sum of their sums and of their counts (weighted)."""
    # One kind per step (the runner's record_loss refuses a mix).
    stacked = torch.stack(losses)
    if stacked.dim() == 2:
        total, count = stacked.double().sum(0).tolist()
        return total, count, True
    return float(stacked.float().mean()), 0.0, False


def forward_only_text(schedule: Schedule) -> str:
    """The forward part (F, SEND_F, RECV_F) of a lowered schedule, as text."""
    return _part(schedule, "forward").to_text()


def backward_only_text(schedule: Schedule) -> str:
    """The backward part of a lowered schedule (see forward_only_text)."""
    return _part(schedule, "backward").to_text()


def resolve_schedule(schedule: Any, *, pp_size: int, num_stages: int, num_microbatches: int,
                     edges: Sequence[tuple[int, int]], shard: bool = False,
                     reshard_after_forward: bool = False) -> Schedule:
    """The lowered, validated schedule for the plan: from a name, a Schedule, or
    a text/CSV file. Errors name the values that do not fit. ``shard``: the
    lowering places UNSHARD/RESHARD actions (sharded data parallel; a schedule
    given lowered keeps its own, and stages without them gather lazily: NOTE
    [Lazy gather] in sharding.py)."""
    spr = num_stages // pp_size
    if isinstance(schedule, str) and schedule in schedule_names():
        if schedule in V_SCHEDULES and spr != 2:
            raise ValueError(f"schedule {schedule!r} places 2 stages per rank (V shape); the "
                             f"model has {num_stages} stages on pp_size={pp_size} ranks "
                             f"({spr} per rank)")
        sched = get_schedule(schedule, num_ranks=pp_size, num_microbatches=num_microbatches,
                             stages_per_rank=spr)
    elif isinstance(schedule, Schedule):
        sched = schedule
    elif isinstance(schedule, (str, os.PathLike)) and os.path.isfile(schedule):
        path = os.fspath(schedule)
        if path.endswith(".csv"):
            sched = Schedule.from_csv(path)
        else:
            with open(path, encoding="utf-8") as f:
                sched = Schedule.from_text(f.read())
    else:
        raise ValueError(f"schedule={schedule!r} is neither a schedule name "
                         f"({', '.join(schedule_names())}), a Schedule, nor an existing "
                         "text/CSV file")
    if (sched.num_ranks, sched.num_stages, sched.num_microbatches) != (
            pp_size, num_stages, num_microbatches):
        raise ValueError(
            f"schedule '{sched.name}' has {sched.num_ranks} ranks, {sched.num_stages} stages and "
            f"{sched.num_microbatches} microbatches; the pipeline has pp_size={pp_size}, "
            f"{num_stages} stages and num_microbatches={num_microbatches}")
    if sched.is_lowered:
        if sorted(sched.edges) != sorted(edges):
            raise ValueError(f"lowered schedule '{sched.name}' has stage edges {sched.edges}, "
                             f"the model's plan has {sorted(edges)}; pass it compute-only")
    else:
        sched = sched.with_edges(sorted(edges))
        sched = (sched.lower(shard=True, reshard_after_forward=reshard_after_forward) if shard
                 else sched.lower())
    sched.validate()
    return sched


def _plan_digest(plan: Any, *, dynamic: bool) -> int:
    """What the ranks compare of their partition plans: its hash, or for a
    dynamic capture the plan without the transferred values' bytes, which
    follow the sizes each rank captured with (data-parallel replicas capture
    from their own first microbatch: the same plan at other sizes)."""
    if not dynamic:
        return _int64(plan.hash)
    structure = (plan.num_stages, list(plan.node_stage),
                 [(v.node, v.producer_stage, list(v.consumer_stages))
                  for v in plan.cross_stage_values],
                 [(p.fqn, list(p.stages)) for p in plan.parameters])
    digest = hashlib.sha256(repr(structure).encode()).digest()
    return _int64(int.from_bytes(digest[:8], "little"))


def _microbatch_digest(count: int, sizes: Sequence[tuple[int, ...]],
                       labels: Sequence[str] = ()) -> int:
    """A digest of a call's microbatch count, sizes and value labels
    (microbatch_contents; nonzero), which the ranks of one pipeline compare in
    the call's begin exchange: ranks given different microbatches stop there,
    before any transfer."""
    h = hashlib.sha256(repr((count, [tuple(k) for k in sizes], list(labels))).encode()).digest()
    return _int64(int.from_bytes(h[:8], "little")) or 1


# NOTE [Microbatch contents]: the ranks of one pipeline must be given the same
# microbatches, contents included (rank 0 reads the inputs, the last rank the
# targets: different batches would train on rank 0's inputs with the last
# rank's targets, silently). Each call's begin exchange therefore carries a
# digest of every input and target value of every microbatch, exact (every
# byte counts; a strided sample could miss a difference): a CPU tensor's
# bytes go through BLAKE2b (read in place, no copy); a tensor on another
# device is reduced there (_device_digest) and two int64 come to the host.
# Non-tensor values count by their repr where it is a value's (numbers,
# strings, None, containers of them), else by their type name (an object's
# default repr holds its address, which differs by process). Measured in
# BENCHMARKS.md ("The microbatch digest").
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_READ_IN_PLACE = ("cpu",)  # device types whose tensors' bytes BLAKE2b reads itself


def _device_sums(flat: torch.Tensor) -> torch.Tensor:
    """An exact digest of a 1-D uint8 tensor's bytes, computed on its device:
    the bytes as 32-bit words (sign-extended to int64, so no bit of a word
    reaches a product's top bit alone) times two position-derived odd
    pseudo-random int64 sequences, each summed with int64 wraparound. A
    change of any word changes each sum unless the changes cancel in both
    (one word: never, an odd multiplier is invertible mod 2**64). Returns
    the two sums (int64, on the device)."""
    if flat.numel() % 4:
        words = flat.to(torch.int64)
    else:
        words = flat.view(torch.int32).to(torch.int64)
    i = torch.arange(words.numel(), dtype=torch.int64, device=flat.device)
    sums = []
    for mult, add in ((-7046029254386353131, 1442695040888963407),     # (splitmix-style
                      (-4658895280553007687, -7723592293110705685)):  #  constants)
        r = i * mult + add
        r = r ^ ((r >> 31) & 0x1FFFFFFFF)  # logical shift: the top bits mix down
        sums.append(((r | 1) * words).sum())
    return torch.stack(sums)


def _device_digest(flat: torch.Tensor) -> bytes:
    """:func:`_device_sums` as bytes (one transfer to the host)."""
    return struct.pack("<2q", *_device_sums(flat).tolist())


def _value_parts(value: Any, parts: list[Any]) -> None:
    """What the digest of ``value`` (a tensor, a plain value, or a list,
    tuple or dict tree of them) reads, in order, into ``parts``: bytes, and
    for a tensor off the CPU its two device sums, read back later, all of a
    call's at once (NOTE [Microbatch contents])."""
    if isinstance(value, torch.Tensor):
        t = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard
        parts.append(repr((str(t.dtype), tuple(t.shape), str(t.layout))).encode())
        if t.layout != torch.strided or t.device.type == "meta":
            return  # (no bytes to read: sparse layouts, meta tensors count by their shape)
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(memoryview(flat.numpy()) if flat.device.type in _READ_IN_PLACE
                     else _device_sums(flat))
    elif isinstance(value, (list, tuple)):
        parts.append(f"{type(value).__name__}[{len(value)}]".encode())
        for v in value:
            _value_parts(v, parts)
    elif isinstance(value, dict):
        parts.append(f"dict[{len(value)}]".encode())
        for k, v in value.items():
            parts.append(repr(k).encode() if isinstance(k, _PLAIN) else b"?")
            _value_parts(v, parts)
    elif isinstance(value, _PLAIN):
        parts.append(repr(value).encode())
    else:
        parts.append(type(value).__qualname__.encode())


def microbatch_contents(inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any]
                        ) -> tuple[int, list[str], list[int]]:
    """(digest of everything, each value's label, each value's digest) for a
    call's microbatches: per microbatch its named inputs, then its target
    (NOTE [Microbatch contents]). The labels name the value in an error."""
    labels, values = [], []
    for mb, named in enumerate(inputs):
        target = targets[mb] if mb < len(targets) else None
        for label, value in [*((f"input {name!r}", v) for name, v in named.items()),
                             ("target", target)]:
            parts: list[Any] = []
            _value_parts(value, parts)
            labels.append(f"microbatch {mb}, {label}")
            values.append(parts)
    # The device sums: one transfer per device for the whole call.
    on_device: dict[torch.device, list[torch.Tensor]] = {}
    for parts in values:
        for p in parts:
            if isinstance(p, torch.Tensor):
                on_device.setdefault(p.device, []).append(p)
    host = {id(t): struct.pack("<2q", *pair)
            for ts in on_device.values() for t, pair in zip(ts, torch.stack(ts).tolist())}
    digests = []
    whole = hashlib.blake2b(digest_size=8)
    for parts in values:
        h = hashlib.blake2b(digest_size=8)
        for p in parts:
            h.update(host[id(p)] if isinstance(p, torch.Tensor) else p)
        d = h.digest()
        whole.update(d)
        digests.append(_int64(int.from_bytes(d, "little")))
    return _int64(int.from_bytes(whole.digest(), "little")) or 1, labels, digests


def _int64(x: int) -> int:
    x &= 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclass
class StagedModel:
    """The pieces of a split model a rank runtime needs (from a SplitModel, or
    from the backend's partition of a Dynamo graph)."""

    stages: list[torch.fx.GraphModule]            # every stage's module
    signatures: list[StageSignature]
    plan: Any                                     # the C++ PartitionPlan
    example_values: dict[int, Any]                # sent value node -> example (microbatch)
    tensors: dict[str, torch.Tensor]              # parameter/buffer FQN -> the model's tensor
    rebuild_output: Callable[[Sequence[Any], Mapping[str, Any]], Any]
    shapes: SymbolicShapes | None = None          # a dynamic capture's sizes (shapes.py)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def from_split(cls, split: SplitModel) -> "StagedModel":
        example = {v.node: split.ir.fx_nodes[v.node].meta.get("example_value")
                   for sig in split.stage_signatures for v in sig.sent}
        shapes = None
        if split.sizes:  # transfers are sized per step; start at the capture's sizes
            phs = {info.name: n for n, info in zip(
                [n for n in split.captured.gm.graph.nodes if n.op == "placeholder"],
                split.captured.placeholders)}
            shapes = SymbolicShapes(
                [(i.name, phs[i.name].meta["example_value"]) for i in split.sizes], example,
                {i.name: phs[i.name].meta["example_value"] for i in split.captured.placeholders
                 if i.kind in ("input", "size")})
            example = shapes.concrete(shapes.hint_key())
        return cls(split.stages, split.stage_signatures, split.plan, example,
                   split.captured.tensors, split.captured.rebuild_output, shapes)


# NOTE [Release at exit]: the C++ executors and transports, and the runtime's
# own fields, hold references to process groups. A runtime that is still alive
# when the interpreter finalizes (a torch.compile'd pipeline in Dynamo's cache,
# a pipeline in a reference cycle) would destroy the last reference to a gloo
# group during finalization, after the script's destroy_process_group(); seen
# to abort the process ("terminate called without an active exception"). So
# at exit, while everything is alive, the runtimes drop their C++ objects and
# group references, Dynamo's caches are cleared and cycles collected, so that
# groups go while the interpreter still runs.
_LIVE: "weakref.WeakSet[RankRuntime]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for rt in list(_LIVE):
        rt.release(groups=True)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        try:
            dynamo.reset()
        except Exception:  # noqa: BLE001  (best effort at exit)
            pass
    gc.collect()


class RankRuntime:
    """Everything one rank builds from one capture (see the module docstring)."""

    def __init__(self, model: StagedModel, *, schedule: Any, num_microbatches: int,
                 group: Any, device: torch.device, timeout: datetime.timedelta,
                 lookahead: int, settings: Mapping[str, str], seed: int | None,
                 dp_group: Any = None, replicas: list[list[int]] | None = None,
                 compiler: Compiler | None = None,
                 startup_timeout: datetime.timedelta | None = None,
                 shards: ParamShards | None = None,
                 reshard_after_forward: bool = False) -> None:
        self.model = model
        # Sharded data parallel: every parameter's DTensor shard (sharding.py).
        self.shards = shards
        self.group = group
        self.dp_group = dp_group
        # Global ranks of every pipeline replica by pp rank, and which one is ours.
        self.replicas = replicas or [dist.get_process_group_ranks(group) if group is not None
                                     else [0]]
        me = dist.get_rank() if dist.is_initialized() else 0
        self.replica = next(i for i, r in enumerate(self.replicas) if me in r)
        self.device = device
        self.timeout_s = timeout.total_seconds()
        # A capture's waits for the other ranks (their capture, their program
        # builds) allow for ranks that capture or compile at different speeds.
        self.startup_timeout_s = (startup_timeout.total_seconds() if startup_timeout is not None
                                  else self.timeout_s)
        self.build_timeout_s = (self.startup_timeout_s if startup_timeout is not None or
                                compiler is None else
                                max(self.timeout_s, _COMPILED_BUILD_TIMEOUT_S))
        self.ledger = lockstep.ledger_for(self.replicas, group, dp_group)
        self.lookahead = lookahead
        self.pp_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        num_stages = model.num_stages
        self.layout = EdgeLayout.build(model.signatures, model.example_values)
        self.schedule = resolve_schedule(schedule, pp_size=self.pp_size, num_stages=num_stages,
                                         num_microbatches=num_microbatches,
                                         edges=self.layout.edges(), shard=shards is not None,
                                         reshard_after_forward=reshard_after_forward)
        self.stage_to_rank = list(self.schedule.stage_to_rank)
        self.local_stages = tuple(s for s in range(num_stages) if self.stage_to_rank[s] == self.rank)
        producers: list[list[int]] = [[] for _ in range(num_stages)]
        consumers: list[list[int]] = [[] for _ in range(num_stages)]
        # The executor's edges: the stage chain s -> s+1 (which the schedule text
        # always declares) and the skip edges. A chain edge nothing crosses (a stage
        # that does not read its predecessor) carries no values.
        for edge in [*self.schedule.edges, *((s, s + 1) for s in range(num_stages - 1))]:
            self.layout.forward.setdefault(tuple(edge), [])
            self.layout.backward.setdefault(tuple(edge), [])
        for p, c in self.layout.edges():
            producers[c].append(p)
            consumers[p].append(c)
        self.runner = ProgramRunner({s: model.stages[s] for s in self.local_stages},
                                    model.signatures, self.layout, producers, consumers,
                                    model.rebuild_output,
                                    split_backward=self.schedule.splits_backward,
                                    compiler=compiler, rank=self.rank, device=device,
                                    kinds=self._compute_kinds())
        self.runner.shapes = model.shapes
        self.transport = self._transport() if self.pp_size > 1 else None
        self.digest = 0  # of this capture's plan and settings: set by the handshake
        self.seed = self._handshake(settings, seed)
        self.executor = self._executor(self.schedule.to_text())
        self._forward_executor: Any = None
        self._backward_executor: Any = None
        # A dynamic capture: the sizes the transfers are sized for now (see
        # use_microbatches); starts at the capture's own sizes.
        self._shape_key = model.shapes.hint_key() if model.shapes is not None else None
        self._by_sizes: dict[tuple[int, ...], tuple[dict[int, torch.Tensor], dict]] = {}
        self._mixed = False  # the transport holds per-microbatch specs
        # (count, sizes digest, contents digest) and every value's (label,
        # digest) of the call's microbatches: use_microbatches, use_contents.
        self._call_microbatches = (0, 0, 0)
        self._call_keys: list[tuple[int, ...]] = []
        self._call_values: tuple[list[str], list[int]] = ([], [])
        self._fitted: Any = None  # the microbatches use_microbatches fitted last
        self._schedule_source = schedule
        self._shard = shards is not None
        self._reshard_after_forward = reshard_after_forward
        # Per microbatch count: the schedule and its executors (use_microbatch_count).
        self._by_count: dict[int, list[Any]] = {}
        self._programs: dict[str, list[list[Action]]] = {}
        self.tied_groups = self._tied_groups()
        _LIVE.add(self)
        self.tied = self._tied_sums()
        self.dp = self._data_parallel() if dp_group is not None else None
        if self.dp is not None or self.tied is not None:
            self.runner.on_reduce_grad = self._reduce_grad
        if isinstance(self.dp, ShardedStages):
            self.runner.sharded = self.dp
        if self.ledger is not None:
            self.ledger.uses(self._groups())

    # ------------------------------------------------------------ construction
    def _compute_kinds(self, schedule: Schedule | None = None,
                       rank: int | None = None) -> dict[int, set[str]]:
        """Per stage of pipeline rank ``rank`` (default this rank), the names
        of the compute kinds (F, B, I, W) its program runs (in ``schedule``,
        default the runtime's)."""
        rank = self.rank if rank is None else rank
        kinds: dict[int, set[str]] = {s: set() for s in range(self.model.num_stages)
                                      if self.stage_to_rank[s] == rank}
        for action in (schedule or self.schedule).actions[rank]:
            if action.is_compute:
                kinds[action.stage].add(kind_name(action.kind))
        return kinds

    def _transport(self) -> Any:
        backend = dist.get_backend(self.group)
        up = down = self.group
        if backend == "nccl":  # NOTE [Direction groups] in csrc/runtime/c10d_transport.h
            every = list(range(self.pp_size))
            up = new_replica_group(every, self.replicas, self.replica)
            down = new_replica_group(every, self.replicas, self.replica)
        self._transport_groups = (up, down)
        return _runtime.C10dTransport(up.group_name, down.group_name, self.layout.specs(),
                                      str(self.device))

    def _executor(self, text: str, *, stateful: bool = True) -> Any:
        # Tracing is always on: two clock reads per action (trace.py). The
        # forward-only and backward-only executors (inference, the compile
        # door) run the autograd path, whose state the runner keeps itself.
        # drain: a failure of this rank's own code ends the step's transfers with
        # stand-ins, so peers end the step too (NOTE [Draining a failed step]).
        runner = self.runner if stateful else self.runner.autograd_view
        return _runtime.Executor(text, self.rank, runner, self.transport,
                                 lookahead=self.lookahead, timeout_s=self.timeout_s, trace=True,
                                 drain=True)

    def _handshake(self, settings: Mapping[str, str], seed: int | None) -> int:
        """Compare plan and settings across every rank of the pipeline (all
        replicas) before any transfer, in the ranks' handshake exchange (NOTE
        [Lockstep]); agree on a seed (this replica's pp rank 0's). Ranks arrive
        after capturing, which takes seconds and varies by rank: the wait is
        ``startup_timeout``. ``settings``: what every rank must share, by name
        (api.py); the schedule's programs join them, by their hash."""
        programs = hashlib.sha256(self.schedule.to_text().encode()).hexdigest()[:16]
        self.settings = {**settings, "schedule programs (hash)": programs}
        digest = hashlib.sha256(json.dumps(list(self.settings.items())).encode()).digest()
        self.digest = _int64(int.from_bytes(digest[:8], "little")) or 1  # 0: not compared
        mine = [_plan_digest(self.model.plan, dynamic=self.model.shapes is not None),
                self.digest,
                _int64(seed if seed is not None else torch.initial_seed())]
        if self.ledger is None:
            return mine[2]
        outcome = self.ledger.exchange("handshake", timeout_s=self.startup_timeout_s,
                                       payload=mine)
        self.ledger.raise_for(outcome, "the start-up comparison of plans", ended=False)
        rows = [row[len(lockstep.FIELDS) - 3:] for row in outcome.rows]
        self._compare(rows)
        return rows[self.ledger.ranks.index(self.replicas[self.replica][0])][2]

    def _compare(self, rows: list[list[int]]) -> None:
        """PipelineError (on every rank) where the ranks' settings or plans
        differ: the settings first (they explain a plan that differs), named
        with their values on this rank and on the first peer whose differ,
        else each rank's hash; ``rows``: (plan hash, settings digest, seed)
        per rank of the ledger."""
        ranks = self.ledger.ranks
        cols = (("pipeline settings or schedule", 1), ("partition plan", 0))
        for what, col in cols:
            values = {r: row[col] & 0xFFFFFFFFFFFFFFFF for r, row in zip(ranks, rows)}
            if len(set(values.values())) > 1:
                # Every rank sees the same rows, so all take this branch together.
                named = self._settings_difference() if col == 1 else ""
                listing = ", ".join(f"{self.ledger.name(r)}: {v:016x}" for r, v in values.items())
                problem = (f"the ranks' settings differ: {named}" if named else
                           f"the ranks disagree on the {what} (hashes {listing})")
                err = PipelineError(
                    f"{self.ledger.name(self.ledger.me)}: {problem}; every rank must build the "
                    "same model and call pipeline() with the same arguments and the same input "
                    "shapes", rank=self.rank)
                raise lockstep.settle(err)  # every rank raises it, in step

    def _settings_difference(self) -> str:
        """Each setting in which this rank differs from the first peer that
        differs, with both values ('' if none does). Called by every rank
        together once the settings digests disagree: one more exchange, of
        every rank's settings (a rare error path), bounded by the start-up
        timeout."""
        me, theirs = self.ledger.me, self._gather_settings()
        for rank, other in zip(self.ledger.ranks, theirs):
            names = [k for k in {**self.settings, **other}
                     if k not in self.settings or k not in other
                     or self.settings[k][:_SETTING_CHARS] != other[k]]
            if rank == me or not names:
                continue
            return "; ".join(
                f"{k} is {self.settings.get(k, '(not set)')[:_SETTING_CHARS]} on "
                f"{self.ledger.name(me)} (this rank) but {other.get(k, '(not set)')} on "
                f"{self.ledger.name(rank)}" for k in names)
        return ""

    def _gather_settings(self) -> list[dict[str, str]]:
        """Every ledger rank's settings (values cut to _SETTING_CHARS), by an
        all_gather of their sizes, then of the JSON texts padded to the largest."""
        mine = json.dumps([[k, v[:_SETTING_CHARS]] for k, v in self.settings.items()]).encode()
        n, group, limit = len(self.ledger.ranks), self.ledger.group, self.startup_timeout_s
        sizes = torch.zeros(n, 1, dtype=torch.int64)
        self.wait(lockstep.all_gather(list(sizes.unbind(0)), torch.tensor([len(mine)]), group,
                                      limit), "the exchange of settings sizes (all_gather)", limit)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        texts = torch.zeros(n, padded.numel(), dtype=torch.uint8)
        self.wait(lockstep.all_gather(list(texts.unbind(0)), padded, group, limit),
                  "the exchange of settings (all_gather)", limit)
        return [dict(json.loads(bytes(texts[i, :int(sizes[i])].tolist()))) for i in range(n)]

    def _tied_ranks(self) -> dict[tuple[int, ...], list[str]]:
        """Per set of pipeline ranks sharing trainable parameters, their FQNs."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for p in self.model.plan.parameters:
            ranks = tuple(sorted({self.stage_to_rank[s] for s in p.stages}))
            t = self.model.tensors.get(p.fqn)
            if len(ranks) > 1 and isinstance(t, torch.nn.Parameter) and t.requires_grad:
                by_ranks.setdefault(ranks, []).append(p.fqn)
        return by_ranks

    def _tied_groups(self) -> list[tuple[Any, list[torch.nn.Parameter]]]:
        """Per set of ranks sharing parameters: (process group, this rank's shared
        params), for broadcasts within this replica (meta-device init).
        Created in the same order on every rank (new_group is collective)."""
        by_ranks = self._tied_ranks()
        groups = []
        for ranks in sorted(by_ranks):
            if len(ranks) == self.pp_size:
                pg = self.group
            else:
                pg = new_replica_group(ranks, self.replicas, self.replica)
            if self.rank in ranks:
                params = [self.user_param(self.model.tensors[f]) for f in sorted(by_ranks[ranks])]
                groups.append((pg, params))
        return groups

    def _tied_sums(self) -> TiedSums | None:
        """The sums of tied gradients (tied.py), each posted by the REDUCE_GRAD
        of this rank's last stage (in its program) reading the group's
        parameters; None when no parameter is shared across pipeline ranks.
        Groups are created in the same order on every rank, after every rank
        has checked the same programs (a schedule lowered without REDUCE_GRAD
        fails alike everywhere, before any group is made)."""
        by_ranks = self._tied_ranks()
        if not by_ranks:
            return None
        dp_size = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        readers = {p.fqn: set(p.stages) for p in self.model.plan.parameters}
        posts: dict[tuple[int, ...], int] = {}
        for ranks in sorted(by_ranks):
            fqns = by_ranks[ranks]
            for r in ranks:
                order = self._reduce_order(r)
                mine = {s for f in fqns for s in readers[f] if self.stage_to_rank[s] == r}
                missing = sorted(mine - set(order))
                if missing:
                    raise ValueError(
                        f"schedule '{self.schedule.name}' has no REDUCE_GRAD for stage(s) "
                        f"{missing} on pipeline rank {r}, which read parameters shared with "
                        f"pipeline ranks {list(ranks)} ({', '.join(sorted(fqns)[:3])}); their "
                        "gradient sum is posted by that action: lower the schedule with "
                        "grad_reduce=True (the default) or pass it compute-only")
                if r == self.rank:
                    posts[ranks] = max(mine, key=order.index)
        groups = []
        for ranks in sorted(by_ranks):
            pg, members = new_tied_group(ranks, self.replicas, self.replica, dp_size)
            if ranks in posts:
                params = [self.model.tensors[f] for f in sorted(by_ranks[ranks])]
                groups.append(TiedGroup(pg, members, params, posts[ranks], ranks))
        return TiedSums(groups, dp_size, self.timeout_s, self.shards)

    def _reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD(stage): the stage's dp reduction, then the tied sums it posts."""
        if self.dp is not None:
            self.dp.reduce(stage)
        if self.tied is not None:
            self.tied.reduce(stage)

    def begin_reductions(self) -> None:
        """Before a run whose program holds REDUCE_GRAD actions (a step, the
        backward part): the reductions start from this step's gradients."""
        if self.dp is not None:
            self.dp.begin_step()
        if self.tied is not None:
            self.tied.begin_step()

    def end_reductions(self) -> None:
        """After that run: wait for the step's reductions (within the timeout)
        and write them into the gradients."""
        if self.dp is not None:
            self.dp.end_step(self.wait)
        if self.tied is not None:
            self.tied.end_step(self.wait)

    def _groups(self) -> list[Any]:
        """Every process group this runtime communicates on."""
        groups = [self.group, self.dp_group, *getattr(self, "_transport_groups", ())]
        tied = getattr(self, "tied", None)
        return (groups + [g for g, _ in getattr(self, "tied_groups", [])] +
                [g.group for g in (tied.groups if tied is not None else ())])

    def _reduce_order(self, rank: int, schedule: Schedule | None = None) -> list[int]:
        """The stages of pipeline rank ``rank``'s REDUCE_GRAD actions, in
        program order (of ``schedule``, default the runtime's)."""
        return [a.stage for a in (schedule or self.schedule).actions[rank]
                if a.kind == ActionKind.REDUCE_GRAD]

    def _data_parallel(self) -> DataParallel | ShardedStages:
        order = self._reduce_order(self.rank)
        tied = {id(p) for p in self.tied.params} if self.tied is not None else set()
        if self.shards is not None:
            every = {s: list(self.model.stages[s].parameters()) for s in self.local_stages}
            return ShardedStages(self.shards, every, order, self.timeout_s, self.wait,
                                 reduced_elsewhere=tied)
        stage_params = {s: [p for p in self.model.stages[s].parameters()
                            if p.requires_grad and id(p) not in tied]
                        for s in self.local_stages}
        return DataParallel(self.dp_group, stage_params, order, self.timeout_s)

    def user_param(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter the user holds for a stage's tensor ``t``: its DTensor
        shard with sharded data parallel, else ``t``."""
        return self.shards.shard_of(t) if self.shards is not None else t

    def release(self, *, groups: bool = False) -> None:
        """Drop the executors and the transport (and with them the process-group
        references they hold), and with ``groups`` the runtime's own group
        references (NOTE [Release at exit]); the runtime cannot step afterwards."""
        self.executor = self._forward_executor = self._backward_executor = None
        self.transport = None
        self._by_count = {}
        if groups:
            self.group = self.dp_group = self.dp = self.tied = None
            self.tied_groups = []
            self.runner.on_reduce_grad = None

    # ------------------------------------------------------------ stepping
    def prepare_programs(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                         loss_fn: Callable | None) -> None:
        """Build this rank's stage programs for a training step (once per capture
        and target shape), then wait for every rank to have built its own: a
        rank still compiling would otherwise make the others' first transfers
        time out. Every rank builds at the same step (the key is the same)."""
        if not self.runner.prepare(inputs, targets, loss_fn):
            return
        if self.ledger is not None:  # bounded by build_timeout_s (see __init__)
            outcome = self.ledger.exchange("build", timeout_s=self.build_timeout_s,
                                           digest=self.digest)
            self.ledger.raise_for(outcome, "waiting for the other ranks to build their stage "
                                  "programs", ended=False)

    def use_microbatches(self, inputs: Sequence[Mapping[str, Any]]) -> None:
        """Fit the runtime to a call's microbatches (their named inputs), on
        every rank alike and before anything is sent: the schedule for their
        count (:meth:`use_microbatch_count`), and, for a dynamic capture, every
        transfer's size for their sizes. Each rank evaluates the symbolic
        shapes itself from the microbatches it is given, so no shape travels
        (NOTE [Microbatch specs] in csrc/runtime/c10d_transport.h): the
        transport's edge specs follow the first microbatch, and the
        microbatches whose sizes differ from it get their own."""
        if inputs is self._fitted:  # (Pipeline.step fits before building programs)
            return
        self._fitted = inputs
        self.use_microbatch_count(len(inputs))
        shapes = self.model.shapes
        keys = [shapes.key(named) for named in inputs] if shapes is not None else []
        self._call_keys = keys
        if shapes is None:
            return
        key = keys[0]
        if key != self._shape_key:
            self.layout.meta.update(self._concrete(key)[0])  # the runner reads this dict
            if self.transport is not None:
                self.transport.set_specs(self.layout.specs())
            self.runner.shapes_changed()
            self._shape_key = key
        own = {mb: k for mb, k in enumerate(keys) if k != key}
        self.runner.use_microbatch_shapes(
            keys if own else None, {mb: self._concrete(k)[0] for mb, k in own.items()})
        if self.transport is not None and (own or self._mixed):
            self.transport.set_microbatch_specs(
                {(p, c, grad, mb): specs for mb, k in own.items()
                 for (p, c, grad), specs in self._concrete(k)[1].items()})
            self._mixed = bool(own)

    def use_contents(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any]) -> None:
        """What the call's begin exchange compares of its microbatches (after
        use_microbatches): their count, sizes and value labels, and a digest
        of every input's and target's contents (NOTE [Microbatch contents])."""
        contents, labels, digests = microbatch_contents(inputs, targets)
        self._call_microbatches = (len(inputs),
                                   _microbatch_digest(len(inputs), self._call_keys, labels),
                                   contents)
        self._call_values = (labels, digests)

    def _concrete(self, key: tuple[int, ...]) -> tuple[dict[int, torch.Tensor], dict]:
        """For sizes ``key``: node id -> meta tensor of each transferred value,
        and the transport's edge specs (made once per sizes)."""
        found = self._by_sizes.get(key)
        if found is None:
            meta = self.model.shapes.concrete(key)
            found = self._by_sizes[key] = (meta, self.layout.specs_for(meta))
        return found

    def use_microbatch_count(self, m: int) -> None:
        """Run the next calls with ``m`` microbatches: the schedule of that
        count (built once per count, from the pipeline's schedule name) and its
        executors. ValueError, on every rank alike, for a count the schedule
        cannot run or one whose program differs in what the runtime was built
        for (the compute kinds, the order of gradient reductions)."""
        current = self.schedule.num_microbatches
        if m == current:
            return
        self._by_count[current] = [self.schedule, self.executor, self._forward_executor,
                                   self._backward_executor, self._programs]
        cached = self._by_count.get(m)
        if cached is None:
            source = self._schedule_source
            if not (isinstance(source, str) and source in schedule_names()):
                raise ValueError(
                    f"this call has {m} microbatches, but the pipeline's schedule is given "
                    f"for num_microbatches={current} (a Schedule or a file): only a schedule "
                    "given by name is built for each microbatch count")
            sched = resolve_schedule(source, pp_size=self.pp_size,
                                     num_stages=self.model.num_stages, num_microbatches=m,
                                     edges=self.layout.edges(), shard=self._shard,
                                     reshard_after_forward=self._reshard_after_forward)
            self._check_same_program_shape(sched, m)
            cached = [sched, None, None, None, {}]
            self._by_count[m] = cached
        self.schedule, self.executor, self._forward_executor, self._backward_executor, \
            self._programs = cached
        if self.executor is None:
            self.executor = cached[1] = self._executor(self.schedule.to_text())

    def _check_same_program_shape(self, sched: Schedule, m: int) -> None:
        """The schedule for ``m`` microbatches asks nothing of any rank that
        its programs, built for the first schedule, lack (checked for every
        rank, so that all raise alike)."""
        base = self.schedule
        for r in range(self.pp_size):
            built = self._compute_kinds(base, r)
            extra = {s: sorted(k - built[s]) for s, k in self._compute_kinds(sched, r).items()
                     if k - built[s]}
            if extra:
                raise ValueError(f"schedule '{sched.name}' with {m} microbatches runs "
                                 f"{extra} on pipeline rank {r}, which its programs for "
                                 f"{base.num_microbatches} microbatches do not: use a "
                                 "microbatch count the schedule runs alike")
            if self._reduce_order(r, sched) != self._reduce_order(r):
                raise ValueError(f"schedule '{sched.name}' reduces gradients in stage order "
                                 f"{self._reduce_order(r, sched)} on pipeline rank {r} with "
                                 f"{m} microbatches, {self._reduce_order(r)} with "
                                 f"{base.num_microbatches}: use a microbatch count the "
                                 "schedule runs alike")

    @property
    def forward_executor(self) -> Any:
        """Runs the forward part of the schedule only (inference, compile path)."""
        if self._forward_executor is None:
            self._forward_executor = self._remember(3, self._executor(
                forward_only_text(self.schedule), stateful=False))
        return self._forward_executor

    @property
    def backward_executor(self) -> Any:
        """Runs the backward part only, after forward_executor (compile path)."""
        if self._backward_executor is None:
            self._backward_executor = self._remember(4, self._executor(
                backward_only_text(self.schedule), stateful=False))
        return self._backward_executor

    def _remember(self, slot: int, executor: Any) -> Any:
        """Keep a lazily built executor with its microbatch count's (use_microbatch_count)."""
        cached = self._by_count.get(self.schedule.num_microbatches)
        if cached is not None:
            cached[slot] = executor
        return executor

    def kind_of(self, executor: Any) -> str:
        """The call an executor of this runtime serves: "step", "forward",
        "eval" (a forward with the loss, by the runner's setting) or "backward"."""
        if executor is self.executor:
            return "step"
        if executor is self._forward_executor:
            return "eval" if getattr(self.runner, "eval_loss", False) else "forward"
        return "backward"

    def programs(self, kind: str) -> list[list[Action]]:
        """Every rank's program (typed actions) for a kind of call (kind_of)."""
        cached = self._programs.get(kind)
        if cached is None:
            part = self.schedule if kind == "step" else _part(self.schedule, kind)
            cached = part.actions
            self._programs[kind] = cached
        return cached

    def run(self, executor: Any) -> None:
        """One executor run between the call's begin and end exchanges (NOTE
        [Lockstep]): a rank that failed, before the run or in it, makes every
        rank raise PipelineError; a failure of this rank's own stage raises it
        with the stage's exception as the cause."""
        kind = self.kind_of(executor)
        step = int(getattr(self.runner, "step", -1))
        ledger = self.ledger
        self._end_loss = None
        if isinstance(self.dp, ShardedStages):
            self.dp.begin_run()
        try:
            if ledger is not None:
                ledger.begin(kind, timeout_s=self.timeout_s, step=step, digest=self.digest,
                             microbatches=self._call_microbatches, pipelines=self.replicas,
                             values=self._call_values)
            if isinstance(self.dp, ShardedStages) and kind != "step":
                # Forward-only programs carry no UNSHARD: gather every local
                # stage now, in stage order, so that a rank whose compute fails
                # (its executor then skips compute) has still paired its
                # replicas' gathers (NOTE [Lazy gather] in sharding.py).
                for stage in self.local_stages:
                    self.dp.ready(stage)
            try:
                executor.run()
            except _runtime.ExecutorError as e:
                cause = self.runner.error
                raise self._failure(e, kind, step) from cause
            if ledger is not None:
                outcome = ledger.end(kind, timeout_s=self.timeout_s, step=step,
                                     digest=self.digest, payload=self._loss_payload(kind))
                self._end_loss = self._loss_of(outcome, kind)
        except BaseException:
            self.runner.end_step()
            if isinstance(self.dp, ShardedStages):
                self.dp.abandon()
            if self.tied is not None:
                self.tied.abandon()
            raise
        finally:
            if isinstance(self.dp, ShardedStages):
                self.dp.reshard_all()  # what an executor without RESHARD left gathered

    # NOTE [Loss in the end exchange]: the last stage's rank puts the call's
    # loss in its end-exchange record, so the other ranks have it without the
    # loss broadcast: the exchange costs a step one collective, not two
    # (call_loss). The record's payload: the float32 bits of
    # the mean of the microbatches' losses and the flag 1; for token-weighted
    # losses (NOTE [Token-weighted losses] in training.py) the float32 bits of
    # the sum of their sums, the flag 2 and the float64 bits of their count.
    _LOSS_KINDS = ("step", "eval")

    def _loss_payload(self, kind: str) -> tuple[int, int, int]:
        losses = self.runner.losses
        m = self.schedule.num_microbatches
        if kind not in self._LOSS_KINDS or self.rank != self.last_rank or len(losses) != m:
            return (0, 0, 0)
        value, count, weighted = loss_summary([losses[k] for k in range(m)])
        bits = struct.unpack("<i", struct.pack("<f", value))[0]
        if weighted:
            return (bits, 2, struct.unpack("<q", struct.pack("<d", count))[0])
        return (bits, 1, 0)

    def _loss_of(self, outcome: Any, kind: str) -> LossSummary | None:
        """The loss summary (:func:`loss_summary`) the last stage's rank put in
        the end exchange; None when it did not."""
        if kind not in self._LOSS_KINDS:
            return None
        row = outcome.rows[self.ledger.ranks.index(self.replicas[self.replica][self.last_rank])]
        p0 = len(lockstep.FIELDS) - 3
        if row[p0 + 1] not in (1, 2):
            return None
        value = struct.unpack("<f", struct.pack("<i", int(row[p0])))[0]
        if row[p0 + 1] == 2:
            return value, struct.unpack("<d", struct.pack("<q", int(row[p0 + 2])))[0], True
        return value, 0.0, False

    def call_loss(self, device: torch.device) -> LossSummary:
        """The loss summary of the call just run (:func:`loss_summary` of the
        runner's losses, computed on the last stage's rank) on every rank of
        the pipeline: from the call's end exchange when it carried it (NOTE
        [Loss in the end exchange]), else broadcast."""
        end_loss = getattr(self, "_end_loss", None)
        if end_loss is not None:
            return end_loss
        losses = self.runner.losses
        if self.rank == self.last_rank:
            summary = loss_summary([losses[k] for k in range(len(losses))])
            if self.pp_size == 1:
                return summary
            sent = torch.tensor(summary, dtype=torch.float64, device=device)
        else:
            sent = torch.zeros(3, dtype=torch.float64, device=device)
        value, count, weighted = self.broadcast_from_last(sent, "the loss").tolist()
        return value, count, bool(weighted)

    def _failure(self, e: Any, kind: str, step: int) -> PipelineError:
        """The PipelineError of a failed executor run. A drained failure of this
        rank's own code (NOTE [Draining a failed step]) is sent to the other
        ranks in the end exchange; any other failure leaves the groups unusable."""
        partial = "The step's gradients are partial (call zero_grad() before another step)"
        if not getattr(e, "drained", False):
            self._break(f"rank {self.rank}: {lockstep.first_line(str(e), 600)}")
            died = self._who_died_first(e)
            text = (f"{e}\n{died + '. ' if died else ''}{partial}; after a failed or timed-out "
                    "transfer the process group is unusable: restart the job (e.g. torchrun "
                    "--max-restarts) rather than retry.")
        elif self.ledger is None:
            text = f"{self._with_microbatch(e)}\n{partial}."
        else:
            cause = self.runner.error
            where = self._microbatch_of(e.action)
            first = (f"{type(cause).__name__}: {lockstep.first_line(str(cause))} (in action "
                     f"{e.action}){'; ' + where if where else ''}" if cause is not None
                     else lockstep.first_line(str(e)))
            try:
                outcome = self.ledger.end(kind, timeout_s=self.timeout_s, step=step,
                                          digest=self.digest, failure=first)
                others = {r: m for r, m in outcome.failures.items() if r != self.ledger.me}
                told = ("The other ranks were told and raise PipelineError naming this rank"
                        + "".join(f"; {self.ledger.name(r)} failed too: {m}"
                                  for r, m in sorted(others.items()))
                        + ". The ranks are still in step: the pipeline can be called again")
            except PipelineError as te:
                told = f"Telling the other ranks failed: {te}"
            text = f"{self._with_microbatch(e)}\n{partial}. {told}."
        err = PipelineError(text, rank=e.rank, action=e.action, peer=e.peer)
        return lockstep.settle(err)  # reported to the others, or the groups are unusable

    def _with_microbatch(self, e: Any) -> str:
        """``e``'s message with its action's microbatch named on its first line."""
        where = self._microbatch_of(e.action)
        if not where:
            return str(e)
        head, _, rest = str(e).partition("\n")
        return f"{head} ({where})" + (f"\n{rest}" if rest else "")

    def _microbatch_of(self, action: str) -> str:
        """For a compute action (``0F1``): its microbatch and that microbatch's
        input shapes (``microbatch 1 (inputs idx (2, 12))``), for a failure message (an index out of a position table
        names no microbatch itself); "" otherwise."""
        match = re.fullmatch(r"\d+[FBIW](\d+)", action or "")
        inputs = self._fitted
        if match is None or not inputs or int(match.group(1)) >= len(inputs):
            return ""
        mb = int(match.group(1))
        shapes = ", ".join(f"{name} {tuple(v.shape)}" for name, v in inputs[mb].items()
                           if isinstance(v, torch.Tensor))
        return f"microbatch {mb} (inputs {shapes})" if shapes else f"microbatch {mb}"

    def _who_died_first(self, e: Any) -> str | None:
        """NOTE [Who died first] (lockstep.py): a peer whose connection closed
        is recorded dead; then the earliest death the pipeline's ranks
        recorded, unless it is the peer this rank's own error names."""
        peer = getattr(e, "peer", -1)
        me = self._global(self.rank)
        if peer is not None and peer >= 0 and lockstep.peer_gone(str(e)):
            lockstep.record_dead(self._global(peer), me)
        ranks = (self.ledger.ranks if self.ledger is not None else
                 [self._global(r) for r in range(self.pp_size)])
        died = lockstep.first_death(r for r in ranks if r != me)
        if died is None or (peer is not None and peer >= 0 and
                            died.startswith(f"rank {self._global(peer)} ")):
            return None
        return died

    def _global(self, rank: int) -> int:
        """A pipeline-group rank as a global rank."""
        if self.group is None or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self.group, rank)

    def _break(self, reason: str) -> None:
        """The groups cannot be used after this failure (NOTE [Abandoned groups])."""
        if self.ledger is not None:
            self.ledger.break_(reason)
        else:
            lockstep.abandon(self._groups())

    @property
    def last_rank(self) -> int:
        return self.stage_to_rank[-1]

    def broadcast_from_last(self, tensor: torch.Tensor, what: str = "the loss") -> torch.Tensor:
        if self.pp_size > 1:
            self.wait(lockstep.broadcast(tensor, self.last_rank, self.group, self.timeout_s),
                      f"the broadcast of {what} from rank {self.last_rank}")
        return tensor

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> Any:
        """Start ``dist.all_reduce`` of ``tensor`` over ``group`` (async), its
        work bounded by the pipeline timeout (NOTE [Bounded collectives] in
        lockstep.py); pass the result to :meth:`wait`."""
        return lockstep.all_reduce(tensor, group, self.timeout_s, op)

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for a collective within the pipeline timeout (the process
        group's own timeout can be much longer): a dead or stalled peer is a
        PipelineError, not a hang, and leaves the groups unusable (NOTE
        [Abandoned groups] in lockstep.py)."""
        limit = timeout_s if timeout_s is not None else self.timeout_s
        lockstep.wait(work, what, limit, rank=self.rank, on_failure=self._break)
