"""Capture ``module(*args, **kwargs)`` as one FX graph with Dynamo.

The graph is what ``torch.compile(fullgraph=True)`` hands a backend: torch-level
calls, with every parameter, buffer and tensor input lifted to a placeholder.
This module maps those placeholders back to names (parameter and buffer FQNs,
user input names) and records how to rebuild the model's return value from the
graph's flat outputs. A graph break is a :class:`CaptureError` that names the
reason and the user's source line.

Dynamo state: each capture compiles a fresh code object and drops its cache
entry afterwards, so captures do not count towards recompile limits and leave
no compiled code behind. The capture call itself runs no model code: the
recording backend returns uninitialised tensors of the graph's output shapes,
so parameters, buffers and the RNG are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import re
import sys
import itertools
import time
import types
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
import torch.utils._pytree as pytree

import torch_mpmd.graph.markers  # noqa: F401  (registers the marker op before any capture)
from torch_mpmd.graph import capture_memo, capture_store
from torch_mpmd.graph.hf import install_output_recorders
from torch_mpmd.graph.state_guards import StateGuards, from_dynamo_guards
from torch_mpmd.graph.unguarded import guards_not_built

_log = logging.getLogger(__name__)

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "PlaceholderInfo",
    "OutputLeaf",
    "capture",
    "flatten_inputs",
    "size_hint",
]

_capture_counter = itertools.count()


class CaptureError(ValueError):
    """The model cannot be captured as one graph (a graph break) or uses a
    feature the stage split cannot reproduce. The message names the reason,
    the source line and a way out."""


PlaceholderKind = Literal["input", "parameter", "buffer", "size"]


@dataclass(frozen=True)
class PlaceholderInfo:
    """What one placeholder of the captured graph stands for.

    ``name`` is the user input name (``"x"``, ``"batch['ids']"``, ``"args[0]"``)
    or the parameter/buffer FQN. ``aliases`` lists the other FQNs of the same
    tensor (tied weights); ``persistent`` is False for non-persistent buffers.
    A ``"size"`` placeholder is a symbolic size of a dynamic capture: dim
    ``size_of[1]`` of input ``size_of[0]`` (named ``"x.size(1)"``), fed per
    microbatch from that input's shape.
    """

    kind: PlaceholderKind
    name: str
    aliases: tuple[str, ...] = ()
    persistent: bool = True
    size_of: tuple[str, int] | None = None


@dataclass(frozen=True)
class OutputLeaf:
    """Where one leaf of the model's return value comes from."""

    source: Literal["graph", "input", "tensor", "constant"]
    index: int = -1          # "graph": position among the graph's outputs
    name: str = ""           # "input": user input name; "tensor": parameter/buffer FQN
    value: Any = None        # "constant": the value itself


@dataclass
class CapturedGraph:
    """A captured forward: the FX graph and what its placeholders mean."""

    gm: torch.fx.GraphModule
    placeholders: list[PlaceholderInfo]   # aligned with the graph's placeholder nodes
    tensors: dict[str, torch.Tensor]      # parameter/buffer FQN -> the module's own tensor
    module_fqns: list[str]                # every submodule FQN ("" = root), for messages
    # id(submodule) -> FQN, for the ids the graph's nn_module_stack keys carry:
    # those of the model that was traced (after a capture memo hit, another
    # model, perhaps freed and its ids reused: never the new model's ids).
    module_ids: dict[int, str] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)      # tensor inputs, call order
    input_constants: dict[str, Any] = field(default_factory=dict)  # non-tensor inputs
    output_spec: pytree.TreeSpec | None = None
    output_leaves: list[OutputLeaf] = field(default_factory=list)
    signature: inspect.Signature | None = None
    root: torch.nn.Module | None = None   # the captured module
    grad_enabled: bool = True             # grad mode the graph was captured under
    # Input name -> earlier input name that was the same tensor at capture (Dynamo
    # reads such inputs once, so they must stay the same tensor).
    input_aliases: dict[str, str] = field(default_factory=dict)
    # The Python values the graph was traced with (NOTE [State guards]).
    state: StateGuards | None = None
    # The source files of the code Dynamo traced (NOTE [Capture store]).
    traced_files: tuple[str, ...] = ()

    def rebuild_output(self, graph_outputs: Sequence[Any], inputs: Mapping[str, Any]) -> Any:
        """The model's return value from the graph's flat outputs."""
        single = self.__dict__.get("_single_graph_output")
        if single is None:  # one graph output returned as it is: the common case
            assert self.output_spec is not None
            single = (self.output_leaves[0].index if self.output_spec.is_leaf() and
                      len(self.output_leaves) == 1 and self.output_leaves[0].source == "graph"
                      else -1)
            self.__dict__["_single_graph_output"] = single
        if single >= 0:
            return graph_outputs[single]
        leaves = []
        for leaf in self.output_leaves:
            if leaf.source == "graph":
                leaves.append(graph_outputs[leaf.index])
            elif leaf.source == "input":
                leaves.append(inputs[leaf.name])
            elif leaf.source == "tensor":
                leaves.append(self.tensors[leaf.name])
            else:
                leaves.append(leaf.value)
        return pytree.tree_unflatten(leaves, self.output_spec)


