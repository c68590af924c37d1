"""A pipeline's session: what both doors (``pipeline()`` and
``torch.compile(backend="mpmd")``) run a model through.

A :class:`Session` owns, for one wrapped module on one rank:

- the captures (one per capture key: shapes, train/eval modes, trainable
  parameters; runtime/captures.py), building each one's split, runtime and
  programs, and a meta-device model's materialization at the first build;
- microbatch preparation: a call's batch split into ``num_microbatches``
  (or the caller's explicit list), checked locally and alike on every rank
  before any communication;
- running a call kind (step, eval, forward, and the compile door's forward
  keeping its graph and backward), each in lockstep with the other ranks
  (lockstep.pipeline_call; the session is its :class:`LockstepParty`), and
  delivering outputs;
- ``plan="auto"``: planning at the first step from its batch.

The contract, for :class:`torch_mpmd.api.Pipeline` and the compile door
(compile/door.py): a call method takes the call's arguments and returns
its result; the session never reaches into the caller, but tells it of a
capture's tensors through ``adopt`` (the Pipeline mirrors them as its own
parameters and buffers). ``config`` travels whole; ``plan="auto"``
replaces it once by the planned config.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd import training
from torch_mpmd.config import PipelineConfig, Resolved, check_stage_count
from torch_mpmd.graph.hf import training_kwargs
from torch_mpmd.graph.recompute import checkpointed, stage_modules
from torch_mpmd.graph.stage import split_model
from torch_mpmd.microbatch import (check_target_batch, contiguous_inputs, contiguous_tree,
                                   explicit_microbatches, first_microbatch,
                                   merge_microbatches, split_tree)
from torch_mpmd.parallel import meta_init
from torch_mpmd.parallel.lockstep import pipeline_call
from torch_mpmd.parallel.sharding import ParamShards
from torch_mpmd.programs.loss import callable_name, needs_target
from torch_mpmd.programs.stage_programs import resolve_compiler
from torch_mpmd.runtime.captures import (CaptureCache, capture_key, describe_key,
                                        microbatch_misfit)
from torch_mpmd.runtime.outputs import deliver_outputs
from torch_mpmd.runtime.rank import RankRuntime, StagedModel
from torch_mpmd.runtime.step import (BACKWARD, EVAL, FORWARD, FORWARD_KEEPING_GRAPH, STEP,
                                     CallHistory, defer_parameter_hooks, run_step)

_log = logging.getLogger("torch_mpmd")

# This rank's parameters and buffers by FQN, and the non-persistent buffer names.
LocalTensors = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]


def _holding_parameters(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a call with the compute parameters unparked (NOTE [Parked
    parameters] in sharding.py)."""
    @functools.wraps(method)
    def run(self: "Session", *args: Any, **kwargs: Any) -> Any:
        with self.unparked():
            return method(self, *args, **kwargs)
    return run


def default_device(module: torch.nn.Module) -> torch.device:
    """The device of the module's first materialized parameter (CPU if none)."""
    for t in module.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


