"""Captures kept for the process: a model captured again reuses its graph.

NOTE [Capture memo]: a training job captures the same model many times over:
``plan="auto"`` profiles it at several microbatch sizes and builds a
pipeline per finalist it measures, ``replan()`` and ``mpmd.plan`` build
again, and a user may build pipelines of fresh copies of one model (a
reference, a sweep). Each capture is a Dynamo trace of the whole model,
seconds each. The graph depends on the model's code, structure and Python
state and on the call's inputs, not on the values of its parameters, so the
process keeps each capture, keyed by:

- :func:`structure_key`: every submodule's type, training flag, instance
  attributes by value (plain data, containers and objects such as a
  config, recursively; functions and other objects by identity: an
  attribute set on one instance only, such as a patched ``forward``, or a
  dict with another key) and forward/backward hooks by what they run
  (:func:`callable_key`: code and closure values, so a model parallelized
  again keys alike; else the objects, kept alive); every parameter, buffer
  and plain tensor attribute's type, shape, strides, dtype, device and
  ``requires_grad`` (and a DTensor's placements and mesh, with this rank's
  process groups: :func:`mesh_key`); which of them are one tensor (tied
  weights); the inputs'
  tensor metadata, their dynamic marks and aliasing, and their non-tensor
  values; grad mode,
  autocast, the default dtype and device, deterministic algorithms and
  Dynamo's configuration;
- and, for each capture under a key, the Python values its trace read
  (NOTE [State guards]): a hit is a capture whose guarded values the new
  model has too (``config.num_layers``, a temperature, which global function
  a name refers to), checked by the same compiled expression as at every
  pipeline call.

A capture whose trace changed the model's Python state (the key after it
differs: an attribute set or replaced by forward) is not kept: its replay on
a hit would be missing that effect. Nothing is kept while a tracing context
or a torch function mode is active, for a model whose class opts out
(``_mpmd_capture_memo = False``), or when ``MPMD_CAPTURE_MEMO=0``. The
compile door's frame modules (their forward is a frame's own function) say
what stands for their attributes (CAPTURE_STATE): a training function
defined again over a copy of the model is the same capture. A hit gives a
new CapturedGraph over the new model's tensors (``capture._rebind``) with a
copy of the graph, which the caller may change.
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["CAPTURE_STATE", "MAX_KEYS", "callable_key", "clear", "kept", "lookup", "mesh_key",
           "stats", "store", "structure_key"]

MAX_KEYS = 16  # least recently used keys are dropped beyond this
_MAX_PER_KEY = 4  # captures of one key kept at once (different guarded values)

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called")

# A module's attributes the key holds by structure (above), not by value.
_STRUCTURE_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "training",
                              "_non_persistent_buffers_set", *_HOOK_DICTS})
_PLAIN_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
                torch.memory_format, torch.layout, enum.Enum)
_MAX_DEPTH = 8
# Object attributes left out of the key: a hash of the object's own values
# (which the key holds) that differs per process, as Python's string hash
# does (transformers' GenerationConfig._original_object_hash). Kept, they
# would make the capture store's key differ on every launch.
_PROCESS_LOCAL_ATTRS = frozenset({"_original_object_hash"})

_memo: collections.OrderedDict[tuple, list[Any]] = collections.OrderedDict()
_stats = {"hits": 0, "misses": 0, "stored": 0, "not_kept": 0}


def stats() -> dict[str, int]:
    """Counts since the process started (or :func:`clear`): hits, misses,
    captures stored and captures not kept (their trace changed the model)."""
    return dict(_stats)


def kept() -> list[Any]:
    """Every kept capture (templates: no model objects), most recent key first."""
    return [t for key in reversed(_memo) for t in _memo[key]]


def clear() -> None:
    """Forget every kept capture."""
    _memo.clear()
    for k in _stats:
        _stats[k] = 0


def _enabled() -> bool:
    return os.environ.get("MPMD_CAPTURE_MEMO", "1") != "0"


class _NotKeyable(Exception):
    """A value the key cannot hold faithfully: the capture is not kept."""


def _tensor_key(t: torch.Tensor) -> tuple:
    kind = type(t)
    extra: tuple = ()
    if kind not in (torch.Tensor, torch.nn.Parameter):
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            raise _NotKeyable(f"a tensor of type {kind.__name__}")
        extra = (tuple(map(str, t.placements)), mesh_key(t.device_mesh))
    return (kind, tuple(t.shape), t.stride(), t.dtype, str(t.device), t.requires_grad,
            t.layout, *extra)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise _NotKeyable(f"an unhashable {type(value).__name__}") from None
    return value


class _InProcess:
    """Stands in a key for what only this process can tell apart (a mesh's
    process groups): name_of() refuses it, so the capture store does not
    write a key that holds one (names.py), while keys in the process stay
    equal."""

    def __repr__(self) -> str:
        return "<in this process>"


_IN_PROCESS = _InProcess()


def mesh_key(mesh: Any) -> tuple:
    """A DeviceMesh as a key holds it: its device type, the ranks in their
    layout, the dim names and the process groups of this rank's dims (the
    objects, kept alive, and their names). DeviceMesh's own equality
    compares the layout and names only, so two meshes over other groups
    would be equal; a capture holds its mesh (a DTensor op's argument), and
    reusing it on a mesh of other groups would communicate over the old
    ones. Group names alone are not enough: a new world after
    destroy_process_group() names its groups again from the start. A mesh
    whose groups cannot be read (this rank is not in it) is keyed as
    itself. In this process only."""
    ranks = mesh.mesh
    try:
        groups: Any = tuple((g.group_name, g) for g in
                            (mesh.get_group(i) for i in range(mesh.ndim)))
    except Exception:  # noqa: BLE001  (a mesh without this rank has no groups here)
        groups = ("itself", mesh, id(mesh))
    return ("DeviceMesh", mesh.device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()),
            mesh.mesh_dim_names, groups, _IN_PROCESS)


def _is_mesh(value: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


def _by_own_equality(value: Any) -> bool:
    """A value whose state is not in its ``__dict__`` and whose type says
    what equal means (a C++ value type: a DTensor placement, Shard(0) and
    Shard(1) with the same empty ``__dict__``): keyed by that equality."""
    kind = type(value)
    return (not vars(value) if hasattr(value, "__dict__") else True) and \
        kind.__eq__ is not object.__eq__ and kind.__hash__ is not None


_CALLABLE_DEPTH = 4  # a hook wrapping a partial of a bound method: 3 levels


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a hook's closure value, a partial's argument, a
    method's object) reaches a tensor through containers and attributes, or
    is too deep to tell: such a hook is keyed as itself."""
    if depth > _MAX_DEPTH:
        return True
    if value is None or isinstance(value, _PLAIN_TYPES) or _is_mesh(value):
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(k, depth + 1) or _holds_tensor(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, (torch.nn.Module, type, types.ModuleType)):
        return False  # keyed by identity
    if hasattr(value, "__dict__") and not callable(value):
        return any(_holds_tensor(v, depth + 1) for v in vars(value).values())
    return False


def callable_key(fn: Any, value_key: Callable[[Any], Any], depth: int = 0) -> tuple | None:
    """A hook as what it runs, so that the same hook installed again (a
    model built and parallelized again: torch's distribute_module installs
    a new lambda over the same layouts and mesh) keys alike: a function by
    its code object, defaults and closure values; a functools.partial by
    its function and arguments; a bound method by its function and object.
    Callables among those values are keyed the same way, other values by
    ``value_key``. None: the hook is keyed as itself (a callable object, a
    value reaching a tensor, which a trace may read by value, or nesting
    too deep)."""
    if depth > _CALLABLE_DEPTH:
        return None

    def value(v: Any) -> Any:
        if (callable(v) and not isinstance(v, (type, torch.nn.Module))
                and not _is_mesh(v)):
            inner = callable_key(v, value_key, depth + 1)
            return ("object", _hashable(v)) if inner is None else inner
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(value(x) for x in v))
        if isinstance(v, dict):
            return (dict, tuple((value_key(k), value(x)) for k, x in v.items()))
        return value_key(v)

    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(_EMPTY_CELL)
        values = (fn.__defaults__, fn.__kwdefaults__ or {}, tuple(cells))
        if _holds_tensor(values):
            return None
        # Code objects compare equal across files and globals: the module
        # and file say which globals the code reads (the state guards check
        # the values it read, in the globals of the kept trace's function).
        return ("function", fn.__module__, fn.__code__.co_filename, fn.__code__, value(values))
    if isinstance(fn, functools.partial):
        values = (fn.func, fn.args, fn.keywords)
        if _holds_tensor(values[1:]):
            return None
        return ("partial", value(values))
    if isinstance(fn, types.MethodType):
        if _holds_tensor(fn.__self__):
            return None
        return ("method", value(fn.__func__), value_key(fn.__self__))
    return None