# ---------------------------------------------------------------- inputs


def _forward_signature(module: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def flatten_inputs(
    signature: inspect.Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any],
    defaulted: set[str] | None = None,
) -> dict[str, Any]:
    """Name every leaf of a forward call: ``{"x": t, "batch['ids']": t2, "args[0]": t3}``.

    Positional arguments take the name of forward's parameter; ``*args`` items
    are ``args[i]``; ``**kwargs`` items take their key. Arguments not passed
    take forward's default (their parameter names are added to ``defaulted``
    when given). Containers are flattened with torch's pytree, their paths
    appended to the name.
    """
    named: list[tuple[str, Any]] = []
    bound = None
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"the inputs do not match forward{signature}: {e}") from None
        # Arguments left at their default are named too, so that a call passing
        # a different value than the capture call can be told apart from it.
        if defaulted is not None:
            defaulted.update(n for n in signature.parameters if n not in bound.arguments)
        bound.apply_defaults()
    if bound is None:
        named += [(f"args[{i}]", a) for i, a in enumerate(args)]
        named += list(kwargs.items())
    else:
        for pname, value in bound.arguments.items():
            kind = bound.signature.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{pname}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += list(value.items())
            else:
                named.append((pname, value))
    flat: dict[str, Any] = {}
    for name, value in named:
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            flat[name + pytree.keystr(path)] = leaf
    return flat


# ---------------------------------------------------------------- graph breaks


def _user_frame(exc: BaseException) -> str:
    frame = getattr(exc, "innermost_user_frame_summary", None)
    if frame is None:
        stack = getattr(exc, "real_stack", None) or []
        frame = stack[-1] if stack else None
    if frame is None:
        return "an unknown source line"
    code = (frame.line or "").strip()
    return f"{frame.filename}:{frame.lineno} (in {frame.name}: `{code}`)"


def _graph_break_error(module: torch.nn.Module, exc: BaseException) -> CaptureError:
    reason = getattr(exc, "gb_type", None) or str(exc).strip().splitlines()[0]
    where = _user_frame(exc)
    return CaptureError(
        f"torch_mpmd captures {type(module).__name__}.forward as one graph, but Dynamo stops "
        f"at {where}: {reason}.\n"
        "Ways out: move data-dependent Python control flow (an `if`/`while` on a tensor's "
        "value, `.item()`, `.tolist()`) out of forward or make it branchless "
        "(torch.where, torch.clamp), or express it with torch.cond; keep stage_boundary() "
        "calls outside such regions.\nDynamo's message:\n" + str(exc)
    )


# ---------------------------------------------------------------- capture


def _fresh_entry(module: torch.nn.Module) -> types.FunctionType:
    """A function calling `module` whose code object is new, so that Dynamo's
    cache entry for it dies with it (no recompile counts, no stale code)."""

    def entry(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    name = f"mpmd_capture_{next(_capture_counter)}"
    names = {"co_name": name}
    if sys.version_info >= (3, 11):
        names["co_qualname"] = name
    code = entry.__code__.replace(**names)
    return types.FunctionType(code, entry.__globals__, name, None, entry.__closure__)


def size_hint(n: Any) -> int:
    """A concrete int for a size that may be symbolic (dynamic capture), adding
    no guards (an int() of a SymInt would specialize the capture to it)."""
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(n, fallback=1))
    return int(n)


