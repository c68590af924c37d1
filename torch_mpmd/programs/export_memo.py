"""Joint graphs kept for the process: a stage traced by AOTAutograd once is
not traced again (NOTE [Export memo]).

NOTE [Export memo]: building a stage's programs starts with AOTAutograd
tracing the stage (and on the last stage the loss) into one joint forward
and backward graph, 0.1-1 s a stage on two cores. The same stage is traced
again and again in one process: every schedule of the same model, split and
microbatch size has the same stages (plan trials, the planner's
calibration, test grids), and so does a copy of the model (its capture
comes from the capture memo). A trace is kept under a key of everything it
reads:

- the stage's code: every node of each GraphModule, its op, target,
  arguments and metadata (an activation checkpoint's tags live there),
  fake values aside (the inputs' descriptions below fix them);
- the stage's parameters and buffers in order: shape, dtype, strides,
  storage size, device, whether each requires grad, which are one tensor;
- the inputs' descriptions, and which inputs share storage;
- how the stage is wrapped (inputs received and sent, outputs cloned), the
  decomposition table, and the torch state a trace reads (grad mode,
  autocast, default dtype);
- on the last stage, the loss: the user's loss function named as the
  capture store names functions (module, code, defaults, closure), the
  Python state it reads (NOTE [Loss state]: a global flag, a module's
  attribute; objects by identity, watched by weak reference so that a dead
  object's id never matches a new one), and the model's output structure.
  A trace that changed what the loss reads (a stateful loss) is not kept.

NOTE [Stages alike]: the key holds no name the model gave. Parameters,
buffers and submodules go by position, nodes by their place in the graph,
the inputs by position; the module stack and provenance are left out, the
capture's write ids renumbered by appearance. So stages that differ only in
names share one trace: a model's equal blocks (each a unit the profile
times, at two sizes), the middle stages of a V schedule on one rank. A hit
renames the kept trace's descriptors, which name the parameters and buffers
the program reads, to the stage's own (by position: the key holds their
order, descriptions and ties).

A tensor parallel stage's DTensors are keyed by their global layout,
placements, mesh (with this rank's process groups: a trace's collectives
name them) and local shard; a DeviceMesh a node takes, by the same.
Anything the key cannot describe is not kept: another tensor subclass, a
constant tensor the graph reads (its values are in the trace),
a module that is not a graph, symbolic sizes, a loss function with no name
across calls (a lambda closing over an instance). A hit hands out a copy of
the kept graph (the caller rewrites it). ``MPMD_EXPORT_MEMO=0`` turns it off.

NOTE [Partitions kept]: cutting a joint graph into F and B (torch's default
partitioner, programs/partition.py) took 40 ms a stage, as long as three
copies of its graphs, and a kept trace is handed out again and again (a
planner's profile, calibration and trials build one stage many times): F
and B are kept beside the trace, under its key, and a hit hands out copies,
or the kept graphs themselves where nothing will change them (FX programs,
not compiled: Inductor rewrites a graph it compiles).
They name no parameter (their inputs are the joint's positions; the
descriptors that name parameters stay on the joint), so a stage alike but
for its names shares them too. They go when their trace goes.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_mpmd.graph.capture_memo import mesh_key

__all__ = ["LossKey", "clear", "export_key", "exported", "lookup", "loss_key", "partitioned",
           "stats", "store"]

# Kept traces (least recently used go first beyond it): joint graphs over
# fake values, small beside the programs built from them.
_MAX_ENTRIES = 64
# Node metadata the key leaves out: fake values (the inputs' descriptions
# fix them), the capture's sources, and where in the user's code and model a
# node came from (no bearing on what it computes; the module stack names a
# block's index: NOTE [Stages alike]).
_UNKEYED_META = frozenset({"val", "example_value", "tensor_meta", "grapharg", "mpmd_source",
                           "stack_trace", "source_fn_stack", "fwd_source_fn_stack",
                           "nn_module_stack", "torch_fn", "from_node"})
# Node metadata holding the capture's write ids (graph/fx_to_ir.py): keyed
# by order of appearance, not by their numbers, which count across the model.
_WRITE_IDS = frozenset({"mpmd_alias_of", "mpmd_write_id"})

_kept: collections.OrderedDict[str, tuple[torch.fx.GraphModule, Any, tuple, tuple]] = \
    collections.OrderedDict()
_stats = {"hits": 0, "misses": 0, "not_keyed": 0, "partitions_kept": 0}
# F and B of a kept trace, under its key (NOTE [Partitions kept]).
_parts: dict[str, tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}
# Where exported() marks a joint graph with its key, for partitioned().
_KEY_META = "mpmd_export_key"


def enabled() -> bool:
    return os.environ.get("MPMD_EXPORT_MEMO", "1") != "0"


def stats() -> dict[str, int]:
    """Hits, misses and traces the key could not describe, since start, and
    the traces kept now."""
    return {**_stats, "kept": len(_kept)}


def clear() -> None:
    _kept.clear()
    _parts.clear()


def _drop(key: str) -> None:
    _kept.pop(key, None)
    _parts.pop(key, None)


class _NotKeyed(Exception):
    """What a trace reads has no description the key can hold."""


def _tensor(t: Any, *, parameter: bool = False) -> tuple:
    allowed = (torch.nn.Parameter, torch.Tensor) if parameter else (torch.Tensor,)
    if type(t) not in allowed:
        from torch.distributed.tensor import DTensor

        if type(t) is not DTensor:
            raise _NotKeyed(f"a {type(t).__name__}")
        # Tensor parallel: the global layout, how it is laid out over which
        # mesh (its process groups: capture_memo.mesh_key), and the shard.
        return ("DTensor", tuple(t.shape), tuple(t.stride()), str(t.dtype), t.requires_grad,
                t.is_leaf, tuple(map(str, t.placements)), mesh_key(t.device_mesh),
                _tensor(t._local_tensor))
    if any(isinstance(s, torch.SymInt) for s in t.shape):
        raise _NotKeyed("symbolic sizes")
    # The storage's size too: a parked or resharded parameter has its layout
    # and an empty storage (NOTE [Resharding frees the storage]).
    return (tuple(t.shape), str(t.dtype), tuple(t.stride()), t.storage_offset(), str(t.device),
            t.requires_grad, t.is_leaf, t.untyped_storage().nbytes())


def _graph(stage: torch.fx.GraphModule) -> list:
    """The stage's code, its tensors' descriptions and its nodes' metadata,
    with every name the model gave replaced by a position (NOTE [Stages
    alike])."""
    params = list(stage.named_parameters(remove_duplicate=False))
    buffers = list(stage.named_buffers(remove_duplicate=False))
    canon: dict[str, tuple] = {}  # a name the code reads: its position
    first: dict[int, tuple] = {}  # a tensor under two names (tied weights): its first position
    parts: list = []
    for kind, named in (("param", params), ("buffer", buffers)):
        for i, (name, t) in enumerate(named):
            canon.setdefault(name, (kind, i))
            described = _tensor(t, parameter=True) if kind == "param" else _tensor(t)
            parts.append((kind, described, first.setdefault(id(t), (kind, i))))
    modules = list(stage.named_modules(remove_duplicate=False))
    for i, (prefix, _) in enumerate(modules):
        canon.setdefault(prefix, ("module", i))
    writes: dict[Any, int] = {}  # the capture's write ids, by first appearance

    def renumbered(ids: Any) -> Any:
        if isinstance(ids, (tuple, list)):
            return tuple(writes.setdefault(w, len(writes)) for w in ids)
        return writes.setdefault(ids, len(writes))

    for m, (prefix, module) in enumerate(modules):
        if type(module) is torch.nn.Module:  # a container GraphModule made for dotted names
            continue
        if not isinstance(module, torch.fx.GraphModule):
            raise _NotKeyed(f"a {type(module).__name__} module")
        index = {node: k for k, node in enumerate(module.graph.nodes)}

        def positional(a: Any) -> Any:
            if not isinstance(a, torch.fx.Node):
                return a
            if a not in index:  # (FX forbids it; a key must not guess)
                raise _NotKeyed(f"a node of another graph: {a.name}")
            return ("node", index[a])

        for node in module.graph.nodes:
            target: Any = str(node.target)
            if node.op == "get_attr":
                full = f"{prefix}.{node.target}" if prefix else str(node.target)
                target = canon.get(full) or ("constant", _opaque(stage, full))
            elif node.op == "call_module":
                raise _NotKeyed("a call_module node")
            elif node.op == "placeholder":
                target = None  # a graph's inputs are positional
            meta = sorted((k, repr(renumbered(v)) if k in _WRITE_IDS else repr(v))
                          for k, v in node.meta.items() if k not in _UNKEYED_META)
            parts.append((m, node.op, target,
                          repr(torch.fx.node.map_aggregate(node.args, positional)),
                          repr(torch.fx.node.map_aggregate(node.kwargs, positional)),
                          meta, _meshes(node)))
    return parts


def _names(stage: torch.fx.GraphModule) -> tuple[str, ...]:
    """The stage's parameter and buffer names, in the order :func:`_graph`
    gives them positions."""
    return (*(n for n, _ in stage.named_parameters(remove_duplicate=False)),
            *(n for n, _ in stage.named_buffers(remove_duplicate=False)))


def _renamed(desc: Any, names: dict[str, str]) -> Any:
    """An AOTAutograd descriptor with the parameter or buffer it names (at any
    depth: a gradient's, a mutation's, a DTensor shard's) renamed by ``names``."""
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, (d.ParamAOTInput, d.BufferAOTInput)):
        return dataclasses.replace(desc, target=names.get(desc.target, desc.target))
    if dataclasses.is_dataclass(desc) and not isinstance(desc, type):
        changes = {f.name: _renamed(getattr(desc, f.name), names)
                   for f in dataclasses.fields(desc)
                   if dataclasses.is_dataclass(getattr(desc, f.name))}
        return dataclasses.replace(desc, **changes) if changes else desc
    return desc


