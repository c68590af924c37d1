"""FX graph -> C++ graph IR (``torch_mpmd._C.Graph``).

The only module that reads FX graph details: node kinds, module FQNs from
``nn_module_stack``, output sizes from fake-tensor metadata, a cost estimate
(FLOPs for matmul-, conv- and attention-like ops, bytes moved for the rest),
and the split points named by module FQN. It also makes in-place mutation
explicit before partitioning (:func:`order_mutations`), so that the def-use
edges the partitioner sees carry every ordering the program relies on.

IR node ids are positions in FX order. The IR keeps no Marker nodes: a
``stage_boundary()`` call carries no value, so :class:`GraphIR` records where
the markers were (``marker_positions``) and the plan is always computed over
the same marker-free graph, whether the boundaries came from markers or from
``split_points``. The same boundaries therefore give the same plan and hash.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from torch_mpmd import _C
from torch_mpmd.graph.capture import CaptureError, PlaceholderInfo, size_hint
from torch_mpmd.graph.markers import is_stage_boundary

__all__ = [
    "GraphIR",
    "to_ir",
    "order_mutations",
    "is_written_alias",
    "resolve_split_points",
    "module_path_to_fqn",
    "node_cost",
    "value_bytes",
    "grad_mode_setting",
    "after",
    "setitem",
]

K = _C.NodeKind


def after(value: Any, *deps: Any) -> Any:
    """Identity on ``value`` that reads ``deps``: inserted after an in-place
    mutation so later readers of the mutated tensor depend on the mutation."""
    return value


def setitem(target: Any, index: Any, value: Any) -> Any:
    """``target[index] = value`` returning ``target`` (operator.setitem returns
    None), so the mutated tensor is the node's value."""
    target[index] = value
    return target


# ------------------------------------------------------------------ op names