def _empty_like_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            [size_hint(d) for d in value.shape], [size_hint(d) for d in value.stride()],
            dtype=value.dtype, device=value.device,
            requires_grad=value.requires_grad and (value.is_floating_point()
                                                   or value.is_complex()))
    return value


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _record(records: list, gm: torch.fx.GraphModule, example_inputs: list,
            guards: list | None = None) -> Any:
    records.append((gm, list(example_inputs)))
    if guards is not None:  # NOTE [State guards]: Dynamo's guards, while the context holds them
        context = torch._guards.TracingContext.try_get()
        if context is not None:
            guards.extend(context.guards_context.dynamo_guards)
    # Dynamo drops each placeholder's GraphArg (its source) after compiling:
    # keep the sources, which name what a symbolic size is the size of.
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["mpmd_source"] = getattr(n.meta.get("grapharg"), "source", None)
    outputs = [
        _empty_like_meta(n.meta.get("example_value", n.meta.get("val")))
        if isinstance(n, torch.fx.Node) else n
        for n in _output_nodes(gm)
    ]
    records.append(outputs)

    def replay(*_: Any) -> tuple:
        return tuple(outputs)

    return replay


def _is_opaque(value: Any) -> bool:
    """Whether ``value`` is an object Dynamo passes to the graph by reference
    (an opaque type: torch.distributed's DeviceMesh and ProcessGroup)."""
    if isinstance(value, (torch.Tensor, int, float, bool, torch.SymInt)) or value is None:
        return False
    try:
        from torch._library.opaque_object import is_opaque_type
    except ImportError:  # an older torch has no opaque types
        return False
    return bool(is_opaque_type(type(value)))


