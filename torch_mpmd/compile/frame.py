"""The function a torch.compile backend was handed, called again.

Dynamo hands a backend a graph of one frame (a function or a module's
forward) traced at the call's shapes, and later calls what the backend
returns with that graph's flat inputs (parameters, buffers, the tensors of
the arguments, symbolic sizes). The mpmd backend does not run that graph: it
pipelines the frame's function through the same capture as ``pipeline()``, at
the microbatch shape. This module recovers what that needs, once, while the
backend runs: the function (code, globals, closure), the modules and tensors
it reads (the roots, which name parameters by FQN, as capture.py does), and
how to rebuild the call's arguments from the graph's flat inputs.

It reads Dynamo's current InstructionTranslator (``f_code``, ``f_locals``,
``f_globals``, ``closure``): the frame being compiled. The arguments are
matched to graph inputs by identity (Dynamo hands backends the real tensors),
never by placeholder names.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["FrameCall", "FrameModule", "frame_call"]

_CO_VARARGS = inspect.CO_VARARGS
_CO_VARKEYWORDS = inspect.CO_VARKEYWORDS
_BAKED = object()  # a module-valued argument: the FrameModule passes it itself


def _current_frame() -> Any:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        raise RuntimeError("the mpmd backend must be called by torch.compile (no frame is being "
                           "compiled)")
    return tx


def _code_names(code: types.CodeType) -> set[str]:
    """Global names a code object (and the functions, lambdas and
    comprehensions defined in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


@dataclass
class FrameCall:
    """How to call the compiled frame's function again.

    ``fn(*args, **kwargs)`` is the call; :meth:`arguments` rebuilds
    ``(args, kwargs)`` from the graph's flat inputs. Module-valued arguments
    (``self`` of a compiled method, a model passed in) are not in them: the
    FrameModule puts them back, so they are never microbatched or hashed.
    """

    fn: Callable[..., Any]
    name: str
    template: tuple[tuple, dict]             # the first call's (args, kwargs), tensors taken out
    leaf_inputs: dict[int, int]              # template leaf -> index of the graph input
    baked: dict[Any, Any] = field(default_factory=dict)  # position or keyword -> module
    roots: dict[str, torch.nn.Module] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors read from globals
    root_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # graph input -> tensor

    def __post_init__(self) -> None:
        self._leaves, self._spec = pytree.tree_flatten(self.template)

    def arguments(self, flat: Sequence[Any]) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` for the graph inputs ``flat``."""
        leaves = list(self._leaves)
        for leaf, i in self.leaf_inputs.items():
            leaves[leaf] = flat[i]
        return pytree.tree_unflatten(leaves, self._spec)

    def frame_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]
                        ) -> tuple[tuple, dict]:
        """A call of the compiled function as its caller writes it (module
        arguments included, or left out as for a compiled method's ``self``)
        as the frame's ``(args, kwargs)``: the module-valued ones taken out,
        as :meth:`arguments` gives them."""
        positions = sorted(k for k in self.baked if isinstance(k, int))
        if positions and len(args) > positions[-1] and all(
                args[p] is self.baked[p] for p in positions):
            args = [a for j, a in enumerate(args) if j not in self.baked]
        return tuple(args), {k: v for k, v in kwargs.items() if k not in self.baked}

    def replaced_tensors(self, flat: Sequence[Any]) -> list[int]:
        """Graph inputs that were a parameter or buffer and are another tensor
        now (``model.w = nn.Parameter(...)`` after compiling, or another model)."""
        return [i for i, t in self.root_inputs.items() if flat[i] is not t]

    def tensor_key(self, flat: Sequence[Any]) -> tuple[int, ...]:
        """Which modules' tensors a call's graph inputs are: the identities of
        its parameters and buffers (NOTE [Another model, the same graph])."""
        return tuple(id(flat[i]) for i in self.root_inputs)

    def holds(self, flat: Sequence[Any]) -> bool:
        """Whether the roots hold every parameter and buffer of ``flat`` now
        (a tensor replaced in a root, rather than another model)."""
        held = {id(t) for r in self.roots.values() for t in [*r.parameters(), *r.buffers()]}
        held |= {id(t) for t in self.tensors.values()}
        return all(id(flat[i]) in held for i in self.root_inputs)

    def rebound(self, flat: Sequence[Any]) -> "FrameCall":
        """This call for the modules whose tensors ``flat`` holds.

        NOTE [Another model, the same graph]: Dynamo lifts a module's
        parameters and buffers into graph inputs and does not guard on the
        module object, so a function closing over another model of the same
        kind (a factory of training steps), or called with another module as
        an argument, reuses the graph and hands the other model's tensors.
        The door cannot reach that model, only its tensors: the roots are
        cloned with those tensors in place of the first model's (deepcopy
        with a memo that maps each to its replacement: the clones' parameters
        are the other model's own, so its ``.grad`` fill), and the function
        is re-bound to the clones (closure cells, module-valued globals and
        arguments)."""
        memo: dict[int, Any] = {id(old): flat[i] for i, old in self.root_inputs.items()}
        memo.update({id(flat[i]): flat[i] for i in self.root_inputs})

        def swap(value: Any) -> Any:
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                return copy.deepcopy(value, memo)
            return value

        roots = {name: swap(r) for name, r in self.roots.items()}
        if isinstance(self.fn, torch.nn.Module):
            fn: Callable[..., Any] = swap(self.fn)
        else:
            cells = []
            for cell in self.fn.__closure__ or ():
                try:
                    cells.append(types.CellType(swap(cell.cell_contents)))
                except ValueError:  # an empty cell
                    cells.append(cell)
            glob = self.fn.__globals__
            if any(isinstance(glob.get(n), torch.nn.Module) and glob[n] in self.roots.values()
                   for n in _code_names(self.fn.__code__)):
                glob = {k: swap(v) if k in _code_names(self.fn.__code__) else v
                        for k, v in glob.items()}
            fn = types.FunctionType(self.fn.__code__, glob, self.fn.__name__,
                                    self.fn.__defaults__, tuple(cells) or None)
            fn.__kwdefaults__ = self.fn.__kwdefaults__
        return FrameCall(fn=fn, name=self.name, template=self.template,
                         leaf_inputs=dict(self.leaf_inputs),
                         baked={k: swap(v) for k, v in self.baked.items()}, roots=roots,
                         tensors={k: swap(v) for k, v in self.tensors.items()},
                         root_inputs={i: flat[i] for i in self.root_inputs})


class FrameModule(torch.nn.Module):
    """The frame's function as a module to pipeline.

    With one root module its parameters keep their FQNs (``layers.4.w``);
    with several, each is named by the variable it was read from
    (``model.layers.4.w``, ``head.w``). Plain tensors the function reads from
    globals or its closure are attributes, so capture takes them for
    (non-persistent) buffers rather than inputs.
    """

    def __init__(self, call: FrameCall) -> None:
        super().__init__()
        roots = call.roots
        if len(roots) == 1:
            (root,) = roots.values()
            # Mirror the root's tree: the same FQNs, the same tensors.
            self._modules = root._modules
            self._parameters = root._parameters
            self._buffers = root._buffers
            self._non_persistent_buffers_set = root._non_persistent_buffers_set
            self.training = root.training
            object.__setattr__(self, "_mpmd_mirrors", (root,))
        else:
            for name, root in roots.items():
                self._modules[name] = root
            object.__setattr__(self, "_mpmd_mirrors", ())
        for name, t in call.tensors.items():
            object.__setattr__(self, name, t)
        object.__setattr__(self, "_mpmd_call", call)
        signature = _free_signature(call)
        fn, baked = call.fn, call.baked

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not baked:
                return fn(*args, **kwargs)
            full = list(args)
            for pos in sorted(k for k in baked if isinstance(k, int)):
                full.insert(pos, baked[pos])
            extra = {k: v for k, v in baked.items() if isinstance(k, str)}
            return fn(*full, **kwargs, **extra)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        object.__setattr__(self, "forward", forward)

    def _get_name(self) -> str:
        return f"FrameModule[{self._mpmd_call.name}]"

    def mpmd_capture_state(self) -> tuple[Any, dict[str, torch.nn.Module]]:
        """What the capture memo keys this module's capture by besides its
        tree (capture_memo.CAPTURE_STATE): the frame's code, its closure's
        values and the call's non-tensor arguments, with the roots named
        rather than held (a copy of the model in a new frame, as a training
        function defined again, is the same capture); and the roots, whose
        own attributes the key reads as any module's."""
        call = self._mpmd_call
        names = {id(m): name for name, m in call.roots.items()}

        def ref(value: Any) -> Any:
            if isinstance(value, torch.nn.Module) and id(value) in names:
                return ("root", names[id(value)])
            return value

        fn = call.fn
        cells = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                cells.append(ref(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append(("empty cell",))
        state = (call.name, getattr(fn, "__code__", fn), getattr(fn, "__module__", None),
                 getattr(fn, "__defaults__", None), tuple(cells),
                 tuple(sorted(((str(k), ref(v)) for k, v in call.baked.items()))),
                 call.template, tuple(sorted(call.leaf_inputs.items())),
                 tuple(sorted(call.tensors.items())), tuple(sorted(call.root_inputs)))
        return state, dict(call.roots)


def _free_signature(call: FrameCall) -> inspect.Signature | None:
    """The function's signature without the baked (module-valued) parameters."""
    try:
        sig = inspect.signature(call.fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    drop = {positional[k].name for k in call.baked if isinstance(k, int) and k < len(positional)}
    drop |= {k for k in call.baked if isinstance(k, str)}
    return sig.replace(parameters=[p.replace(default=p.empty) for p in params
                                   if p.name not in drop])


def _is_dynamo_wrapper(code: types.CodeType) -> bool:
    """torch.compile(module) traces a wrapper ``inner(*args, **kwargs)`` calling
    the module (torch/_dynamo/external_utils.py): pipeline the module."""
    return (code.co_filename.replace("\\", "/").endswith("torch/_dynamo/external_utils.py")
            and "fn" in code.co_freevars)


def frame_call(example_inputs: Sequence[Any]) -> FrameCall:
    """The FrameCall of the frame Dynamo is compiling now (call it from a backend)."""
    tx = _current_frame()
    code: types.CodeType = tx.f_code
    f_locals = dict(tx.f_locals)
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in (tx.closure or ()))))
    if _is_dynamo_wrapper(code) and isinstance(cells.get("fn"), torch.nn.Module):
        module = cells["fn"]
        fn: Callable[..., Any] = module
        name = type(module).__name__
        args, kwargs = tuple(f_locals.get("args", ())), dict(f_locals.get("kwargs", {}))
        baked: dict[Any, Any] = {}
        roots = {"self": module}
    else:
        fn = types.FunctionType(code, tx.f_globals, code.co_name, None, tx.closure)
        name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        args, kwargs, baked, roots = _bind(code, f_locals)
        for var, value in cells.items():
            if isinstance(value, torch.nn.Module):
                roots.setdefault(var, value)
        for var in sorted(_code_names(code)):
            value = tx.f_globals.get(var)
            if isinstance(value, torch.nn.Module):
                roots.setdefault(var, value)
    tensors = {}
    if not _is_dynamo_wrapper(code):
        for var, value in [*cells.items(), *((v, tx.f_globals.get(v))
                                             for v in sorted(_code_names(code)))]:
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                tensors.setdefault(var, value)
    template = (args, kwargs)
    leaves, _ = pytree.tree_flatten(template)
    by_id = {id(t): i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)}
    leaf_inputs = {k: by_id[id(leaf)] for k, leaf in enumerate(leaves)
                   if isinstance(leaf, torch.Tensor) and id(leaf) in by_id}
    owned = {id(t) for r in roots.values() for t in [*r.parameters(), *r.buffers()]}
    owned |= {id(t) for t in tensors.values()}
    root_inputs = {i: t for i, t in enumerate(example_inputs)
                   if isinstance(t, torch.Tensor) and id(t) in owned}
    # Hold no reference to the first call's batch: its tensors come from the
    # graph inputs on every call.
    stripped = [None if k in leaf_inputs else leaf for k, leaf in enumerate(leaves)]
    template = pytree.tree_unflatten(stripped, pytree.tree_flatten(template)[1])
    return FrameCall(fn=fn, name=name, template=template, leaf_inputs=leaf_inputs,
                     baked=baked, roots=roots, tensors=tensors, root_inputs=root_inputs)


def _bind(code: types.CodeType, f_locals: dict[str, Any]
          ) -> tuple[tuple, dict, dict[Any, Any], dict[str, torch.nn.Module]]:
    """The frame's arguments as a call: ``(args, kwargs, baked, roots)``."""
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    baked: dict[Any, Any] = {}
    roots: dict[str, torch.nn.Module] = {}
    for pos, var in enumerate(names[:n_pos]):
        value = f_locals[var]
        if isinstance(value, torch.nn.Module):
            baked[pos] = value
            roots[var] = value
        else:
            args.append(value)
    at = n_pos + n_kw
    if code.co_flags & _CO_VARARGS:
        # A decorated forward (transformers wraps its models' forwards in
        # ``wrapper(*args, **kwargs)``) gets the module itself in *args.
        for j, value in enumerate(f_locals.get(names[at], ())):
            if isinstance(value, torch.nn.Module):
                baked[n_pos + j] = value
                roots[f"{names[at]}_{j}"] = value
            else:
                args.append(value)
        at += 1
    for var in names[n_pos:n_pos + n_kw]:
        value = f_locals[var]
        if isinstance(value, torch.nn.Module):
            baked[var] = value
            roots[var] = value
        else:
            kwargs[var] = value
    if code.co_flags & _CO_VARKEYWORDS:
        for var, value in f_locals.get(names[at], {}).items():
            if isinstance(value, torch.nn.Module):
                baked[var] = value
                roots[var] = value
            else:
                kwargs[var] = value
    return tuple(args), kwargs, baked, roots
