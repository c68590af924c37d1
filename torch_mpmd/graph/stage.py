"""Per-stage ``fx.GraphModule``s from a partition plan, and a single-process runner.

Each stage module takes, positionally, the model inputs it reads (by name) and
then the values it receives from earlier stages (named after their producing
node), and returns a tuple: the values later stages read, then, on the last
stage, the model's flat outputs. :class:`StageSignature` describes that.
Parameters and buffers are ``get_attr`` under their original FQNs and are the
model's own tensors (shared storage; BatchNorm running stats update the
model's buffers). Constant nodes are recomputed on every stage that reads them.
A DTensor value crosses as its local shard: the producer returns it, the
consumer receives it and rebuilds the DTensor (NOTE [DTensor boundaries]).

:func:`split_model` is the public entry point; :class:`SplitModel.run` chains
the stages in one process under autograd.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_mpmd import _C
from torch_mpmd.graph.capture import CapturedGraph, PlaceholderInfo, capture
from torch_mpmd.graph.capture import flatten_inputs
from torch_mpmd.graph.fx_to_ir import GraphIR, _dtensor_type, grad_mode_setting, order_mutations
from torch_mpmd.graph.fx_to_ir import resolve_split_points, to_ir
from torch_mpmd.microbatch import Replicate, split_microbatches

__all__ = [
    "StageValue",
    "StageSignature",
    "build_stages",
    "partition",
    "run_stages",
    "split_model",
    "SplitModel",
]

K = _C.NodeKind


@dataclass(frozen=True)
class StageValue:
    """A value crossing stages: produced by ``producer_stage``, read by ``consumer_stages``."""

    name: str                          # the producing FX node's name
    node: int                          # IR node id (plan.cross_stage_values[k].node)
    producer_stage: int
    consumer_stages: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class StageSignature:
    """Inputs and outputs of one stage module, in call order.

    ``stage_module(*[inputs[n] for n in user_inputs], *[value of v for v in received])``
    returns ``(*[value of v for v in sent], *model_outputs)``; only the last
    stage has model outputs (``num_model_outputs``, the flat outputs of the
    captured graph).
    """

    stage: int
    user_inputs: tuple[str, ...]
    received: tuple[StageValue, ...]
    sent: tuple[StageValue, ...]
    num_model_outputs: int
    parameters: tuple[str, ...]
    buffers: tuple[str, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.user_inputs + tuple(v.name for v in self.received)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.sent) + tuple(
            f"output[{i}]" for i in range(self.num_model_outputs))


# ------------------------------------------------------------------ partition


def partition(ir: GraphIR, *, split_points: Sequence[str] | None = None,
              num_stages: int | None = None, known_modules: Sequence[str] | None = None,
              what: str = "the model", default_num_stages: int = 1,
              bytes_cost: float | None = None) -> Any:
    """The plan for ``ir``: from its markers, else ``split_points``, else
    ``num_stages`` (or ``default_num_stages``) balanced by cost.

    ``bytes_cost`` prices, in cost units per byte, the values crossing each
    boundary of a balanced split (None: ``_C.DEFAULT_BYTES_COST``, derived from
    a measured p2p rate; see NOTE [Bytes cost] in csrc/core/partition.h)."""
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    try:
        if ir.num_markers:
            if split_points is not None:
                raise ValueError(
                    f"{what} has {ir.num_markers} stage_boundary() markers and split_points="
                    f"{list(split_points)!r} was given too: use one or the other")
            # Validate on the graph with its markers (errors name them), then plan
            # over the marker-free graph so the plan equals the split-point one.
            _C.partition_by_markers(ir.graph_with_markers())
            plan = _C.partition_at_nodes(ir.graph, ir.marker_stage_starts())
            source = f"{ir.num_markers} stage_boundary() markers"
        elif split_points is not None:
            starts = resolve_split_points(ir, split_points, known_modules)
            first = next((i for i, k in enumerate(ir.kinds) if k == K.COMPUTE), None)
            if starts and starts[0] == first:
                raise ValueError(
                    f"split point {split_points[0]!r} begins at the model's first operation "
                    f"({ir.fx_nodes[first].name!r}), so stage 0 would be empty; drop it")
            plan = _C.partition_at_nodes(ir.graph, starts)
            source = f"split_points={list(split_points)!r}"
        else:
            if bytes_cost is None:
                return _C.partition_balanced(ir.graph, num_stages or default_num_stages)
            return _C.partition_balanced(ir.graph, num_stages or default_num_stages,
                                         bytes_cost=bytes_cost)
    except ValueError as e:
        raise ValueError(f"cannot split {what} into stages: {e}") from None
    if num_stages is not None and num_stages != plan.num_stages:
        raise ValueError(f"num_stages={num_stages} disagrees with {source}, which give "
                         f"{plan.num_stages} stages")
    return plan


# ------------------------------------------------------------------ stage modules


def set_path(root: torch.nn.Module, fqn: str, value: Any, kind: str,
              persistent: bool = True) -> None:
    *prefix, leaf = fqn.split(".")
    mod = root
    for part in prefix:
        nxt = mod._modules.get(part)
        if nxt is None:
            nxt = torch.nn.Module()
            mod.add_module(part, nxt)
        mod = nxt
    if kind == "parameter":
        mod.register_parameter(leaf, value)
    elif kind == "buffer":
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        setattr(mod, leaf, value)


def _module_at(root: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    *prefix, leaf = fqn.split(".")
    mod = root
    for part in prefix:
        mod = getattr(mod, part)
    return mod, leaf


def _identifier(name: str) -> str:
    """A placeholder name for an input name like ``batch['ids']`` (FX makes it unique)."""
    ident = re.sub(r"\W+", "_", name).strip("_") or "input"
    return ident if not ident[0].isdigit() else f"_{ident}"


def _is_autocast_enter(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "enter_autocast" in getattr(
        node.target, "__name__", "")


# ------------------------------------------------------------------ DTensor boundaries


@dataclass(frozen=True, eq=False)
class LocalShardTransfer:
    """How a DTensor value crossing stages travels: as its local shard.

    NOTE [DTensor boundaries]: with tensor parallelism each tp rank runs its
    own pipeline replica, and pp rank k of every replica sends to pp rank k+1
    of the same replica, which has the same coordinate along "tp". So a
    DTensor over the pipeline mesh's "tp" dim crosses a stage boundary as
    what this rank holds of it, its local shard (no gather to the full
    tensor between stages): the producing stage's graph ends in ``send``
    (``to_local``), so the runners, the transport and the stage programs see
    a plain tensor of the local shape (fx_to_ir's NOTE [Local shapes] prices
    the same bytes), and the consuming stage's graph begins with ``receive``
    (``from_local``), which rebuilds the DTensor with the value's mesh,
    placements and global shape before anything reads it. The stage
    programs are traced over these plain edges: AOTAutograd traces the two
    conversions as it traces the plan's own from_local/to_local, so the
    programs' inputs, outputs and tangents for crossing values stay plain
    tensors, and a gradient's redistribution lands in B (or I) as a
    functional collective. Feeding the programs DTensors instead would have
    AOTAutograd split each into a local-shard and a mesh input (its tangent
    and gradient likewise), for every runner to pair up again. One rule in
    the stage graph serves the FX, compiled and autograd paths alike.

    The gradient crosses the other way in the same placements: both
    conversions name the value's placements as the gradient's. The
    consumer's gradient may come out of its stage in another placement (a
    Replicate value read by a column-parallel matmul gets a Partial
    gradient); ``from_local``'s backward redistributes it to the value's
    placements (the Partial one is all-reduced) before its local part is
    sent, and ``to_local``'s backward on the producer reads the local part
    in those placements. Both sides therefore agree on what the local
    tensors mean, and the value's layout decides it.

    Refused at the split (:func:`_local_shard_transfer`): a DTensor over any
    other mesh (its shards need not line up with the pipeline's peers), a
    Partial value (a pending reduction: its gradient rule depends on the
    reduce op; redistribute it before the boundary), and symbolic sizes (a
    dynamic capture sizes each step's transfers from the values' global
    shapes, shapes.py)."""

    mesh: Any                     # DeviceMesh: the pipeline mesh's "tp" dim
    placements: tuple[Any, ...]   # of the value, and of its gradient
    shape: tuple[int, ...]        # global shape
    stride: tuple[int, ...]       # global stride of the value rebuilt from a contiguous shard

    def send(self, value: Any) -> torch.Tensor:
        """The local shard to send, contiguous (as the transport's buffers are)."""
        return value.to_local(grad_placements=self.placements).contiguous()

    def receive(self, local: torch.Tensor) -> Any:
        """The DTensor the consuming stage reads, rebuilt from the received shard."""
        return _dtensor_type().from_local(
            local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape),
            stride=self.stride, grad_placements=self.placements)


def transferred_value(example: Any) -> Any:
    """What travels for a cross-stage value with this example: a DTensor's
    local shard (NOTE [DTensor boundaries]), else the value itself."""
    dtensor = _dtensor_type()
    return example._local_tensor if dtensor is not None and isinstance(example, dtensor) \
        else example


def _local_shard_transfer(node: torch.fx.Node, v: Any) -> LocalShardTransfer | None:
    """How the value crossing stages at ``node`` travels when it is a DTensor
    (None: a plain tensor); ValueError for the DTensors NOTE [DTensor
    boundaries] refuses, naming the value, its mesh and placements."""
    dtensor = _dtensor_type()
    value = node.meta.get("example_value")
    if dtensor is None or not isinstance(value, dtensor):
        return None
    names = tuple(value.device_mesh.mesh_dim_names or ())
    placements = tuple(value.placements)
    what = (f"the value {node.name!r} crossing from stage {v.producer_stage} to stage "
            f"{v.consumer_stages[0]} is a DTensor over mesh dims {names} with placements "
            f"{placements} (shape {tuple(value.shape)})")
    if names != ("tp",):
        raise ValueError(
            f"{what}; torch_mpmd sends a DTensor between stages as its local shard only over "
            "the pipeline mesh's 'tp' dim, whose shards line up between pipeline peers: apply "
            "the tensor-parallel plan over mesh['tp'] (parallelize_module(..., mesh['tp'], "
            "...)), return plain tensors at the boundary (use_local_output=True), or split "
            "elsewhere")
    if not all(p.is_replicate() or p.is_shard() for p in placements):
        raise ValueError(
            f"{what}; torch_mpmd sends Replicate and Shard values between stages, not a "
            "pending reduction: redistribute it before the boundary (e.g. RowwiseParallel's "
            "output_layouts=Replicate() or Shard(1)), or split elsewhere")
    if any(isinstance(d, torch.SymInt) for d in value.shape):
        raise ValueError(
            f"{what}; its sizes are symbolic (a dynamic capture), and torch_mpmd sizes the "
            "local shards of DTensors crossing stages from a static shape: capture with "
            "dynamic=False, return plain tensors at the boundary (use_local_output=True), or "
            "split elsewhere")
    shape = tuple(int(d) for d in value.shape)
    contiguous = torch.empty(shape, device="meta").stride()
    return LocalShardTransfer(value.device_mesh, placements, shape, tuple(contiguous))


def _example_meta(node: torch.fx.Node) -> dict[str, Any]:
    return {k: node.meta[k] for k in ("example_value", "val") if k in node.meta}


def _received_value(graph: torch.fx.Graph, placeholder: torch.fx.Node,
                    original: torch.fx.Node, transfer: LocalShardTransfer | None
                    ) -> torch.fx.Node:
    """The node a consuming stage reads for a received value: its placeholder,
    or for a DTensor the DTensor rebuilt from the placeholder's local shard."""
    meta = _example_meta(original)
    if transfer is None:
        placeholder.meta.update(meta)
        return placeholder
    placeholder.meta.update({k: transferred_value(v) for k, v in meta.items()})
    rebuilt = graph.call_function(transfer.receive, (placeholder,))
    rebuilt.meta.update(meta)
    return rebuilt


def _sent_value(graph: torch.fx.Graph, value: torch.fx.Node, original: torch.fx.Node,
                transfer: LocalShardTransfer | None) -> torch.fx.Node:
    """The node a producing stage returns for a sent value: the value, or for
    a DTensor its local shard."""
    if transfer is None:
        return value
    local = graph.call_function(transfer.send, (value,))
    local.meta.update({k: transferred_value(v) for k, v in _example_meta(original).items()})
    return local


def build_stages(gm: torch.fx.GraphModule, ir: GraphIR, plan: Any,
                 placeholders: Sequence[PlaceholderInfo], tensors: Mapping[str, torch.Tensor],
                 *, grad_enabled_at_capture: bool = True
                 ) -> tuple[list[torch.fx.GraphModule], list[StageSignature]]:
    """One GraphModule per stage of ``plan`` (see the module docstring)."""
    nodes = ir.fx_nodes
    ph_info: dict[torch.fx.Node, PlaceholderInfo] = dict(
        zip([n for n in gm.graph.nodes if n.op == "placeholder"], placeholders))
    num_stages = plan.num_stages
    cross = plan.cross_stage_values
    output_node = nodes[-1]
    model_outputs = output_node.args[0]
    model_outputs = list(model_outputs) if isinstance(model_outputs, (tuple, list)) else [
        model_outputs]

    transfers: dict[int, LocalShardTransfer] = {}  # node id -> how a DTensor value travels
    for v in cross:
        if isinstance(nodes[v.node].meta.get("example_value"), (int, torch.SymInt)):
            raise ValueError(
                f"a size computed from a tensor on stage {v.producer_stage} "
                f"({nodes[v.node].name!r}) is read on stage {v.consumer_stages[0]}; torch_mpmd "
                "sends tensors only: compute it from the inputs' sizes, or split elsewhere")
        transfer = _local_shard_transfer(nodes[v.node], v)
        if transfer is not None:
            transfers[v.node] = transfer
        if _is_autocast_enter(nodes[v.node]):
            raise ValueError(
                f"a stage boundary falls inside a `with torch.autocast(...)` region (entered at "
                f"node {nodes[v.node].name!r}, stage {v.producer_stage}, left on stage "
                f"{v.consumer_stages[0]}); move the boundary out of the region")

    # Grad mode each node runs under: None = the mode the stage is called in.
    desired: list[bool | None] = []
    mode: bool | None = None
    for node in nodes:
        flag = grad_mode_setting(node)
        if flag is not None:
            mode = None if flag == grad_enabled_at_capture else flag
        desired.append(mode)

    # Readers per stage, for user inputs.
    reads_input: list[set[int]] = [set() for _ in range(num_stages)]
    for i, node in enumerate(nodes):
        kind = ir.kinds[i]
        if kind == K.COMPUTE or kind == K.OUTPUT:
            stages = [plan.node_stage[i]]
        elif kind == K.CONSTANT:
            stages = list(plan.constant_stages[i])
        else:
            continue
        for a in node.all_input_nodes:
            j = ir.index[a]
            if ir.kinds[j] == K.INPUT:
                for s in stages:
                    reads_input[s].add(j)

    placements = {p.node: p for p in plan.parameters}
    by_name = {info.name: info for info in placeholders}
    stages: list[torch.fx.GraphModule] = []
    signatures: list[StageSignature] = []
    for s in range(num_stages):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        user_inputs = []
        # FX does not make placeholder targets unique (a duplicate is a
        # SyntaxError in the generated forward): a user input and a received
        # value may share a name (`mask = self.a(x) * mask`), so uniquify here;
        # the StageSignature keeps the original names.
        arg_names: set[str] = set()

        def placeholder(name: str) -> torch.fx.Node:
            base, ident, n = name, name, 0
            while ident in arg_names:
                n += 1
                ident = f"{base}_{n}"
            arg_names.add(ident)
            return graph.placeholder(ident)

        for j in sorted(reads_input[s]):
            name = ph_info[nodes[j]].name
            user_inputs.append(name)
            env[nodes[j]] = placeholder(_identifier(name))
        for j, node in enumerate(nodes):  # symbolic sizes this stage reads
            info = ph_info.get(node)
            if info is not None and info.kind == "size" and s in plan.constant_stages[j]:
                user_inputs.append(info.name)
                env[node] = placeholder(_identifier(info.name))
                env[node].meta.update({k: node.meta[k] for k in ("example_value", "val")
                                       if k in node.meta})
        received = []
        for v in cross:
            if s in v.consumer_stages:
                sv = StageValue(nodes[v.node].name, v.node, v.producer_stage,
                                tuple(v.consumer_stages), v.bytes)
                received.append(sv)
                env[nodes[v.node]] = placeholder(sv.name)
        for sv in received:  # after every placeholder: a DTensor is rebuilt from its shard
            env[nodes[sv.node]] = _received_value(graph, env[nodes[sv.node]], nodes[sv.node],
                                                  transfers.get(sv.node))
        root = torch.nn.Module()
        params, buffers = [], []
        for node_id, p in placements.items():
            if s not in p.stages:
                continue
            info = ph_info[nodes[node_id]]
            set_path(root, info.name, tensors[info.name], info.kind, info.persistent)
            (params if info.kind == "parameter" else buffers).append(info.name)
            env[nodes[node_id]] = graph.get_attr(info.name)

        entry_mode: torch.fx.Node | None = None
        current: bool | None = None

        def switch_mode(want: bool | None) -> None:
            nonlocal entry_mode, current
            if want == current:
                return
            if entry_mode is None:
                entry_mode = graph.call_function(torch.is_grad_enabled, ())
            graph.call_function(torch._C._set_grad_enabled,
                                (entry_mode if want is None else want,))
            current = want

        for i, node in enumerate(nodes):
            kind = ir.kinds[i]
            if kind == K.COMPUTE:
                if plan.node_stage[i] != s or grad_mode_setting(node) is not None:
                    continue
            elif kind == K.CONSTANT:
                if s not in plan.constant_stages[i] or node.op == "placeholder":
                    continue
            else:
                continue
            if node.op == "get_attr":
                target = str(node.target)
                set_path(root, target, operator.attrgetter(target)(gm), "attr")
            switch_mode(desired[i])
            try:
                env[node] = graph.node_copy(node, lambda n: env[n])
            except KeyError as e:
                raise RuntimeError(
                    f"stage {s}: node {node.name!r} reads {e.args[0]}, which the plan does "
                    "not make available on this stage (partitioner bug)") from None
        switch_mode(None)

        outs = []
        sent = []
        for v in cross:
            if v.producer_stage == s:
                sent.append(StageValue(nodes[v.node].name, v.node, v.producer_stage,
                                       tuple(v.consumer_stages), v.bytes))
                outs.append(_sent_value(graph, env[nodes[v.node]], nodes[v.node],
                                        transfers.get(v.node)))
        num_model_outputs = 0
        if s == num_stages - 1:
            for o in model_outputs:
                outs.append(env[o] if isinstance(o, torch.fx.Node) else o)
            num_model_outputs = len(model_outputs)
        graph.output(tuple(outs))
        graph.lint()
        module = torch.fx.GraphModule(root, graph, class_name=f"Stage{s}")
        for name in buffers:
            if not by_name[name].persistent:
                mod, leaf = _module_at(module, name)
                mod._non_persistent_buffers_set.add(leaf)
        stages.append(module)
        signatures.append(StageSignature(
            stage=s, user_inputs=tuple(user_inputs), received=tuple(received), sent=tuple(sent),
            num_model_outputs=num_model_outputs, parameters=tuple(params),
            buffers=tuple(buffers)))
    return stages, signatures


def run_stages(stages: Sequence[torch.nn.Module], signatures: Sequence[StageSignature],
               inputs: Mapping[str, Any]) -> tuple:
    """Run the stages in order in this process; returns the model's flat outputs."""
    values: dict[int, Any] = {}
    outputs: tuple = ()
    for module, sig in zip(stages, signatures):
        args = [inputs[n] for n in sig.user_inputs] + [values[v.node] for v in sig.received]
        result = module(*args)
        for v, value in zip(sig.sent, result):
            values[v.node] = value
        for v in sig.received:  # free what no later stage reads
            if v.consumer_stages[-1] <= sig.stage:
                values.pop(v.node, None)
        outputs = tuple(result[len(sig.sent):])
    return outputs


# ------------------------------------------------------------------ split_model


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|")  # the parameter a flattened name starts with


class SplitModel:
    """A model split into pipeline stages (see :func:`split_model`).

    ``stages`` are the stage ``fx.GraphModule``s, ``stage_signatures`` their
    inputs/outputs, ``plan`` the C++ PartitionPlan (``plan.hash`` compares
    plans), ``run(*args, **kwargs)`` the model's forward computed stage by stage.
    """

    def __init__(self, captured: CapturedGraph, ir: GraphIR, plan: Any,
                 stages: list[torch.fx.GraphModule], signatures: list[StageSignature],
                 model_name: str) -> None:
        self.captured = captured
        self.ir = ir
        self.plan = plan
        self.stages = stages
        self.stage_signatures = signatures
        self.model_name = model_name
        self._training = _training_flags(captured.root)
        # Symbolic sizes (a dynamic capture): fed per microbatch from the inputs.
        self.sizes = [info for info in captured.placeholders if info.kind == "size"]
        self.dynamic_dims: dict[str, set[int]] = {}
        for info in self.sizes:
            assert info.size_of is not None
            self.dynamic_dims.setdefault(info.size_of[0], set()).add(info.size_of[1])
        # Per input: its shape at capture (None in dynamic dims) and dtype. Hints,
        # not symbolic sizes: a comparison with those would add guards.
        self._input_meta = {
            info.name: _static_meta(node.meta.get("example_value"),
                                    self.dynamic_dims.get(info.name, set()))
            for node, info in zip(
                [n for n in captured.gm.graph.nodes if n.op == "placeholder"],
                captured.placeholders)
            if info.kind == "input"}

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def parameter_aliases(self) -> dict[str, tuple[str, ...]]:
        """FQN -> the other FQNs of the same tensor (tied weights)."""
        return {p.name: p.aliases for p in self.captured.placeholders if p.aliases}

    def stage_of_parameter(self, fqn: str) -> list[int]:
        """The stages that read parameter/buffer ``fqn`` (an alias works too)."""
        for p in self.plan.parameters:
            if p.fqn == fqn:
                return list(p.stages)
        for name, aliases in self.parameter_aliases.items():
            if fqn in aliases:
                return self.stage_of_parameter(name)
        raise KeyError(f"{fqn!r} is not a parameter or buffer the model reads")

    def named_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """One microbatch's inputs by the capture's input names, checked against
        the capture (ValueError naming what differs), with the sizes they bind."""
        inputs = flatten_inputs(self.captured.signature, args, kwargs)
        self._check_named_inputs(inputs)
        return self._with_sizes(inputs)

    def _with_sizes(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``inputs`` plus the symbolic sizes' values, read from the inputs' shapes."""
        for info in self.sizes:
            name, dim = info.size_of  # type: ignore[misc]
            inputs[info.name] = inputs[name].shape[dim]
        return inputs

    def named_microbatches(self, args: Sequence[Any], kwargs: Mapping[str, Any],
                           num_microbatches: int) -> list[dict[str, Any]]:
        """The named inputs of each of the ``num_microbatches`` microbatches of
        a batch (split as ``split_microbatches`` does, whose errors a caller
        raises first), checked against the capture. The batch is named once
        and each tensor leaf chunked, instead of binding forward's signature
        per microbatch: the microbatches share the batch's structure and their
        tensors its shapes."""
        m = num_microbatches
        defaults: set[str] = set()
        full = flatten_inputs(self.captured.signature, args, kwargs, defaults)
        per: dict[str, Sequence[Any]] = {}
        for name, value in full.items():
            if defaults and _IDENT.match(name).group(0) in defaults:  # type: ignore[union-attr]
                per[name] = [value] * m  # a default goes whole, as split_microbatches does
            elif isinstance(value, Replicate) and isinstance(value.value, torch.Tensor):
                per[name] = [value.value] * m
            elif isinstance(value, Replicate):  # a container: its leaves have other names
                return [self.named_inputs(a, k)
                        for a, k, _ in split_microbatches(args, kwargs, None, m)]
            elif isinstance(value, torch.Tensor) and m > 1:
                per[name] = value.chunk(m, dim=0)
            else:
                per[name] = [value] * m
        names = list(per)
        named = [dict(zip(names, values)) for values in zip(*per.values())] if names else \
            [{} for _ in range(m)]
        self._check_named_inputs(named[0])
        if self.sizes:
            named = [self._with_sizes(n) for n in named]
        return named

    def _check_named_inputs(self, inputs: Mapping[str, Any]) -> None:
        known = set(self.captured.input_names) | set(self.captured.input_constants)
        unknown = [name for name in inputs if name not in known]
        if unknown:
            raise ValueError(
                f"{self.model_name} was split without input(s) "
                f"{', '.join(map(repr, unknown))} (not passed, or None), which this call "
                "passes; the stages do not read them, split again with them")
        for name in self.captured.input_names:
            if name not in inputs:
                raise ValueError(f"{self.model_name} was split with input {name!r}, which "
                                 "this call does not pass")
        for name, meta in self._input_meta.items():
            if name not in inputs:
                raise ValueError(f"{self.model_name} was split with input {name!r}, which "
                                 "this call does not pass")
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"input {name!r} was a tensor when the model was split, got "
                                 f"{type(t).__name__}")
            if meta is not None and not _fits(t, meta):
                shape, dtype = meta
                shown = tuple("*" if d is None else d for d in shape)
                raise ValueError(
                    f"the stages are specialized to the example inputs: {name!r} had shape "
                    f"{shown} and dtype {dtype} when the model was split ('*': dynamic), got "
                    f"{tuple(t.shape)} and {t.dtype}; split again with an example of this shape")
        for name, first in self.captured.input_aliases.items():
            if name in inputs and inputs.get(first) is not inputs[name]:
                raise ValueError(
                    f"inputs {first!r} and {name!r} were the same tensor when the model was "
                    "split, so the stages read it once; pass the same tensor again, or split "
                    "with distinct example tensors")
        for name, value in self.captured.input_constants.items():
            if name not in inputs:
                raise ValueError(
                    f"non-tensor input {name!r} was {value!r} when the model was split, and "
                    "this call does not pass it; the stages have it baked in, split again")
            if not _same_constant(inputs[name], value):
                raise ValueError(
                    f"non-tensor input {name!r} was {value!r} when the model was split, got "
                    f"{inputs[name]!r}; the stages have it baked in, split again")

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Chain the stages in this process; returns what the model's forward returns."""
        if _training_flags(self.captured.root) != self._training:
            mode = "training" if self._training[0] else "eval"
            raise ValueError(
                f"{self.model_name} was split in {mode} mode and its train/eval mode has "
                "changed since; the stages have the mode baked in (dropout, BatchNorm): "
                "split again after switching")
        inputs = self.named_inputs(args, kwargs)
        flat = run_stages(self.stages, self.stage_signatures, inputs)
        return self.captured.rebuild_output(flat, inputs)

    __call__ = run

    def describe(self) -> str:
        """The plan summary, every stage's signature, then a table per stage:
        estimated compute cost, parameter/buffer bytes, and the activation
        bytes it sends and receives per microbatch (per call with the example
        inputs; a Pipeline splits with one microbatch). A value read by several
        later stages is sent to each; backward sends the gradients of those
        that require grad back the same way."""
        lines = [_C.describe_plan(self.ir.graph, self.plan).rstrip()]
        for sig in self.stage_signatures:
            lines.append(
                f"  stage {sig.stage}: inputs ({', '.join(sig.input_names)}) -> outputs "
                f"({', '.join(sig.output_names)}); {len(sig.parameters)} parameters, "
                f"{len(sig.buffers)} buffers")
        n = self.plan.num_stages
        sent, received = [0] * n, [0] * n
        for v in self.plan.cross_stage_values:
            sent[v.producer_stage] += v.bytes * len(v.consumer_stages)
            for c in v.consumer_stages:
                received[c] += v.bytes
        header = ("stage", "compute cost", "parameter bytes", "bytes sent", "bytes received")
        rows = [(str(s), f"{self.plan.stage_cost[s]:.4g}",
                 f"{self.plan.stage_parameter_bytes[s]:,}", f"{sent[s]:,}", f"{received[s]:,}")
                for s in range(n)]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines.append("  per stage, per microbatch:")
        for r in [header, *rows]:
            lines.append("    " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"SplitModel({self.model_name}, num_stages={self.num_stages}, "
                f"hash={self.plan.hash:016x})")


def _static_meta(value: Any, dynamic: set[int]) -> tuple[tuple, torch.dtype] | None:
    """(shape with None in the dynamic dims, dtype) of an example input."""
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(None if d in dynamic or isinstance(n, torch.SymInt) else int(n)
                  for d, n in enumerate(value.shape))
    return shape, value.dtype


def _fits(t: torch.Tensor, meta: tuple[tuple, torch.dtype]) -> bool:
    shape, dtype = meta
    return (t.dtype == dtype and t.dim() == len(shape) and
            all(want is None or want == got for want, got in zip(shape, t.shape)))


def _training_flags(module: torch.nn.Module | None) -> tuple[bool, ...]:
    return tuple(m.training for m in module.modules()) if module is not None else ()


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001  (objects with odd __eq__)
        return a is b


def split_model(module: torch.nn.Module, *example_args: Any,
                split_points: Sequence[str] | None = None, num_stages: int | None = None,
                bytes_cost: float | None = None,
                default_num_stages: int = 1, dynamic: bool = False,
                **example_kwargs: Any) -> SplitModel:
    """Capture ``module(*example_args, **example_kwargs)`` and split it into stages.

    Markers (``stage_boundary()``) in the model fix the stages; else
    ``split_points`` (module FQNs where a new stage begins); else ``num_stages``
    stages balanced by estimated cost (``default_num_stages`` when
    ``num_stages`` is None; ``bytes_cost`` prices the bytes crossing each
    cut, see :func:`partition`). ``num_stages`` given together with markers or
    split points must agree with them. ``dynamic``: sizes symbolic (see
    capture.capture; dims marked with torch._dynamo.mark_dynamic are either way).
    """
    captured = capture(module, example_args, example_kwargs, dynamic=dynamic)
    gm = captured.gm
    order_mutations(gm.graph)
    gm.recompile()
    ir = to_ir(gm, captured.placeholders, captured.module_ids)
    name = type(module).__name__
    plan = partition(ir, split_points=split_points, num_stages=num_stages,
                     known_modules=captured.module_fqns, what=name,
                     default_num_stages=default_num_stages, bytes_cost=bytes_cost)
    stages, signatures = build_stages(gm, ir, plan, captured.placeholders, captured.tensors,
                                      grad_enabled_at_capture=captured.grad_enabled)
    return SplitModel(captured, ir, plan, stages, signatures, name)