def _opaque_inputs_as_constants(gm: torch.fx.GraphModule, example_inputs: list) -> list:
    """Turn each opaque graph input into a ``get_attr`` of ``gm`` holding the
    object; return the remaining example inputs.

    NOTE [Opaque inputs]: a tensor-parallel model (DTensor, applied with
    ``parallelize_module``) has forward hooks that close over its DeviceMesh;
    Dynamo registers DeviceMesh and ProcessGroup as opaque reference types and
    lifts them as graph inputs (``..._forward_pre_hooks_0_closure_0_cell_contents``).
    They are the same objects on every call, so they are constants of the
    model: as ``get_attr`` nodes, fx_to_ir classifies them CONSTANT and
    build_stages puts the object on every stage that reads it, instead of a
    placeholder that no microbatch could feed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs) or not any(map(_is_opaque, example_inputs)):
        return example_inputs  # (a count mismatch is reported by the caller)
    kept = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not _is_opaque(value):
            kept.append(value)
            continue
        attr = f"_mpmd_opaque_{i}"
        setattr(gm, attr, value)
        # FX warns of a get_attr that is not a submodule, parameter or buffer
        # (it checks only those); a plain attribute is what we mean here.
        with gm.graph.inserting_after(placeholders[-1]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
            const = gm.graph.get_attr(attr)
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
    gm.recompile()
    return kept


def logging_functions() -> set:
    """Dynamo's ignore set plus every logging.Logger method (including ones
    libraries add, like transformers' ``warning_once``): a log call in forward
    is dropped from the graph instead of breaking it."""
    extra = {f for name, f in vars(logging.Logger).items()
             if callable(f) and not name.startswith("_")}
    return set(torch._dynamo.config.ignore_logging_functions) | extra


def _named_module_tensors(module: torch.nn.Module) -> tuple[
    dict[int, tuple[PlaceholderKind, list[str], bool]], dict[str, torch.Tensor]
]:
    """id(tensor) -> (kind, FQNs in registration order, persistent), and FQN -> tensor
    for the first FQN of each tensor."""
    by_id: dict[int, tuple[PlaceholderKind, list[str], bool]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        entry = by_id.setdefault(id(p), ("parameter", [], True))
        entry[1].append(fqn)
        tensors.setdefault(entry[1][0], p)
    for mod_fqn, mod in module.named_modules(remove_duplicate=False):
        for name, b in mod._buffers.items():
            if b is None:
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            persistent = name not in mod._non_persistent_buffers_set
            entry = by_id.setdefault(id(b), ("buffer", [], persistent))
            entry[1].append(fqn)
            tensors.setdefault(entry[1][0], b)
    return by_id, tensors


def _tensor_attribute_fqn(module: torch.nn.Module, tensor: torch.Tensor) -> str | None:
    """FQN of a plain (unregistered) tensor attribute, e.g. ``self.scale = torch.tensor(2.)``."""
    mirrors = [("", m) for m in getattr(module, "_mpmd_mirrors", ())]  # frame.FrameModule
    for mod_fqn, mod in [*module.named_modules(), *mirrors]:
        for name, value in vars(mod).items():
            if value is tensor:
                return f"{mod_fqn}.{name}" if mod_fqn else name
    return None


def _mark_dynamic(inputs: Mapping[str, Any], all_dims: bool) -> bool:
    """Mark the dims of the inputs Dynamo should keep symbolic: every dim with
    ``all_dims`` (pipeline(dynamic=True); dims the model fixes stay static),
    else those the user marked (torch._dynamo.mark_dynamic). True if any."""
    any_marked = False
    for value in inputs.values():
        if not isinstance(value, torch.Tensor):
            continue
        if all_dims:
            for d in range(value.dim()):
                torch._dynamo.maybe_mark_dynamic(value, d)
        any_marked = any_marked or bool(getattr(value, "_dynamo_dynamic_indices", None) or
                                        getattr(value, "_dynamo_weak_dynamic_indices", None))
    return any_marked or all_dims


_WEAK = "_dynamo_weak_dynamic_indices"
_UNMARKED = object()


def _weak_marks(inputs: Mapping[str, Any]) -> list[tuple[torch.Tensor, Any]]:
    """Each tensor input's weak dynamic marks (maybe_mark_dynamic's), as
    :func:`_mark_dynamic` found them: the capture puts them back after its
    trace. Marks left on the user's tensors would make their own
    torch.compile treat those dims as dynamic, and would change the
    capture's key after the trace, so that the capture was never kept
    (NOTE [Capture memo]): every rank and every call traced again."""
    return [(v, set(getattr(v, _WEAK)) if hasattr(v, _WEAK) else _UNMARKED)
            for v in inputs.values() if isinstance(v, torch.Tensor)]


def _restore_weak_marks(marks: list[tuple[torch.Tensor, Any]]) -> None:
    for tensor, before in marks:
        if before is _UNMARKED:
            if hasattr(tensor, _WEAK):
                delattr(tensor, _WEAK)
        else:
            setattr(tensor, _WEAK, before)


def _source_name(source: Any) -> str:
    name = source.name  # a property in recent torch, a method before
    return name() if callable(name) else name


def _size_placeholder(node: torch.fx.Node, input_sources: Mapping[str, str]
                      ) -> PlaceholderInfo:
    """The PlaceholderInfo of a SymInt graph input: a size of a user input."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    source = node.meta.get("mpmd_source")
    if (isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE
            and _source_name(source.base) in input_sources):
        name = input_sources[_source_name(source.base)]
        return PlaceholderInfo("size", f"{name}.size({source.idx})",
                               size_of=(name, int(source.idx)))
    raise CaptureError(
        f"the dynamic capture takes a symbolic value {node.target} "
        f"({_source_name(source) if source is not None else 'unknown source'}) that is not the size "
        "of a tensor input; torch_mpmd feeds only input sizes: mark only tensor dims dynamic")