def _rename(joint: torch.fx.GraphModule, names: dict[str, str]) -> None:
    """Rename, in place, the parameters and buffers ``joint``'s inputs and
    outputs describe (their descriptors: stage_programs reads the stage's
    tensors by these names)."""
    for node in joint.graph.nodes:
        desc = node.meta.get("desc")
        if node.op == "placeholder" and desc is not None:
            node.meta["desc"] = _renamed(desc, names)
        elif node.op == "output" and desc is not None:
            node.meta["desc"] = [_renamed(x, names) for x in desc]


def _opaque(stage: torch.fx.GraphModule, target: str) -> tuple:
    """A constant the graph reads that is not a tensor: a tensor parallel
    model's DeviceMesh or ProcessGroup (NOTE [Opaque inputs] in
    graph/capture.py), by its process groups; anything else is not keyed."""
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    value: Any = stage
    for atom in target.split("."):
        value = getattr(value, atom, None)
    if isinstance(value, DeviceMesh):
        return mesh_key(value)
    if isinstance(value, ProcessGroup):  # its name, and the object (repr: its address)
        return ("ProcessGroup", value.group_name, repr(value))
    raise _NotKeyed(f"a constant {target}")


def _meshes(node: torch.fx.Node) -> list:
    """The DeviceMeshes a node takes as arguments (a DTensor made from a
    local tensor), by their process groups: the generated code names them,
    it does not describe them."""
    from torch.distributed.device_mesh import DeviceMesh

    found: list = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(
        mesh_key(a)) if isinstance(a, DeviceMesh) else None)
    return found


