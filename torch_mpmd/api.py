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
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd import training
from torch_mpmd.config import (PLAN_FIELDS, PipelineConfig, Resolved, check_stage_count,
                               positive_int, settings_signature)
from torch_mpmd.graph.hf import training_kwargs
from torch_mpmd.graph.recompute import checkpointed, stage_modules
from torch_mpmd.graph.stage import set_path, split_model
from torch_mpmd.microbatch import (check_target_batch, contiguous_inputs, contiguous_tree,
                                   explicit_microbatches, first_microbatch,
                                   merge_microbatches, split_tree)
from torch_mpmd.parallel import meta_init
from torch_mpmd.parallel.lockstep import Collectives, PipelineError, pipeline_call
from torch_mpmd.parallel.sharding import ParamShards
from torch_mpmd.programs.loss import callable_name, needs_target
from torch_mpmd.programs.stage_programs import resolve_compiler
from torch_mpmd.runtime import trace
from torch_mpmd.runtime.captures import (CaptureCache, capture_key, describe_key,
                                        microbatch_misfit)
from torch_mpmd.runtime.outputs import deliver_outputs
from torch_mpmd.runtime.rank import RankRuntime, StagedModel
from torch_mpmd.runtime.view import RankView
from torch_mpmd.runtime.step import EVAL, FORWARD, STEP, CallHistory, run_step
from torch_mpmd.schedules import Schedule

__all__ = ["pipeline", "Pipeline", "PipelineError", "PipelineConfig"]

_log = logging.getLogger("torch_mpmd")


