"""The StageRunner the C++ executor calls (csrc/runtime/stage_runner.h).

One :class:`StageRunner` per rank runs that rank's stage modules: forward
under autograd with every received value a fresh leaf, the full backward (B),
and the zero-bubble split into input gradient (I) and weight gradient (W).
Values cross the C++ boundary as lists of tensors per stage edge, in the order
of the plan's cross-stage values (:class:`EdgeLayout`), which is also the
order of the transport's tensor specs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from torch_mpmd.graph.stage import StageSignature, StageValue, transferred_value
from torch_mpmd.programs.loss import check_token_count, microbatch_loss
from torch_mpmd.programs.weight_grad import WeightGradPlan

__all__ = ["EdgeLayout", "StageRunner", "stage_seed"]

_MASK63 = (1 << 63) - 1


def stage_seed(base: int, step: int, stage: int, microbatch: int) -> int:
    """The RNG seed of one (stage, microbatch) forward: the same under every
    schedule and placement, so dropout masks do not depend on them."""
    h = 0xCBF29CE484222325
    for x in (base, step, stage, microbatch):
        h = ((h ^ (x & _MASK63)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h & _MASK63


def _rng_states() -> list[torch.Tensor]:
    """The default generators' states (CPU, and CUDA's where initialized)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _seed_rng(seed: int) -> None:
    # Not torch.manual_seed: with CUDA built in but not initialized it queues a
    # lazy CUDA seeding that formats a stack trace (~2 ms) on every call.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # (never true where CUDA is unavailable)
        torch.cuda.manual_seed(seed)


_ENGINE = torch.autograd.Variable._execution_engine


def _label(stage: int, kind: str, mb: int) -> Any:
    """A torch.profiler label for one action ("mpmd 1F3"); free when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(f"mpmd {stage}{kind}{mb}")
    return contextlib.nullcontext()


def _requires_grad(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.requires_grad and
            (value.is_floating_point() or value.is_complex()))


@dataclass
class EdgeLayout:
    """Which cross-stage values travel on each stage edge, and which carry gradients.

    ``forward[(p, c)]``: the values of edge p -> c in plan order;
    ``backward[(p, c)]``: the subset whose gradient goes back c -> p (values
    that require grad at capture); ``meta``: what travels for each value, a
    DTensor's local shard (NOTE [DTensor boundaries] in stage.py).
    """

    forward: dict[tuple[int, int], list[StageValue]] = field(default_factory=dict)
    backward: dict[tuple[int, int], list[StageValue]] = field(default_factory=dict)
    meta: dict[int, torch.Tensor] = field(default_factory=dict)  # node id -> example value

    @classmethod
    def build(cls, signatures: Sequence[StageSignature],
              example_values: Mapping[int, Any]) -> "EdgeLayout":
        layout = cls()
        for sig in signatures:
            for v in sig.sent:
                example = example_values[v.node]
                if not isinstance(example, torch.Tensor):
                    raise ValueError(
                        f"stage {v.producer_stage} sends {v.name!r} to stage(s) "
                        f"{list(v.consumer_stages)}, a {type(example).__name__}, but only "
                        "tensors can cross pipeline stages; move the stage boundary so that "
                        "only tensors cross it")
                layout.meta[v.node] = transferred_value(example)
                for c in v.consumer_stages:
                    layout.forward.setdefault((sig.stage, c), []).append(v)
                    if _requires_grad(example):
                        layout.backward.setdefault((sig.stage, c), []).append(v)
                    else:
                        layout.backward.setdefault((sig.stage, c), [])
        return layout

    def edges(self) -> list[tuple[int, int]]:
        return sorted(self.forward)

    def specs(self, device: str = "meta") -> dict[tuple[int, int, bool], list[torch.Tensor]]:
        """Transport specs: an empty tensor of each transferred value's shape and dtype."""
        return self.specs_for(self.meta, device)

    def specs_for(self, meta: Mapping[int, torch.Tensor], device: str = "meta"
                  ) -> dict[tuple[int, int, bool], list[torch.Tensor]]:
        """Transport specs for the values' shapes ``meta`` (node id -> tensor)."""
        out: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
        for (p, c), values in self.forward.items():
            for backward, vs in ((False, values), (True, self.backward[(p, c)])):
                out[(p, c, backward)] = [
                    torch.empty(meta[v.node].shape, dtype=meta[v.node].dtype,
                                device=device) for v in vs]
        return out