def _inputs(args: Sequence[Any]) -> list:
    """Each input's description, and for a tensor the first input sharing
    its storage."""
    parts: list = []
    storages: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            described = _tensor(a)  # (a fake tensor of a dynamic capture is not keyed)
            ptr = getattr(a, "_local_tensor", a).untyped_storage().data_ptr()  # a DTensor's shard
            first = storages.setdefault(ptr, i) if ptr else i
            parts.append(("tensor", described, first))
        elif type(a) is int:
            parts.append(("int", a))
        else:
            raise _NotKeyed(f"an input of type {type(a).__name__}")
    return parts


@dataclasses.dataclass(frozen=True)
class LossKey:
    """What a last stage's trace reads of the loss (stage_programs.loss_tail):
    ``text``, the key's part; ``identities``, the objects it names by id
    (NOTE [Loss state]), watched by weak reference: an entry whose object
    died is dropped, as another object may now have its id; ``loss_fn`` and
    ``state``, to tell a loss that changed what it reads while traced (a
    stateful loss, which the runner runs under autograd): not kept."""

    text: str
    identities: tuple
    loss_fn: Any
    state: tuple

    def unchanged(self) -> bool:
        from torch_mpmd.programs.loss_state import loss_state

        return loss_state(self.loss_fn) == self.state