def capture(module: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
            *, dynamic: bool = False) -> CapturedGraph:
    """Capture ``module(*args, **kwargs)`` as one FX graph (see the module docstring).

    ``dynamic``: every dim of every tensor input symbolic where the model
    allows; without it, only dims the user marked with
    ``torch._dynamo.mark_dynamic`` are. Symbolic sizes become "size"
    placeholders."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod  # a torch.compile'd module: capture the original
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    signature = _forward_signature(module)
    inputs = flatten_inputs(signature, args, kwargs)
    install_output_recorders(module, kwargs)
    # NOTE [Capture memo]: the same model (or a copy) captured before.
    memo_key = capture_memo.structure_key(module, inputs, dynamic)
    kept = capture_memo.lookup(memo_key, lambda t: _guards_hold(t, module))
    if kept is not None:
        _log.debug("capture of %s: from the memo", type(module).__name__)
        return _rebind(kept, module)
    # NOTE [Capture store]: another process's capture (a rank beside this
    # one, the last launch), or this trace kept for them.
    stem = capture_store.disk_key(memo_key)
    with capture_store.claim(stem):
        kept = capture_store.load(stem, module, globals())
        if kept is not None:
            capture_memo.store(memo_key, kept, key_after=memo_key)
            _log.debug("capture of %s: from the store (%s)", type(module).__name__, stem)
            return _rebind(kept, module)
        start = time.perf_counter()
        captured = _trace(module, signature, inputs, args, kwargs, dynamic)
        _log.debug("capture of %s: traced in %.2f s (%s)", type(module).__name__,
                   time.perf_counter() - start, stem)
        saved = False
        if memo_key is not None and captured.state is not None:
            template = _template(captured)
            key_after = capture_memo.structure_key(module, inputs, dynamic)
            capture_memo.store(memo_key, template, key_after=key_after)
            if key_after == memo_key:
                saved = capture_store.save(stem, template, captured.traced_files)
        if not saved:
            capture_store.mark_unsaved(stem)
    return captured


@contextlib.contextmanager
def _grads_hidden(module: torch.nn.Module, hide: bool) -> Any:
    """With ``hide``, the parameters' gradients are None within the block and
    as they were after it. Dynamo makes a fake tensor of every gradient it
    finds on a parameter, and a gradient that is a view of a flat buffer (as
    a pipeline step leaves them) costs it that buffer's views: a capture of
    the zoo's 24-block model after a step took 8.2 s with them, 1.6 s
    without."""
    if not hide:
        yield
        return
    grads = {p: p.grad for p in module.parameters() if p.grad is not None}
    try:
        for p in grads:
            p.grad = None
        yield
    finally:
        for p, g in grads.items():
            p.grad = g


def _reads_grads(guards: Sequence[Any]) -> bool:
    """Whether Dynamo guarded on some tensor's ``.grad`` (a forward that reads
    a gradient: it must be traced with the gradients as they are)."""
    return any(_GRAD_SOURCE.search(getattr(g, "name", "") or "") for g in guards)


_GRAD_SOURCE = re.compile(r"\.grad\b")


def _unbuilt_guards(entry: types.FunctionType, inputs: Mapping[str, Any]) -> Any:
    """Dynamo builds no guards for the capture's frame (NOTE [Guards never
    built]), unless the user marked a dim dynamic: the guards' shape part is
    what tells that the trace specialized it."""
    if any(isinstance(v, torch.Tensor) and getattr(v, "_dynamo_dynamic_indices", None)
           for v in inputs.values()):
        return contextlib.nullcontext()
    return guards_not_built(entry.__code__)


def _trace(module: torch.nn.Module, signature: inspect.Signature | None,
           inputs: dict[str, Any], args: Sequence[Any], kwargs: Mapping[str, Any],
           dynamic: bool, hide_grads: bool = True) -> CapturedGraph:
    """The capture itself: Dynamo traces ``module(*args, **kwargs)``, the
    parameters' gradients hidden (:func:`_grads_hidden`) unless the forward
    turns out to read one."""
    records: list = []
    dynamo_guards: list = []
    entry = _fresh_entry(module)
    state: list[StateGuards] = []

    # What the backend reaches, dropped when the capture returns: Dynamo keeps
    # every backend it was given (until torch._dynamo.reset()), and a backend
    # reaching the model kept each captured model and its tensors alive (the
    # finalists of plan trials, every copy a user captured).
    traced_code: list[types.CodeType] = []
    reach = {"scope": {"L": {"module": module}, "G": entry.__globals__},
             "records": records, "guards": dynamo_guards, "state": state, "code": traced_code}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        replay = _record(reach["records"], gm, example_inputs, reach["guards"])
        reach["code"].extend(torch._guards.TracingContext.get_traced_code() or ())
        # Read the guarded values now, before the traced code's side effects run.
        reach["state"].append(from_dynamo_guards(reach["guards"], reach["scope"]))
        return replay

    marks = _weak_marks(inputs)
    symbolic = _mark_dynamic(inputs, dynamic)
    compiled = torch.compile(entry, backend=backend, fullgraph=True,
                             dynamic=None if symbolic else False)
    try:
        # Static unless marked, whatever an enclosing torch.compile(dynamic=True)
        # set (the compile door captures inside one): Python floats stay
        # constants, only the marked dims are symbolic. Dynamo's own guards
        # are never evaluated (the frame runs once; NOTE [State guards] keeps
        # what a later call checks): objects shared by many parameters (a
        # DTensor's mesh) are guarded as relations, not by a generated Python
        # function whose source Dynamo deduplicates quadratically (3.4 s of a
        # 7.7 s tensor-parallel capture).
        with torch._dynamo.config.patch(ignore_logging_functions=logging_functions(),
                                        assume_static_by_default=True,
                                        automatic_dynamic_shapes=False,
                                        specialize_float=True,
                                        use_lamba_guard_for_object_aliasing=False), \
                _grads_hidden(module, hide_grads), _unbuilt_guards(entry, inputs):
            result = compiled(*args, **kwargs)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        raise _graph_break_error(module, e) from None
    finally:
        torch._dynamo.eval_frame.reset_code(entry.__code__)
        reach.clear()
        _restore_weak_marks(marks)
    if hide_grads and _reads_grads(dynamo_guards):
        return _trace(module, signature, inputs, args, kwargs, dynamic, hide_grads=False)
    if len(records) != 2:
        raise CaptureError(
            f"expected Dynamo to produce one graph for {type(module).__name__}.forward, got "
            f"{len(records) // 2}")
    (gm, example_inputs), fake_outputs = records
    example_inputs = _opaque_inputs_as_constants(gm, example_inputs)

    by_id, tensors = _named_module_tensors(module)
    input_ids: dict[int, str] = {}
    input_aliases: dict[str, str] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            first = input_ids.setdefault(id(v), k)
            if first != k:
                input_aliases[k] = first
    placeholders: list[PlaceholderInfo] = []
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(nodes) != len(example_inputs):
        raise CaptureError(f"Dynamo graph has {len(nodes)} placeholders but "
                           f"{len(example_inputs)} example inputs")
    input_sources = {}  # Dynamo's source name of each tensor input -> its input name
    for node, value in zip(nodes, example_inputs):
        source = node.meta.get("mpmd_source")
        if isinstance(value, torch.Tensor) and id(value) in input_ids and source is not None:
            input_sources[_source_name(source)] = input_ids[id(value)]
    for node, value in zip(nodes, example_inputs):
        if isinstance(value, (int, torch.SymInt)) and symbolic:
            placeholders.append(_size_placeholder(node, input_sources))
            continue
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"the captured graph takes a non-tensor input {node.target} ({value!r}); "
                "torch_mpmd captures only tensor inputs and (dynamic) sizes")
        if id(value) in by_id:
            kind, fqns, persistent = by_id[id(value)]
            placeholders.append(PlaceholderInfo(kind, fqns[0], tuple(fqns[1:]), persistent))
        elif id(value) in input_ids:
            placeholders.append(PlaceholderInfo("input", input_ids[id(value)]))
        else:
            fqn = _tensor_attribute_fqn(module, value)
            if fqn is None:
                raise CaptureError(
                    f"the captured graph reads a tensor ({node.target}) that is neither an "
                    "input of forward nor a parameter, buffer or tensor attribute of the model "
                    "(a global tensor?); register it as a buffer or pass it as an input")
            # A plain tensor attribute acts as a (non-persistent) buffer of the stage.
            tensors[fqn] = value
            placeholders.append(PlaceholderInfo("buffer", fqn, (), False))

    captured = CapturedGraph(
        gm=gm,
        placeholders=placeholders,
        tensors=tensors,
        module_fqns=[name for name, _ in module.named_modules()],
        input_names=[k for k, v in inputs.items() if isinstance(v, torch.Tensor)],
        input_constants={k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)},
        signature=signature,
        root=module,
        grad_enabled=torch.is_grad_enabled(),
        input_aliases=input_aliases,
        state=state[0].readable() if state else None,
    )
    # First FQN per module id (named_modules(remove_duplicate=False) lists aliases later).
    captured.module_ids = {}
    for name, m in module.named_modules(remove_duplicate=False):
        captured.module_ids.setdefault(id(m), name)
    for m in getattr(module, "_mpmd_mirrors", ()):  # a FrameModule's root (frame.py)
        captured.module_ids.setdefault(id(m), "")
    _map_outputs(captured, module, result, fake_outputs, inputs)
    captured.traced_files = capture_store.source_files(traced_code, captured.output_spec)
    return captured


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (nodes' meta copied one
    level deep: the fake values are shared) and ``gm``'s attributes."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


def _template(captured: CapturedGraph) -> CapturedGraph:
    """What the capture memo keeps of a capture: its graph (copied before the
    caller changes it) and meaning, none of the model's objects."""
    kept = copy.copy(captured)
    kept.gm = _copy_graph_module(captured.gm)
    # module_ids stays: plain ids and names, what the graph's module keys mean.
    kept.tensors, kept.root, kept.module_fqns = {}, None, []
    kept.module_ids = dict(captured.module_ids)
    kept.signature = None
    assert captured.state is not None
    # The guards without the captured model's frame (the template must not
    # keep the model alive); a hit binds them to the new model.
    kept.state = StateGuards(captured.state.guards, {"L": {}, "G": {}})
    return kept