def target_name(node: torch.fx.Node) -> str:
    """A readable op name: ``torch._C._nn.linear``, ``operator.add``, ``Tensor.add_``."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    if module in ("", "builtins", "_operator"):
        module = "operator" if module == "_operator" else module
    return f"{module}.{name}" if module else name


def _short_name(node: torch.fx.Node) -> str:
    """Last component of the op name without a trailing underscore pair: 'linear', 'add_'."""
    name = target_name(node).rsplit(".", 1)[-1]
    return name


_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial",
                 "exponential", "cauchy", "geometric", "log_normal", "poisson")


def _is_random(node: torch.fx.Node) -> bool:
    name = _short_name(node).lower()
    return any(w in name for w in _RANDOM_WORDS)


def grad_mode_setting(node: torch.fx.Node) -> bool | None:
    """For a ``torch._C._set_grad_enabled(flag)`` node (what Dynamo records
    for ``torch.no_grad()`` / ``torch.enable_grad()``), the flag; else None."""
    if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
        flag = node.args[0] if node.args else node.kwargs.get("mode")
        return bool(flag)
    return None


def _is_global_state(node: torch.fx.Node) -> bool:
    """Grad-mode and autocast switches: effects on global state, not values."""
    return grad_mode_setting(node) is not None or "autocast" in target_name(node)


# ------------------------------------------------------------------ mutation

_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}

_VIEW_NAMES = {"view", "view_as", "reshape", "reshape_as", "getitem", "__getitem__", "transpose",
               "t", "permute", "narrow", "select", "expand", "expand_as", "unsqueeze", "squeeze",
               "flatten", "unflatten", "as_strided", "split", "chunk", "unbind", "diagonal",
               "movedim", "moveaxis", "swapaxes", "swapdims", "detach", "contiguous", "T", "mT",
               "real", "imag", "view_as_real", "view_as_complex", "unfold", "split_with_sizes",
               "tensor_split", "hsplit", "vsplit", "alias",
               "after", "setitem"}  # this module's helpers return their first argument


def mutated_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor an in-place node writes to (its first argument), or None."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    first = node.args[0]
    if not isinstance(first, torch.fx.Node):
        return None
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        for arg, schema_arg in zip(node.args, target._schema.arguments):
            if schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
                return arg if isinstance(arg, torch.fx.Node) else None
        return None
    if node.op == "call_function" and target in _INPLACE_OPERATORS:
        return first
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        out = node.kwargs.get("out", first)
        return out if isinstance(out, torch.fx.Node) else None
    name = _short_name(node)
    if name.endswith("_") and not name.startswith("_") and not name.endswith("__"):
        return first
    return None


def _view_base(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op in ("call_function", "call_method") and node.args:
        if _short_name(node) in _VIEW_NAMES and isinstance(node.args[0], torch.fx.Node):
            return node.args[0]
    return None


_ALIAS_OF = "mpmd_alias_of"  # on a node: ids of the writes to its alias family
_WRITE_ID = "mpmd_write_id"  # on an in-place node: its write id


def _alias_family(v: torch.fx.Node) -> list[torch.fx.Node]:
    """``v``, its bases, and every view derived from any of them (transitively),
    in graph order: the nodes that may share memory with ``v``."""
    root = v
    seen = {root}
    while True:
        b = _view_base(root)
        if b is None or b in seen:
            break
        seen.add(b)
        root = b
    family = [root]
    members = {root}
    k = 0
    while k < len(family):
        a = family[k]
        k += 1
        for u in a.users:
            if u not in members and _view_base(u) is a:
                members.add(u)
                family.append(u)
    return family


def is_written_alias(node: torch.fx.Node) -> bool:
    """Whether :func:`order_mutations` found an in-place write to ``node`` or
    to a tensor it may share memory with (a base, a view, a view of a base)."""
    return bool(node.meta.get(_ALIAS_OF))


def order_mutations(graph: torch.fx.Graph) -> int:
    """Make every in-place mutation a def-use dependency of later readers.

    For a node ``m`` that writes tensor ``v``, the alias family of ``v`` is
    ``v``, its bases and every view taken of any of them (before or after
    ``m``). Each later reader of a family member ``a`` that existed before
    ``m`` reads ``after(a, m)`` instead, a node inserted right after ``m``.
    Values are unchanged (``after`` is the identity); what changes is that a
    reader on another stage now depends on the mutation, so the mutated
    tensor, not the value from before it, is what crosses stages. Every
    family member is marked (:func:`is_written_alias`) so that :func:`to_ir`
    classifies none of them as a Constant (which a later stage would rebuild
    without the write) when the write itself is not a Constant. Returns the
    number of nodes inserted.
    """
    position: dict[torch.fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    inserted = 0
    next_id = 1 + max((n.meta[_WRITE_ID] for n in graph.nodes if _WRITE_ID in n.meta), default=-1)
    for m in list(graph.nodes):
        v = mutated_arg(m)
        if v is None:
            continue
        if m.op == "call_function" and m.target is operator.setitem:
            m.target = setitem
            m.meta.update({k: v.meta[k] for k in ("example_value", "val") if k in v.meta})
        family = _alias_family(v)
        write_id = next_id
        next_id += 1
        m.meta[_WRITE_ID] = write_id
        for a in family + [m]:
            a.meta[_ALIAS_OF] = a.meta.get(_ALIAS_OF, ()) + (write_id,)
        # Members from before m, each with its readers after m (collected before
        # any insertion, so the inserted after() nodes are never redirected).
        redirects = []
        for a in family:
            if a is m or position.get(a, float("inf")) >= position[m]:
                continue
            later = [u for u in a.users if u is not m and position.get(u, -1) > position[m]]
            if later:
                redirects.append((a, later))
        cursor = m
        for k, (a, later) in enumerate(redirects):
            with graph.inserting_after(cursor):
                dep = graph.call_function(after, (a, m))
            dep.meta.update({k: a.meta[k] for k in ("example_value", "val") if k in a.meta})
            dep.meta[_ALIAS_OF] = (write_id,)
            if "nn_module_stack" in m.meta:
                dep.meta["nn_module_stack"] = m.meta["nn_module_stack"]
            # Between m and its successor; never "later" than m for this or other aliases.
            position[dep] = position[m] + (1 - 0.5 ** (min(k, 40) + 1)) / 2
            for u in later:
                u.replace_input_with(a, dep)
            cursor = dep
            inserted += 1
    return inserted


# ------------------------------------------------------------------ sizes and costs


def _meta_value(node: Any) -> Any:
    """The example value of ``node`` for costs and bytes, DTensors replaced by
    their local shards.

    NOTE [Local shapes]: inside a tensor-parallel region Dynamo's example
    values are DTensors of the global shape, while each rank computes and
    holds its local shard: costs and bytes are this rank's, so a split
    balances what the ranks actually run (a column-parallel layer costs 1/tp
    of the dense one)."""
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(
        node, torch.fx.Node) else node
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(v, dtensor) for v in pytree.tree_leaves(value)):
        value = pytree.tree_map_only(dtensor, lambda t: t._local_tensor, value)
    return value


@functools.cache
def _dtensor_type() -> Any:
    """torch's DTensor class, or None for a torch built without distributed
    (stage.py uses it too)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