def loss_key(loss_fn: Any, rebuild_output: Any, user_names: Sequence[str],
             target_spec: Any) -> LossKey | None:
    """The key of the loss a last stage traces (stage_programs.loss_tail):
    the loss function by name (graph.names: code, defaults, closure), the
    Python state it reads (programs.loss_state: globals, attributes) and
    the model's output structure (``rebuild_output`` of a capture); None
    when one of them has no such description."""
    from torch_mpmd.graph.capture import CapturedGraph
    from torch_mpmd.graph.names import Unnamed, name_of
    from torch_mpmd.programs.loss_state import loss_state

    captured = getattr(rebuild_output, "__self__", None)
    if not enabled() or not isinstance(captured, CapturedGraph) or captured.output_spec is None:
        return None
    leaves = []
    for leaf in captured.output_leaves:
        if leaf.source == "tensor":  # a model tensor returned: its values would be traced
            return None
        leaves.append((leaf.source, leaf.index, leaf.name,
                       repr(leaf.value) if leaf.source == "constant" else None))
    try:
        fn = name_of(loss_fn) if loss_fn is not None else None
    except (Unnamed, RecursionError):
        return None
    identities: list = []
    state = loss_state(loss_fn, identities)
    try:
        watched = tuple(weakref.ref(o) for o in identities)
    except TypeError:  # an object with no weak reference (a builtin): not kept
        return None
    text = repr((fn, state, str(captured.output_spec), leaves, tuple(user_names),
                 str(target_spec)))
    return LossKey(text, watched, loss_fn, state)


def export_key(stage: torch.fx.GraphModule, args: Sequence[Any], *, num_user: int,
               num_received: int, num_sent: int, clone_outputs: frozenset[int],
               loss: Any, decomposed: bool) -> str | None:
    """The key of tracing ``stage`` (stage_programs._Traced over it) at
    ``args``, or None when it cannot be kept (see the module docstring).
    ``loss``: the last stage's loss callable (its ``memo_key`` attribute,
    from :func:`loss_key`), None elsewhere; ``decomposed``: traced with
    Inductor's decomposition table."""
    if not enabled():
        return None
    loss_part = None
    if loss is not None:
        memo = getattr(loss, "memo_key", None)
        if memo is None:
            _stats["not_keyed"] += 1
            return None
        loss_part = memo.text
    try:
        parts = [_graph(stage), _inputs(args)]
    except (_NotKeyed, RuntimeError):  # RuntimeError: a tensor with no storage to read
        _stats["not_keyed"] += 1
        return None
    state = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
             torch.is_autocast_enabled("cuda"), str(torch.get_default_dtype()),
             torch.are_deterministic_algorithms_enabled())
    text = repr((parts, num_user, num_received, num_sent, sorted(clone_outputs), loss_part,
                 decomposed, state))
    return hashlib.sha256(text.encode()).hexdigest()


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node metadata copied
    one level deep: the fake values are shared), ``gm``'s attributes."""
    with warnings.catch_warnings():  # copying a graph's output TreeSpec (torch 2.13)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                category=FutureWarning)
        graph = copy.deepcopy(gm.graph)
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def lookup(key: str | None, names: Sequence[str] = ()) -> tuple[torch.fx.GraphModule, Any] | None:
    """A copy of the joint graph kept under ``key`` and its AOTAutograd
    metadata (shared: read only), or None. ``names``: the parameters and
    buffers, in :func:`_names`' order, as the caller's descriptors name them;
    the copy's descriptors are renamed from the kept stage's to these (NOTE
    [Stages alike]). An entry one of whose loss's objects died is dropped
    (see :class:`LossKey`)."""
    if key is None:
        return None
    kept = _kept.get(key)
    if kept is not None and any(ref() is None for ref in kept[2]):
        _drop(key)
        kept = None
    if kept is None:
        _stats["misses"] += 1
        return None
    _kept.move_to_end(key)
    _stats["hits"] += 1
    joint = _copy(kept[0])
    renames = {old: new for old, new in zip(kept[3], names) if old != new}
    if renames:
        _rename(joint, renames)
    return joint, kept[1]


