"""``torch.compile(backend="mpmd")`` over several ranks.

The compiled forward runs the stages as a GPipe pipeline over the process
group (forward part of the schedule only), then broadcasts the full output
from the last stage's rank, so every rank returns it. The pipeline is an
autograd Function: ``backward()`` on anything computed from the output runs
the backward part of the schedule on every rank (each rank must call it, as
they all called forward), which accumulates gradients into each rank's
local-stage parameters directly; tied parameters are summed across ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.microbatch import split_microbatches
from torch_mpmd.runtime import RankRuntime, StagedModel
from torch_mpmd.stage import StageSignature

__all__ = ["CompiledPipeline", "microbatch_examples"]


def microbatch_examples(stages: Sequence[torch.nn.Module], signatures: Sequence[StageSignature],
                        inputs: Mapping[str, Any]) -> dict[int, Any]:
    """Example values (fake tensors) of every cross-stage value for ``inputs``,
    found by running the stages under a FakeTensorMode (no real compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}
    values: dict[int, Any] = {}
    with mode, torch.enable_grad():  # requires_grad decides which values carry gradients
        for module, sig in zip(stages, signatures):
            args = [fake[n] for n in sig.user_inputs] + [values[v.node] for v in sig.received]
            out = module(*args)
            for v, o in zip(sig.sent, out):
                values[v.node] = o
    return values


class _PipelinedForward(torch.autograd.Function):
    """Forward: the pipeline's forward part; backward: its backward part."""

    @staticmethod
    def forward(ctx: Any, pipe: "CompiledPipeline", *params: torch.Tensor) -> Any:
        ctx.pipe = pipe
        outputs = pipe.run_forward()
        ctx.generation = pipe._generation
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.generation != ctx.pipe._generation:
            # The runner keeps one forward's state per (stage, microbatch): a later
            # forward replaced this one's. Every rank sees the same calls, so every
            # rank raises here, before any transfer.
            raise RuntimeError(
                "torch.compile(backend='mpmd') over several ranks keeps the pipeline state of "
                "the latest forward only: call backward() on an output before the next "
                "forward with grad enabled (run forwards you do not backpropagate under "
                "torch.no_grad())")
        ctx.pipe.run_backward(grads)
        return (None,) * (1 + ctx.pipe.num_param_inputs)


class CompiledPipeline:
    """The callable the backend returns when the world size is above 1."""

    def __init__(self, stages: list[torch.fx.GraphModule], signatures: list[StageSignature],
                 plan: Any, tensors: dict[str, torch.Tensor], output_examples: Sequence[Any],
                 example_inputs: Mapping[str, Any], *, num_microbatches: int,
                 timeout: datetime.timedelta, group: Any = None) -> None:
        self.m = num_microbatches
        self.output_examples = list(output_examples)
        for i, ex in enumerate(self.output_examples):
            if not isinstance(ex, torch.Tensor):
                raise ValueError(f"output {i} of the compiled graph is a {type(ex).__name__}; "
                                 "the mpmd backend over several ranks returns tensors only")
            if self.m > 1 and ex.dim() == 0:
                raise ValueError(f"output {i} of the compiled graph is a 0-dim tensor, which "
                                 f"cannot be merged from num_microbatches={self.m} "
                                 "microbatches; use num_microbatches=1 or return per-sample "
                                 "values")
        # Real zeros of the example shapes: Dynamo may hand over fake tensors.
        zeros = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                 for k, v in example_inputs.items()}
        mb_inputs = split_microbatches((), zeros, None, self.m)[0][1]
        try:
            examples = microbatch_examples(stages, signatures, mb_inputs)
        except Exception as e:  # noqa: BLE001  (any shape error of the specialized graph)
            raise ValueError(
                f"the graph Dynamo captured does not run on microbatches of the batch "
                f"(num_microbatches={self.m}): {type(e).__name__}: {str(e)[:300]}; use "
                "num_microbatches=1, or torch_mpmd.pipeline(), which captures at the "
                "microbatch shape") from None
        group = group if group is not None else dist.group.WORLD
        self.device = next((t.device for t in tensors.values()), torch.device("cpu"))
        model = StagedModel(stages, signatures, plan, examples, tensors,
                            lambda flat, inputs: flat)
        settings = repr(("compile", self.m, plan.num_stages))
        self.rt = RankRuntime(model, schedule="gpipe", num_microbatches=self.m, group=group,
                              device=self.device, timeout=timeout, lookahead=2,
                              settings=settings, seed=None)
        local = [self.rt.model.signatures[s] for s in self.rt.local_stages]
        names = sorted({n for sig in local for n in sig.parameters})
        self.params = [tensors[n] for n in names if tensors[n].requires_grad]
        if not self.params:  # outputs must require grad for backward to reach us
            self.params = [torch.zeros((), requires_grad=True)]
        self.num_param_inputs = len(self.params)
        self._inputs: list[dict[str, Any]] = []
        self._tied_before: Any = None
        self._step = 0
        self._generation = 0  # training forwards so far; one backward per forward

    def __call__(self, inputs: Mapping[str, Any]) -> tuple:
        self._inputs = [k for _, k, _ in split_microbatches((), dict(inputs), None, self.m)]
        if torch.is_grad_enabled():
            return _PipelinedForward.apply(self, *self.params)
        return tuple(self.run_forward(training=False))

    def run_forward(self, training: bool = True) -> list[torch.Tensor]:
        rt = self.rt
        rt.runner.end_step()  # a forward never backpropagated leaves state behind
        rt.runner.begin_step(self._inputs, [], None, rt.seed, self._step, training=training,
                             outputs_as_roots=training)
        self._step += 1
        rng = torch.get_rng_state()
        if training:
            self._generation += 1
        try:
            with torch.enable_grad() if training else torch.no_grad():
                rt.run(rt.forward_executor)
        finally:
            torch.set_rng_state(rng)
        outputs = []
        for i, ex in enumerate(self.output_examples):
            if rt.last_rank == rt.rank:
                parts = [rt.runner.outputs[k][i] for k in range(self.m)]
                out = (torch.cat(parts) if self.m > 1 else parts[0]).contiguous()
            else:
                out = torch.empty(ex.shape, dtype=ex.dtype, device=self.device)
            outputs.append(rt.broadcast_from_last(out, f"output {i}"))
        if not training:
            rt.runner.end_step()
        return outputs

    def run_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        rt = self.rt
        chunks = [g.chunk(self.m) if g is not None else [None] * self.m for g in grads]
        rt.runner.output_grads = [[c[k] for c in chunks] for k in range(self.m)]
        before = rt.tied_grads_before()
        self._generation += 1  # a second backward through the same output is refused too
        rt.run(rt.backward_executor)
        rt.sum_tied_grads(before)
        rt.runner.end_step()
