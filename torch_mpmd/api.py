"""The public pipeline API: ``pipeline(...)`` and :class:`Pipeline`.

A Pipeline is an ``nn.Module`` whose parameters and buffers are this rank's,
under the original module's FQNs, and are the module's own tensors: optimizers
and state-dict helpers work unchanged. Capture is lazy, like torch.compile:
the first ``step`` or call captures the model with its first microbatch, splits
it into stages, builds the schedule and the executor (runtime/rank.py), and
compares plans across ranks. Until then the Pipeline presents the whole
module's parameters, so an optimizer built before the first step (as in the
README's example) still covers this rank's (the others never get gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd import training
from torch_mpmd.config import (PLAN_FIELDS, PipelineConfig, Resolved, positive_int,
                               settings_signature)
from torch_mpmd.graph.stage import set_path
from torch_mpmd.parallel.lockstep import Collectives, PipelineError
from torch_mpmd.runtime import trace
from torch_mpmd.runtime.step import CallHistory
from torch_mpmd.runtime.view import RankView
from torch_mpmd.schedules import Schedule
from torch_mpmd.session import Session

__all__ = ["pipeline", "Pipeline", "PipelineError", "PipelineConfig"]


class Pipeline(torch.nn.Module):
    """A model split into pipeline stages, this rank's part of it (see :func:`pipeline`).

    The captures, calls and plan are its :attr:`session`'s (session.py);
    the Pipeline is the face of them a user holds: an ``nn.Module`` of this
    rank's tensors, its calls, statistics, traces and replanning."""

    def __init__(self, module: torch.nn.Module, config: PipelineConfig,
                 resolved: Resolved, constraints: dict[str, Any] | None = None) -> None:
        """Use :func:`pipeline`, which checks ``config`` and resolves its groups."""
        super().__init__()
        # Not registered as a submodule: parameters() must list this rank's only.
        object.__setattr__(self, "_mpmd_module", module)
        session = Session(module, config, resolved, self._adopt_local_tensors, constraints)
        object.__setattr__(self, "_mpmd_session", session)
        self.data_parallel = config.data_parallel
        if session.shards is not None:
            self._mirror_shards()
            return
        # Until capture: mirror the whole module's tree (see the module docstring).
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set

    def _mirror_shards(self) -> None:
        """Until capture, with sharded data parallel: the module's tree with each
        parameter replaced by its shard."""
        module, shards = self._mpmd_module, self.session.shards
        for fqn, p in module.named_parameters(remove_duplicate=False):
            set_path(self, fqn, shards.shard_of(p), "parameter")
        for name, mod in module.named_modules():
            for leaf, b in mod._buffers.items():
                if b is not None:
                    set_path(self, f"{name}.{leaf}" if name else leaf, b, "buffer",
                              persistent=leaf not in mod._non_persistent_buffers_set)

    def _adopt_local_tensors(self, params: dict[str, torch.Tensor],
                             buffers: dict[str, torch.Tensor], non_persistent: set[str]) -> None:
        """This rank's tensors of the capture in use, as the module's own (the
        session's ``adopt``)."""
        self._modules = {}
        self._parameters = {}
        self._buffers = {}
        self._non_persistent_buffers_set = set()
        for fqn, p in params.items():
            set_path(self, fqn, p, "parameter")
        for fqn, b in buffers.items():
            set_path(self, fqn, b, "buffer", persistent=fqn not in non_persistent)

    def park_between_calls(self) -> None:
        """With sharded data parallel: from now on, between calls, the module's
        own (compute) parameters hold empty tensors of their own shape and
        strides, as torch.compile's guards expect (NOTE [Parked parameters] in
        sharding.py; the compile door asks for it). No-op otherwise."""
        self.session.park_between_calls()

    def unparked(self) -> contextlib.AbstractContextManager[None]:
        """The compute parameters as the pipeline runs them, for the duration
        (parked again after, when parking: :meth:`park_between_calls`)."""
        return self.session.unparked()

    # ------------------------------------------------------------ the session's state
    @property
    def session(self) -> Session:
        """The captures, calls and plan behind this pipeline (session.py)."""
        return self._mpmd_session

    @property
    def config(self) -> PipelineConfig:
        """The config the pipeline runs with (with ``plan="auto"``, the planned
        one after the first step)."""
        return self.session.config

    @property
    def num_microbatches(self) -> int | None:
        """Microbatches per step (None until ``plan="auto"`` plans)."""
        return self.session.num_microbatches

    @property
    def rank(self) -> int:
        """This process's rank in the pipeline group."""
        return self.session.rank

    @property
    def pp_size(self) -> int:
        return self.session.pp_size

    @property
    def dp_size(self) -> int:
        return self.session.dp_size

    @property
    def device(self) -> torch.device:
        return self.session.device

    @property
    def timeout(self) -> datetime.timedelta:
        """The bound of every wait of a call."""
        return self.session.timeout

    @property
    def startup_timeout(self) -> datetime.timedelta | None:
        """The bound of the waits of a capturing call (None: ``timeout``)."""
        return self.session.startup_timeout

    @property
    def calls(self) -> CallHistory:
        """What this rank's calls did (runtime/step.py)."""
        return self.session.calls

    @property
    def parameter_bytes(self) -> int:
        """This rank's materialized bytes (meta-device models; 0 otherwise)."""
        return self.session.parameter_bytes

    @property
    def last_token_count(self) -> float | None:
        """The global token count of the last step or eval_step when its loss
        was token-weighted (else None)."""
        return self.session.last_token_count

    # ------------------------------------------------------------ properties
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (all of it; its tensors are shared with the stages)."""
        return self._mpmd_module

    @property
    def is_captured(self) -> bool:
        return self.session.runtime_or_none is not None

    @property
    def num_stages(self) -> int:
        return self.session.runtime.model.num_stages

    @property
    def local_stages(self) -> tuple[int, ...]:
        return self.session.runtime.local_stages

    @property
    def schedule(self) -> Schedule:
        """The lowered schedule every rank runs (this rank's row is its program)."""
        return self.session.runtime.schedule

    @property
    def replicas(self) -> list[list[int]] | None:
        """With a mesh's "dp" dimension: the global ranks of each data-parallel
        replica's pipeline (None without one)."""
        return self.session.replicas

    def inspect(self) -> RankView:
        """What this rank runs now (a :class:`torch_mpmd.runtime.view.RankView`):
        its stages and their modules, its programs as typed actions per kind of
        call, its stage programs (or why the autograd runner runs instead), the
        activation bytes held, the shapes crossing each stage edge, and how many
        captures were made. Local; a RuntimeError before the first call."""
        return RankView.of(self.session.runtime,
                           captures=self.session.captures.count)

    @property
    def split(self) -> Any:
        """The SplitModel: plan, stage modules (all stages) and signatures."""
        return self.session.split

    # ------------------------------------------------------------ capture
    def train(self, mode: bool = True) -> "Pipeline":
        """Set train/eval mode on the wrapped module (the stages follow it: the
        next call captures in the new mode, or reuses that mode's capture)."""
        super().train(mode)
        self._mpmd_module.train(mode)
        return self

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load this rank's entries of ``state_dict``: a full checkpoint of the
        module works on every rank (keys of other ranks' stages are skipped);
        with ``strict``, this rank's keys must all be there and keys the module
        does not have are errors. With sharded data parallel, a full tensor
        (a plain state dict, e.g. pretrained weights) loads its rows into the
        parameter's shard. ``assign=True`` is refused once the model is
        captured, and with sharded data parallel: it would put new tensors in
        the module where the stages (and the user's optimizer) hold the old
        ones, and the load would be silently ignored."""
        if assign and (self.is_captured or self.session.shards is not None):
            when = ("the pipeline has captured the model (its stages hold the parameters)"
                    if self.is_captured else
                    "data_parallel='shard' (the parameters are DTensor shards)")
            raise ValueError(f"load_state_dict(assign=True) is not supported once {when}: "
                             "new tensors would replace the ones the stages and your optimizer "
                             "hold; use assign=False (copies into them), or assign before "
                             "pipeline()")
        if self.is_captured:
            local = set(super().state_dict().keys())
            model_keys = set(self._mpmd_module.state_dict().keys())
            state_dict = {k: v for k, v in state_dict.items()
                          if k in local or k not in model_keys}
        if self.session.shards is not None:
            params = dict(self.named_parameters(remove_duplicate=False))
            state_dict = {k: self.session.shards.shard_value(params[k], v) if k in params else v
                          for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def describe(self) -> str:
        """The split: plan summary, every stage's inputs and outputs, and per stage
        its compute cost, parameter bytes and bytes sent and received per
        microbatch (SplitModel.describe)."""
        if self.session.split is None:
            raise RuntimeError("the pipeline has not captured the model yet: call step() or the "
                               "pipeline once first")
        return self.session.split.describe()

    # ------------------------------------------------------------ running
    def step(self, *args: Any, target: Any = None, microbatches: Any = None,
             targets: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of all microbatches per the schedule; accumulates
        into this rank's parameters the gradient of the mean of the microbatches'
        losses (the loss contract: :func:`pipeline`), or with a token-weighted
        ``loss_fn`` (returning ``(sum, count)``) of the global sum over the
        global count; returns that loss on every rank. Needs grad mode (``eval_step`` is the step without backward).

        The batch (``args``, ``kwargs``, ``target``) is split along dim 0
        into ``num_microbatches``. Or give the microbatches themselves:
        ``microbatches=[(args0, kwargs0), (args1, kwargs1), ...]`` with
        ``targets=[t0, t1, ...]``, of shapes free to differ (with
        ``dynamic=True``) and of a count free to differ per call where the
        schedule (given by name) runs it. Every rank of a pipeline is given
        the same list; each derives every transfer's shape from it."""
        loss = self.session.step(args, kwargs, target, microbatches, targets)
        if os.environ.get("MPMD_TRACE"):
            self.save_trace(os.environ["MPMD_TRACE"])
        return loss

    # ------------------------------------------------------------ plans
    def replan(self, last_n: int | None = None) -> tuple[Any, str]:
        """Re-run the plan search on the stage times the last ``last_n`` steps
        measured (``stage_times``; default all kept) and say whether another
        plan is predicted faster, by how much. Returns ``(best plan, sentence)``.

        The sheet: with a plan from ``mpmd.plan`` or ``plan="auto"`` (which
        carries its profile), each stage's measured F, I and W are shared
        among its units in proportion to the profile (bytes and link rates
        from the profile); otherwise the stages are the units. The current
        plan is evaluated on the same sheet. Collective over the pipeline
        group (the ranks' stage times are gathered); the same result on
        every rank."""
        from torch_mpmd.planning.auto import replan_sentence, replan_sheet

        rt = self.session.runtime
        times = dict(self.stage_times(last_n))
        if rt.pp_size > 1:
            times = self._gathered_stage_times(times)
        config, plan = self.config, self.config.plan
        schedule = config.schedule if isinstance(config.schedule, str) else config.schedule.name
        n = self.num_stages
        split = list(config.split_points or ())
        sheet = getattr(plan, "sheet", None) if plan is not None else None
        if sheet is not None and (len(split) != n - 1 or
                                  any(name not in {u.name for u in sheet.units}
                                      for name in split)):
            sheet = None
        if sheet is None and len(split) != n - 1:
            split = [f"stage {s}" for s in range(1, n)]
        shapes = self.last_step_stats.get("microbatch_shapes") or []
        batch = sum(int(shape[0]) for shape in shapes if shape) or self.num_microbatches
        # The limit the plan was made under holds for its replan too.
        profile = getattr(plan, "sheet", None) if plan is not None else None
        limit = config.memory_limit
        if limit is None and profile is not None and profile.memory_limit:
            limit = profile.memory_limit
        sheet = replan_sheet(times, profile_sheet=sheet, split_points=split, num_stages=n,
                             global_batch=batch, num_microbatches=self.num_microbatches,
                             pp_size=rt.pp_size, memory_limit=limit)
        return replan_sentence(sheet, schedule=schedule, num_microbatches=self.num_microbatches,
                               stages_per_rank=n // rt.pp_size, split_points=split,
                               memory_limit=limit, data_parallel=config.data_parallel)

    def _gathered_stage_times(self, times: dict[int, dict[str, float]]
                              ) -> dict[int, dict[str, float]]:
        """Every stage's times, from the rank that holds it: one bounded
        all_reduce over the pipeline group (NOTE [Named waits] in named_waits.py;
        a dead or stalled peer is a PipelineError naming it within timeout=)."""
        kinds = "FBIW"
        table = torch.zeros(2, self.num_stages, len(kinds), dtype=torch.float64)
        for s, row in times.items():
            for k, seconds in row.items():
                table[0, s, kinds.index(k)] = seconds
                table[1, s, kinds.index(k)] = 1.0  # (a time of 0 is a time)
        timeout_s = self.timeout.total_seconds()
        with Collectives(self.session.group, timeout_s, "replan") as waits:
            table = waits.all_reduce(table.to(waits.device), "the stage times").cpu()
        return {s: {k: float(table[0, s, i]) for i, k in enumerate(kinds) if table[1, s, i]}
                for s in range(self.num_stages)}

    # ------------------------------------------------------------ what a step did
    @property
    def stats_window(self) -> int:
        """How many completed calls (steps, forwards, evals) this rank keeps the
        trace and peaks of, for :meth:`stage_times` and ``timelines(steps=)``
        (default 20; a bounded history: older calls are dropped)."""
        return self.calls.window

    @stats_window.setter
    def stats_window(self, value: int) -> None:
        positive_int("stats_window", value)
        self.calls.window = value

    @property
    def step_count(self) -> int:
        """The training steps taken: the step index that seeds each stage's
        random numbers (checkpoints save and restore it; set it to resume a run
        at a step)."""
        return self.calls.step

    @step_count.setter
    def step_count(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"step_count={value!r} must be an int >= 0")
        self.calls.step = value

    @property
    def last_step_stats(self) -> dict[str, Any]:
        """What the last call (``step``, forward or ``eval_step``) did on this
        rank, that call only (no running totals): its ``kind`` and ``step`` (the
        pipeline's step counter: a step's own index), ``actions`` run,
        ``peak_live_forwards`` (forwards held before their backward),
        ``peak_buffered`` values, ``peak_state_values`` (values held for
        backward by the executor), ``peak_activation_bytes`` per local stage,
        ``peak_held_bytes`` (the same over all local stages at once: the
        rank's peak, at most the sum of the stages' peaks),
        ``peak_gathered_bytes`` (with sharded data parallel, the most bytes
        of full parameters gathered at once, their storages from unpacking
        to RESHARD, the all-gathers' own buffers not counted; 0 otherwise),
        ``peak_live_bytes`` (the most bytes beyond the rank's persistent
        state at once, measured after each compute action: those held for
        backward and, with sharded data parallel, the gathered full
        parameters and the full gradients no REDUCE_GRAD has taken yet;
        ``peak_held_bytes`` otherwise),
        ``span_s``, ``compute_s`` and the measured ``bubble_fraction``
        (:func:`torch_mpmd.trace.step_metrics`), ``microbatch_shapes`` (the
        shape of each microbatch's first tensor input: the lengths of
        explicit microbatches); with sharded data parallel,
        ``collectives``: its all-gathers (count, bytes, seconds, the seconds
        compute waited for them and the share hidden behind other work) and
        reduce-scattered bytes, the peak bytes of gathered parameters held
        (``gathered_peak_bytes``; ``ShardedStages.report``); with weights tied
        across pipeline ranks, after a step, ``collectives["tied_all_reduce"]``:
        the sums of their gradients this rank posted (count, bytes, the
        REDUCE_GRAD actions that posted them, each group's global ranks:
        ``TiedSums.report`` in tied.py). Empty before the first call and after
        a call that failed."""
        return self.calls.last_stats()

    def stage_times(self, last_n: int | None = None) -> dict[int, dict[str, float]]:
        """Per local stage, the median seconds of its F, B, I and W actions (the
        kinds its schedule runs) over the last ``last_n`` training steps this
        rank kept (default: all kept, at most ``stats_window``); what one reads
        to rebalance stages. Forward and eval calls are not counted. Local (no
        communication); a RuntimeError before the first completed step."""
        if last_n is not None:
            positive_int("last_n", last_n)
        steps = [r for r in self.calls.records if r.kind == "step"]
        if not steps:
            raise RuntimeError("no completed step: stage_times() measures training steps; call "
                               "step() first")
        return trace.stage_times(steps, last_n)

    def timelines(self, steps: int = 1) -> list[list[tuple[str, float, float]]]:
        """Every rank's ``(action, start s, end s)`` over the last ``steps``
        completed calls (steps, forwards or evals; at most ``stats_window``), on
        every rank, on one clock (seconds from the earliest begin). Collective:
        call it on every rank."""
        positive_int("steps", steps)
        rt = self.session.runtime
        history = list(self.calls.records)
        if not history:
            raise RuntimeError("no completed step: call step() or the pipeline first (a step that "
                               "failed leaves no timeline)")
        group = rt.group if rt.pp_size > 1 else None
        return trace.gather_timelines(history[-steps:], group, rt.timeout_s, rt.wait)

    def save_trace(self, path: str | os.PathLike, steps: int = 1) -> None:
        """Write the last ``steps`` completed calls of all ranks as a Chrome trace
        JSON (rank 0 writes). Collective. Also done after every step (the last
        step) when MPMD_TRACE=path is set."""
        rows = self.timelines(steps)
        if self._writes_files():
            trace.write_chrome_trace(path, rows, title=f"torch_mpmd {self.schedule.name}")

    def save_timeline(self, path: str | os.PathLike, steps: int = 1) -> None:
        """Draw the measured timeline of the last ``steps`` completed calls above
        the simulated step (with their median F/B/I/W times) into a PNG (rank 0
        writes; needs matplotlib). Collective."""
        rows = self.timelines(steps)
        if self._writes_files():
            trace.save_measured_timeline(self.schedule, rows, path)

    def _writes_files(self) -> bool:
        """Whether this process writes the job's trace and timeline files: the
        pipeline's rank 0, in the pipeline that holds global rank 0 when one
        does (with dp or tp every replica has a rank 0; the files are replaced
        atomically, so writers of other pipelines never corrupt them)."""
        if self.rank != 0:
            return False
        if self.session.group is None or not dist.is_initialized():
            return True
        if 0 in dist.get_process_group_ranks(self.session.group):
            return True
        # Another data-parallel replica holds global rank 0: it writes.
        return not any(0 in ranks for ranks in self.session.replicas or ())

    def forward(self, *args: Any, output_rank: int | None = None, microbatches: Any = None,
                **kwargs: Any) -> Any:
        """Forward only (no autograd state kept), in the schedule's forward order.

        ``output_rank=None``: the output on every rank of the pipeline (a
        broadcast from the last stage's rank). An int, a rank of the pipeline
        group (``pipe.rank``): the output on that rank only, None on the others
        (one point-to-point transfer per output tensor, none when it is the
        last stage's rank): a large output (logits) need not reach every rank.
        With a mesh, each replica delivers to its own rank ``output_rank``.
        ``microbatches=[(args, kwargs), ...]`` (as ``step`` takes them): the
        list of their outputs instead of one merged output."""
        return self.session.forward(args, kwargs, output_rank, microbatches)

    def eval_step(self, *args: Any, target: Any = None, microbatches: Any = None,
                  targets: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and loss of every microbatch, in the schedule's forward order,
        with no autograd graph kept and no gradient touched; returns the mean
        loss on every rank (over the microbatches, and over the data-parallel
        replicas as ``step``'s). Arguments and target are split as ``step``
        splits them; the loss is ``loss_fn``'s, or the model's own with
        ``loss_fn=None``. It runs in the module's current train/eval mode:
        call ``pipe.eval()`` before (and ``pipe.train()`` after) to turn
        dropout off; each mode keeps its own capture. ``microbatches=`` and
        ``targets=``: as ``step`` takes them."""
        return self.session.eval_step(args, kwargs, target, microbatches, targets)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        foreach: bool | None = None,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole model: the norm of
        every gradient over all stages (a tied parameter counted once, a
        data-parallel replica's averaged gradients once), the same on every
        rank; this rank's gradients are scaled by ``max_norm / (norm + 1e-6)``
        when that is below 1. Returns the total norm (float32). Collective over
        the pipeline group: call it on every rank, after ``step`` (see
        training.py)."""
        return training.clip_grad_norm_(self.session.runtime, list(self.parameters()), max_norm,
                                        norm_type, foreach, error_if_nonfinite)

def pipeline(module: torch.nn.Module, config: PipelineConfig | None = None,
             **settings: Any) -> Pipeline:
    """Wrap ``module`` for pipeline-parallel training over ``group`` (default: the
    default process group; none initialized means one rank).

    The loss: ``loss_fn(output, target)`` is called on the last stage's rank,
    once per microbatch, with the model's output for that microbatch and its
    chunk of ``step``'s ``target`` (split along dim 0 like the inputs), and
    must return a one-element tensor. ``step`` returns the mean of the
    microbatches' losses and accumulates the gradient of that mean, so a
    mean-reduced loss over equal microbatches gives the full batch's loss and
    gradient (a sum-reduced loss gives 1/num_microbatches of the sum's). With
    ``loss_fn=None`` the model returns its loss: a one-element tensor, or a
    dict, dataclass or Hugging Face ``ModelOutput`` with a field ``loss`` (a
    Hugging Face model called with ``labels=``, which are split like every
    other input); passing ``target=`` then is a ValueError.

    Parameters: until the first ``step`` or call captures the model (the
    split is not known before), ``parameters()`` lists all of the module's
    parameters; after, only this rank's. An optimizer built before the first
    step holds them all but steps only this rank's: the others never get a
    ``.grad`` here, and torch's optimizers skip parameters without one (they
    keep their initial values on this rank; ``checkpoint.load`` trims such an
    optimizer to this rank's parameters, ``checkpoint.save`` never changes it).

    Stages come from ``stage_boundary()`` markers, else ``split_points``, else
    ``pp_size * stages_per_rank`` (or ``num_stages``) stages balanced by cost;
    the stage count must be a multiple of the pipeline size. ``bytes_cost``
    (cost units per byte; None: ``torch_mpmd._C.DEFAULT_BYTES_COST``, from a
    measured p2p rate) weighs the bytes crossing each cut of a balanced split
    against its compute (0: compute alone). ``schedule``: a
    name (``torch_mpmd.schedules.names()``), a Schedule, or a text/CSV file
    (default ``"1f1b"``, which at several stages per rank runs
    ``"interleaved_1f1b"``: ``PipelineConfig.schedule_at``).
    ``mesh``: a DeviceMesh with dimensions named from ("dp", "pp", "tp"), in
    any order, any of size 1 left out: the pipeline runs over "pp" and is
    replicated over "dp" (each replica steps on its own batch; gradients are
    averaged over "dp" as each stage's backward ends, and the returned loss is
    the global mean). With "tp", apply DTensor tensor-parallel plans over
    ``mesh["tp"]`` to the model before ``pipeline()`` (torchtitan's style,
    ``parallelize_module``); each tp rank runs its own copy of the pipeline
    on the same batch, its stages computing on local shards with the plan's
    collectives, and DTensor parameters get DTensor gradients. A DTensor
    value crossing stages (a plan with ``use_local_output=False``, sequence
    parallel's Shard(1)) is sent as each tp rank's local shard and rebuilt
    on the next stage, its gradient in the same placements; Partial values,
    DTensors over other meshes and symbolic sizes are refused at the split
    (NOTE [DTensor boundaries] in stage.py). ``data_parallel``: ``"replicate"``
    (the default: every dp rank holds whole stages, gradients all-reduced)
    or ``"shard"`` (ZeRO-3, as FSDP2: parameters, gradients and optimizer
    state split along dim 0 over "dp"; ``parameters()`` are DTensors from
    here on; each stage's parameters are all-gathered by the schedule's
    UNSHARD action ahead of its first compute and freed by RESHARD after its
    last, gradients reduce-scattered at REDUCE_GRAD; see sharding.py). A
    parameter shared by stages on several pipeline ranks (tied embeddings)
    has its gradient summed over them and averaged over "dp" by one
    all-reduce that its last REDUCE_GRAD posts on each rank (tied.py);
    ``reshard_after_forward=True`` also frees them between a stage's last
    forward and its backward when other stages run in between (less memory,
    one more gather). ``timeout`` (seconds or timedelta)
    bounds every wait of a call, the library's own collectives included; a
    rank whose own code fails (a bad argument only it sees, a loss_fn that
    raises) makes every rank raise PipelineError at once, naming it, and the
    ranks stay in step (NOTE [Lockstep] in lockstep.py). ``startup_timeout``
    (default: ``timeout``) bounds instead the waits of a call that captures
    the model for the other ranks' capture and program builds, which can take
    longer on some ranks (with ``compile`` set, program builds wait
    ``max(timeout, 30 min)`` unless it is given);
    ``lookahead`` is the number of receives posted ahead. A model built on the
    meta device is captured without memory and only this rank's part is
    materialized, initialized by ``init_fn(module)`` per submodule (default:
    its ``reset_parameters()``; see meta_init.py). ``compile``: training
    steps run each stage as functional programs (F, B, or I and W; see
    programs/stage_programs.py) with no autograd engine; ``False`` runs them as FX graphs,
    ``True``/``"inductor"`` compiles them with Inductor, a callable
    ``(GraphModule, example_inputs) -> callable`` is used as the compiler. A
    ``torch.compile``'d module is pipelined with its stages compiled by
    Inductor. ``dynamic=True`` captures the inputs' sizes symbolically (as
    dims marked with ``torch._dynamo.mark_dynamic`` are without it): a new
    sequence length (or batch size) then runs on the same stages and stage
    programs, compiled ones included, with every transfer sized per step
    from the inputs; sizes the capture cannot serve (a guard it recorded
    fails, a static dim changed) capture again, with a log line saying why.
    ``plan``: a ``torch_mpmd.planning.Plan`` (``mpmd.plan(...)``, or its JSON
    text or file) sets schedule, num_microbatches, stages_per_rank,
    split_points and data_parallel (a setting given beside it that
    contradicts it is a ValueError naming both), and the stages it recomputes
    recompute their units; ``plan="auto"`` profiles and plans at the first
    ``step`` from its batch, keeping schedule, num_microbatches and
    stages_per_rank given beside it as constraints, data_parallel too (the
    parameters are shards, or not, from ``pipeline()`` on; ``mpmd.plan`` on
    the mesh searches it), and ``memory_limit`` (bytes per rank) as the limit
    (torch_mpmd/planning/auto.py);
    Its finalists (``plan_trials``, default 3, beside the configuration a
    user writes first; 0: none) run a few steps each on the real group and
    the measured fastest is the plan; the decision is cached with the
    profile, and a relaunch takes it without trials unless ``plan_again``
    (torch_mpmd/planning/trials.py).
    ``pipe.replan()`` re-runs the search on the measured stage times.
    ``recompute``: module FQNs whose activations are not kept for backward
    but computed again in it (activation checkpointing put on at capture:
    torch_mpmd/graph/recompute.py).
    Settings are the fields of :class:`torch_mpmd.PipelineConfig` (the
    signature lists them): pass them as keywords, or a config (and keywords
    that change it: ``pipeline(model, config, num_microbatches=8)``).
    ``pipe.config`` is the config the pipeline runs with. Settings are checked
    here, before any communication; capture happens on the first call.
    """
    config = PipelineConfig.from_settings(config, **settings)
    orig = getattr(module, "_orig_mod", None)
    if isinstance(orig, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
        # pipeline(torch.compile(model)): pipeline the model, compile its stages.
        module = orig
        if config.compile is False:
            config = dataclasses.replace(config, compile="inductor")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pipeline() takes an nn.Module, got {type(module).__name__}")
    constraints = None
    if config.plan == "auto":  # what the user fixed beside it: constraints of the search
        defaults = {"schedule": "1f1b"}
        constraints = {k: getattr(config, k) for k in PLAN_FIELDS
                       if k in settings or getattr(config, k) != defaults.get(k)}
    return Pipeline(module, config, config.resolve(), constraints)


pipeline.__signature__ = settings_signature(  # type: ignore[attr-defined]
    inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                      annotation="torch.nn.Module"))