def _mutated_placeholders(gm: torch.fx.GraphModule) -> set[str]:
    """Placeholders the stage graph writes in place (directly or through a view):
    they are fed a clone, since a leaf requiring grad cannot be written and a
    locally handed-off tensor belongs to the producing stage."""
    from torch_mpmd.graph.fx_to_ir import mutated_arg

    family: dict[torch.fx.Node, str] = {}
    mutated: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            family[node] = node.name
            continue
        written = mutated_arg(node)
        if written is not None and written in family:
            mutated.add(family[written])
        args = [a for a in node.all_input_nodes if a in family]
        if args and node.op in ("call_method", "call_function", "call_module"):
            family[node] = family[args[0]]  # conservatively: a possible view of it
    return mutated


@dataclass
class _LocalStage:
    module: torch.fx.GraphModule
    signature: StageSignature
    producers: list[int]
    consumers: list[int]
    received_index: dict[int, int]     # node id -> position in signature.received
    sent_index: dict[int, int]         # node id -> position in signature.sent
    clone_inputs: set[int]             # node ids fed a clone (written in place)
    weights: list[torch.Tensor]        # parameters requiring grad (for W)
    # Per producer (in `producers` order), per value on that edge:
    # (position in signature.received, gets a gradient, fed a clone).
    receive_plan: list[list[tuple[int, bool, bool]]] = field(default_factory=list)
    # Per consumer (in `consumers` order): positions in signature.sent to send.
    send_plan: list[list[int]] = field(default_factory=list)
    # NOTE [Weight-gradient split] (weight_grad.py); None: W re-walks the stage.
    wplan: WeightGradPlan | None = None
    # User inputs the stage writes in place: each forward gets its own copy, as
    # the functional programs do (a microbatch is a chunk() view of the batch,
    # sharing one version counter with the others: a write to one would
    # invalidate what autograd saved of another). The caller's batch is not
    # written.
    clone_user: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Saved:
    leaves: list[torch.Tensor | None]  # per received value
    roots: list[torch.Tensor]          # outputs to backprop from (loss on the last stage)
    root_nodes: list[int]              # node id per root (-1 for the loss)
    saved_bytes: int = 0               # activations autograd saved for this forward
    zs: list[torch.Tensor] = field(default_factory=list)   # weight-node outputs (split only)
    dzs: list[torch.Tensor | None] = field(default_factory=list)  # their gradients, from I
    xs: list[torch.Tensor] = field(default_factory=list)   # inputs of formula weight nodes


def _storage(t: torch.Tensor) -> Any:
    """The storage holding ``t``'s data on this rank: a DTensor's (tensor
    parallel) is its local shard's; the DTensor wrapper itself has none."""
    local = getattr(t, "_local_tensor", None)  # DTensor
    return (local if isinstance(local, torch.Tensor) else t).untyped_storage()


class _ForwardContext:
    """Grad mode, profiler label and (when measuring) saved-tensor hooks
    around one stage forward: the slow path of StageRunner._forward."""

    def __init__(self, label: tuple[int, str, int], training: bool, *, measure: bool) -> None:
        self._stack = contextlib.ExitStack()
        self._label = label
        self._training = training
        self._measure = measure
        self._storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        self._storages[storage.data_ptr()] = storage.nbytes()
        # Detached: returning the tensor itself would make a saved output refer
        # to its own grad_fn, a cycle gc cannot break (leaks whatever part of
        # the graph no backward frees).
        return t.detach()

    def __enter__(self) -> "_ForwardContext":
        self._stack.enter_context(torch.set_grad_enabled(self._training))
        if self._measure:
            self._stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._stack.enter_context(_label(*self._label))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def saved_bytes(self, module: torch.nn.Module) -> int:
        """Bytes of the tensors saved for backward, parameters and buffers excluded."""
        own = {_storage(t).data_ptr()
               for t in list(module.parameters()) + list(module.buffers())}
        return sum(n for ptr, n in self._storages.items() if ptr not in own)