_EMPTY_CELL = ("empty cell",)


def _dims_marked(t: torch.Tensor) -> tuple:
    return tuple(tuple(sorted(getattr(t, name, None) or ())) for name in (
        "_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_static_indices"))


_config_digests: dict[bytes, str] = {}


def _dynamo_config() -> str:
    """Dynamo's configuration, as a digest that is the same in every process
    (its own ``get_hash()`` hashes the repr of sets, which string hashing
    orders differently per process: the capture store needs one across)."""
    own = torch._dynamo.config.get_hash()
    digest = _config_digests.get(own)
    if digest is None:
        config = torch._dynamo.config
        try:
            values = config._get_dict(ignored_keys=list(config._compile_ignored_keys),
                                      readonly_values=True)
            text = repr(sorted((k, sorted(map(repr, v)) if isinstance(v, (set, frozenset))
                                else v) for k, v in values.items()))
        except Exception:  # noqa: BLE001  (another torch: per process only)
            text = f"{os.getpid()}:{own.hex()}"
        digest = _config_digests[own] = hashlib.sha256(text.encode()).hexdigest()
    return digest


def _global_state() -> tuple:
    state = [torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
             torch.get_default_dtype(), str(torch.get_default_device()), _dynamo_config()]
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        state.append((device, enabled, torch.get_autocast_dtype(device) if enabled else None))
    return tuple(state)


