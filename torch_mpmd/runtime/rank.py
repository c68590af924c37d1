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

Beside it in this package: the lowered schedule it runs (lowered.py), the
start-up handshake (handshake.py), the digests of a call's microbatches
(contents.py) and the call's loss in the end exchange (call_loss.py).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import re
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from torch_mpmd import _runtime
from torch_mpmd.parallel import lockstep
from torch_mpmd.parallel.data_parallel import (DataParallel, release_kept_groups, replica_group,
                                               tied_group)
from torch_mpmd.parallel.sharding import ParamShards, ShardedStages
from torch_mpmd.runtime.program_runner import ProgramRunner
from torch_mpmd.parallel.lockstep import PipelineError
from torch_mpmd.programs.stage_programs import Compiler
from torch_mpmd.graph.shapes import SymbolicShapes
from torch_mpmd.runtime.runner import EdgeLayout
from torch_mpmd.runtime import handshake
from torch_mpmd.runtime.call_loss import (LOSS_KINDS, NO_LOSS, LossSummary, loss_summary,
                                          pack_loss, unpack_loss)
from torch_mpmd.runtime.contents import as_int64, microbatch_contents, microbatch_digest
from torch_mpmd.runtime.lowered import (backward_only_text, forward_only_text, part,
                                        resolve_schedule)
from torch_mpmd.schedules import Action, ActionKind, Schedule, kind_name, names as schedule_names
from torch_mpmd.graph.stage import SplitModel, StageSignature
from torch_mpmd.parallel.tied import TiedGroup, TiedSums

__all__ = ["PipelineError", "RankRuntime", "StagedModel", "CountExecutors",
           "resolve_schedule", "forward_only_text", "backward_only_text", "loss_summary",
           "LossSummary", "microbatch_contents"]


# Default least wait for the other ranks' compiled (Inductor) program builds,
# which can take minutes longer on one rank than another; startup_timeout= sets it.
_COMPILED_BUILD_TIMEOUT_S = 1800.0


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


@dataclass
class CountExecutors:
    """What a runtime runs with one microbatch count
    (:meth:`RankRuntime.use_microbatch_count`): that count's lowered schedule,
    its executors (the forward and backward parts' built on first use) and
    every rank's program per kind of call."""

    schedule: Schedule
    step: Any = None                # runs the whole step
    forward: Any = None             # the forward part (inference, the compile door)
    backward: Any = None            # the backward part (the compile door)
    programs: dict[str, list[list[Action]]] = field(default_factory=dict)  # by kind_of