_hint = size_hint  # (capture.py)


def value_bytes(value: Any) -> int:
    """Bytes of every tensor in a (possibly nested) value."""
    total = 0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            total += _numel(leaf) * leaf.element_size()
    return total


def _numel(t: Any) -> int:
    return math.prod(_hint(d) for d in t.shape) if isinstance(t, torch.Tensor) else 0


def _dim(t: torch.Tensor, i: int) -> int:
    return _hint(t.shape[i])


def _prod_dims(t: torch.Tensor, start: int) -> int:
    return math.prod(_hint(d) for d in t.shape[start:])


def _einsum_flops(equation: str, operands: Sequence[Any]) -> float:
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, t in zip(lhs, operands):
        if not isinstance(t, torch.Tensor) or "..." in spec:
            return 0.0
        for letter, size in zip(spec, t.shape):
            sizes[letter] = int(size)
    return 2.0 * math.prod(sizes.values()) if sizes else 0.0


def _flops(node: torch.fx.Node) -> float | None:
    """FLOPs of matmul-, conv- and attention-like ops; None for other ops."""
    name = _short_name(node).rstrip("_")
    if node.op == "call_module":
        return None
    args = [_meta_value(a) for a in node.args]
    out = _meta_value(node)
    if name in ("linear",) and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        return 2.0 * _numel(out) * _dim(args[1], -1)
    if name in ("matmul", "__matmul__", "mm", "bmm", "imatmul", "rmatmul", "__rmatmul__"):
        a = args[0] if name not in ("rmatmul", "__rmatmul__") else args[1]
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return 2.0 * _numel(out) * _dim(a, -1)
    if name in ("addmm", "baddbmm", "addbmm", "addmv") and len(args) >= 2:
        a = args[1]
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return 2.0 * _numel(out) * _dim(a, -1)
    if name.startswith("conv") and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        w = args[1]
        if "transpose" in name:
            # weight [C_in, C_out/groups, *k]: every input element meets C_out/groups * k.
            return 2.0 * _numel(args[0]) * _prod_dims(w, 1)
        return 2.0 * _numel(out) * _prod_dims(w, 1)
    if "scaled_dot_product_attention" in name or name in ("_flash_attention_forward",):
        q, k = (args + [None, None])[:2]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            s = _dim(k, -2)
            return 2.0 * _numel(q) * s + 2.0 * (_numel(out) if isinstance(out, torch.Tensor)
                                                 else _numel(q)) * s
    if name == "einsum" and node.args and isinstance(node.args[0], str):
        ops = args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        return _einsum_flops(node.args[0], [_meta_value(o) for o in ops])
    return None


def node_cost(node: torch.fx.Node) -> float:
    """Estimated time units: FLOPs for matmul/conv/attention-like ops, else the
    bytes the node reads and writes."""
    flops = _flops(node)
    if flops is not None:
        return float(flops)
    read = sum(value_bytes(_meta_value(n)) for n in node.all_input_nodes)
    return float(read + value_bytes(_meta_value(node)))


# ------------------------------------------------------------------ module FQNs