def _guards_hold(template: CapturedGraph, module: torch.nn.Module) -> bool:
    """Whether the Python values ``template``'s trace read are the same on ``module``."""
    assert template.state is not None
    state = StateGuards(template.state.guards, {"L": {"module": module}, "G": globals()})
    return state.changed() is None


def _attribute(module: torch.nn.Module, fqn: str) -> Any:
    """The plain tensor attribute ``fqn`` names, found as
    :func:`_tensor_attribute_fqn` named it: in ``module``'s tree, else in a
    root a FrameModule mirrors."""
    for root in (module, *getattr(module, "_mpmd_mirrors", ())):
        value: Any = root
        try:
            for part in fqn.split("."):
                value = getattr(value, part)
        except AttributeError:
            continue
        return value
    raise AttributeError(f"{type(module).__name__} has no tensor attribute {fqn!r}")


def _rebind(template: CapturedGraph, module: torch.nn.Module) -> CapturedGraph:
    """A kept capture as a capture of ``module``, a model of the same
    structure and guarded values (NOTE [Capture memo])."""
    _, tensors = _named_module_tensors(module)
    for info in template.placeholders:
        if info.kind in ("parameter", "buffer") and info.name not in tensors:
            tensors[info.name] = _attribute(module, info.name)  # a plain tensor attribute
    captured = copy.copy(template)
    captured.gm = _copy_graph_module(template.gm)
    captured.placeholders = list(template.placeholders)
    captured.input_names = list(template.input_names)
    captured.input_constants = dict(template.input_constants)
    captured.input_aliases = dict(template.input_aliases)
    captured.output_leaves = list(template.output_leaves)
    captured.tensors = tensors
    captured.root = module
    captured.signature = _forward_signature(module)
    captured.module_fqns = [name for name, _ in module.named_modules()]
    # The graph's nn_module_stack keys hold the traced model's module ids:
    # they keep meaning what they meant then (the new model's ids could
    # equal some of them, for other modules: a freed model's memory reused).
    captured.module_ids = dict(template.module_ids)
    captured.state = StateGuards(template.state.guards, {"L": {"module": module}, "G": globals()})
    captured.__dict__.pop("_single_graph_output", None)
    return captured


