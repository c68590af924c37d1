"""What ``torch.compile(fn, backend="mpmd")`` runs: the compile door.

The backend (backend.py) hands each Dynamo graph to a :class:`Door`. The door
does not run Dynamo's graph, which is specialized to the full batch: it
pipelines the compiled frame's own function (frame.py) with ``pipeline()``,
so both doors share one capture (at the microbatch shape), split, stage
programs and runtime. Per call, from the graph's flat inputs it rebuilds the
function's arguments, then:

- training (grad enabled, the function returns one scalar that requires
  grad, e.g. forward + loss): ``Pipeline.step`` runs the whole schedule; the
  returned loss (mean over microbatches, or their sum with
  ``reduction="sum"``) carries the gradients: its backward hands each local
  parameter (and each input that requires grad, on every rank) its gradient
  times the upstream gradient, so ``loss.backward()``, ``(loss * s).backward()``,
  ``torch.autograd.grad`` and gradient hooks behave as for an eager model;
- otherwise the forward part of the schedule runs and the outputs are
  returned on every rank; with grad enabled they are roots of an autograd
  Function whose backward runs the backward part of the schedule, filling
  the local parameters' ``.grad`` (every rank must call backward).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from torch_mpmd.config import PLAN_FIELDS, PipelineConfig
from torch_mpmd.compile.frame import FrameCall, FrameModule, frame_call
from torch_mpmd.microbatch import explicit_microbatches

__all__ = ["Door", "over_microbatches", "pipeline_of"]

# The latest Door per compiled function (its code object) or module: what
# pipeline_of() finds (the door then picks the pipeline of the function's own
# modules). Weak: a door lives as long as Dynamo's cache keeps it.
_DOORS: "weakref.WeakValueDictionary[Any, Door]" = weakref.WeakValueDictionary()
_MODELS_KEPT = 4  # pipelines a door keeps for the models its graph was called with


def _door_key(fn: Any) -> Any:
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)   # a torch.compile'd function
    fn = getattr(fn, "_orig_mod", fn)                    # a torch.compile'd module
    if isinstance(fn, torch.nn.Module):
        return ("module", id(fn))
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"pipeline_of() takes a function or module compiled with "
                        f"backend='mpmd', got {type(fn).__name__}")
    return ("code", code)


def pipeline_of(fn: Any) -> Any:
    """The Pipeline behind ``torch.compile(fn, backend="mpmd")`` (after its first
    call): for ``clip_grad_norm_``, ``eval_step``, ``describe``, timelines and
    checkpoints. ``fn``: the compiled function or module, or the original."""
    door = _DOORS.get(_door_key(fn))
    if door is None:
        raise RuntimeError("no pipeline yet for this function: call it once (the mpmd backend "
                           "builds its pipeline on the first call)")
    return door.pipeline_for(fn)


# NOTE [Explicit microbatches through the door]: over_microbatches calls the
# compiled function on the first microbatch (Dynamo traces it, and guards, at
# that microbatch's shapes) with the whole list here; the door that runs the
# call takes the list (once) and steps on it instead of splitting the call's
# arguments. A call that no door took (not compiled with backend="mpmd"), or
# that two doors took (a graph break), is an error, never a step on the first
# microbatch alone.
_EXPLICIT = threading.local()


def over_microbatches(fn: Any, microbatches: Sequence[Any]) -> Any:
    """Call ``fn``, compiled with ``backend="mpmd"`` and returning its loss (a
    scalar that requires grad) or a ``(sum, count)`` pair, on explicit
    microbatches of shapes free to differ (``options={"dynamic": True}``):
    ``microbatches`` is ``[(args0, kwargs0), (args1, kwargs1), ...]``, each
    the arguments of one call of ``fn``. Returns what ``fn`` returns for the
    whole list, as ``Pipeline.step(microbatches=...)`` computes it (the mean
    of the microbatches' losses, or the sum and count), with its gradients
    for ``backward()``; without grad, a ``(sum, count)`` function returns the
    list's sum and count. Every rank of the pipeline calls it with the same
    list."""
    mbs, _ = explicit_microbatches(microbatches, None)
    if getattr(_EXPLICIT, "pending", None) is not None:
        raise RuntimeError("over_microbatches() calls do not nest")
    _EXPLICIT.pending, _EXPLICIT.taken = mbs, 0
    try:
        args0, kwargs0 = mbs[0]
        out = fn(*args0, **kwargs0)
    finally:
        taken = _EXPLICIT.taken
        _EXPLICIT.pending = None
    if taken != 1:
        raise RuntimeError(
            f"over_microbatches(): {'no' if taken == 0 else taken} mpmd pipeline call(s) took "
            "the microbatches; fn must be compiled with torch.compile(backend='mpmd') and run "
            "as one graph (no graph break) computing its loss")
    return out


def _take_explicit() -> list[tuple[tuple, dict]] | None:
    """The pending explicit microbatches, counted as taken (NOTE [Explicit
    microbatches through the door])."""
    mbs = getattr(_EXPLICIT, "pending", None)
    if mbs is not None:
        _EXPLICIT.taken += 1
    return mbs


def _output_examples(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return [v.meta.get("example_value", v.meta.get("val")) if isinstance(v, torch.fx.Node)
            else v for v in values]


def _mute_hooks(params: list[torch.Tensor]) -> list[tuple[dict, dict]]:
    """Empty the parameters' gradient-hook dicts in place (the engine holds the
    dicts themselves); returns what _unmute_hooks puts back."""
    muted = []
    for p in params:
        for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(p, name, None)
            if hooks:
                muted.append((hooks, dict(hooks)))
                hooks.clear()
    return muted


def _unmute_hooks(muted: list[tuple[dict, dict]]) -> None:
    for hooks, saved in muted:
        hooks.update(saved)


class _StepLoss(torch.autograd.Function):
    """The step's loss as an autograd node: backward multiplies the gradients
    the step computed by the upstream gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, grads: list, *tensors: torch.Tensor
                ) -> torch.Tensor:
        ctx.grads = grads
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> Any:
        return (None, None, *[_scaled(g, upstream) for g in ctx.grads])