def store(key: str | None, joint: torch.fx.GraphModule, meta: Any,
          watched: tuple = (), names: Sequence[str] = ()) -> None:
    """Keep a copy of ``joint`` (taken before the caller rewrites it), valid
    while every weak reference in ``watched`` lives; ``names``: as its
    descriptors name the stage's parameters and buffers (see :func:`lookup`)."""
    if key is None:
        return
    _kept[key] = (_copy(joint), meta, watched, tuple(names))
    _kept.move_to_end(key)
    while len(_kept) > _MAX_ENTRIES:
        _drop(next(iter(_kept)))


def exported(stage: torch.fx.GraphModule, args: Sequence[Any], *, num_user: int,
             num_received: int, num_sent: int, clone_outputs: frozenset[int], loss: Any,
             decomposed: bool, export: Callable[[], tuple[torch.fx.GraphModule, Any]],
             prefix: str = "") -> tuple[torch.fx.GraphModule, Any]:
    """The joint graph and metadata of tracing ``stage`` at ``args`` (see
    :func:`export_key`): kept from an earlier trace, or ``export()``'s, kept
    for later ones (not when tracing the loss changed what the loss reads).
    ``prefix``: what the traced module's descriptors put before the stage's
    own parameter and buffer names (its attribute holding ``stage``)."""
    key = export_key(stage, args, num_user=num_user, num_received=num_received,
                     num_sent=num_sent, clone_outputs=clone_outputs, loss=loss,
                     decomposed=decomposed)
    names = [prefix + n for n in _names(stage)] if key is not None else []
    kept = lookup(key, names)
    if kept is not None:
        kept[0].meta[_KEY_META] = key
        return kept
    joint, meta = export()
    memo = getattr(loss, "memo_key", None) if loss is not None else None
    if memo is None or memo.unchanged():
        store(key, joint, meta, memo.identities if memo is not None else (), names)
    joint.meta[_KEY_META] = key
    return joint, meta


def partitioned(joint: torch.fx.GraphModule,
                partition: Callable[[], tuple[torch.fx.GraphModule, torch.fx.GraphModule]],
                *, shared: bool = False) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """F and B of ``joint`` (as :func:`exported` handed it out, rewritten
    since only by what its key determines): copies of those kept for its
    trace, or ``partition()``'s, kept while the trace is (NOTE [Partitions
    kept]). A joint graph of no kept trace is partitioned and not kept.
    ``shared``: the caller never changes the graphs (FX programs run as they
    are; a compiler rewrites them), so a hit hands out the kept ones
    themselves, not copies."""
    key = joint.meta.get(_KEY_META)
    if key is None or key not in _kept:
        return partition()
    parts = _parts.get(key)
    if parts is not None:
        _stats["partitions_kept"] += 1
        return parts if shared else (_copy(parts[0]), _copy(parts[1]))
    fw, bw = partition()
    _parts[key] = (_copy(fw), _copy(bw))
    return fw, bw
