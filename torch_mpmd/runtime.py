"""What one rank builds from a capture: schedule, runner, transport, executor.

:class:`RankRuntime` is the per-capture state of a :class:`~torch_mpmd.Pipeline`
(api.py): the split model, the lowered schedule, this rank's stages, the
C++ executor over the c10d transport, the process groups of tied weights.
It also holds the collective steps around an executor run: the start-up
handshake (plan hashes), the sum of tied-weight gradients and the broadcast
of the loss and outputs from the last stage's rank.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
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
from torch_mpmd.data_parallel import DataParallel, new_replica_group
from torch_mpmd.program_runner import ProgramRunner
from torch_mpmd.programs import Compiler
from torch_mpmd.runner import EdgeLayout
from torch_mpmd.trace import action_kind
from torch_mpmd.schedules import Schedule, get_schedule, names as schedule_names
from torch_mpmd.stage import SplitModel, StageSignature

__all__ = ["PipelineError", "RankRuntime", "StagedModel", "resolve_schedule",
           "forward_only_text", "backward_only_text", "V_SCHEDULES"]

V_SCHEDULES = ("zbv", "dualpipev")
_STARTUP_TIMEOUT_S = 120.0  # least wait for the other ranks' captures at start-up
_BUILD_TIMEOUT_S = 1800.0  # least wait for the other ranks' program builds (Inductor)
_FORWARD_KINDS = ("F", "SEND_F", "RECV_F")
_BACKWARD_KINDS = ("B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD")


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank: a peer died or timed out, a transfer
    failed, or a stage raised. ``rank``, ``action`` (text form, e.g.
    ``"1RECV_F3"``) and ``peer`` (-1 when none) say where; the message also
    lists this rank's program with the failing step marked."""

    def __init__(self, message: str, rank: int = -1, action: str = "", peer: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.peer = peer


def _filtered_text(schedule: Schedule, kinds: Sequence[str], name: str) -> str:
    lines = [f"# schedule {name}"]
    for edge in schedule.edges:
        if edge[1] != edge[0] + 1:
            lines.append(f"# edge {edge[0]} {edge[1]}")
    for rank, row in enumerate(schedule.actions):
        lines.append(f"{rank}: " + " ".join(t for t in row if action_kind(t) in kinds))
    return "\n".join(lines) + "\n"


def forward_only_text(schedule: Schedule) -> str:
    """The forward part (F, SEND_F, RECV_F) of a lowered schedule, as text. A
    subsequence of a valid program keeps every channel's order (NOTE [Channel
    order]) and forwards depend only on forwards, so it is valid too."""
    return _filtered_text(schedule, _FORWARD_KINDS, f"{schedule.name}-forward")


def backward_only_text(schedule: Schedule) -> str:
    """The backward part of a lowered schedule (see forward_only_text)."""
    return _filtered_text(schedule, _BACKWARD_KINDS, f"{schedule.name}-backward")


def resolve_schedule(schedule: Any, *, pp_size: int, num_stages: int, num_microbatches: int,
                     edges: Sequence[tuple[int, int]]) -> Schedule:
    """The lowered, validated schedule for the plan: from a name, a Schedule, or
    a text/CSV file. Errors name the values that do not fit."""
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
        sched = sched.with_edges(sorted(edges)).lower()
    sched.validate()
    return sched


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

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def from_split(cls, split: SplitModel) -> "StagedModel":
        example = {v.node: split.ir.fx_nodes[v.node].meta.get("example_value")
                   for sig in split.stage_signatures for v in sig.sent}
        return cls(split.stages, split.stage_signatures, split.plan, example,
                   split.captured.tensors, split.captured.rebuild_output)


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
                 lookahead: int, settings: str, seed: int | None,
                 dp_group: Any = None, replicas: list[list[int]] | None = None,
                 compiler: Compiler | None = None) -> None:
        self.model = model
        self.group = group
        self.dp_group = dp_group
        # Global ranks of every pipeline replica by pp rank, and which one is ours.
        self.replicas = replicas or [dist.get_process_group_ranks(group) if group is not None
                                     else [0]]
        me = dist.get_rank() if dist.is_initialized() else 0
        self.replica = next(i for i, r in enumerate(self.replicas) if me in r)
        self.device = device
        self.timeout_s = timeout.total_seconds()
        self.lookahead = lookahead
        self.pp_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        num_stages = model.num_stages
        self.layout = EdgeLayout.build(model.signatures, model.example_values)
        self.schedule = resolve_schedule(schedule, pp_size=self.pp_size, num_stages=num_stages,
                                         num_microbatches=num_microbatches,
                                         edges=self.layout.edges())
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
                                    split_backward=self.schedule._cpp.splits_backward,
                                    compiler=compiler, rank=self.rank, device=device,
                                    kinds=self._compute_kinds())
        self.transport = self._transport() if self.pp_size > 1 else None
        self.seed = self._handshake(settings, seed)
        self.executor = self._executor(self.schedule.to_text())
        self._forward_executor: Any = None
        self._backward_executor: Any = None
        self.tied_groups = self._tied_groups()
        _LIVE.add(self)
        self.dp = self._data_parallel() if dp_group is not None else None
        if self.dp is not None:
            self.runner.on_reduce_grad = self.dp.reduce

    # ------------------------------------------------------------ construction
    def _compute_kinds(self) -> dict[int, set[str]]:
        """Per local stage, the compute kinds (F, B, I, W) this rank's program runs."""
        kinds: dict[int, set[str]] = {s: set() for s in self.local_stages}
        for token in self.schedule.actions[self.rank]:
            kind = action_kind(token)
            if kind in ("F", "B", "I", "W"):
                kinds[int(token[:len(token) - len(token.lstrip("0123456789"))])].add(kind)
        return kinds

    def _transport(self) -> Any:
        backend = dist.get_backend(self.group)
        up = down = self.group
        if backend == "nccl":  # NOTE [Direction groups] in csrc/runtime/c10d_transport.h
            every = list(range(self.pp_size))
            up = new_replica_group(every, self.replicas, self.replica)
            down = new_replica_group(every, self.replicas, self.replica)
        return _runtime.C10dTransport(up.group_name, down.group_name, self.layout.specs(),
                                      str(self.device))

    def _executor(self, text: str, *, stateful: bool = True) -> Any:
        # Tracing is always on: two clock reads per action (trace.py). The
        # forward-only and backward-only executors (inference, the compile
        # door) run the autograd path, whose state the runner keeps itself.
        runner = self.runner if stateful else self.runner.autograd_view
        return _runtime.Executor(text, self.rank, runner, self.transport,
                                 lookahead=self.lookahead, timeout_s=self.timeout_s, trace=True)

    def _handshake(self, settings: str, seed: int | None) -> int:
        """Compare plan and settings across ranks before any transfer; agree on a seed."""
        digest = hashlib.sha256(f"{settings}|{self.schedule.to_text()}".encode()).digest()
        mine = [_int64(self.model.plan.hash), _int64(int.from_bytes(digest[:8], "little")),
                _int64(seed if seed is not None else torch.initial_seed())]
        seed_out = mine[2]
        for group, label in ((self.group, "pp"), (self.dp_group, "dp")):
            if group is None or dist.get_world_size(group) == 1:
                continue
            rows = self._compare(group, label, mine)
            if label == "pp":
                seed_out = rows[0][2]  # pp rank 0's seed
        return seed_out

    def _compare(self, group: Any, label: str, mine: list[int]) -> list[list[int]]:
        size = dist.get_world_size(group)
        t = torch.tensor(mine, dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(t) for _ in range(size)]
        # Ranks arrive after capturing, which takes seconds and varies by rank: the
        # wait allows for that skew (a dead peer still fails at once: gloo reports
        # the closed connection).
        self.wait(dist.all_gather(everyone, t, group=group, async_op=True),
                  f"the start-up comparison of plans over the {label} group (all_gather)",
                  timeout_s=max(self.timeout_s, _STARTUP_TIMEOUT_S))
        rows = [e.tolist() for e in everyone]
        cols = (("partition plan", 0), ("pipeline settings or schedule", 1))
        for what, col in cols:
            values = {r: rows[r][col] & 0xFFFFFFFFFFFFFFFF for r in range(size)}
            if len(set(values.values())) > 1:
                listing = ", ".join(f"{label} rank {r}: {v:016x}" for r, v in values.items())
                raise PipelineError(
                    f"the ranks disagree on the {what} (hashes {listing}); every rank must "
                    "build the same model and call pipeline() with the same arguments and the "
                    "same input shapes", rank=self.rank)
        return rows

    def _tied_groups(self) -> list[tuple[Any, list[torch.nn.Parameter]]]:
        """Per set of ranks sharing parameters: (process group, this rank's shared params).
        Created in the same order on every rank (new_group is collective)."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for p in self.model.plan.parameters:
            ranks = tuple(sorted({self.stage_to_rank[s] for s in p.stages}))
            t = self.model.tensors.get(p.fqn)
            if len(ranks) > 1 and isinstance(t, torch.nn.Parameter) and t.requires_grad:
                by_ranks.setdefault(ranks, []).append(p.fqn)
        groups = []
        for ranks in sorted(by_ranks):
            if len(ranks) == self.pp_size:
                pg = self.group
            else:
                pg = new_replica_group(ranks, self.replicas, self.replica)
            if self.rank in ranks:
                params = [self.model.tensors[f] for f in sorted(by_ranks[ranks])]
                groups.append((pg, params))
        return groups

    def _data_parallel(self) -> DataParallel:
        stage_params = {s: [p for p in self.model.stages[s].parameters() if p.requires_grad]
                        for s in self.local_stages}
        order = [int(t[:-len("REDUCE_GRAD")]) for t in self.schedule.actions[self.rank]
                 if t.endswith("REDUCE_GRAD")]
        return DataParallel(self.dp_group, stage_params, order, self.timeout_s)

    def release(self, *, groups: bool = False) -> None:
        """Drop the executors and the transport (and with them the process-group
        references they hold), and with ``groups`` the runtime's own group
        references (NOTE [Release at exit]); the runtime cannot step afterwards."""
        self.executor = self._forward_executor = self._backward_executor = None
        self.transport = None
        if groups:
            self.group = self.dp_group = self.dp = None
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
        flag = torch.zeros(1, device=self.device)
        limit = max(self.timeout_s, _BUILD_TIMEOUT_S)
        for group, label in ((self.group, "pp"), (self.dp_group, "dp")):
            if group is not None and dist.get_world_size(group) > 1:
                me = dist.get_rank(group)
                peers = [r for r in range(dist.get_world_size(group)) if r != me]
                self.wait(dist.all_reduce(flag, group=group, async_op=True),
                          f"waiting for the other {label} ranks (peer rank"
                          f"{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}) to "
                          "build their stage programs", timeout_s=limit)

    @property
    def forward_executor(self) -> Any:
        """Runs the forward part of the schedule only (inference, compile path)."""
        if self._forward_executor is None:
            self._forward_executor = self._executor(forward_only_text(self.schedule),
                                                   stateful=False)
        return self._forward_executor

    @property
    def backward_executor(self) -> Any:
        """Runs the backward part only, after forward_executor (compile path)."""
        if self._backward_executor is None:
            self._backward_executor = self._executor(backward_only_text(self.schedule),
                                                    stateful=False)
        return self._backward_executor

    def run(self, executor: Any) -> None:
        """One executor run; failures become PipelineError (cause: the stage's
        own exception when a stage raised)."""
        try:
            executor.run()
        except _runtime.ExecutorError as e:
            cause = self.runner.error
            self.runner.end_step()
            raise PipelineError(
                f"{e}\nThe step's gradients are partial (call zero_grad() before another "
                "step); after a failed or timed-out transfer the process group may be "
                "unusable: restart the job (e.g. torchrun --max-restarts) rather than retry.",
                rank=e.rank, action=e.action, peer=e.peer) from cause

    def tied_grads_before(self) -> list[list[torch.Tensor | None]]:
        return [[p.grad.clone() if p.grad is not None else None for p in params]
                for _, params in self.tied_groups]

    def sum_tied_grads(self, before: list[list[torch.Tensor | None]]) -> None:
        """Sum this step's gradient of each tied parameter over the ranks holding it
        (gradients accumulated in earlier steps are already summed: only the
        step's increment is reduced)."""
        for (pg, params), prev in zip(self.tied_groups, before):
            deltas = []
            for p, old in zip(params, prev):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                deltas.append(g - old if old is not None else g)
            flat = torch.cat([d.reshape(-1) for d in deltas])
            self.wait(dist.all_reduce(flat, group=pg, async_op=True),
                      f"the sum of tied parameter gradients ({len(params)} tensors, all_reduce)")
            offset = 0
            for p, old, d in zip(params, prev, deltas):
                inc = flat[offset:offset + d.numel()].view_as(p)
                offset += d.numel()
                p.grad = inc.clone() if old is None else old + inc

    @property
    def last_rank(self) -> int:
        return self.stage_to_rank[-1]

    def broadcast_from_last(self, tensor: torch.Tensor, what: str = "the loss") -> torch.Tensor:
        if self.pp_size > 1:
            src = dist.get_global_rank(self.group, self.last_rank)
            self.wait(dist.broadcast(tensor, src=src, group=self.group, async_op=True),
                      f"the broadcast of {what} from rank {self.last_rank}")
        return tensor

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for a collective within the pipeline timeout (the process
        group's own timeout can be much longer): a dead peer is an error, not
        a hang."""
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=limit))
        except Exception as e:  # noqa: BLE001  (c10d raises RuntimeError subclasses)
            raise PipelineError(f"rank {self.rank}: {what} failed within the {limit:g} s "
                                f"timeout: {str(e)[:500]}", rank=self.rank) from e
        if ok is False:
            raise PipelineError(f"rank {self.rank}: {what} timed out after {limit:g} s",
                                rank=self.rank)
