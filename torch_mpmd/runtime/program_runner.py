"""ProgramRunner: the executor's StageRunner over functional stage programs.

Training steps call each local stage's F, B, I and W programs (programs/stage_programs.py)
directly: no autograd engine, no graph kept between actions. What a forward
saves for its backward, and the carry I hands to W, are returned to the C++
executor, which holds them per (stage, microbatch) and frees them at their
last use (NOTE [Runner state] in csrc/runtime/executor.h). Weight gradients
are accumulated into the parameters' ``.grad`` as the autograd engine would.

Forward-only runs (inference) and the torch.compile door's runs (outputs as
roots) keep the autograd runner's path (runner.StageRunner, the base class),
and so does a rank whose stages cannot be traced into programs
(ProgramsUnsupported: a warning says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from torch_mpmd.programs.stage_programs import (Compiler, ProgramsUnsupported, StagePrograms,
                                 build_stage_programs, flatten_target, loss_tail)
from torch_mpmd.programs.loss_state import describe_change, loss_state
from torch_mpmd.runtime.runner import EdgeLayout, StageRunner, _label, _seed_rng, stage_seed

__all__ = ["ProgramRunner", "MAX_LOSS_STATE_BUILDS"]

# Builds one loss_fn may cause by changed Python state (NOTE [Loss state])
# before its rank runs under autograd instead: a value changed at every step
# would otherwise rebuild (and recompile) the programs at every step.
MAX_LOSS_STATE_BUILDS = 8

log = logging.getLogger("torch_mpmd")


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """p.grad += g, as the engine's AccumulateGrad does (a new .grad takes the
    parameter's layout). For a DTensor ``p`` (tensor parallel), ``g`` is the
    gradient of its local shard (NOTE [DTensor parameters in programs]) and
    ``p.grad`` a DTensor of ``p``'s placements, as eager DTensor gives."""
    if isinstance(p, DTensor):
        if p.grad is None:
            local = p._local_tensor
            if not (g.stride() == local.stride() and g.dtype == local.dtype):
                g = torch.empty_like(local).copy_(g)
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        else:
            p.grad._local_tensor.add_(g)
        return
    if p.grad is None:
        if g.stride() == p.stride() and g.dtype == p.dtype:
            p.grad = g
        else:
            p.grad = torch.empty_like(p).copy_(g)
    else:
        p.grad.add_(g)


class _AutogradView:
    """The runner as the executor sees it on the autograd path only
    (returns_state False): for executors that run part of a schedule
    (forward-only, backward-only), whose state the runner keeps itself."""

    returns_state = False

    def __init__(self, runner: "ProgramRunner") -> None:
        self._runner = runner

    def forward(self, stage: int, mb: int, inputs: Any) -> Any:
        return StageRunner.forward(self._runner, stage, mb, inputs)

    def backward(self, stage: int, mb: int, grads: Any, input_only: bool) -> Any:
        return StageRunner.backward(self._runner, stage, mb, grads, input_only)

    def backward_weight(self, stage: int, mb: int) -> None:
        StageRunner.backward_weight(self._runner, stage, mb)

    def reduce_grad(self, stage: int) -> None:
        self._runner.reduce_grad(stage)

    def unshard(self, stage: int) -> None:
        self._runner.unshard(stage)

    def reshard(self, stage: int) -> None:
        self._runner.reshard(stage)

    @property
    def error(self) -> BaseException | None:
        return self._runner.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self._runner.error = value