class StageRunner:
    """Runs this rank's stages for the executor; one training step per ``begin_step``."""

    def __init__(self, modules: Mapping[int, torch.fx.GraphModule],
                 signatures: Sequence[StageSignature], layout: EdgeLayout,
                 producers: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]],
                 rebuild_output: Callable[[Sequence[Any], Mapping[str, Any]], Any],
                 *, split_backward: bool = False) -> None:
        self.layout = layout
        self.num_stages = len(signatures)
        self.rebuild_output = rebuild_output
        self.stages: dict[int, _LocalStage] = {}
        for s, module in modules.items():
            sig = signatures[s]
            mutated = _mutated_placeholders(module)
            placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
            received_names = placeholders[len(sig.user_inputs):]
            self.stages[s] = _LocalStage(
                module=module, signature=sig, producers=list(producers[s]),
                consumers=list(consumers[s]),
                received_index={v.node: i for i, v in enumerate(sig.received)},
                sent_index={v.node: i for i, v in enumerate(sig.sent)},
                clone_inputs={v.node for v, name in zip(sig.received, received_names)
                              if name in mutated},
                weights=[p for p in module.parameters() if p.requires_grad],
                clone_user=frozenset(n for n, name in zip(sig.user_inputs, placeholders)
                                     if name in mutated))
            self.stages[s].receive_plan = self._receive_plan(s, layout)
            self.stages[s].send_plan = [[self.stages[s].sent_index[v.node]
                                         for v in layout.forward[(s, c)]]
                                        for c in consumers[s]]
            if split_backward:
                self.stages[s].wplan = WeightGradPlan.build(module)
        self._saved: dict[tuple[int, int], _Saved] = {}
        # NOTE [Saved-bytes accounting]: the bytes autograd saves for one forward
        # of a stage, measured with saved-tensor hooks on the stage's first
        # training forward (per graph: plain or split, and per microbatch sizes
        # when explicit microbatches differ) and reused after: microbatches of
        # the same sizes save the same bytes; the hooks cost a Python call per
        # saved tensor.
        self._bytes_per_forward: dict[tuple[int, bool, Any], int] = {}
        # Explicit microbatches of different sizes (use_microbatch_shapes): each
        # microbatch's sizes (the saved-bytes key), and the transferred values'
        # shapes of those that differ from the layout's (their zero gradients).
        self._mb_sizes: Sequence[Any] | None = None
        self.mb_meta: dict[int, Mapping[int, torch.Tensor]] = {}
        # NOTE [Seeding only random stages]: whether a stage's forward (and loss)
        # draws random numbers, per (stage, split graph, training), found on its
        # first run by comparing the generators' states around it. A stage that
        # draws none is not reseeded: reseeding costs more than a small layer,
        # and nothing could observe it (the step restores the caller's RNG state).
        self._draws_rng: dict[tuple[int, bool, bool], bool] = {}
        self.on_reduce_grad: Callable[[int], None] | None = None
        # Sharded data parallel (sharding.ShardedStages): the UNSHARD/RESHARD
        # actions go to it, and every compute action first makes sure its
        # stage's parameters are gathered.
        self.sharded: Any = None
        # Bytes of activations autograd holds per local stage, now and at peak
        # (tensors saved for backward, parameters and buffers excluded).
        self.live_bytes: dict[int, int] = {s: 0 for s in self.stages}
        self.peak_bytes: dict[int, int] = {s: 0 for s in self.stages}
        self.live_total = self.peak_total = 0  # the same over all local stages at once
        self.peak_live = 0  # with sharded data parallel's transient bytes too (_ready)
        self._grads_from: int | None = None  # the stage whose B or W ran last (_ready)
        self.error: BaseException | None = None
        self.begin_step([], [], None, 0, 0, training=True)

    def _hold(self, stage: int, delta: int) -> None:
        """``delta`` bytes more (or fewer) held for ``stage``'s backward: the
        stage's and the rank's counts now and at their peaks."""
        live = self.live_bytes[stage] + delta
        self.live_bytes[stage] = live
        if live > self.peak_bytes[stage]:
            self.peak_bytes[stage] = live
        self.live_total += delta
        if self.live_total > self.peak_total:
            self.peak_total = self.live_total

    # ------------------------------------------------------------ per step
    def begin_step(self, inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any],
                   loss_fn: Callable[..., torch.Tensor] | None, seed: int, step: int,
                   *, training: bool, outputs_as_roots: bool = False,
                   eval_loss: bool = False) -> None:
        """Set the microbatches of the next ``Executor.run``.

        ``training``: keep autograd state for backward. ``outputs_as_roots``
        (compile path): backward starts from the last stage's flat outputs,
        with the gradients set in ``output_grads`` before the backward run,
        instead of from the loss. ``eval_loss`` (with ``training`` False,
        Pipeline.eval_step): the last stage computes each microbatch's loss
        into ``losses`` instead of keeping its outputs.
        """
        self.inputs = list(inputs)
        self.targets = list(targets)
        self.loss_fn = loss_fn
        self.seed = seed
        self.step = step
        self.training = training
        self.outputs_as_roots = outputs_as_roots
        self.eval_loss = eval_loss
        self.output_grads: list[Sequence[torch.Tensor | None]] = []
        self.num_microbatches = len(self.inputs)
        self.losses: dict[int, torch.Tensor] = {}
        self._loss_dim: int | None = None  # 0: scalar losses, 1: [sum, count] (record_loss)
        self.outputs: dict[int, tuple] = {}
        self.error = None
        self.live_bytes = {s: 0 for s in self.stages}
        self.peak_bytes = {s: 0 for s in self.stages}
        self.live_total = self.peak_total = self.peak_live = 0
        self._grads_from = None
        self._loss_grad_value: torch.Tensor | None = None  # (_loss_grad)
        # Stages reading a user input that requires grad (the compile door's
        # inputs): their backward is never split, so the input's gradient
        # accumulates in one engine call (I runs all of B, W nothing).
        first = self.inputs[0] if self.inputs else {}
        wanted = [n for n, v in first.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        self.whole_backward: frozenset[int] = frozenset(
            s for s, st in self.stages.items()
            if wanted and any(n in wanted for n in st.signature.user_inputs)) if training \
            else frozenset()

    def use_microbatch_shapes(self, sizes: Sequence[Any] | None,
                              meta: Mapping[int, Mapping[int, torch.Tensor]]) -> None:
        """The next calls' microbatches differ in size (RankRuntime.use_microbatches):
        ``sizes``, one hashable per microbatch (None: all alike), and per
        microbatch that differs from the layout the shapes of its values."""
        self._mb_sizes = sizes
        self.mb_meta = dict(meta)

    def meta_of(self, node: int, mb: int) -> torch.Tensor:
        """The shape and dtype value ``node`` has in microbatch ``mb``."""
        own = self.mb_meta.get(mb)
        return own[node] if own is not None else self.layout.meta[node]

    def end_step(self) -> None:
        """Drop what a step left behind (after an error, or forward-only runs)."""
        self._saved.clear()

    # ------------------------------------------------------------ executor API
    # forward and backward run once per action: their common path is written
    # out inline (each Python call costs a microsecond or two here, which is
    # what a near-empty stage's runtime overhead is made of). An exception
    # raised by any of these methods is stored in `error` by the C++ trampoline
    # (csrc/python/runtime/module.cpp) and becomes the PipelineError's cause.

    def unshard(self, stage: int) -> None:
        """UNSHARD: post the gather of the stage's sharded parameters."""
        if self.sharded is not None:
            self.sharded.unshard(stage)

    def reshard(self, stage: int) -> None:
        """RESHARD: free the stage's gathered parameters."""
        if self.sharded is not None:
            self.sharded.reshard(stage)

    def _ready(self, stage: int, backward: bool) -> None:
        """Before a compute action of ``stage`` (a B, I or W when ``backward``)
        with sharded data parallel: its parameters gathered (NOTE [Lazy
        gather]), and the rank's bytes beyond its persistent state at this
        moment noted at their peak (``peak_live``): held for backward,
        gathered full parameters, and full gradients no REDUCE_GRAD has taken
        (the last backward's counted now; summing the three peaks apart would
        count moments that never meet)."""
        if self.sharded is None:
            return
        self.sharded.ready(stage)
        if self._grads_from is not None:
            self.sharded.note_grads(self._grads_from)
        self._grads_from = stage if backward else None
        now = self.live_total + self.sharded.live_bytes()
        if now > self.peak_live:
            self.peak_live = now

    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD: the stage's backward is over; starts its data-parallel
        reduction and the sums of tied weights it posts (runtime._reduce_grad)."""
        if self.on_reduce_grad is not None:
            self.on_reduce_grad(stage)

    # ------------------------------------------------------------ internals
    def _receive_plan(self, stage: int, layout: EdgeLayout) -> list[list[tuple[int, bool, bool]]]:
        st = self.stages[stage]
        plan = []
        for p in st.producers:
            grad_nodes = {v.node for v in layout.backward[(p, stage)]}
            plan.append([(st.received_index[v.node], v.node in grad_nodes,
                          v.node in st.clone_inputs) for v in layout.forward[(p, stage)]])
        return plan

    def forward(self, stage: int, mb: int, inputs: list[list[torch.Tensor]]
                ) -> list[list[torch.Tensor]]:
        self._ready(stage, backward=False)
        st = self.stages[stage]
        sig = st.signature
        training = self.training
        received: list[Any] = [None] * len(sig.received)
        leaves: list[torch.Tensor | None] = [None] * len(sig.received)
        for plan, tensors in zip(st.receive_plan, inputs):
            for (slot, grad, clone), t in zip(plan, tensors):
                leaf = t.detach()
                if training and grad:
                    leaf.requires_grad_(True)
                    leaves[slot] = leaf
                if clone:  # written in place: give the stage a copy
                    with torch.set_grad_enabled(training):
                        received[slot] = leaf.clone()
                else:
                    received[slot] = leaf
        mb_inputs = self.inputs[mb]
        if st.clone_user:
            with torch.set_grad_enabled(training):
                args = [mb_inputs[n].clone() if n in st.clone_user else mb_inputs[n]
                        for n in sig.user_inputs] + received
        else:
            args = [*map(mb_inputs.__getitem__, sig.user_inputs), *received]
        split = training and st.wplan is not None and stage not in self.whole_backward
        rng_key = (stage, split, training)
        draws = self._draws_rng.get(rng_key)
        if draws is not False:
            _seed_rng(stage_seed(self.seed, self.step, stage, mb))
            rng_before = _rng_states() if draws is None else None
        module = st.wplan.module if split else st.module
        size_key = (stage, split, self._mb_sizes[mb] if self._mb_sizes is not None else None)
        measured = self._bytes_per_forward.get(size_key) if training else 0
        if (measured is not None and torch.is_grad_enabled() == training and
                not torch.autograd.profiler._is_profiler_enabled):
            # The common case, kept lean: NOTE [Saved-bytes accounting].
            # .forward: the stage is our own GraphModule, no module hooks to run.
            result = module.forward(*args)
        else:
            with _ForwardContext((stage, "F", mb), training,
                                 measure=measured is None) as ctx:
                result = module.forward(*args)
            if measured is None:
                measured = ctx.saved_bytes(st.module)
                self._bytes_per_forward[size_key] = measured
        zs: list[torch.Tensor] = []
        xs: list[torch.Tensor] = []
        if split:
            result, zs, xs = st.wplan.split_outputs(result)
        sent = result[:len(sig.sent)]
        roots: list[torch.Tensor] = []
        root_nodes: list[int] = []
        if stage == self.num_stages - 1:
            flat = tuple(result[len(sig.sent):])
            if self.outputs_as_roots:
                for i, o in enumerate(flat):
                    if _requires_grad(o):
                        roots.append(o)
                        root_nodes.append(-2 - i)  # flat output i
                self.outputs[mb] = tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                         for o in flat)
            elif training:
                loss = self._loss(flat, mb)
                self.record_loss(mb, loss.detach())
                roots, root_nodes = [loss], [-1]  # scaled by 1/m through its gradient
            elif self.eval_loss:
                with torch.no_grad():
                    self.record_loss(mb, self._loss(flat, mb))
            else:
                self.outputs[mb] = flat
        elif training:
            for v, t in zip(sig.sent, sent):
                if _requires_grad(t):
                    roots.append(t)
                    root_nodes.append(v.node)
        if training:
            self._saved[(stage, mb)] = _Saved(leaves, roots, root_nodes, measured, zs,
                                              xs=xs)
            self._hold(stage, measured)
        if draws is None:  # NOTE [Seeding only random stages]
            after = _rng_states()
            self._draws_rng[rng_key] = len(after) != len(rng_before) or any(
                not torch.equal(a, b) for a, b in zip(rng_before, after))
        return [[sent[i] for i in idx] for idx in st.send_plan] if st.send_plan else []

    def record_loss(self, mb: int, loss: torch.Tensor) -> None:
        """Keep microbatch ``mb``'s loss; a ValueError when its kind (scalar or
        token-weighted pair) is not the other microbatches' (raised in the
        stage's compute, so every rank learns of it)."""
        dim = loss.dim()
        if dim != self._loss_dim:
            if self._loss_dim is not None:
                raise ValueError("loss_fn returned a scalar for some microbatches and a (sum, "
                                 "count) pair for others in one step; return one kind for "
                                 "every microbatch")
            self._loss_dim = dim
        if dim == 1:
            check_token_count(float(loss[1]), f"loss_fn (microbatch {mb})")
        self.losses[mb] = loss

    def _loss(self, flat: tuple, mb: int) -> torch.Tensor:
        output = self.rebuild_output(flat, self.inputs[mb])
        return microbatch_loss(self.loss_fn, output, self.targets[mb],
                               needs_grad=self.training)

    def _loss_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient the loss of one microbatch starts backward with: 1/m, so
        the step accumulates the gradient of the mean loss; for a token-weighted
        loss ``[sum, count]``, ``[1, 0]``: the gradient of the sum, which the
        step scales by the total count at its end (NOTE [Token-weighted losses]
        in training.py). Made once per step (a step's losses are of one kind,
        dtype and device: record_loss)."""
        g = self._loss_grad_value
        if g is None:
            if loss.dim() == 1:
                g = torch.tensor([1.0, 0.0], dtype=loss.dtype, device=loss.device)
            else:
                g = torch.full((), 1.0 / self.num_microbatches, dtype=loss.dtype,
                               device=loss.device)
            self._loss_grad_value = g
        return g

    def _root_grads(self, stage: int, mb: int, saved: _Saved,
                    grads: list[list[torch.Tensor]]) -> list[torch.Tensor | None]:
        st = self.stages[stage]
        if stage == self.num_stages - 1:
            return [self.output_grads[mb][-2 - n] for n in saved.root_nodes]
        total: dict[int, torch.Tensor] = {}
        for c, tensors in zip(st.consumers, grads):
            for v, g in zip(self.layout.backward[(stage, c)], tensors):
                total[v.node] = g if v.node not in total else total[v.node] + g
        return [total.get(n) for n in saved.root_nodes]

    def _input_grads(self, stage: int, mb: int, saved: _Saved,
                     grads: Sequence[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        st = self.stages[stage]
        out = []
        for p in st.producers:
            row = []
            for v in self.layout.backward[(p, stage)]:
                g = grads[st.received_index[v.node]]
                if g is None:  # the value did not reach the roots: a zero gradient
                    meta = self.meta_of(v.node, mb)
                    leaf = saved.leaves[st.received_index[v.node]]
                    g = torch.zeros(meta.shape, dtype=meta.dtype,
                                    device=leaf.device if leaf is not None else None)
                row.append(g)
            out.append(row)
        return out

    def backward(self, stage: int, mb: int, grads: list[list[torch.Tensor]],
                 input_only: bool) -> list[list[torch.Tensor]]:
        self._ready(stage, backward=True)
        if input_only and stage in self.whole_backward:
            return self._whole_backward_as_input(stage, mb, grads)
        saved = self._saved[(stage, mb)] if input_only else self._saved.pop((stage, mb))
        if not input_only:
            self._hold(stage, -saved.saved_bytes)
        if stage == self.num_stages - 1 and not self.outputs_as_roots:
            loss = saved.roots[0]
            roots, root_grads = (loss,), (self._loss_grad(loss),)
        else:
            rs, gs = [], []
            for r, g in zip(saved.roots, self._root_grads(stage, mb, saved, grads)):
                if g is not None:
                    rs.append(r)
                    gs.append(g)
            roots, root_grads = tuple(rs), tuple(gs)
        label = (_label(stage, "I" if input_only else "B", mb)
                 if torch.autograd.profiler._is_profiler_enabled else None)
        if label is not None:
            label.__enter__()
        try:
            if input_only:
                input_grads = self._autograd_input(saved, roots, root_grads)
            elif roots:  # B: one engine call; the received values' gradients land in .grad
                _ENGINE.run_backward(roots, root_grads, False, False, (), True, True)
                input_grads = [leaf.grad if leaf is not None else None
                               for leaf in saved.leaves] if saved.leaves else []
            else:
                input_grads = [None] * len(saved.leaves)
        finally:
            if label is not None:
                label.__exit__(None, None, None)
        result = (self._input_grads(stage, mb, saved, input_grads) if saved.leaves else
                  [[] for _ in self.stages[stage].producers])  # nothing received
        if input_only:  # keep only what W needs: the roots and their gradients
            saved.roots, saved.root_nodes = list(roots), [-1] * len(roots)
            saved.leaves = list(root_grads)  # type: ignore[arg-type]
        return result

    def _autograd_input(self, saved: _Saved, roots: tuple[torch.Tensor, ...],
                        root_grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """I: the received values' gradients (and the Zs', NOTE [Weight-gradient split])."""
        if saved.zs:
            return self._input_and_weight_node_grads(saved, roots, root_grads)
        leaves = tuple(leaf for leaf in saved.leaves if leaf is not None)
        if not roots or not leaves:
            return [None] * len(saved.leaves)
        it = iter(_ENGINE.run_backward(roots, root_grads, True, False, leaves, True, False))
        return [next(it) if leaf is not None else None for leaf in saved.leaves]

    # The engine is called directly (what torch.autograd.backward/grad end in):
    # the roots' gradients are always given, and the Python wrappers' checks
    # cost as much as a small layer's backward. Arguments: roots, their
    # gradients, keep_graph, create_graph, inputs, allow_unreachable,
    # accumulate_grad.

    @staticmethod
    def _input_and_weight_node_grads(saved: _Saved, roots: tuple[torch.Tensor, ...],
                                     root_grads: tuple[torch.Tensor, ...]
                                     ) -> list[torch.Tensor | None]:
        """I with NOTE [Weight-gradient split]: gradients of the received values
        (returned) and of every Z (kept in ``saved.dzs`` for W)."""
        leaves = [leaf for leaf in saved.leaves if leaf is not None]
        zs = [z for z in saved.zs if z.requires_grad]
        if not roots or not (leaves or zs):
            saved.zs, saved.dzs = [], []
            return [None] * len(saved.leaves)
        got = _ENGINE.run_backward(roots, root_grads, True, False, tuple(leaves + zs), True,
                                   False)
        it = iter(got[:len(leaves)])
        dz = iter(got[len(leaves):])
        saved.dzs = [next(dz) if z.requires_grad else None for z in saved.zs]
        return [next(it) if leaf is not None else None for leaf in saved.leaves]

    def _whole_backward_as_input(self, stage: int, mb: int,
                                 grads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """I of a stage in ``whole_backward``: all of B; W then has nothing left."""
        result = StageRunner.backward(self, stage, mb, grads, input_only=False)
        self._saved[(stage, mb)] = _Saved([], [], [], 0, [])
        return result

    def backward_weight(self, stage: int, mb: int) -> None:
        self._ready(stage, backward=True)
        saved = self._saved.pop((stage, mb))
        self._hold(stage, -saved.saved_bytes)
        weights = self.stages[stage].weights
        wplan = self.stages[stage].wplan
        if saved.dzs and wplan is not None and wplan.can_accumulate(saved.zs, saved.dzs,
                                                                    saved.xs):
            with _label(stage, "W", mb):
                wplan.accumulate(saved.zs, saved.dzs, saved.xs)
        elif saved.roots and weights:
            # NOTE: W walks the retained graph again from the stage outputs,
            # restricted to the weights; I computed the input gradients only.
            with _label(stage, "W", mb):
                torch.autograd.backward(saved.roots, saved.leaves, inputs=weights)