class _ScaledLoss(torch.autograd.Function):
    """``loss * scale`` as an autograd node (the sum of a token-weighted loss
    from its mean): backward passes ``upstream * scale`` on."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.detach() * scale

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> Any:
        return upstream * ctx.scale, None


def _is_loss(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 0
            and value.is_floating_point() and value.requires_grad)


def _pair_of_output(output: Any, target: Any) -> tuple[Any, Any]:
    """The loss of a compiled function returning ``(sum, count)``: that pair."""
    return output[0], output[1]


def _scaled(grad: torch.Tensor | None, upstream: torch.Tensor) -> torch.Tensor | None:
    """``grad * upstream`` (a DTensor gradient, of a sharded parameter, is
    scaled on its local shard: DTensor refuses a plain tensor operand)."""
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        local = grad.to_local() * upstream.to(grad.dtype)
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                                  shape=grad.shape, stride=grad.stride())
    return grad * upstream.to(grad.dtype)


class _PipelinedForward(torch.autograd.Function):
    """Forward: the pipeline's forward part; backward: its backward part."""

    @staticmethod
    def forward(ctx: Any, door: "Door", *params: torch.Tensor) -> Any:
        ctx.door = door
        outputs = door.run_forward(keep_graph=True)
        ctx.generation = door.generation
        ctx.num_params = len(params)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        door = ctx.door
        if ctx.generation != door.generation:
            # The runner keeps one forward's state per (stage, microbatch): a later
            # forward replaced this one's. Every rank sees the same calls, so every
            # rank raises here, before any transfer.
            raise RuntimeError(
                "torch.compile(backend='mpmd') keeps the pipeline state of the latest forward "
                "only: call backward() on an output before the next forward with grad enabled "
                "(run forwards you do not backpropagate under torch.no_grad())")
        door.run_backward(grads)
        return (None,) * (1 + ctx.num_params)