class Session:
    """One wrapped module's captures, calls and plan on this rank (module
    docstring). ``adopt(params, buffers, non_persistent)`` is called with
    this rank's tensors (as the user holds them) whenever the capture in use
    changes; ``constraints``: with ``plan="auto"``, the plan fields the user
    fixed beside it."""

    def __init__(self, module: torch.nn.Module, config: PipelineConfig, resolved: Resolved,
                 adopt: Callable[[dict, dict, set], None],
                 constraints: dict[str, Any] | None = None) -> None:
        self.module = module
        self.config = config
        self.num_microbatches = config.num_microbatches  # None until plan="auto" plans
        self.constraints = dict(constraints or {})
        self._adopt = adopt
        # The LockstepParty: groups and bound.
        self.group = resolved.group
        self.dp_group = resolved.dp_group
        self.replicas = resolved.replicas
        self.timeout = resolved.timeout
        self.startup_timeout = resolved.startup_timeout  # None: timeout (see pipeline())
        self.pp_size = resolved.pp_size
        self.rank = dist.get_rank(self.group) if self.group else 0
        self.dp_size = (dist.get_world_size(resolved.dp_group)
                        if resolved.dp_group is not None else 1)
        self.device = (torch.device(config.device) if config.device is not None
                       else default_device(module))
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        self.compiler = resolve_compiler(config.compile)
        self.meta = meta_init.has_meta_tensors(module)
        self.parameter_bytes = 0  # this rank's materialized bytes (meta-device models)
        self.runtime_or_none: RankRuntime | None = None
        self.split: Any = None
        self.captures = CaptureCache()
        self.calls = CallHistory()  # what this rank's calls did (step.py)
        self.local_parameters: list[torch.Tensor] = []  # this rank's, as the user holds them
        self._all_modules: list[torch.nn.Module] | None = None
        self._all_params: list[torch.Tensor] = []  # the module's, for NOTE [Freezing]
        self._hooks_later = False
        if self.meta:  # now, so that an optimizer built before the first step
            # holds the Parameters that this rank later materializes in place
            meta_init.replace_with_standins(module, self.device)
        mesh = config.mesh
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        # Tensor-parallel peers: a meta-device model's shared tensors are synced over it.
        self.tp_group = (mesh.get_group("tp") if "tp" in names and
                         mesh.size(names.index("tp")) > 1 else None)
        # Sharded data parallel: the user's parameters are DTensor shards from
        # now on, so an optimizer built before the first step holds them.
        self.shards = (ParamShards(module, resolved.dp_mesh, root=mesh)
                       if config.data_parallel == "shard" and resolved.dp_mesh is not None
                       else None)
        self.weighted: bool | None = None  # token-weighted loss (None: no step yet)
        # The global token count of the last step or eval_step when its loss
        # was token-weighted (else None).
        self.last_token_count: float | None = None
        self._parking = False  # NOTE [Parked parameters] (sharding.py)
        self._unparked = 0     # depth of unparked() contexts

    # ------------------------------------------------------------ state
    @property
    def runtime(self) -> RankRuntime:
        """The runtime of the capture in use; a RuntimeError before the first call."""
        if self.runtime_or_none is None:
            raise RuntimeError("the pipeline has not captured the model yet: call step() or the "
                               "pipeline once first")
        return self.runtime_or_none

    def park_between_calls(self) -> None:
        """With sharded data parallel: from now on, between calls, the module's
        own (compute) parameters hold empty tensors of their own shape and
        strides, as torch.compile's guards expect (NOTE [Parked parameters] in
        sharding.py). No-op otherwise."""
        if self.shards is not None:
            self._parking = True
            if not self._unparked:
                self.shards.park()

    @contextlib.contextmanager
    def unparked(self) -> Iterator[None]:
        """The compute parameters as the pipeline runs them, for the duration
        (parked again after, when parking)."""
        if not self._parking:
            yield
            return
        if not self._unparked:
            self.shards.unpark()
        self._unparked += 1
        try:
            yield
        finally:
            self._unparked -= 1
            if not self._unparked:
                self.shards.park()

    def defer_parameter_hooks(self) -> None:
        """From now on the caller runs the parameters' gradient hooks after a
        step (the compile door, in its loss's backward): hooked parameters
        keep their stage programs."""
        self._hooks_later = True
        if self.runtime_or_none is not None:
            defer_parameter_hooks(self.runtime_or_none)

    # ------------------------------------------------------------ captures
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
    def build(self, args0: tuple, kwargs0: dict) -> RankRuntime:
        """The runtime for calls whose first microbatch is ``args0``/``kwargs0``:
        the capture of its key, made (capture, split, runtime; the first one
        also materializes a meta-device model) or taken from the cache."""
        if self._all_modules is None:  # walked once: the capture fixed the modules
            self._all_modules = list(self.module.modules())
            self._all_params = list(self.module.parameters())
        key = capture_key(args0, kwargs0, self.config.dynamic, self._all_modules,
                          self._all_params)
        current = self.captures.current
        found, unfit = self.captures.find(key, args0, kwargs0)
        if found is not None:
            if found is not current:  # an earlier capture: its tensors are the rank's again
                self.runtime_or_none, self.split = found
                self._use_local_tensors(*found)
                if self._hooks_later:
                    defer_parameter_hooks(found[0])
            return found[0]
        self.captures.check_state_captures(key, unfit)
        previous = self.runtime_or_none
        if previous is not None and self.rank == 0:
            # Stages and their programs are specialized to the shapes captured
            # (a dynamic capture: to the guards its symbolic sizes recorded).
            _log.warning("torch_mpmd: capturing%s again: %s",
                         " and compiling" if self.compiler else "",
                         self.captures.why_again(key, unfit))
        split = self._split(args0, kwargs0)
        config = self.config
        # Markers may define several stages per rank: 1F1B then runs interleaved.
        schedule = config.schedule_at(split.num_stages // self.pp_size)
        runtime = RankRuntime(StagedModel.from_split(split), schedule=schedule,
                              num_microbatches=self.num_microbatches, group=self.group,
                              device=self.device, timeout=self.timeout,
                              lookahead=config.lookahead,
                              settings=self.shared_settings(split, key), seed=config.seed,
                              dp_group=self.dp_group, replicas=self.replicas,
                              compiler=self.compiler, startup_timeout=self.startup_timeout,
                              shards=self.shards,
                              reshard_after_forward=config.reshard_after_forward)
        if self._hooks_later:
            defer_parameter_hooks(runtime)
        if previous is not None:
            old = sorted(self.local_tensors(previous, self.split)[0])
            new = sorted(self.local_tensors(runtime, split)[0])
            if old != new:
                raise ValueError(
                    "the batch shape changed and the re-captured model places other parameters "
                    f"on rank {self.rank} ({len(new)} instead of {len(old)}); use markers or "
                    "split_points so stages do not depend on shapes, or keep the batch shape")
        self.runtime_or_none, self.split = runtime, split
        self.captures.add(key, (runtime, split))
        self._use_local_tensors(runtime, split)
        if previous is None and (self.meta or self.shards is not None):
            self._materialize(runtime, split)
        return runtime

    def build_for_batch(self, args: tuple, kwargs: dict) -> RankRuntime:
        """:meth:`build` for a batch split into ``num_microbatches``."""
        return self.build(*first_microbatch(args, kwargs, self.num_microbatches))

    def _split(self, args0: tuple, kwargs0: dict) -> Any:
        """Capture the module on a microbatch and split it into stages."""
        config = self.config
        spr = config.stages_per_rank_default
        # Under grad mode whatever the caller's: which values carry gradients
        # across stages is read from the capture (the runner sets the mode).
        with torch.enable_grad(), checkpointed(self.module,
                                               self.recompute_modules(args0, kwargs0)):
            split = split_model(self.module, *args0, split_points=config.split_points,
                                num_stages=config.num_stages,
                                default_num_stages=self.pp_size * spr,
                                bytes_cost=config.bytes_cost, dynamic=config.dynamic, **kwargs0)
        check_stage_count(split.num_stages, self.pp_size, config.stages_per_rank,
                          source="the stage_boundary() markers or split points"
                          if (split.ir.num_markers or config.split_points) else "num_stages")
        return split

    def shared_settings(self, split: Any, key: tuple) -> dict[str, str]:
        """The settings every rank must share, by name: the start-up handshake
        compares them and names the one that differs, with its values."""
        return {"model": type(self.module).__name__, **self.config.shared_settings(),
                "num_stages": str(split.num_stages), "microbatch inputs": describe_key(key)}

    def _materialize(self, runtime: RankRuntime, split: Any) -> None:
        """At the first build: a meta-device model's tensors of this rank's
        stages materialized and synchronized; with sharded data parallel,
        the compute tensors' values into their shards."""
        shards = self.shards
        compute = self.local_tensors(runtime, split, user=False)
        local = list({id(t): t for t in [*compute[0].values(), *compute[1].values()]}.values())
        if self.meta:
            self.parameter_bytes = meta_init.materialize(self.module, local,
                                                         self.config.init_fn, self.device)
            tied = [(pg, [shards.compute[id(p)] for p in ps] if shards is not None else ps)
                    for pg, ps in runtime.tied_groups]
            meta_init.synchronize(tied, runtime.dp_group, local, runtime,
                                  tp_group=self.tp_group)
        if shards is not None:
            shards.take(local)  # materialized values into the shards; compute freed
            shards.release(local)  # other ranks' stages' shards
            if self.meta:
                buffers = self.local_tensors(runtime, split)[1].values()
                tensors = {id(t): t for t in [*self.local_parameters, *buffers]}.values()
                held = [getattr(t, "_local_tensor", t)  # a shard: its local rows
                        for t in tensors]
                self.parameter_bytes = sum(t.numel() * t.element_size() for t in held
                                           if not meta_init.is_standin(t))

    def local_tensors(self, runtime: RankRuntime, split: Any, *, user: bool = True
                      ) -> LocalTensors:
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
            for fqn, p in self.module.named_parameters(remove_duplicate=False):
                if fqn not in used and not any(fqn in i.aliases for i in infos.values()):
                    params.setdefault(fqn, p)
            for fqn, b in self.module.named_buffers(remove_duplicate=False):
                if fqn not in used and not any(fqn in i.aliases for i in infos.values()):
                    buffers.setdefault(fqn, b)
        for table in (params, buffers):
            for fqn in list(table):
                info = infos.get(fqn)
                for alias in info.aliases if info is not None else ():
                    table[alias] = table[fqn]
        if user and self.shards is not None:
            params = {fqn: self.shards.shard_of(p) for fqn, p in params.items()}
        non_persistent = {fqn for fqn, info in infos.items() if not info.persistent}
        for fqn, b in self.module.named_buffers(remove_duplicate=False):
            mod, _, leaf = fqn.rpartition(".")
            owner = self.module.get_submodule(mod) if mod else self.module
            if leaf in owner._non_persistent_buffers_set:
                non_persistent.add(fqn)
        return params, buffers, non_persistent

    def _use_local_tensors(self, runtime: RankRuntime, split: Any) -> None:
        params, buffers, non_persistent = self.local_tensors(runtime, split)
        self.local_parameters = list({id(p): p for p in params.values()}.values())
        self._adopt(params, buffers, non_persistent)

    # ------------------------------------------------------------ microbatches
    def check_target(self, target: Any) -> None:
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

    def check_output_rank(self, output_rank: Any) -> None:
        if output_rank is None:
            return
        if (not isinstance(output_rank, int) or isinstance(output_rank, bool) or
                not 0 <= output_rank < self.pp_size):
            raise ValueError(f"output_rank={output_rank!r} must be None (every rank) or a rank "
                             f"of the pipeline group, 0 to {self.pp_size - 1}")

    def microbatches(self, args: tuple, kwargs: dict, target: Any = None,
                     microbatches: Any = None, targets: Any = None, *, loss: bool = True
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
                self.check_target(target)
                kwargs = training_kwargs(self.module, kwargs)
            # A sliced batch (x[:, :n]) laid out dense, as its microbatches'
            # capture and programs expect (NOTE [Contiguous microbatches]).
            args, kwargs = contiguous_inputs(args, kwargs)
            target = contiguous_tree(target)
            m = self.num_microbatches
            args0, kwargs0 = first_microbatch(args, kwargs, m)
            if target is not None:  # split alike, or it would broadcast silently
                check_target_batch(args, kwargs, target)
            split_targets = split_tree(target, m, "target") if target is not None else [None] * m
            rt = self.build(args0, kwargs0)
            return rt, self.split.named_microbatches(args, kwargs, m), split_targets
        mbs, split_targets = explicit_microbatches(microbatches, targets, args=args,
                                                   kwargs=kwargs, target=target)
        if loss:
            mbs = [(a, training_kwargs(self.module, k)) for a, k in mbs]
            given = {t is not None for t in split_targets}
            if len(given) > 1:
                raise ValueError("targets= has a target for some microbatches and None for "
                                 "others: give every microbatch its target, or none")
            self.check_target(split_targets[0])
        for i, ((a, k), t) in enumerate(zip(mbs, split_targets)):
            if t is not None:
                try:
                    check_target_batch(a, k, t)
                except ValueError as e:
                    raise ValueError(f"microbatch {i}: {e}") from None
        rt = self.build(*mbs[0])
        inputs = []
        for i, (a, k) in enumerate(mbs):
            try:
                inputs.append(self.split.named_inputs(a, k))
            except ValueError as e:
                if i == 0:
                    raise
                hint = ("" if self.split.sizes else "; microbatches of different shapes "
                        "need pipeline(dynamic=True) (one capture for every size), or pad them "
                        "to one shape")
                raise ValueError(f"microbatch {i}: {e}{hint}") from None
        why = microbatch_misfit(rt, self.split, inputs, split_targets)
        if why is not None:
            raise ValueError(why)
        return rt, inputs, split_targets

    # ------------------------------------------------------------ call kinds
    @pipeline_call("step")
    @_holding_parameters
    def step(self, args: tuple, kwargs: dict, target: Any = None, microbatches: Any = None,
             targets: Any = None) -> torch.Tensor:
        """A training step (``Pipeline.step``'s contract): plans first under
        ``plan="auto"``; returns the loss on every rank and leaves this rank's
        gradients accumulated in its parameters."""
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipeline.step() runs backward and needs grad mode, but it was "
                               "called under torch.no_grad() or inference_mode(); use "
                               "eval_step() for the loss without backward, or the pipeline "
                               "call for outputs")
        if microbatches is None:  # (use_cache=False, graph/hf.py: the plan's profile too)
            kwargs = training_kwargs(self.module, kwargs)
        if self.config.plan == "auto":
            self.plan_auto(args, kwargs, target, microbatches)
        rt, inputs, targets = self.microbatches(args, kwargs, target, microbatches, targets)
        rt.use_microbatches(inputs)  # (before building: the programs' sizes)
        rt.prepare_programs(inputs, targets, self.config.loss_fn)
        params = self.local_parameters
        # NOTE [Token-weighted losses] (training.py): gradients held before the
        # step are kept aside while the loss may be token-weighted.
        before = training.grads_before(params) if self.weighted is not False else {}
        # Scalar losses so far: gradients they accumulated could not be told
        # from a pair's increment, were the loss to switch (refused below).
        unsplittable = self.weighted is False and any(p.grad is not None for p in params)
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
        self.weighted = tokens is not None
        self.last_token_count = tokens
        return loss

    @pipeline_call("eval")
    @_holding_parameters
    def eval_step(self, args: tuple, kwargs: dict, target: Any = None,
                  microbatches: Any = None, targets: Any = None) -> torch.Tensor:
        """Forward and loss of every microbatch without autograd state
        (``Pipeline.eval_step``'s contract); the mean loss on every rank."""
        with torch.no_grad():
            rt, inputs, targets = self.microbatches(args, kwargs, target, microbatches, targets)
            run_step(rt, EVAL, self.calls, self.device, inputs=inputs, targets=targets,
                     loss_fn=self.config.loss_fn)
            try:
                loss, self.last_token_count = training.step_loss(rt, self.device)
                return loss
            finally:
                rt.runner.end_step()

    @pipeline_call("forward")
    @_holding_parameters
    def forward(self, args: tuple, kwargs: dict, output_rank: int | None = None,
                microbatches: Any = None) -> Any:
        """Forward only (``Pipeline.forward``'s contract): the model's output,
        merged over the microbatches (or their list with ``microbatches``), on
        ``output_rank`` (None: every rank)."""
        self.check_output_rank(output_rank)
        inputs, flats = self._forward_outputs(args, kwargs, microbatches, output_rank)
        outputs = [self.split.captured.rebuild_output(flat, inputs[k])
                   for k, flat in enumerate(flats) if flat is not None]
        if microbatches is not None:
            return outputs or None
        return merge_microbatches(outputs) if outputs else None

    @pipeline_call("forward")
    @_holding_parameters
    def forward_flat(self, args: tuple, kwargs: dict) -> list[tuple]:
        """Forward only, per microbatch the last stage's flat outputs on every
        rank (the compile door merges them as its graph returns them)."""
        return self._forward_outputs(args, kwargs, None, None)[1]

    def _forward_outputs(self, args: tuple, kwargs: dict, microbatches: Any,
                         output_rank: int | None) -> tuple[list[dict[str, Any]], list[Any]]:
        """The forward part over a call's microbatches: their named inputs and,
        per microbatch, its flat outputs on ``output_rank`` (None elsewhere)."""
        rt, inputs, _ = self.microbatches(args, kwargs, None, microbatches, None, loss=False)
        run_step(rt, FORWARD, self.calls, self.device, inputs=inputs,
                 targets=[None] * len(inputs))
        try:
            return inputs, [self._delivered(rt, k, output_rank) for k in range(len(inputs))]
        finally:
            rt.runner.end_step()

    @pipeline_call("forward")
    @_holding_parameters
    def forward_keeping_graph(self, args: tuple, kwargs: dict) -> list[tuple]:
        """The forward part of a step whose backward :meth:`backward` runs
        later, from the gradients of the outputs (the compile door's
        forward with grad); per microbatch the flat outputs on every rank. A
        forward never backpropagated is dropped by the next one."""
        rt = self.build_for_batch(args, kwargs)
        m = self.num_microbatches
        inputs = self.split.named_microbatches(args, kwargs, m)
        rt.runner.end_step()  # a forward never backpropagated leaves state behind
        run_step(rt, FORWARD_KEEPING_GRAPH, self.calls, self.device, inputs=inputs)
        return [self._delivered(rt, k, None) for k in range(m)]

    @pipeline_call("backward")
    @_holding_parameters
    def backward(self, output_grads: list[list[torch.Tensor | None]]) -> None:
        """The backward part after :meth:`forward_keeping_graph`:
        ``output_grads[k]`` are the gradients of microbatch k's flat outputs;
        this rank's gradients accumulate into its parameters."""
        rt = self.runtime
        run_step(rt, BACKWARD, self.calls, self.device, output_grads=output_grads)
        rt.runner.end_step()

    def _delivered(self, rt: RankRuntime, k: int, output_rank: int | None) -> Any:
        return deliver_outputs(rt, self.split.ir, rt.runner.outputs.get(k), output_rank,
                               self.device, k)

    # ------------------------------------------------------------ plans
    def recompute_modules(self, args: tuple, kwargs: dict) -> list[str]:
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
                if not self.meta:
                    with model_state_kept(self.module):
                        order = call_order(self.module, tuple(args), dict(kwargs))
                units = find_units(self.module, order)
            modules = [name for name, _ in self.module.named_modules()]
            fqns += stage_modules(units, plan.split_points, plan.recompute, modules)
        return fqns

    @pipeline_call("step")
    def plan_auto(self, args: tuple, kwargs: dict, target: Any = None,
                  microbatches: Any = None) -> None:
        """plan="auto" at the first step: profile on this batch, search, and
        take the plan as if given (collective over the pipeline group, and the
        same plan on every rank of the job; torch_mpmd.planning.auto). No-op
        once planned."""
        from torch_mpmd.planning.auto import plan as make_plan

        if self.config.plan != "auto":
            return
        if microbatches is not None:
            raise ValueError("plan='auto' plans from a batch: the first step() takes the batch "
                             "(its args and target=), not microbatches=[...]")
        self.check_target(target)
        c = self.constraints
        mesh = self.config.mesh
        chosen = make_plan(self.module, tuple(args), dict(kwargs),
                           loss_fn=self.config.loss_fn, target=target,
                           group=mesh if mesh is not None else self.group,
                           memory_limit=self.config.memory_limit,
                           schedules=c.get("schedule"),
                           num_microbatches=c.get("num_microbatches"),
                           stages_per_rank=c.get("stages_per_rank"),
                           compile=self.config.compile,
                           # Fixed when the pipeline was built (its parameters are
                           # shards, or not, since): NOTE [Plans in the config].
                           data_parallel=self.config.data_parallel,
                           # Every wait of the profile and search (NOTE [Named
                           # waits] in named_waits.py): the capture's bound.
                           timeout=(self.startup_timeout if self.startup_timeout is not None
                                    else self.timeout),
                           trials=self.config.plan_trials, trials_again=self.config.plan_again)
        config = PipelineConfig.from_settings(self.config, plan=chosen)
        config.check_schedule_at(self.pp_size)
        self.config = config
        self.num_microbatches = config.num_microbatches
        if self.rank == 0:
            _log.info("torch_mpmd: plan='auto' chose %s; %s", chosen.describe().splitlines()[0],
                      chosen.planning_summary())