def _map_outputs(captured: CapturedGraph, module: torch.nn.Module, result: Any,
                 graph_outputs: list, inputs: Mapping[str, Any]) -> None:
    leaves, spec = pytree.tree_flatten(result)
    by_id_graph = {id(t): i for i, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    by_id_input = {id(v): k for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    by_id_tensor = {id(t): k for k, t in captured.tensors.items()}
    out: list[OutputLeaf] = []
    used: set[int] = set()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in by_id_graph:
                used.add(by_id_graph[id(leaf)])
                out.append(OutputLeaf("graph", index=by_id_graph[id(leaf)]))
            elif id(leaf) in by_id_input:
                out.append(OutputLeaf("input", name=by_id_input[id(leaf)]))
            elif id(leaf) in by_id_tensor:
                out.append(OutputLeaf("tensor", name=by_id_tensor[id(leaf)]))
            else:
                raise CaptureError(
                    f"{type(module).__name__}.forward returns a tensor that torch_mpmd cannot "
                    "trace back to the captured graph (an output of type "
                    f"{type(result).__name__} that torch's pytree does not flatten?)")
        else:
            out.append(OutputLeaf("constant", value=leaf))
    unused = [i for i, t in enumerate(graph_outputs)
              if isinstance(t, torch.Tensor) and i not in used]
    if unused:
        names = [str(n) for i, n in enumerate(_output_nodes(captured.gm)) if i in unused]
        raise CaptureError(
            f"{type(module).__name__}.forward produces tensors that its return value does not "
            f"show torch's pytree (graph values {', '.join(names)}): an attribute assignment "
            "(`self.attr = tensor`), a tensor appended to a Python list, or an output object "
            "pytree cannot flatten, such as a KV cache (pass use_cache=False). torch_mpmd "
            "replays only what forward returns: update registered buffers in place "
            "(`self.buf.copy_(value)`) or return the value.")
    captured.output_spec = spec
    captured.output_leaves = out