class ProgramRunner(StageRunner):
    """Runs this rank's stages as functional programs (see the module docstring)."""

    returns_state = True  # read by the C++ trampoline (csrc/python/runtime/module.cpp)

    def __init__(self, modules: Mapping[int, torch.fx.GraphModule], signatures: Sequence[Any],
                 layout: EdgeLayout, producers: Sequence[Sequence[int]],
                 consumers: Sequence[Sequence[int]], rebuild_output: Callable, *,
                 split_backward: bool = False, compiler: Compiler | None = None,
                 rank: int = 0, device: torch.device | None = None,
                 kinds: Mapping[int, set[str]] | None = None) -> None:
        self.programs: dict[int, StagePrograms] | None = None  # (begin_step reads it)
        super().__init__(modules, signatures, layout, producers, consumers, rebuild_output,
                         split_backward=split_backward)
        self.split_backward = split_backward
        self.autograd_view = _AutogradView(self)
        # Which of F, B, I, W each local stage runs (dualpipev mixes B with I/W):
        # only those programs are built and compiled.
        self.kinds = {s: set(kinds[s]) if kinds is not None else
                      ({"F", "I", "W"} if split_backward else {"F", "B"}) for s in modules}
        self.compiler = compiler
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.fallback_reason: str | None = None
        # Set by the compile door, which hands the step's gradients to autograd
        # afterwards (where parameter hooks run): hooks do not force a fallback.
        self.hooks_run_later = False
        self.shapes: Any = None  # SymbolicShapes of a dynamic capture (set by the runtime)
        self._target_fakes: list[torch.Tensor] = []  # the programs' symbolic target
        self._built: dict[tuple, dict[int, StagePrograms] | None] = {}
        self._functional = False
        self._targets_flat: list[list[torch.Tensor]] = []
        self._plans: dict[int, _StagePlan] = {}
        # NOTE [Loss state]: loss functions found to change state when called,
        # and the states each was built for.
        self._stateful_losses: dict[int, str] = {}  # id(loss_fn) -> why
        self._loss_builds: dict[int, list[tuple]] = {}
        self._built_bases: set[tuple] = set()  # the keys built, less their loss state

    # ------------------------------------------------------------ building
    def prepare(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                loss_fn: Callable | None) -> bool:
        """Build (or reuse) the programs for a training step with these
        microbatches; True when this call built them for a key every rank
        builds for (the caller then waits for the other ranks, which may still
        be compiling); False when it reused them, or rebuilt the last stage's
        for changed loss state (NOTE [Loss state]), which no other rank does."""
        target0 = targets[0] if targets else None
        leaves, spec = pytree.tree_flatten(target0) if target0 is not None else ([], None)
        grad_inputs = sorted(n for n, v in (inputs[0] if inputs else {}).items()
                             if isinstance(v, torch.Tensor) and v.requires_grad)
        dynamic = self.shapes is not None  # programs for any sizes: key by rank, dtype
        if dynamic and self._target_fakes:
            self._check_target(inputs[0], leaves)
            if self._mb_sizes is not None:  # microbatches of their own sizes: each target
                for k in range(1, len(inputs)):
                    self._check_target(inputs[k], pytree.tree_leaves(targets[k]), k)
        # NOTE [Loss state]: the last stage's programs trace loss_fn with the
        # Python values it reads: they are part of the key (on that rank only).
        last = (self.num_stages - 1) in self.stages
        stateful = self._stateful_losses.get(id(loss_fn)) if last else None
        state = (() if not last else loss_state(loss_fn) if stateful is None else ("stateful",))
        key = (id(loss_fn), str(spec),
               tuple(((t.dim() if dynamic else tuple(t.shape)), t.dtype)
                     if isinstance(t, torch.Tensor) else repr(t) for t in leaves),
               tuple(grad_inputs), state)
        if key in self._built:
            if self.programs is not self._built[key]:
                self.programs = self._built[key]
                self._plans = {}
            self._check_program_guards(inputs)
            return False
        programs: dict[int, StagePrograms] | None = {}
        self.fallback_reason = None  # of this build (an earlier key's may differ)
        try:
            s = self.num_stages - 1  # (named by the fallback reason)
            if stateful is not None:
                raise ProgramsUnsupported(stateful)
            if last and self._built:
                self._check_loss_rebuilds(loss_fn, state)
            for s, st in sorted(self.stages.items()):
                wanted = [n for n in st.signature.user_inputs if n in grad_inputs]
                if wanted:  # the programs return no input gradients
                    raise ProgramsUnsupported(f"user input(s) {', '.join(wanted)} require grad")
                # Sharded parameters are traced (and compiled) with their full
                # values' layout, not their stand-ins' (every replica builds at
                # the same step, so these gathers pair up).
                if self.sharded is not None:
                    self.sharded.ready(s)
                try:
                    programs[s] = self._build(s, st, inputs[0], leaves, spec, loss_fn)
                finally:
                    if self.sharded is not None:
                        self.sharded.reshard(s)
                if s == self.num_stages - 1:
                    after = loss_state(loss_fn)
                    if after != state:  # tracing it changed what it reads: side effects
                        self._stateful_loss(loss_fn, (
                            f"loss_fn changes Python state when called "
                            f"({describe_change(state, after)}), which a traced program "
                            "would not repeat: it runs at every microbatch under autograd"))
        except ProgramsUnsupported as e:
            programs = None
            self.fallback_reason = f"stage {s}: {e}"
            log.warning("torch_mpmd: rank %d runs its stages under autograd (%s)", self.rank,
                        self.fallback_reason)
        self._built[key] = programs
        self.programs = programs
        self._plans = {}
        # A build for changed loss state alone is this rank's (the last
        # stage's): the other ranks build nothing and must not wait for it.
        fresh = key[:-1] not in self._built_bases
        self._built_bases.add(key[:-1])
        self._check_program_guards(inputs)
        return fresh

    def _check_program_guards(self, inputs: Sequence[Mapping[str, Any]]) -> None:
        """A ValueError naming the first microbatch whose sizes break a guard
        that tracing this rank's programs added (NOTE [Program guards] in
        graph/shapes.py), before anything runs: its programs would compute
        another branch than eager PyTorch."""
        if self.shapes is None or self.programs is None:
            return
        for k, named in enumerate(inputs):
            why = self.shapes.program_violation(self.shapes.key(named))
            if why is not None:
                raise ValueError(
                    f"microbatch {k} has sizes {dict(zip(self.shapes.names, self.shapes.key(named)))}"
                    f" that this rank's stage programs (built from the sizes of an earlier "
                    f"microbatch) cannot run: {why}. A Python branch on a size (an `if` on "
                    "t.shape[...] in loss_fn or forward) takes another way for these sizes; "
                    "make it a tensor expression (torch.where), or pad the microbatches to "
                    "one side of it")

    def _check_loss_rebuilds(self, loss_fn: Callable | None, state: tuple) -> None:
        """Count the builds made for changed loss state (NOTE [Loss state]);
        past :data:`MAX_LOSS_STATE_BUILDS` for one ``loss_fn``, a
        ProgramsUnsupported: the state changes at every step, and the rank
        runs under autograd (loss_fn called at every microbatch)."""
        builds = self._loss_builds.get(id(loss_fn), [])
        builds.append(state)
        self._loss_builds[id(loss_fn)] = builds
        if len(builds) > MAX_LOSS_STATE_BUILDS:
            self._stateful_loss(loss_fn, (
                f"the Python state loss_fn reads changed at {len(builds) - 1} builds "
                f"({describe_change(builds[-2], builds[-1])}): it runs at every microbatch "
                "under autograd"))

    def _stateful_loss(self, loss_fn: Callable | None, reason: str) -> None:
        """From now on this rank runs ``loss_fn`` under autograd; raises
        ProgramsUnsupported(reason)."""
        self._stateful_losses[id(loss_fn)] = reason
        raise ProgramsUnsupported(reason)

    def _build(self, s: int, st: Any, inputs0: Mapping[str, Any], target_leaves: list,
               target_spec: Any, loss_fn: Callable | None) -> StagePrograms:
        sig = st.signature
        last = s == self.num_stages - 1
        grad_nodes = {v.node for p in st.producers for v in self.layout.backward[(p, s)]}
        if any(not isinstance(t, torch.Tensor) for t in target_leaves):
            raise ProgramsUnsupported("the target has non-tensor leaves")
        if self.shapes is not None:  # a dynamic capture: trace with symbolic sizes
            received = [self.shapes.values[v.node] for v in sig.received]
            user = [self.shapes.inputs[n] for n in sig.user_inputs]
            target_leaves = [self.shapes.symbolic_like(t) for t in target_leaves]
            if target_leaves:
                self._target_fakes = target_leaves
        else:
            received = []
            for v in sig.received:
                meta = self.layout.meta[v.node]
                received.append(torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
            user = [inputs0[n] for n in sig.user_inputs]
        kinds = self.kinds[s]
        if self.compiler is not None and self.rank == 0:
            print(f"[torch_mpmd] compiling stage {s}: "
                  f"{' '.join(k for k in 'FBIW' if k in kinds)} ...", flush=True)
        return build_stage_programs(
            s, st.module, num_user=len(sig.user_inputs), received=received,
            received_grad=[v.node in grad_nodes for v in sig.received],
            user_inputs=user, num_sent=len(sig.sent),
            loss=(loss_tail(loss_fn, self.rebuild_output, sig.user_inputs, target_spec)
                  if last else None),
            target_leaves=target_leaves if last else [], split_backward="I" in kinds,
            run_backward="B" in kinds, compiler=self.compiler,
            hooks_run_later=self.hooks_run_later)

    def _check_target(self, inputs0: Mapping[str, Any], leaves: Sequence[Any],
                      mb: int = 0) -> None:
        """The programs relate the target's sizes to the inputs' as they were at
        capture (shapes.SymbolicShapes.symbolic_like): a target that does not
        follow them is an error here, not a wrong loss."""
        key = self.shapes.key(inputs0)
        for i, (fake, t) in enumerate(zip(self._target_fakes, leaves)):
            want = self.shapes.expected(fake, key)
            if isinstance(t, torch.Tensor) and tuple(t.shape) != want:
                raise ValueError(
                    f"target leaf {i} has {f'in microbatch {mb} ' if mb else ''}microbatch "
                    f"shape {tuple(t.shape)}; the stage programs "
                    f"were built for a target of shape {want} with these inputs (its sizes "
                    "follow the inputs' as at capture); keep that relation, or use "
                    "dynamic=False")

    def shapes_changed(self) -> None:
        """The step's sizes differ from the last (a dynamic capture): plans hold
        the transfer shapes, and the saved-bytes measurements are per shape."""
        self._plans = {}
        self._bytes_per_forward.clear()

    # ------------------------------------------------------------ per step
    def begin_step(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                   loss_fn: Callable | None, seed: int, step: int, *, training: bool,
                   outputs_as_roots: bool = False, eval_loss: bool = False) -> None:
        super().begin_step(inputs, targets, loss_fn, seed, step, training=training,
                           outputs_as_roots=outputs_as_roots, eval_loss=eval_loss)
        self._functional = training and not outputs_as_roots and self.programs is not None
        if self._functional and (self.num_stages - 1) in self.stages:
            self._targets_flat = [flatten_target(t) for t in self.targets]

    @property
    def functional(self) -> bool:
        """The step set by begin_step runs the functional programs."""
        return self._functional

    # ------------------------------------------------------------ executor API
    # The common path of each method is written out: it runs once per action,
    # and what it costs beyond the program itself is the runtime's overhead
    # (scripts/bench_runner_overhead.py). Pipeline.step runs the executor
    # under no_grad; a direct caller with grad enabled gets it set here.

    def _plan(self, stage: int) -> "_StagePlan":
        plan = self._plans.get(stage)
        if plan is None:
            plan = self._plans[stage] = _StagePlan.build(self, stage)
        return plan

    def forward(self, stage: int, mb: int, inputs: list[list[torch.Tensor]]) -> Any:
        self._ready(stage, backward=False)
        if not self._functional:
            return super().forward(stage, mb, inputs), None
        plan = self._plans.get(stage) or self._plan(stage)
        prog = plan.prog
        args = prog.state_tensors + [self.inputs[mb][n] for n in plan.user_names]
        if plan.recv:
            received: list[Any] = [None] * prog.num_received
            for slots, tensors in zip(plan.recv, inputs):
                for slot, t in zip(slots, tensors):
                    received[slot] = t
            args += received
        if plan.last:
            args += self._targets_flat[mb]
        if prog.draws_rng:
            _seed_rng(stage_seed(self.seed, self.step, stage, mb))
        if torch.is_grad_enabled() or torch.autograd.profiler._is_profiler_enabled:
            with torch.no_grad(), _label(stage, "F", mb):
                outs = self._run_forward(prog, args)
        else:
            outs = self._run_forward(prog, args)
        self._hold(stage, prog.saved_bytes)
        saved = list(outs[plan.saved_from:])
        if prog.saved_sizes:
            _box(saved, prog.saved_sizes)
        if plan.last:
            self.record_loss(mb, outs[prog.output_offset])
            return [], saved
        return [[outs[i] for i in idx] for idx in plan.sends], saved

    @staticmethod
    def _run_forward(prog: StagePrograms, args: list[Any]) -> Any:
        """F, then its new values of mutated buffers (BatchNorm's running stats)
        written into the stage's own tensors. Under no_grad."""
        outs = prog.forward(*args)
        for i, t in prog.mutations:
            t.copy_(outs[i])
        return outs

    def _tangents(self, stage: int, mb: int, grads: list[list[torch.Tensor]],
                  plan: "_StagePlan") -> list[torch.Tensor]:
        tangents = list(plan.zero_tangents)
        if plan.loss_tangent >= 0:  # the loss: 1/m, for the mean over microbatches
            tangents[plan.loss_tangent] = self._loss_grad(self.losses[mb])
        for (ci, vi, k) in plan.tangent_sources:
            g = grads[ci][vi]
            tangents[k] = g if tangents[k] is None else tangents[k] + g
        if plan.check_tangents and any(t is None for t in tangents):
            k = tangents.index(None)
            raise RuntimeError(f"stage {stage}: no gradient arrived for its output {k}")
        return tangents

    def _send_grads(self, plan: "_StagePlan", by_slot: dict[int, torch.Tensor], mb: int
                    ) -> list[list[torch.Tensor]]:
        out = []
        for row in plan.grad_rows:
            grads = []
            for slot, node, meta in row:
                g = by_slot.get(slot)
                if g is None:  # the value did not reach the loss: a zero gradient
                    if self.mb_meta:  # microbatches of their own sizes
                        meta = self.meta_of(node, mb)
                    g = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
                grads.append(g)
            out.append(grads)
        return out

    def backward(self, stage: int, mb: int, grads: list[list[torch.Tensor]], input_only: bool,
                 state: list[torch.Tensor] | None = None) -> Any:
        self._ready(stage, backward=True)
        if not self._functional:
            return super().backward(stage, mb, grads, input_only), None
        plan = self._plans.get(stage) or self._plan(stage)
        tangents = self._tangents(stage, mb, grads, plan)
        if torch.is_grad_enabled() or torch.autograd.profiler._is_profiler_enabled:
            with torch.no_grad(), _label(stage, "I" if input_only else "B", mb):
                by_slot, carry = self._backward(plan.prog, stage, state, tangents, input_only)
        else:
            by_slot, carry = self._backward(plan.prog, stage, state, tangents, input_only)
        return (self._send_grads(plan, by_slot, mb) if plan.grad_rows else []), carry

    def _backward(self, prog: StagePrograms, stage: int, state: list[torch.Tensor],
                  tangents: list[torch.Tensor], input_only: bool
                  ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor] | None]:
        if input_only:
            # The forward's saved values go now; the carry lives until W.
            self._hold(stage, prog.carry_bytes - prog.saved_bytes)
            if prog.saved_sizes:
                state = _unbox(state, prog.saved_sizes)
            outs = prog.input_backward(*state, *tangents)
            n = len(prog.i_input_slots)
            carry = list(outs[n:])
            if prog.carry_sizes:
                _box(carry, prog.carry_sizes)
            return dict(zip(prog.i_input_slots, outs[:n])), carry
        self._hold(stage, -prog.saved_bytes)
        if prog.saved_sizes:
            state = _unbox(state, prog.saved_sizes)
        outs = prog.backward(*state, *tangents)
        for p, pos in prog.param_grads:
            _accumulate(p, outs[pos])
        return {slot: outs[pos] for slot, pos in prog.input_grads}, None

    def backward_weight(self, stage: int, mb: int, carry: list[torch.Tensor] | None = None
                        ) -> None:
        self._ready(stage, backward=True)
        if not self._functional:
            return super().backward_weight(stage, mb)
        prog = self.programs[stage]
        self._hold(stage, -prog.carry_bytes)
        if prog.carry_sizes:
            carry = _unbox(carry, prog.carry_sizes)
        if torch.is_grad_enabled() or torch.autograd.profiler._is_profiler_enabled:
            with torch.no_grad(), _label(stage, "W", mb):
                grads = prog.weight_backward(*carry)
                for p, g in zip(prog.w_params, grads):
                    _accumulate(p, g)
        else:
            grads = prog.weight_backward(*carry)
            for p, g in zip(prog.w_params, grads):
                _accumulate(p, g)
        return None