# NOTE [Release at exit]: the C++ executors and transports, and the runtime's
# own fields, hold references to process groups. A runtime that is still alive
# when the interpreter finalizes (a torch.compile'd pipeline in Dynamo's cache,
# a pipeline in a reference cycle) would destroy the last reference to a gloo
# group during finalization, after the script's destroy_process_group(); seen
# to abort the process ("terminate called without an active exception"). So
# at exit, while everything is alive, the runtimes drop their C++ objects and
# group references, so do the groups kept for reuse (NOTE [Groups kept]),
# Dynamo's caches are cleared and cycles collected, so that groups go while
# the interpreter still runs.
_LIVE: "weakref.WeakSet[RankRuntime]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for rt in list(_LIVE):
        rt.release(groups=True)
    release_kept_groups()
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
        # The schedule and executors of the microbatch count the calls run with
        # now, and those of every count used so far (use_microbatch_count).
        self._current = CountExecutors(resolve_schedule(
            schedule, pp_size=self.pp_size, num_stages=num_stages,
            num_microbatches=num_microbatches, edges=self.layout.edges(),
            shard=shards is not None, reshard_after_forward=reshard_after_forward))
        self._by_count: dict[int, CountExecutors] = {}
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
        self._current.step = self._executor(self.schedule.to_text())
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
            up = replica_group("up", every, self.replicas, self.replica, self.startup_timeout_s)
            down = replica_group("down", every, self.replicas, self.replica,
                                 self.startup_timeout_s)
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
        self.digest = handshake.settings_digest(self.settings)  # (0: not compared)
        mine = [handshake.plan_digest(self.model.plan, dynamic=self.model.shapes is not None),
                self.digest,
                as_int64(seed if seed is not None else torch.initial_seed())]
        if self.ledger is None:
            return mine[2]
        return handshake.agree(self.ledger, self.settings, mine,
                               seed_rank=self.replicas[self.replica][0], rank=self.rank,
                               timeout_s=self.startup_timeout_s, wait=self.wait)

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
                pg = replica_group("tied init", ranks, self.replicas, self.replica,
                                   self.startup_timeout_s)
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
            pg, members = tied_group(ranks, self.replicas, self.replica, dp_size,
                                     self.startup_timeout_s)
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
        self._current.step = self._current.forward = self._current.backward = None
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
                                   microbatch_digest(len(inputs), self._call_keys, labels),
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
        self._by_count[current] = self._current
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
            cached = self._by_count[m] = CountExecutors(sched)
        self._current = cached
        if cached.step is None:
            cached.step = self._executor(self.schedule.to_text())

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
    def schedule(self) -> Schedule:
        """The lowered schedule of the microbatch count the calls run with now."""
        return self._current.schedule

    @property
    def executor(self) -> Any:
        """Runs the whole schedule (a training step); None after release()."""
        return self._current.step

    @property
    def forward_executor(self) -> Any:
        """Runs the forward part of the schedule only (inference, compile path)."""
        current = self._current
        if current.forward is None:
            current.forward = self._executor(forward_only_text(current.schedule),
                                             stateful=False)
        return current.forward

    @property
    def backward_executor(self) -> Any:
        """Runs the backward part only, after forward_executor (compile path)."""
        current = self._current
        if current.backward is None:
            current.backward = self._executor(backward_only_text(current.schedule),
                                              stateful=False)
        return current.backward

    def kind_of(self, executor: Any) -> str:
        """The call an executor of this runtime serves: "step", "forward",
        "eval" (a forward with the loss, by the runner's setting) or "backward"."""
        if executor is self._current.step:
            return "step"
        if executor is self._current.forward:
            return "eval" if getattr(self.runner, "eval_loss", False) else "forward"
        return "backward"

    def programs(self, kind: str) -> list[list[Action]]:
        """Every rank's program (typed actions) for a kind of call (kind_of)."""
        cached = self._current.programs.get(kind)
        if cached is None:
            sched = self.schedule if kind == "step" else part(self.schedule, kind)
            cached = sched.actions
            self._current.programs[kind] = cached
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

    def _loss_payload(self, kind: str) -> tuple[int, int, int]:
        """This rank's payload of the call's end exchange: on the last stage's
        rank the call's loss (NOTE [Loss in the end exchange] in call_loss.py)."""
        losses = self.runner.losses
        m = self.schedule.num_microbatches
        if kind not in LOSS_KINDS or self.rank != self.last_rank or len(losses) != m:
            return NO_LOSS
        return pack_loss(loss_summary([losses[k] for k in range(m)]))

    def _loss_of(self, outcome: Any, kind: str) -> LossSummary | None:
        """The loss summary (:func:`loss_summary`) the last stage's rank put in
        the end exchange; None when it did not."""
        if kind not in LOSS_KINDS:
            return None
        row = outcome.rows[self.ledger.ranks.index(self.replicas[self.replica][self.last_rank])]
        return unpack_loss(lockstep.payload(row))

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
        """NOTE [Who died first] (job_store.py): a peer whose connection closed
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
        """The groups cannot be used after this failure (NOTE [Abandoned groups]
        in bounded.py)."""
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
        bounded.py); pass the result to :meth:`wait`."""
        return lockstep.all_reduce(tensor, group, self.timeout_s, op)

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for a collective within the pipeline timeout (the process
        group's own timeout can be much longer): a dead or stalled peer is a
        PipelineError, not a hang, and leaves the groups unusable (NOTE
        [Abandoned groups] in bounded.py)."""
        limit = timeout_s if timeout_s is not None else self.timeout_s
        lockstep.wait(work, what, limit, rank=self.rank, on_failure=self._break)