def _modes_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return bool(_get_current_function_mode_stack()) or _get_current_dispatch_mode() is not None


# A module class whose instance attributes the key cannot hold by value (the
# compile door's FrameModule: a frame's function and its closure) defines
# ``mpmd_capture_state(self) -> (state, modules)``: ``state`` stands for its
# own attributes in the key (fingerprinted by value as attributes are), and
# ``modules`` ({name: module}) are trees its forward reaches that its own tree
# does not list (a root it mirrors), walked as its tree is.
CAPTURE_STATE = "mpmd_capture_state"


def structure_key(module: torch.nn.Module, inputs: Mapping[str, Any], dynamic: bool
                  ) -> tuple | None:
    """What a capture of ``module`` with these flattened ``inputs`` depends
    on besides the Python values its trace reads (see the module docstring);
    None when such a capture must not be kept or looked up (also when a
    user's object in the model fails to be read: the capture goes on without
    the memo)."""
    try:
        return _structure_key(module, inputs, dynamic)
    except Exception:  # noqa: BLE001  (_NotKeyable, or a user object's __hash__/__dict__ raising)
        return None


def _structure_key(module: torch.nn.Module, inputs: Mapping[str, Any], dynamic: bool
                   ) -> tuple | None:
    if (not _enabled() or not getattr(type(module), "_mpmd_capture_memo", True)
            or torch._guards.TracingContext.try_get() is not None or _modes_active()):
        return None
    seen: dict[int, int] = {}  # id(tensor) -> its first position: tied tensors

    def tensor(t: torch.Tensor) -> tuple:
        first = seen.setdefault(id(t), len(seen))
        return (first, _tensor_key(t))

    # id(object) -> (the object, its fingerprint): a shared config summarized
    # once. The object is held until the key is made: a temporary (an
    # object's attribute dict, built below) freed meanwhile would hand its id,
    # and so its summary, to the next one (two styles of one list keyed as
    # the first: test_capture_memo.py).
    summaries: dict[int, tuple[Any, Any]] = {}

    def fingerprint(value: Any, depth: int = 0, within: frozenset = frozenset()) -> Any:
        """A model attribute's value as the key holds it: plain data by value
        (containers and objects' attributes recursively: a dict's keys too,
        which the state guards do not check), tensors by metadata, anything
        else (functions, modules in containers, deep or cyclic objects) as
        the object itself, kept alive, compared by identity."""
        if value is None or isinstance(value, _PLAIN_TYPES):
            return (type(value), value)
        if isinstance(value, torch.Tensor):
            return tensor(value)
        key = id(value)
        if key in summaries:
            return summaries[key][1]
        if _is_mesh(value):
            summaries[key] = (value, mesh_key(value))
            return summaries[key][1]
        if depth >= _MAX_DEPTH or key in within or isinstance(
                value, (torch.nn.Module, type, types.FunctionType, types.MethodType,
                        types.ModuleType, types.BuiltinFunctionType)):
            out: Any = ("object", _hashable(value))
        else:
            inner = within | {key}
            if isinstance(value, (tuple, list)):
                out = (type(value), tuple(fingerprint(v, depth + 1, inner) for v in value))
            elif isinstance(value, (set, frozenset)):
                out = (type(value), frozenset(fingerprint(v, depth + 1, inner) for v in value))
            elif isinstance(value, dict):
                out = (type(value), tuple((fingerprint(k, depth + 1, inner),
                                           fingerprint(v, depth + 1, inner))
                                          for k, v in value.items()))
            elif _by_own_equality(value):
                out = ("value", type(value), _hashable(value))
            elif hasattr(value, "__dict__") and not callable(value):
                own = {k: v for k, v in vars(value).items() if k not in _PROCESS_LOCAL_ATTRS}
                out = (type(value), fingerprint(own, depth + 1, inner))
            else:
                out = ("object", _hashable(value))
        summaries[key] = (value, out)
        return out

    def hooks(registered: Mapping[Any, Any]) -> tuple:
        # Hooks by what they run (callable_key), else by the objects
        # themselves (kept alive: a dead hook's id reused by another cannot
        # make two keys equal), not by id.
        return tuple(callable_key(h, fingerprint) or ("object", _hashable(h))
                     for h in registered.values())

    modules = []
    trees = [("", module)]
    own_state = getattr(type(module), CAPTURE_STATE, None)
    if own_state is not None:  # see CAPTURE_STATE
        state, more = own_state(module)
        trees += [(f"<{name}>", m) for name, m in more.items()]
        modules.append(("<state>", fingerprint(state)))
    for prefix, tree in trees:
        for name, m in tree.named_modules(remove_duplicate=False):
            attrs = vars(m)
            hooked = tuple(hooks(attrs[d]) if d in attrs else None for d in _HOOK_DICTS)
            params = tuple((k, None if p is None else tensor(p)) for k, p in m._parameters.items())
            buffers = tuple((k, None if b is None else tensor(b),
                             k in m._non_persistent_buffers_set) for k, b in m._buffers.items())
            state = (None if m is module and own_state is not None else
                     tuple((k, fingerprint(v)) for k, v in attrs.items()
                           if k not in _STRUCTURE_ATTRS))
            modules.append((prefix + name, type(m), m.training, hooked, params, buffers, state))
    named = tuple((name, fingerprint(value), _dims_marked(value))
                  if isinstance(value, torch.Tensor) else (name, fingerprint(value))
                  for name, value in inputs.items())
    from torch.nn.modules import module as module_globals

    global_hooks = tuple(hooks(getattr(module_globals, g, {})) for g in _GLOBAL_HOOKS)
    return (tuple(modules), named, dynamic, global_hooks, _global_state())


def lookup(key: tuple | None, matches: Any) -> Any:
    """The kept capture under ``key`` for which ``matches(capture)`` holds
    (its guarded values hold for the new model), or None."""
    if key is None:
        return None
    try:
        kept = _memo.get(key)
    except Exception:  # noqa: BLE001  (an object in the key whose __eq__ raises)
        kept = None
    if kept:
        _memo.move_to_end(key)
        for template in kept:
            if matches(template):
                _stats["hits"] += 1
                return template
    _stats["misses"] += 1
    return None


def store(key: tuple | None, template: Any, key_after: tuple | None) -> None:
    """Keep ``template`` (a CapturedGraph holding no model tensors) under
    ``key``, the model's key before its capture, unless ``key_after``, its
    key after, differs: the trace changed the model's state."""
    if key is None:
        return
    try:
        if key_after != key:
            _stats["not_kept"] += 1
            return
        kept = _memo.setdefault(key, [])
    except Exception:  # noqa: BLE001  (an object in the key whose __eq__ raises)
        return
    kept.insert(0, template)
    del kept[_MAX_PER_KEY:]
    _memo.move_to_end(key)
    _stats["stored"] += 1
    while len(_memo) > MAX_KEYS:
        _memo.popitem(last=False)