def _box(values: list[Any], positions: Sequence[int]) -> None:
    """Sizes (ints) at ``positions`` as 0-dim tensors: the executor holds tensors."""
    for i in positions:
        values[i] = torch.tensor(values[i])


def _unbox(values: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    out = list(values)
    for i in positions:
        out[i] = int(out[i])
    return out


@dataclass(slots=True)
class _StagePlan:
    """Per stage, what forward/backward look up on every action, resolved once
    per set of programs: argument names and slots, output positions."""

    prog: StagePrograms
    user_names: list[str]
    recv: list[list[int]]              # per producer: received slots of its values
    last: bool
    sends: list[list[int]]             # per consumer: F output positions to send
    saved_from: int                    # F outputs from here on are `saved`
    zero_tangents: list[torch.Tensor | None]  # start of each backward's tangents
    tangent_sources: list[tuple[int, int, int]]  # (consumer, value, tangent position)
    check_tangents: bool               # some tangent has no source: check each step
    loss_tangent: int                  # the loss's tangent position (-1: not the last stage)
    grad_rows: list[list[tuple[int, int, torch.Tensor]]]  # per producer: (slot, node, meta)

    @classmethod
    def build(cls, runner: "ProgramRunner", stage: int) -> "_StagePlan":
        st = runner.stages[stage]
        prog = runner.programs[stage]
        layout = runner.layout
        off = prog.output_offset
        position = {k: i for i, k in enumerate(prog.tangent_outputs) if k >= 0}
        sources = []
        for ci, c in enumerate(st.consumers):
            for vi, v in enumerate(layout.backward[(stage, c)]):
                k = position.get(st.sent_index[v.node])
                if k is not None:
                    sources.append((ci, vi, k))
        zeros = [prog.zero_tangents.get(i) for i in range(len(prog.tangent_outputs))]
        last = stage == runner.num_stages - 1
        loss_tangent = position.get(0, -1) if last else -1  # the loss is output 0
        covered = {k for _, _, k in sources} | set(prog.zero_tangents) | {loss_tangent}
        return cls(
            prog=prog, user_names=list(st.signature.user_inputs),
            recv=[[slot for slot, _, _ in plan] for plan in st.receive_plan], last=last,
            sends=[[off + i for i in idx] for idx in st.send_plan],
            saved_from=off + prog.num_outputs, zero_tangents=zeros, tangent_sources=sources,
            check_tangents=len(covered - {-1}) < len(prog.tangent_outputs),
            loss_tangent=loss_tangent,
            grad_rows=[[(st.received_index[v.node], v.node, layout.meta[v.node])
                        for v in layout.backward[(p, stage)]] for p in st.producers])