class Door:
    """The callable the mpmd backend returns for one Dynamo graph (see the
    module docstring). ``pipeline`` is the Pipeline it runs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 config: PipelineConfig, reduction: str = "mean",
                 given: Sequence[str] = ()) -> None:
        self.call: FrameCall = frame_call(example_inputs)
        self.config = config
        # The option keys the user gave: with plan="auto", those that are plan
        # fields are constraints of the search, as pipeline()'s keywords are.
        self.given = tuple(k for k in given if k in PLAN_FIELDS)
        self.reduction = reduction
        self.outputs = _output_examples(gm)
        out = self.outputs
        self.returns_loss = len(out) == 1 and _is_loss(out[0])
        # A token-weighted loss: (sum of token losses, token count), NOTE
        # [Token-weighted losses] in training.py.
        # Without grad (validation) the pair is told by the function's
        # training door: a float and a count alone could be anything.
        known = _DOORS.get(_door_key(self.call.fn))
        self.returns_pair = (len(out) == 2 and all(isinstance(o, torch.Tensor) and o.dim() == 0
                                                   for o in out)
                             and out[0].is_floating_point() and not out[1].requires_grad
                             and (out[0].requires_grad or
                                  (known is not None and known.returns_pair)))
        if self.returns_pair and reduction != "mean":
            raise ValueError(f"option reduction={reduction!r} does not apply to a function "
                             "returning (sum of token losses, token count): it returns the "
                             "batch's sum and count as they are")
        self.pipeline = self._new_pipeline()
        # Per set of module tensors the graph was called with, its call and
        # pipeline (NOTE [Another model, the same graph] in frame.py); the
        # latest few, most recent last. Each holds its tensors, so an id in
        # a key is not reused while the entry lives.
        self._key = self.call.tensor_key(example_inputs)
        self._by_tensors: collections.OrderedDict[tuple[int, ...], tuple[FrameCall, Any]] = \
            collections.OrderedDict({self._key: (self.call, self.pipeline)})
        # pipeline_of(fn) is the training pipeline's: a door of the same
        # function traced without grad (validation) does not replace it.
        self.trains = self.returns_loss or (self.returns_pair and out[0].requires_grad)
        if known is None or self.trains or not known.trains:
            _DOORS[_door_key(self.call.fn)] = self
        self._anchor = torch.zeros((), requires_grad=True)  # a loss with no local parameter
        self.generation = 0  # forwards with grad and backwards run: NOTE in backward
        self._pending: tuple[list, list] | None = None

    def _new_pipeline(self) -> Any:
        from torch_mpmd.api import pipeline

        fn = self.call.fn
        module = fn if isinstance(fn, torch.nn.Module) else FrameModule(self.call)
        pipe = pipeline(module, self.config,
                        loss_fn=_pair_of_output if self.returns_pair else None,
                        **{k: getattr(self.config, k) for k in self.given})
        pipe.park_between_calls()  # the guards Dynamo made see the parameters they saw
        return pipe

    # ------------------------------------------------------------ what tests read
    @property
    def plan(self) -> Any:
        return self.pipeline.split.plan

    @property
    def stages(self) -> list[torch.fx.GraphModule]:
        return self.pipeline.split.stages

    @property
    def stage_signatures(self) -> list[Any]:
        return self.pipeline.split.stage_signatures

    # ------------------------------------------------------------ calls
    def __call__(self, *flat: Any) -> tuple:
        if self.call.replaced_tensors(flat):
            self._use_tensors(flat)
        with self.pipeline.unparked():
            return self._call(flat)

    def _call(self, flat: Sequence[Any]) -> tuple:
        explicit = _take_explicit()
        if explicit is not None:
            explicit = self._frame_microbatches(flat, explicit)
        if torch.is_grad_enabled() and self.returns_loss:
            return (self._train(flat, explicit),)
        if self.returns_pair and torch.is_grad_enabled():
            return self._train_pair(flat, explicit)
        self._check_planned()
        if self.returns_pair:
            return self._eval_pair(flat, explicit)
        if explicit is not None:
            raise ValueError("over_microbatches() runs a compiled function that returns its "
                             "loss (a scalar requiring grad, called with grad enabled) or a "
                             "(sum, count) pair; this one returns "
                             f"{len(self.outputs)} output(s)")
        args, kwargs = self.call.arguments(flat)
        self._pending = (args, kwargs)
        if torch.is_grad_enabled() and any(isinstance(o, torch.Tensor) and o.requires_grad
                                           for o in self.outputs):
            params = self._local_trainable(args, kwargs) or [self._anchor]
            return _PipelinedForward.apply(self, *params)
        return tuple(self.run_forward(keep_graph=False))

    def _frame_microbatches(self, flat: Sequence[Any], explicit: list[tuple[tuple, dict]]
                            ) -> list[tuple[tuple, dict]]:
        """over_microbatches()'s list as the frame's arguments (module arguments
        taken out); its first must be the call Dynamo traced."""
        mbs = [self.call.frame_arguments(a, k) for a, k in explicit]
        traced = torch.utils._pytree.tree_leaves(self.call.arguments(flat))
        first = torch.utils._pytree.tree_leaves(mbs[0])
        if len(traced) != len(first) or any(
                isinstance(t, torch.Tensor) and t is not f for t, f in zip(traced, first)):
            raise ValueError("over_microbatches(): the compiled function ran on other "
                             "arguments than the first microbatch's")
        return mbs

    def _use_tensors(self, flat: Sequence[Any]) -> None:
        """Switch to the call and pipeline of the module tensors in ``flat``:
        a tensor replaced in the first model's modules (``model.w =
        nn.Parameter(...)``) captures them again; another model's tensors
        (NOTE [Another model, the same graph]) get a call re-bound to them
        and a pipeline of their own, kept for when they come back."""
        key = self.call.tensor_key(flat)
        cached = self._by_tensors.pop(key, None)
        if cached is None:
            if self.call.holds(flat):
                for i in self.call.replaced_tensors(flat):
                    self.call.root_inputs[i] = flat[i]
                call = self.call
            else:
                call = self.call.rebound(flat)
            self.call = call
            cached = (call, self._new_pipeline())
        self.call, self.pipeline = cached
        self._key = key
        self._by_tensors[key] = cached
        while len(self._by_tensors) > _MODELS_KEPT:
            self._by_tensors.popitem(last=False)

    def pipeline_for(self, fn: Any) -> Any:
        """The pipeline of the modules ``fn`` (a compiled function, the
        original, or a module) closes over or is, when one was built for
        them; else the latest."""
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)
        fn = getattr(fn, "_orig_mod", fn)
        modules = [fn] if isinstance(fn, torch.nn.Module) else [
            c.cell_contents for c in getattr(fn, "__closure__", None) or ()
            if isinstance(getattr(c, "cell_contents", None), torch.nn.Module)]
        owned = {id(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
        for key, (_, pipe) in reversed(self._by_tensors.items()):
            if owned and owned.issuperset(key):
                return pipe
        return self.pipeline

    def _plan_if_auto(self, args: tuple, kwargs: dict,
                      explicit: list[tuple[tuple, dict]] | None) -> None:
        """``options={"plan": "auto"}``: the first training call plans from its
        batch (Session.plan_auto: profile and search, collective), before the
        pipeline is built; every later call runs that plan."""
        pipe = self.pipeline
        if pipe.config.plan != "auto":
            return
        if explicit is not None:
            raise ValueError("option plan='auto' plans from a batch: make the first training "
                             "call on the batch itself, then over_microbatches() may follow")
        pipe.session.plan_auto(args, kwargs)

    def _check_planned(self) -> None:
        """A call that is not a training step cannot be the one that plans."""
        if self.pipeline.config.plan != "auto":
            return
        if torch.is_grad_enabled():  # (without grad a loss is not told from an output)
            raise ValueError(
                f"option plan='auto' plans from a training call's loss, but {self.call.name} "
                f"returns {len(self.outputs)} output(s) that are not its loss: compile the "
                "forward and the loss as one function, or pass the plan of mpmd.plan(model, "
                "example_args, loss_fn=..., target=...)")
        raise ValueError(
            f"option plan='auto' chooses the plan at the first training call of "
            f"{self.call.name} (grad enabled); this first call runs without grad: train once "
            "first")

    def _local_trainable(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        pipe = self.pipeline
        pipe.session.build_for_batch(args, kwargs)
        return [p for p in pipe.parameters() if p.requires_grad]

    # ------------------------------------------------------------ training
    def _train(self, flat: Sequence[Any], explicit: list[tuple[tuple, dict]] | None = None
               ) -> torch.Tensor:
        pipe = self.pipeline
        grad_inputs = sorted(i for i in self.call.leaf_inputs.values()
                             if isinstance(flat[i], torch.Tensor) and flat[i].requires_grad)
        if explicit is not None and grad_inputs:
            raise ValueError("over_microbatches(): inputs that require grad are not supported "
                             "(their gradients would be the first microbatch's only)")
        flat = list(flat)
        originals = [flat[i] for i in grad_inputs]
        for i in grad_inputs:  # leaves of their own: their gradients land in .grad
            flat[i] = flat[i].detach().requires_grad_(True)
        args, kwargs = self.call.arguments(flat)
        # The module's parameters, and with sharded data parallel the shards
        # the user steps: the step's gradients are handed out by backward only.
        every = list(dict.fromkeys([*pipe.module.parameters(), *pipe.parameters()]))
        stash = [p.grad for p in every]
        for p in every:
            p.grad = None
        self._plan_if_auto(args, kwargs, explicit)
        pipe.session.defer_parameter_hooks()  # they run in _StepLoss.backward, once
        # The step itself may run under the autograd engine (inputs that require
        # grad): the parameters' hooks are silenced there, to run in backward.
        muted = _mute_hooks(every)
        try:
            loss = (pipe.step(*args, **kwargs) if explicit is None else
                    pipe.step(microbatches=explicit))
            local = [p for p in pipe.parameters() if p.requires_grad]
            grads = [p.grad for p in local]
        finally:
            for p, g in zip(every, stash):
                p.grad = g
            _unmute_hooks(muted)
        grads += self._input_grads([flat[i] for i in grad_inputs])
        if self.reduction == "sum":
            m = pipe.num_microbatches if explicit is None else len(explicit)
            loss = loss * m
            grads = [g * m if g is not None else None for g in grads]
        tensors = local + originals
        if not any(t.requires_grad for t in tensors):
            tensors, grads = [self._anchor], [None]
        return _StepLoss.apply(loss, grads, *tensors)

    def _train_pair(self, flat: Sequence[Any], explicit: list[tuple[tuple, dict]] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A training call of a function returning ``(sum, count)``: the step
        runs the token-weighted loss; the call returns the global sum and count
        (over the batch and the data-parallel replicas), the sum carrying the
        gradients of the sum (the step's gradients, of sum / count, times the
        count), so ``(s / n).backward()`` trains on the token mean."""
        loss = self._train(flat, explicit)
        tokens = self.pipeline.last_token_count
        if tokens is None:  # the capture's loss_fn returns the pair: never
            raise RuntimeError("the mpmd backend's token-weighted step returned no count")
        count = torch.tensor(tokens, device=loss.device).to(self.outputs[1].dtype)
        return _ScaledLoss.apply(loss, tokens), count

    def _eval_pair(self, flat: Sequence[Any], explicit: list[tuple[tuple, dict]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A call without grad of a function returning ``(sum, count)``: the
        batch's sum and count (eval_step's token-weighted loss times its count)."""
        args, kwargs = self.call.arguments(flat)
        pipe = self.pipeline
        loss = (pipe.eval_step(*args, **kwargs) if explicit is None else
                pipe.eval_step(microbatches=explicit))
        tokens = pipe.last_token_count
        return ((loss * tokens).to(self.outputs[0].dtype),
                torch.tensor(tokens, device=loss.device).to(self.outputs[1].dtype))

    def _input_grads(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's gradient of the inputs that require grad: only ranks
        whose stages read an input computed one; they are summed over the
        pipeline group (scaled like the loss under data parallelism)."""
        if not leaves:
            return []
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                 for leaf in leaves]
        rt = self.pipeline.session.runtime
        if rt.pp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            rt.wait(rt.all_reduce(flat, rt.group),
                    f"the sum of input gradients ({len(grads)} tensors, all_reduce)")
            grads = [part.view_as(g) for part, g in
                     zip(flat.split([g.numel() for g in grads]), grads)]
        if rt.dp is not None:
            grads = [g / self.pipeline.dp_size for g in grads]
        return grads

    # ------------------------------------------------------------ forward part
    def run_forward(self, keep_graph: bool) -> list[torch.Tensor]:
        """The forward part of the schedule over the pending call's
        microbatches, merged as the graph returns them; ``keep_graph``: with
        the state :meth:`run_backward` needs."""
        assert self._pending is not None
        args, kwargs = self._pending
        self._pending = None
        session = self.pipeline.session
        if keep_graph:
            self.generation += 1
            return self._merge(session.forward_keeping_graph(args, kwargs))
        return self._merge(session.forward_flat(args, kwargs))

    def _merge(self, per_mb: list[tuple]) -> list[torch.Tensor]:
        """The graph's outputs from each microbatch's flat outputs: batched
        outputs concatenated, scalars averaged (exact for mean-reduced values
        over equal microbatches)."""
        n = len(per_mb[0])
        if n != len(self.outputs):
            raise RuntimeError(
                f"the mpmd backend's capture of {self.call.name} returns {n} tensors where "
                f"Dynamo's graph returns {len(self.outputs)}; return tensors (or containers "
                "of them) only, or use torch_mpmd.pipeline()")
        merged = []
        for i in range(n):
            parts = [mb[i] for mb in per_mb]
            first = parts[0]
            if not isinstance(first, torch.Tensor) or len(parts) == 1:
                merged.append(first)
            elif first.dim() == 0:
                merged.append(torch.stack(parts).mean(0) if first.is_floating_point()
                              else first)
            else:
                merged.append(torch.cat(parts))
        return merged

    def run_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The backward part of the schedule from the gradients of the graph's
        outputs (each split into the microbatches' shares)."""
        m = self.pipeline.num_microbatches
        chunks = []
        for g in grads:
            if g is None:
                chunks.append([None] * m)
            elif g.dim() == 0:  # an averaged scalar: each microbatch's share
                chunks.append([g / m] * m)
            else:
                chunks.append(list(g.chunk(m)))
        self.generation += 1  # a second backward through the same output is refused too
        self.pipeline.session.backward([[c[k] for c in chunks] for k in range(m)])