_PATH_TOKEN = re.compile(
    r"\._modules\[['\"]([^'\"]*)['\"]\]"     # ._modules['layers']
    r"|\.(\w+)"                             # .layers, .0
    r"|\[(\d+)\]"                           # [0]
    r"|\[['\"]([^'\"]*)['\"]\]")            # ['name']


def module_path_to_fqn(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[0]._modules['attn']``) to a
    plain FQN (``layers.0.attn``). The leading local/global is the root."""
    path = path.strip()
    m = re.match(r"^(?:[LG]\[['\"][^'\"]*['\"]\]|[A-Za-z_]\w*)", path)
    rest = path[m.end():] if m else path
    parts = []
    for tok in _PATH_TOKEN.finditer(rest):
        parts.append(next(g for g in tok.groups() if g is not None))
    return ".".join(parts)


def _module_fqn(node: torch.fx.Node, module_ids: Mapping[int, str] | None) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    key, value = list(stack.items())[-1]
    if module_ids is not None:
        try:
            fqn = module_ids.get(int(str(key).split("_")[0]))
        except ValueError:
            fqn = None
        if fqn is not None:
            return fqn
    path = value[0] if isinstance(value, tuple) else str(value)
    return module_path_to_fqn(path)


# ------------------------------------------------------------------ the IR


@dataclass
class GraphIR:
    """The IR of a captured graph and its link back to FX.

    ``graph`` has no Marker nodes; ``fx_nodes[i]`` is the FX node of IR node i.
    ``marker_positions[k]`` is the number of IR nodes before the k-th marker
    (so markers can be put back, see :meth:`graph_with_markers`).
    """

    graph: _C.Graph
    fx_nodes: list[torch.fx.Node]
    kinds: list[Any]
    marker_positions: list[int] = field(default_factory=list)
    marker_names: list[str] = field(default_factory=list)
    module_fqns: list[str] = field(default_factory=list)  # in program order, deduplicated

    def __post_init__(self) -> None:
        self.index = {n: i for i, n in enumerate(self.fx_nodes)}

    @property
    def num_markers(self) -> int:
        return len(self.marker_positions)

    def graph_with_markers(self) -> _C.Graph:
        """The same graph with the Marker nodes in their places (ids shifted)."""
        g = _C.Graph()
        nodes = self.graph.nodes
        new_id: list[int] = []
        k = 0
        for i, node in enumerate(nodes):
            while k < len(self.marker_positions) and self.marker_positions[k] == i:
                g.add_node(K.MARKER, self.marker_names[k], "mpmd.stage_boundary.default")
                k += 1
            new_id.append(len(g))
            g.add_node(node.kind, node.name, node.target, node.module_fqn, node.fqn,
                       [new_id[j] for j in node.inputs], node.cost, node.output_bytes)
        return g

    def marker_stage_starts(self) -> list[int]:
        """IR ids of the first Compute node after each marker (what the
        markers mean as ``partition_at_nodes`` stage starts)."""
        nodes = self.graph.nodes
        starts = []
        for pos in self.marker_positions:
            nxt = next((i for i in range(pos, len(nodes)) if nodes[i].kind == K.COMPUTE), None)
            starts.append(nxt if nxt is not None else len(nodes) - 1)
        return starts


_HOP_NAMES = {"cond": "torch.cond", "tag_activation_checkpoint": "torch.utils.checkpoint",
              "checkpoint": "torch.utils.checkpoint", "while_loop": "torch.while_loop",
              "map_impl": "torch.map", "wrap": "a wrapped region",
              "wrap_with_autocast": "a torch.autocast region",
              "wrap_with_set_grad_enabled": "a grad-mode region"}


def _has_marker(graph: torch.fx.Graph, root: torch.nn.Module) -> bool:
    """Whether ``graph`` (or a subgraph it calls, at any depth) has a marker."""
    for node in graph.nodes:
        if node.op == "call_function" and is_stage_boundary(node.target):
            return True
        if node.op == "get_attr":
            sub = _get_attr(root, str(node.target))
            if isinstance(sub, torch.fx.GraphModule) and _has_marker(sub.graph, sub):
                return True
    return False


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(root)
    except AttributeError:
        return None


def _check_no_nested_markers(gm: torch.fx.GraphModule) -> None:
    """A marker inside a higher-order op's body (torch.cond branch, checkpointed
    region) cannot split the graph: refuse it instead of dropping it."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        sub = _get_attr(gm, str(node.target))
        if not isinstance(sub, torch.fx.GraphModule) or not _has_marker(sub.graph, sub):
            continue
        users = [u for u in node.users if u.op == "call_function"]
        hop = _short_name(users[0]) if users else "a higher-order op"
        what = _HOP_NAMES.get(hop, hop)
        raise CaptureError(
            f"stage_boundary() inside the {what} body {str(node.target)!r} (called by "
            f"{users[0].name if users else 'no node'!r}) is not supported: a stage boundary "
            f"cannot split a {what} region; put the boundary outside it")


