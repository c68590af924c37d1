"""ProgramRunner: the executor's StageRunner over functional stage programs.

Training steps call each local stage's F, B, I and W programs (programs.py)
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

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_mpmd.programs import (Compiler, ProgramsUnsupported, StagePrograms,
                                 build_stage_programs, flatten_target, loss_tail)
from torch_mpmd.runner import EdgeLayout, StageRunner, _label, _seed_rng, stage_seed

__all__ = ["ProgramRunner"]

log = logging.getLogger("torch_mpmd")
_NO_LABEL = contextlib.nullcontext()  # reusable: nullcontext keeps no state


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """p.grad += g, as the engine's AccumulateGrad does (a new .grad takes the
    parameter's layout)."""
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
        self._built: dict[tuple, dict[int, StagePrograms] | None] = {}
        self._functional = False
        self._targets_flat: list[list[torch.Tensor]] = []
        self._tangent_plan: dict[int, list[tuple[int, int, int]]] = {}

    # ------------------------------------------------------------ building
    def prepare(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                loss_fn: Callable | None) -> bool:
        """Build (or reuse) the programs for a training step with these
        microbatches; True when this call built them (the caller then waits for
        the other ranks, which may still be compiling)."""
        target0 = targets[0] if targets else None
        leaves, spec = pytree.tree_flatten(target0) if target0 is not None else ([], None)
        key = (id(loss_fn), str(spec),
               tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                     for t in leaves))
        if key in self._built:
            self.programs = self._built[key]
            return False
        programs: dict[int, StagePrograms] | None = {}
        try:
            for s, st in sorted(self.stages.items()):
                programs[s] = self._build(s, st, inputs[0], leaves, spec, loss_fn)
        except ProgramsUnsupported as e:
            programs = None
            self.fallback_reason = f"stage {s}: {e}"
            log.warning("torch_mpmd: rank %d runs its stages under autograd (%s)", self.rank,
                        self.fallback_reason)
        self._built[key] = programs
        self.programs = programs
        return True

    def _build(self, s: int, st: Any, inputs0: Mapping[str, Any], target_leaves: list,
               target_spec: Any, loss_fn: Callable | None) -> StagePrograms:
        sig = st.signature
        last = s == self.num_stages - 1
        grad_nodes = {v.node for p in st.producers for v in self.layout.backward[(p, s)]}
        received = []
        for v in sig.received:
            meta = self.layout.meta[v.node]
            received.append(torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
        if any(not isinstance(t, torch.Tensor) for t in target_leaves):
            raise ProgramsUnsupported("the target has non-tensor leaves")
        kinds = self.kinds[s]
        if self.compiler is not None and self.rank == 0:
            print(f"[torch_mpmd] compiling stage {s}: "
                  f"{' '.join(k for k in 'FBIW' if k in kinds)} ...", flush=True)
        return build_stage_programs(
            s, st.module, num_user=len(sig.user_inputs), received=received,
            received_grad=[v.node in grad_nodes for v in sig.received],
            user_inputs=[inputs0[n] for n in sig.user_inputs], num_sent=len(sig.sent),
            loss=(loss_tail(loss_fn, self.rebuild_output, sig.user_inputs, target_spec)
                  if last else None),
            target_leaves=target_leaves if last else [], split_backward="I" in kinds,
            run_backward="B" in kinds, compiler=self.compiler)

    # ------------------------------------------------------------ per step
    def begin_step(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                   loss_fn: Callable | None, seed: int, step: int, *, training: bool,
                   outputs_as_roots: bool = False) -> None:
        super().begin_step(inputs, targets, loss_fn, seed, step, training=training,
                           outputs_as_roots=outputs_as_roots)
        self._functional = training and not outputs_as_roots and self.programs is not None
        if self._functional and (self.num_stages - 1) in self.stages:
            self._targets_flat = [flatten_target(t) for t in self.targets]

    # ------------------------------------------------------------ executor API
    def forward(self, stage: int, mb: int, inputs: list[list[torch.Tensor]]) -> Any:
        if not self._functional:
            return super().forward(stage, mb, inputs), None
        st = self.stages[stage]
        prog = self.programs[stage]
        received: list[Any] = [None] * prog.num_received
        for plan, tensors in zip(st.receive_plan, inputs):
            for (slot, _grad, _clone), t in zip(plan, tensors):
                received[slot] = t
        mb_inputs = self.inputs[mb]
        args = [*prog.state_tensors, *map(mb_inputs.__getitem__, st.signature.user_inputs),
                *received]
        last = stage == self.num_stages - 1
        if last:
            args.extend(self._targets_flat[mb])
        if prog.draws_rng:
            _seed_rng(stage_seed(self.seed, self.step, stage, mb))
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.no_grad(), (_label(stage, "F", mb) if profiling else _NO_LABEL):
            outs = prog.forward(*args)
            for i, t in prog.mutations:
                t.copy_(outs[i])
        off = prog.output_offset
        saved = list(outs[off + prog.num_outputs:])
        live = self.live_bytes[stage] + prog.saved_bytes
        self.live_bytes[stage] = live
        if live > self.peak_bytes[stage]:
            self.peak_bytes[stage] = live
        if last:
            self.losses[mb] = outs[off]
            return [], saved
        return [[outs[off + i] for i in idx] for idx in st.send_plan], saved

    def _tangents(self, stage: int, mb: int, grads: list[list[torch.Tensor]],
                  prog: StagePrograms) -> list[torch.Tensor]:
        st = self.stages[stage]
        total: dict[int, torch.Tensor] = {}
        if stage == self.num_stages - 1:  # the loss: 1/m, for the mean over microbatches
            total[0] = self._loss_grad(self.losses[mb])
        for c, tensors in zip(st.consumers, grads):
            for v, g in zip(self.layout.backward[(stage, c)], tensors):
                k = st.sent_index[v.node]
                total[k] = g if k not in total else total[k] + g
        try:
            return [total[k] if k >= 0 else prog.zero_tangents[i]
                    for i, k in enumerate(prog.tangent_outputs)]
        except KeyError as e:
            raise RuntimeError(f"stage {stage}: no gradient arrived for sent value "
                               f"{st.signature.sent[e.args[0]].name!r}") from None

    def _send_grads(self, stage: int, by_slot: dict[int, torch.Tensor]) -> list[list[torch.Tensor]]:
        st = self.stages[stage]
        out = []
        for p in st.producers:
            row = []
            for v in self.layout.backward[(p, stage)]:
                g = by_slot.get(st.received_index[v.node])
                if g is None:  # the value did not reach the loss: a zero gradient
                    meta = self.layout.meta[v.node]
                    g = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
                row.append(g)
            out.append(row)
        return out

    def backward(self, stage: int, mb: int, grads: list[list[torch.Tensor]], input_only: bool,
                 state: list[torch.Tensor] | None = None) -> Any:
        if not self._functional:
            return super().backward(stage, mb, grads, input_only), None
        prog = self.programs[stage]
        tangents = self._tangents(stage, mb, grads, prog)
        profiling = torch.autograd.profiler._is_profiler_enabled
        label = _label(stage, "I" if input_only else "B", mb) if profiling else _NO_LABEL
        with torch.no_grad(), label:
            if input_only:
                # The forward's saved values go now; the carry lives until W.
                live = self.live_bytes[stage] + prog.carry_bytes - prog.saved_bytes
                self.live_bytes[stage] = live
                if live > self.peak_bytes[stage]:
                    self.peak_bytes[stage] = live
                outs = prog.input_backward(*state, *tangents)
                n = len(prog.i_input_slots)
                by_slot = dict(zip(prog.i_input_slots, outs[:n]))
                carry = list(outs[n:])
            else:
                self.live_bytes[stage] -= prog.saved_bytes
                outs = prog.backward(*state, *tangents)
                for p, pos in prog.param_grads:
                    _accumulate(p, outs[pos])
                by_slot = {slot: outs[pos] for slot, pos in prog.input_grads}
                carry = None
        return self._send_grads(stage, by_slot), carry

    def backward_weight(self, stage: int, mb: int, carry: list[torch.Tensor] | None = None
                        ) -> None:
        if not self._functional:
            return super().backward_weight(stage, mb)
        prog = self.programs[stage]
        self.live_bytes[stage] -= prog.carry_bytes
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.no_grad(), (_label(stage, "W", mb) if profiling else _NO_LABEL):
            grads = prog.weight_backward(*carry)
            for p, g in zip(prog.w_params, grads):
                _accumulate(p, g)
        return None