def _holding_parameters(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a Pipeline method with its compute parameters unparked (NOTE [Parked
    parameters] in sharding.py)."""
    @functools.wraps(method)
    def run(self: "Pipeline", *args: Any, **kwargs: Any) -> Any:
        with self.unparked():
            return method(self, *args, **kwargs)
    return run


class Pipeline(torch.nn.Module):
    """A model split into pipeline stages, this rank's part of it (see :func:`pipeline`)."""

    def __init__(self, module: torch.nn.Module, config: PipelineConfig,
                 resolved: Resolved) -> None:
        """Use :func:`pipeline`, which checks ``config`` and resolves its groups."""
        super().__init__()
        # Not registered as a submodule: parameters() must list this rank's only.
        object.__setattr__(self, "_mpmd_module", module)
        self.config = config
        self.num_microbatches = config.num_microbatches  # None until plan="auto" plans
        # plan="auto": the settings the user gave beside it, kept by the search.
        self._mpmd_constraints: dict[str, Any] = {}
        self._mpmd_group = resolved.group
        self.pp_size = resolved.pp_size
        self.rank = dist.get_rank(self._mpmd_group) if self._mpmd_group else 0
        self.device = (torch.device(config.device) if config.device is not None
                       else _default_device(module))
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        self.timeout = resolved.timeout
        self.startup_timeout = resolved.startup_timeout  # None: timeout (see pipeline())
        self._mpmd_dp_group = resolved.dp_group
        self._mpmd_replicas = resolved.replicas
        self.dp_size = dist.get_world_size(resolved.dp_group) if resolved.dp_group is not None else 1
        self._mpmd_compiler = resolve_compiler(config.compile)
        self._mpmd_meta = meta_init.has_meta_tensors(module)
        self.parameter_bytes = 0  # this rank's materialized bytes (meta-device models)
        self._mpmd_runtime: RankRuntime | None = None
        self._mpmd_split: Any = None
        self._mpmd_cache = CaptureCache()  # the captures per key (captures.py)
        self.calls = CallHistory()  # what this rank's calls did (step.py)
        self._mpmd_all_modules: list[torch.nn.Module] | None = None
        self._mpmd_all_params: list[torch.Tensor] = []  # the module's, for NOTE [Freezing]
        if self._mpmd_meta:  # now, so that an optimizer built before the first step
            # holds the Parameters that this rank later materializes in place
            meta_init.replace_with_standins(module, self.device)
        self.data_parallel = config.data_parallel
        mesh, dp_mesh = config.mesh, resolved.dp_mesh
        # Sharded data parallel: the user's parameters are DTensor shards from
        # now on, so an optimizer built before the first step holds them.
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        # Tensor-parallel peers: a meta-device model's shared tensors are synced over it.
        self._mpmd_tp_group = (mesh.get_group("tp") if "tp" in names and
                               mesh.size(names.index("tp")) > 1 else None)
        self._mpmd_shards = (ParamShards(module, dp_mesh, root=mesh)
                             if config.data_parallel == "shard" and dp_mesh is not None else None)
        self._mpmd_weighted: bool | None = None  # token-weighted loss (None: no step yet)
        # The global token count of the last step or eval_step when its loss
        # was token-weighted (else None).
        self.last_token_count: float | None = None
        self._mpmd_parking = False  # NOTE [Parked parameters] (sharding.py)
        self._mpmd_unparked = 0     # depth of unparked() contexts
        if self._mpmd_shards is not None:
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
        module, shards = self._mpmd_module, self._mpmd_shards
        for fqn, p in module.named_parameters(remove_duplicate=False):
            set_path(self, fqn, shards.shard_of(p), "parameter")
        for name, mod in module.named_modules():
            for leaf, b in mod._buffers.items():
                if b is not None:
                    set_path(self, f"{name}.{leaf}" if name else leaf, b, "buffer",
                              persistent=leaf not in mod._non_persistent_buffers_set)

    def park_between_calls(self) -> None:
        """With sharded data parallel: from now on, between calls, the module's
        own (compute) parameters hold empty tensors of their own shape and
        strides, as torch.compile's guards expect (NOTE [Parked parameters] in
        sharding.py; the compile door asks for it). No-op otherwise."""
        if self._mpmd_shards is not None:
            self._mpmd_parking = True
            if not self._mpmd_unparked:
                self._mpmd_shards.park()

    @contextlib.contextmanager
    def unparked(self) -> Iterator[None]:
        """The compute parameters as the pipeline runs them, for the duration
        (parked again after, when parking: :meth:`park_between_calls`)."""
        if not self._mpmd_parking:
            yield
            return
        if not self._mpmd_unparked:
            self._mpmd_shards.unpark()
        self._mpmd_unparked += 1
        try:
            yield
        finally:
            self._mpmd_unparked -= 1
            if not self._mpmd_unparked:
                self._mpmd_shards.park()

    # ------------------------------------------------------------ properties
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (all of it; its tensors are shared with the stages)."""
        return self._mpmd_module

    @property
    def is_captured(self) -> bool:
        return self._mpmd_runtime is not None

    def _runtime(self) -> RankRuntime:
        if self._mpmd_runtime is None:
            raise RuntimeError("the pipeline has not captured the model yet: call step() or the "
                               "pipeline once first")
        return self._mpmd_runtime

    @property
    def num_stages(self) -> int:
        return self._runtime().model.num_stages

    @property
    def local_stages(self) -> tuple[int, ...]:
        return self._runtime().local_stages

    @property
    def schedule(self) -> Schedule:
        """The lowered schedule every rank runs (this rank's row is its program)."""
        return self._runtime().schedule

    @property
    def replicas(self) -> list[list[int]] | None:
        """With a mesh's "dp" dimension: the global ranks of each data-parallel
        replica's pipeline (None without one)."""
        return self._mpmd_replicas

    def inspect(self) -> RankView:
        """What this rank runs now (a :class:`torch_mpmd.runtime.view.RankView`):
        its stages and their modules, its programs as typed actions per kind of
        call, its stage programs (or why the autograd runner runs instead), the
        activation bytes held, the shapes crossing each stage edge, and how many
        captures were made. Local; a RuntimeError before the first call."""
        return RankView.of(self._runtime(),
                           captures=self._mpmd_cache.count)

    @property
    def split(self) -> Any:
        """The SplitModel: plan, stage modules (all stages) and signatures."""
        return self._mpmd_split

    # ------------------------------------------------------------ capture
    def train(self, mode: bool = True) -> "Pipeline":
        """Set train/eval mode on the wrapped module (the stages follow it: the
        next call captures in the new mode, or reuses that mode's capture)."""
        super().train(mode)
        self._mpmd_module.train(mode)
        return self

    # NOTE [Freezing]: stage programs, the autograd runner's weight lists,
    # data-parallel buckets and tied sums are built for the parameters that
    # require grad when the model is captured. ``requires_grad`` of every
    # parameter of the wrapped module is therefore part of the capture key,
    # read at every call: freezing or unfreezing between steps takes the
    # capture built for the new set (made once, then reused, like train/eval
    # captures), so a frozen parameter gets no gradient and an unfrozen one
    # gets its own, as in eager PyTorch. The key is the module's flags, which
    # every rank holds whole: freeze on the module (``pipe.module`` or the
    # model you wrapped), on every rank alike; ranks that disagree get a
    # PipelineError at the next call. With sharded data parallel the shards
    # (``pipe.parameters()``) may also be frozen: their rows are reduced and
    # left without gradient (ShardedStages.add_grad), no new capture needed.
    def _ensure_built(self, args0: tuple, kwargs0: dict) -> RankRuntime:
        # One capture per key (shapes, train/eval modes, trainable parameters:
        # NOTE [Freezing]), kept and reused (runtime/captures.py).
        if self._mpmd_all_modules is None:  # walked once: the capture fixed the modules
            self._mpmd_all_modules = list(self._mpmd_module.modules())
            self._mpmd_all_params = list(self._mpmd_module.parameters())
        key = capture_key(args0, kwargs0, self.config.dynamic, self._mpmd_all_modules,
                          self._mpmd_all_params)
        current = self._mpmd_cache.current
        found, unfit = self._mpmd_cache.find(key, args0, kwargs0)
        if found is not None:
            if found is not current:  # an earlier capture: its tensors are the rank's again
                self._mpmd_runtime, self._mpmd_split = found
                self._adopt_local_tensors(*found)
            return found[0]
        self._mpmd_cache.check_state_captures(key, unfit)
        previous = self._mpmd_runtime
        if previous is not None and self.rank == 0:
            # Stages and their programs are specialized to the shapes captured
            # (a dynamic capture: to the guards its symbolic sizes recorded).
            _log.warning("torch_mpmd: capturing%s again: %s",
                         " and compiling" if self._mpmd_compiler else "",
                         self._mpmd_cache.why_again(key, unfit))
        spr = self.config.stages_per_rank_default
        schedule = self.config.schedule
        # Under grad mode whatever the caller's: which values carry gradients
        # across stages is read from the capture (the runner sets the mode).
        with torch.enable_grad(), checkpointed(self._mpmd_module,
                                                     self._recompute_modules(args0, kwargs0)):
            split = split_model(self._mpmd_module, *args0,
                                split_points=self.config.split_points,
                                num_stages=self.config.num_stages,
                                default_num_stages=self.pp_size * spr,
                                bytes_cost=self.config.bytes_cost,
                                dynamic=self.config.dynamic, **kwargs0)
        check_stage_count(split.num_stages, self.pp_size, self.config.stages_per_rank,
                          source="the stage_boundary() markers or split points"
                          if (split.ir.num_markers or self.config.split_points) else
                          "num_stages")
        settings = self._shared_settings(split, key)
        runtime = RankRuntime(StagedModel.from_split(split), schedule=schedule, num_microbatches=self.num_microbatches,
                              group=self._mpmd_group, device=self.device, timeout=self.timeout,
                              lookahead=self.config.lookahead, settings=settings,
                              seed=self.config.seed, dp_group=self._mpmd_dp_group,
                              replicas=self._mpmd_replicas, compiler=self._mpmd_compiler,
                              startup_timeout=self.startup_timeout, shards=self._mpmd_shards,
                              reshard_after_forward=self.config.reshard_after_forward)
        if previous is not None:
            old = sorted(n for n, _ in self.named_parameters(remove_duplicate=False))
            new = sorted(self._local_tensors(runtime, split)[0])
            if old != new:
                raise ValueError(
                    "the batch shape changed and the re-captured model places other parameters "
                    f"on rank {self.rank} ({len(new)} instead of {len(old)}); use markers or "
                    "split_points so stages do not depend on shapes, or keep the batch shape")
        self._mpmd_runtime, self._mpmd_split = runtime, split
        self._mpmd_cache.add(key, (runtime, split))
        self._adopt_local_tensors(runtime, split)
        shards = self._mpmd_shards
        if previous is None and (self._mpmd_meta or shards is not None):
            # The compute tensors of this rank's stages (with sharding, the
            # parameters are their shards' full-shape compute parameters).
            compute = self._local_tensors(runtime, split, user=False)
            local = list({id(t): t for t in [*compute[0].values(), *compute[1].values()]}
                         .values())
            if self._mpmd_meta:
                self.parameter_bytes = meta_init.materialize(
                    self._mpmd_module, local, self.config.init_fn, self.device)
                tied = [(pg, [shards.compute[id(p)] for p in ps] if shards is not None else ps)
                        for pg, ps in runtime.tied_groups]
                meta_init.synchronize(tied, runtime.dp_group, local, runtime,
                                      tp_group=self._mpmd_tp_group)
            if shards is not None:
                shards.take(local)  # materialized values into the shards; compute freed
                shards.release(local)  # other ranks' stages' shards
                if self._mpmd_meta:
                    held = [getattr(t, "_local_tensor", t)  # a shard: its local rows
                            for t in [*self.parameters(), *self.buffers()]]
                    self.parameter_bytes = sum(t.numel() * t.element_size() for t in held
                                               if not meta_init.is_standin(t))
        return runtime

    def _shared_settings(self, split: Any, key: tuple) -> dict[str, str]:
        """The settings every rank must share, by name: the start-up handshake
        compares them and names the one that differs, with its values."""
        return {"model": type(self._mpmd_module).__name__, **self.config.shared_settings(),
                "num_stages": str(split.num_stages), "microbatch inputs": describe_key(key)}

    def _local_tensors(self, runtime: RankRuntime, split: Any, *, user: bool = True
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]:
        """This rank's parameters and buffers by FQN (aliases of tied weights
        included), and the non-persistent buffer names. ``user``: parameters as
        the user holds them (their shards with sharded data parallel), else the
        stages' own."""
        infos = {p.name: p for p in split.captured.placeholders
                 if p.kind in ("parameter", "buffer")}
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for s in runtime.local_stages:
            sig = split.stage_signatures[s]
            for fqn in sig.parameters:
                params[fqn] = split.captured.tensors[fqn]
            for fqn in sig.buffers:
                buffers[fqn] = split.captured.tensors[fqn]
        # Tensors no stage reads live with stage 0 so checkpoints stay complete.
        if 0 in runtime.local_stages:
            used = {p.fqn for p in split.plan.parameters}
            for fqn, p in self._mpmd_module.named_parameters(remove_duplicate=False):
                if fqn not in used and not any(fqn in i.aliases for i in infos.values()):
                    params.setdefault(fqn, p)
            for fqn, b in self._mpmd_module.named_buffers(remove_duplicate=False):
                if fqn not in used and not any(fqn in i.aliases for i in infos.values()):
                    buffers.setdefault(fqn, b)
        for table in (params, buffers):
            for fqn in list(table):
                info = infos.get(fqn)
                for alias in info.aliases if info is not None else ():
                    table[alias] = table[fqn]
        if user and self._mpmd_shards is not None:
            params = {fqn: self._mpmd_shards.shard_of(p) for fqn, p in params.items()}
        non_persistent = {fqn for fqn, info in infos.items() if not info.persistent}
        for fqn, b in self._mpmd_module.named_buffers(remove_duplicate=False):
            mod, _, leaf = fqn.rpartition(".")
            owner = self._mpmd_module.get_submodule(mod) if mod else self._mpmd_module
            if leaf in owner._non_persistent_buffers_set:
                non_persistent.add(fqn)
        return params, buffers, non_persistent

    def _adopt_local_tensors(self, runtime: RankRuntime, split: Any) -> None:
        params, buffers, non_persistent = self._local_tensors(runtime, split)
        self._modules = {}
        self._parameters = {}
        self._buffers = {}
        self._non_persistent_buffers_set = set()
        for fqn, p in params.items():
            set_path(self, fqn, p, "parameter")
        for fqn, b in buffers.items():
            set_path(self, fqn, b, "buffer", persistent=fqn not in non_persistent)

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
        if assign and (self.is_captured or self._mpmd_shards is not None):
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
        if self._mpmd_shards is not None:
            params = dict(self.named_parameters(remove_duplicate=False))
            state_dict = {k: self._mpmd_shards.shard_value(params[k], v) if k in params else v
                          for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def describe(self) -> str:
        """The split: plan summary, every stage's inputs and outputs, and per stage
        its compute cost, parameter bytes and bytes sent and received per
        microbatch (SplitModel.describe)."""
        if self._mpmd_split is None:
            raise RuntimeError("the pipeline has not captured the model yet: call step() or the "
                               "pipeline once first")
        return self._mpmd_split.describe()

    # ------------------------------------------------------------ running
    @pipeline_call("step")
    @_holding_parameters
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
        # Local checks every rank makes alike, before any communication.
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipeline.step() runs backward and needs grad mode, but it was "
                               "called under torch.no_grad() or inference_mode(); use "
                               "eval_step() for the loss without backward, or the pipeline "
                               "call for outputs")
        if microbatches is None:  # (use_cache=False, graph/hf.py: the plan's profile too)
            kwargs = training_kwargs(self._mpmd_module, kwargs)
        if self.config.plan == "auto":
            self._plan_auto(args, kwargs, target, microbatches)
        rt, inputs, targets = self._call_microbatches(args, kwargs, target, microbatches,
                                                      targets)
        rt.use_microbatches(inputs)  # (before building: the programs' sizes)
        rt.prepare_programs(inputs, targets, self.config.loss_fn)
        params = list(self.parameters())
        # NOTE [Token-weighted losses] (training.py): gradients held before the
        # step are kept aside while the loss may be token-weighted.
        before = training.grads_before(params) if self._mpmd_weighted is not False else {}
        # Scalar losses so far: gradients they accumulated could not be told
        # from a pair's increment, were the loss to switch (refused below).
        unsplittable = self._mpmd_weighted is False and any(p.grad is not None for p in params)
        run_step(rt, STEP, self.calls, self.device, inputs=inputs, targets=targets,
                 loss_fn=self.config.loss_fn)
        try:
            loss, tokens = training.step_loss(rt, self.device)
        finally:
            rt.runner.end_step()
        if tokens is not None:
            if unsplittable:
                raise ValueError("loss_fn returned a (sum, count) pair after steps that "
                                 "returned scalars, with gradients accumulated from them: "
                                 "zero the gradients before switching losses")
            training.scale_step_grads(params, before, self.dp_size / tokens)
        self._mpmd_weighted = tokens is not None
        self.last_token_count = tokens
        if os.environ.get("MPMD_TRACE"):
            self.save_trace(os.environ["MPMD_TRACE"])
        return loss

    # ------------------------------------------------------------ plans
    def _recompute_modules(self, args: tuple, kwargs: dict) -> list[str]:
        """The submodules whose activations are recomputed (graph/recompute.py):
        ``recompute=`` and the units of the stages the plan recomputes.

        A plan from ``mpmd.plan`` carries its profile's units. One read from
        JSON does not: its units are found again, with the outer ones in the
        call order of one no-grad forward on ``args``/``kwargs`` (a microbatch),
        as the profile found them (NOTE [Outer units] in planning/profile.py:
        a final norm registered before the blocks runs after them). A model
        still on the meta device cannot run: registration order then."""
        fqns = list(self.config.recompute or ())
        plan = self.config.plan
        if plan is not None and plan != "auto" and any(plan.recompute):
            from torch_mpmd.planning.calibrate import model_state_kept
            from torch_mpmd.planning.profile import find_units
            from torch_mpmd.planning.units import call_order

            sheet = getattr(plan, "sheet", None)
            if sheet is not None:
                units = [u.name for u in sheet.units]
            else:
                order = None
                if not self._mpmd_meta:
                    with model_state_kept(self._mpmd_module):
                        order = call_order(self._mpmd_module, tuple(args), dict(kwargs))
                units = find_units(self._mpmd_module, order)
            modules = [name for name, _ in self._mpmd_module.named_modules()]
            fqns += stage_modules(units, plan.split_points, plan.recompute, modules)
        return fqns

    def _plan_auto(self, args: tuple, kwargs: dict, target: Any, microbatches: Any) -> None:
        """plan="auto" at the first step: profile on this batch, search, and
        take the plan as if given (collective over the pipeline group, and the
        same plan on every rank of the job; torch_mpmd.planning.auto)."""
        from torch_mpmd.planning.auto import plan as make_plan

        if microbatches is not None:
            raise ValueError("plan='auto' plans from a batch: the first step() takes the batch "
                             "(its args and target=), not microbatches=[...]")
        self._check_target(target)
        c = self._mpmd_constraints
        mesh = self.config.mesh
        chosen = make_plan(self._mpmd_module, tuple(args), dict(kwargs),
                           loss_fn=self.config.loss_fn, target=target,
                           group=mesh if mesh is not None else self._mpmd_group,
                           memory_limit=self.config.memory_limit,
                           schedules=c.get("schedule"),
                           num_microbatches=c.get("num_microbatches"),
                           stages_per_rank=c.get("stages_per_rank"),
                           compile=self.config.compile,
                           # Fixed when the pipeline was built (its parameters are
                           # shards, or not, since): NOTE [Plans in the config].
                           data_parallel=self.config.data_parallel,
                           # Every wait of the profile and search (NOTE [Named
                           # waits] in lockstep.py): the capture's bound.
                           timeout=(self.startup_timeout if self.startup_timeout is not None
                                    else self.timeout),
                           trials=self.config.plan_trials, trials_again=self.config.plan_again)
        config = PipelineConfig.from_settings(self.config, plan=chosen)
        config._check_schedule_at(self.pp_size)
        self.config = config
        self.num_microbatches = config.num_microbatches
        if self.rank == 0:
            _log.info("torch_mpmd: plan='auto' chose %s; %s", chosen.describe().splitlines()[0],
                      chosen.planning_summary())

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

        rt = self._runtime()
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
        all_reduce over the pipeline group (NOTE [Named waits] in lockstep.py;
        a dead or stalled peer is a PipelineError naming it within timeout=)."""
        kinds = "FBIW"
        table = torch.zeros(2, self.num_stages, len(kinds), dtype=torch.float64)
        for s, row in times.items():
            for k, seconds in row.items():
                table[0, s, kinds.index(k)] = seconds
                table[1, s, kinds.index(k)] = 1.0  # (a time of 0 is a time)
        timeout_s = self.timeout.total_seconds()
        with Collectives(self._mpmd_group, timeout_s, "replan") as waits:
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
        rt = self._runtime()
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
        if self._mpmd_group is None or not dist.is_initialized():
            return True
        if 0 in dist.get_process_group_ranks(self._mpmd_group):
            return True
        # Another data-parallel replica holds global rank 0: it writes.
        return not any(0 in ranks for ranks in self._mpmd_replicas or ())

    @pipeline_call("forward")
    @_holding_parameters
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
        self._check_output_rank(output_rank)
        rt, inputs, _ = self._call_microbatches(args, kwargs, None, microbatches, None,
                                                loss=False)
        self._forward_only(rt, inputs, [None] * len(inputs), eval_loss=False)
        try:
            outputs = []
            for k in range(len(inputs)):
                flat = deliver_outputs(rt, self._mpmd_split.ir, rt.runner.outputs.get(k),
                                       output_rank, self.device, k)
                if flat is not None:
                    outputs.append(self._mpmd_split.captured.rebuild_output(flat, inputs[k]))
        finally:
            rt.runner.end_step()
        if microbatches is not None:
            return outputs or None
        return merge_microbatches(outputs) if outputs else None

    @pipeline_call("eval")
    @_holding_parameters
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
        with torch.no_grad():
            rt, inputs, targets = self._call_microbatches(args, kwargs, target, microbatches,
                                                          targets)
            self._forward_only(rt, inputs, targets, eval_loss=True)
            try:
                loss, self.last_token_count = training.step_loss(rt, self.device)
                return loss
            finally:
                rt.runner.end_step()

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
        return training.clip_grad_norm_(self._runtime(), list(self.parameters()), max_norm,
                                        norm_type, foreach, error_if_nonfinite)

    # ------------------------------------------------------------ forward-only runs
    def _check_target(self, target: Any) -> None:
        """The target as the loss contract needs it, before capture or any
        communication: none without loss_fn, there for torch's losses (its
        batch size is checked by check_target_batch, after the inputs')."""
        loss_fn = self.config.loss_fn
        if target is not None and loss_fn is None:
            raise ValueError("target= was given, but the pipeline has loss_fn=None: the loss "
                             "comes from the model's output and the target would be ignored; "
                             "pass pipeline(loss_fn=...), or give the labels to the model as "
                             "an argument (e.g. labels=y)")
        if target is None and loss_fn is not None and needs_target(loss_fn):
            raise ValueError(f"target is missing: pipeline(loss_fn="
                             f"{callable_name(loss_fn)}) computes loss_fn(output, "
                             "target) on each microbatch, but no "
                             "target= was given; pass step(..., target=y)")

    def _check_output_rank(self, output_rank: Any) -> None:
        if output_rank is None:
            return
        if (not isinstance(output_rank, int) or isinstance(output_rank, bool) or
                not 0 <= output_rank < self.pp_size):
            raise ValueError(f"output_rank={output_rank!r} must be None (every rank) or a rank "
                             f"of the pipeline group, 0 to {self.pp_size - 1}")

    def _call_microbatches(self, args: tuple, kwargs: dict, target: Any, microbatches: Any,
                           targets: Any, *, loss: bool = True
                           ) -> tuple[RankRuntime, list[dict[str, Any]], list[Any]]:
        """A call's runtime (capturing on first use), its microbatches' named
        inputs and their targets: the batch split into ``num_microbatches``,
        or the caller's ``microbatches`` list. Every check is local and alike
        on every rank, before any communication. ``loss``: the call computes
        the loss (targets are checked against ``loss_fn``)."""
        if self.config.plan == "auto":
            raise ValueError("plan='auto' chooses the plan at the first step(), from its batch: "
                             "call step() before eval_step() or the forward call")
        if microbatches is None:
            if targets is not None:
                raise ValueError("targets= goes with microbatches=[...]; for a batch, pass its "
                                 "target as target=")
            if loss:
                self._check_target(target)
                kwargs = training_kwargs(self._mpmd_module, kwargs)
            # A sliced batch (x[:, :n]) laid out dense, as its microbatches'
            # capture and programs expect (NOTE [Contiguous microbatches]).
            args, kwargs = contiguous_inputs(args, kwargs)
            target = contiguous_tree(target)
            m = self.num_microbatches
            args0, kwargs0 = first_microbatch(args, kwargs, m)
            if target is not None:  # split alike, or it would broadcast silently
                check_target_batch(args, kwargs, target)
            split_targets = split_tree(target, m, "target") if target is not None else [None] * m
            rt = self._ensure_built(args0, kwargs0)
            return rt, self._mpmd_split.named_microbatches(args, kwargs, m), split_targets
        mbs, split_targets = explicit_microbatches(microbatches, targets, args=args,
                                                   kwargs=kwargs, target=target)
        if loss:
            mbs = [(a, training_kwargs(self._mpmd_module, k)) for a, k in mbs]
            given = {t is not None for t in split_targets}
            if len(given) > 1:
                raise ValueError("targets= has a target for some microbatches and None for "
                                 "others: give every microbatch its target, or none")
            self._check_target(split_targets[0])
        for i, ((a, k), t) in enumerate(zip(mbs, split_targets)):
            if t is not None:
                try:
                    check_target_batch(a, k, t)
                except ValueError as e:
                    raise ValueError(f"microbatch {i}: {e}") from None
        rt = self._ensure_built(*mbs[0])
        inputs = []
        for i, (a, k) in enumerate(mbs):
            try:
                inputs.append(self._mpmd_split.named_inputs(a, k))
            except ValueError as e:
                if i == 0:
                    raise
                hint = ("" if self._mpmd_split.sizes else "; microbatches of different shapes "
                        "need pipeline(dynamic=True) (one capture for every size), or pad them "
                        "to one shape")
                raise ValueError(f"microbatch {i}: {e}{hint}") from None
        why = microbatch_misfit(rt, self._mpmd_split, inputs, split_targets)
        if why is not None:
            raise ValueError(why)
        return rt, inputs, split_targets

    def _forward_only(self, rt: RankRuntime, inputs: list[dict[str, Any]], targets: list[Any],
                      *, eval_loss: bool) -> None:
        """Run the forward part of the schedule over the microbatches; the last
        stage leaves its outputs (or with ``eval_loss`` its losses) in the
        runner. The caller ends the runner's step."""
        run_step(rt, EVAL if eval_loss else FORWARD, self.calls, self.device, inputs=inputs,
                 targets=targets, loss_fn=self.config.loss_fn if eval_loss else None)


def _default_device(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


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
    keep their initial values on this rank; ``checkpoint.save`` trims such an
    optimizer to this rank's parameters).

    Stages come from ``stage_boundary()`` markers, else ``split_points``, else
    ``pp_size * stages_per_rank`` (or ``num_stages``) stages balanced by cost;
    the stage count must be a multiple of the pipeline size. ``bytes_cost``
    (cost units per byte; None: ``torch_mpmd._C.DEFAULT_BYTES_COST``, from a
    measured p2p rate) weighs the bytes crossing each cut of a balanced split
    against its compute (0: compute alone). ``schedule``: a
    name (``torch_mpmd.schedules.names()``), a Schedule, or a text/CSV file.
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
    pipe = Pipeline(module, config, config.resolve())
    if config.plan == "auto":  # what the user fixed beside it: constraints of the search
        defaults = {"schedule": "1f1b"}
        pipe._mpmd_constraints = {k: getattr(config, k) for k in PLAN_FIELDS
                                  if k in settings or getattr(config, k) != defaults.get(k)}
    return pipe


pipeline.__signature__ = settings_signature(  # type: ignore[attr-defined]
    inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                      annotation="torch.nn.Module"))