def _subgraph_module_fqn(gm: torch.fx.GraphModule, node: torch.fx.Node,
                         module_ids: Mapping[int, str] | None) -> str:
    """For a higher-order op (``checkpoint(layer, x)``, ``torch.cond``) whose body
    runs inside a submodule deeper than the op's own module: that submodule's FQN
    (the deepest module every op of its bodies runs in), so that a split point
    can name a checkpointed layer. "" otherwise."""
    if node.op != "call_function":
        return ""
    fqns: list[list[str]] = []
    for a in node.all_input_nodes:
        sub = _get_attr(gm, str(a.target)) if a.op == "get_attr" else None
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op in ("call_function", "call_method", "call_module"):
                fqn = _module_fqn(n, module_ids)
                fqns.append(fqn.split(".") if fqn else [])
    if not fqns:
        return ""
    common: list[str] = []
    for parts in zip(*fqns):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    inner = ".".join(common)
    own = _module_fqn(node, module_ids)
    if inner and len(inner) > len(own) and (not own or inner.startswith(own + ".")):
        return inner
    return ""


def _is_pure(node: torch.fx.Node) -> bool:
    return not (_is_random(node) or _is_global_state(node) or node.op == "call_module"
                or (node.op == "call_function" and node.target in
                    torch.fx.node._side_effectful_functions))


def _non_constant_writes(graph: torch.fx.Graph) -> set[int]:
    """Ids of the in-place writes (see :func:`order_mutations`) that are not
    Constants, once every alias family such a write touches is itself kept
    from being Constant (a fixpoint: un-Constant members can make more writes
    non-Constant)."""
    poisoned: set[int] = set()
    while True:
        const: dict[torch.fx.Node, bool] = {}
        for node in graph.nodes:
            if node.op == "call_function" and is_stage_boundary(node.target):
                continue
            if node.op in ("placeholder", "output"):
                const[node] = False
            elif node.op == "get_attr":
                const[node] = True
            else:
                const[node] = (all(const.get(a, True) for a in node.all_input_nodes)
                               and _is_pure(node)
                               and not poisoned.intersection(node.meta.get(_ALIAS_OF, ())))
        found = {n.meta[_WRITE_ID] for n, c in const.items() if not c and _WRITE_ID in n.meta}
        if found <= poisoned:
            return poisoned
        poisoned |= found


def to_ir(gm: torch.fx.GraphModule, placeholders: Sequence[PlaceholderInfo],
          module_ids: Mapping[int, str] | None = None) -> GraphIR:
    """Build the IR of ``gm``; ``placeholders`` says what each placeholder is.

    A CaptureError if a marker sits inside a higher-order op's subgraph."""
    _check_no_nested_markers(gm)
    g = _C.Graph()
    fx_nodes: list[torch.fx.Node] = []
    kinds: list[Any] = []
    index: dict[torch.fx.Node, int] = {}
    marker_positions: list[int] = []
    marker_names: list[str] = []
    module_fqns: dict[str, None] = {}
    ph = iter(placeholders)
    poisoned = _non_constant_writes(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_stage_boundary(node.target):
            marker_positions.append(len(fx_nodes))
            marker_names.append(node.name)
            continue
        inputs = []
        for a in node.all_input_nodes:
            if a in index and index[a] not in inputs:
                inputs.append(index[a])
        fqn = ""
        module_fqn = ""
        cost = 0.0
        out_bytes = value_bytes(_meta_value(node))
        if node.op == "placeholder":
            info = next(ph)
            # A symbolic size (dynamic capture) is known to every stage from its
            # own inputs' shapes: a Constant, recomputed where it is read.
            kind = {"input": K.INPUT, "parameter": K.PARAMETER, "buffer": K.BUFFER,
                    "size": K.CONSTANT}[info.kind]
            fqn = info.name if info.kind in ("parameter", "buffer") else ""
        elif node.op == "output":
            kind = K.OUTPUT
            out_bytes = sum(value_bytes(_meta_value(a)) for a in node.all_input_nodes)
        elif node.op == "get_attr":
            kind = K.CONSTANT
        else:
            module_fqn = _subgraph_module_fqn(gm, node, module_ids) or _module_fqn(
                node, module_ids)
            all_const = all(kinds[i] == K.CONSTANT for i in inputs)
            pure = _is_pure(node)
            # A tensor sharing memory with one that a non-Constant in-place write
            # changes is not a Constant: a stage rebuilding it would miss the write.
            written = bool(poisoned.intersection(node.meta.get(_ALIAS_OF, ())))
            kind = K.CONSTANT if all_const and pure and not written else K.COMPUTE
            if kind == K.COMPUTE:
                cost = 0.0 if _is_global_state(node) else node_cost(node)
                if module_fqn not in module_fqns:
                    module_fqns[module_fqn] = None
        index[node] = g.add_node(kind, node.name, target_name(node), module_fqn, fqn, inputs,
                                 cost, out_bytes)
        fx_nodes.append(node)
        kinds.append(kind)
    return GraphIR(g, fx_nodes, kinds, marker_positions, marker_names, list(module_fqns))


# ------------------------------------------------------------------ split points


def _closest(name: str, known: Sequence[str], n: int = 5) -> list[str]:
    close = difflib.get_close_matches(name, known, n=n, cutoff=0.5)
    if close:
        return close
    prefix = name.split(".")[0]
    return [k for k in known if k.split(".")[0] == prefix][:n] or list(known)[:n]


def resolve_split_points(ir: GraphIR, split_points: Sequence[str],
                         known_modules: Sequence[str] | None = None) -> list[int]:
    """IR ids of the first Compute node traced inside each named module.

    ValueError for an unknown FQN (listing the closest known module FQNs),
    a module that runs no compute, or split points out of program order.
    """
    if isinstance(split_points, str):
        raise TypeError(f"split_points must be a list of module FQNs, got the string "
                        f"{split_points!r} (did you mean [{split_points!r}]?)")
    known = [k for k in (known_modules if known_modules is not None else ir.module_fqns) if k]
    nodes = ir.graph.nodes
    starts: list[int] = []
    for fqn in split_points:
        if not isinstance(fqn, str) or not fqn:
            raise ValueError(f"split_points entries must be non-empty module FQNs, got {fqn!r}")
        first = next((i for i, nd in enumerate(nodes) if nd.kind == K.COMPUTE and (
            nd.module_fqn == fqn or nd.module_fqn.startswith(fqn + "."))), None)
        if first is None:
            if fqn in known:
                raise ValueError(
                    f"split point {fqn!r} names a module that runs no computation in forward "
                    f"(it is never called, or only its parameters are used elsewhere); name a "
                    "module whose forward runs")
            raise ValueError(
                f"split point {fqn!r} is not a module of the model; closest module FQNs: "
                f"{', '.join(repr(k) for k in _closest(fqn, known))}")
        starts.append(first)
    for k in range(1, len(starts)):
        if starts[k] <= starts[k - 1]:
            a, b = split_points[k - 1], split_points[k]
            when = "at the same op as" if starts[k] == starts[k - 1] else "before"
            raise ValueError(
                f"split_points must follow program order: {b!r} (first op "
                f"{nodes[starts[k]].name!r}) runs {when} {a!r} (first op "
                f"{nodes[starts[k - 1]].name!r}); list {b!r} before {a!r} or drop one")
    return starts

