"""Functional stage programs: F, B, and the I/W halves of B.

A stage's captured ``fx.GraphModule`` (stage.py), with the loss appended on
the last stage, is traced by AOTAutograd into one functionalized joint
forward+backward graph whose inputs and outputs carry descriptors (which
parameter, which input, which tangent). The joint graph is cut into

- ``F(params, buffers, user inputs, received, target) -> (mutations, outputs, saved)``
- ``B(saved, tangents) -> gradients`` (one per primal; ``None`` where none)

by torch's default partitioner (which honours activation-checkpointing
recompute tags; a recomputed random op replays F's generator state, NOTE
[Recompute of random ops]), and for schedules with I and W, B is cut again by the C++
partitioner (``_C.split_backward``, csrc/core/backward_split.h) into

- ``I(saved, tangents) -> (input gradients, carry)``: the nodes on a path to
  a received value's gradient;
- ``W(carry) -> weight gradients``: the nodes only weight gradients need.

Each program is an ``fx.GraphModule`` run as it is (``compile=False``), or
handed to Inductor or to the user's compiler. Nothing here runs the autograd
engine: runner.ProgramRunner calls the programs and accumulates the weight
gradients into ``.grad``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from torch_mpmd import _C
from torch_mpmd.programs import export_memo
from torch_mpmd.programs.errors import ProgramsUnsupported
from torch_mpmd.programs.loss import microbatch_loss
from torch_mpmd.programs.partition import forward_and_backward
from torch_mpmd.programs.vec_isa import vec_isa_ok

__all__ = ["ProgramsUnsupported", "StagePrograms", "build_stage_programs", "resolve_compiler",
           "program_ops"]

log = logging.getLogger("torch_mpmd")

Compiler = Callable[[torch.fx.GraphModule, list], Callable[..., Any]]


# ------------------------------------------------------------------ compilers


_CPU_CAPABILITY_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")


def _cache_key_tag() -> str:
    """The user's cache key tag, plus the CPU vector ISA Inductor generates
    code for and the variables that cap ATen's, MKL's and oneDNN's: Inductor's
    FX graph cache does not key programs by them, and a program compiled
    under one capability and loaded under another crashed a rank (a segfault,
    a nan loss). Programs made under another setting are compiled again."""
    from torch._inductor import cpu_vec_isa

    parts = [torch.compiler.config.cache_key_tag, f"isa={cpu_vec_isa.pick_vec_isa()}"]
    parts += [f"{name}={os.environ[name]}" for name in _CPU_CAPABILITY_VARIABLES
              if name in os.environ]
    return ";".join(parts)


def _inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx_inner

    from torch._inductor import config

    # Random ops run as aten's (seeded per stage and microbatch before F):
    # Inductor's own lowering of them needs its joint-graph passes, which a
    # program compiled on its own does not go through.
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    inputs = example_inputs
    if fake_mode is None:
        # NOTE [Programs in Inductor's cache]: Inductor's FX graph cache keys a
        # graph by the guards of its shape environment and bypasses graphs
        # compiled without one ("No shape env"): every stage program was
        # lowered again in every process, for every pipeline. Static sizes are
        # traced as fakes of one environment of their own, so equal programs
        # (another schedule's, another case's, a relaunch's) load from the cache.
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        inputs = [fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor)
                  else t for t in example_inputs]
    with contextlib.ExitStack() as stack:
        # NOTE [A probe per machine]: vec_isa_ok, in every process alike.
        stack.enter_context(config.patch({"fallback_random": True, **(
            {"cpp.vec_isa_ok": True} if vec_isa_ok() else {})}))
        stack.enter_context(torch.compiler.config.patch(cache_key_tag=_cache_key_tag()))
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
        compiled = compile_fx_inner(gm, inputs)
    # Inductor's code assumes the example inputs' strides; an input laid out
    # otherwise (a user's non-contiguous batch) is copied into that layout.
    # (Symbolic strides: the inputs are the runner's own contiguous tensors.)
    strides = [t.stride() if isinstance(t, torch.Tensor) and not any(
        isinstance(x, torch.SymInt) for x in t.stride()) else None for t in example_inputs]

    def run(*args: Any) -> Any:
        boxed = list(args)
        for i, want in enumerate(strides):
            t = boxed[i]
            if want is not None and t.stride() != want and t.numel() > 1:
                boxed[i] = torch.empty_strided(t.shape, want, dtype=t.dtype,
                                               device=t.device).copy_(t)
        return compiled(boxed)

    return run


def resolve_compiler(compile: Any) -> Compiler | None:
    """``pipeline(compile=...)``: False/None -> None (FX graphs as they are),
    True or "inductor" -> Inductor, a callable ``(gm, example_inputs) -> fn``."""
    if compile is None or compile is False:
        return None
    if compile is True or compile == "inductor":
        return _inductor
    if callable(compile):
        return compile
    raise ValueError(f"compile={compile!r} must be False, True, 'inductor' or a callable "
                     "(GraphModule, example_inputs) -> callable")


# ------------------------------------------------------------------ programs


@dataclass
class StagePrograms:
    """One stage's functional programs and how their inputs and outputs map to
    the stage's tensors (see the module docstring)."""

    stage: int
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None
    input_backward: Callable[..., Any] | None = None
    weight_backward: Callable[..., Any] | None = None
    # F's leading inputs, in order: parameters then buffers (the module's own tensors).
    state_tensors: list[torch.Tensor] = field(default_factory=list)
    num_user: int = 0
    num_received: int = 0
    num_target: int = 0
    # F's outputs: mutated tensors first ((output index, tensor to copy into)),
    # then the stage's outputs (sent values, or the loss), then `saved`.
    mutations: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    output_offset: int = 0
    num_outputs: int = 0
    num_saved: int = 0
    # Output positions (among the stage outputs) that B receives a tangent for,
    # in order; -1: a zero tangent (zero_tangents[k]) for an input written in place.
    tangent_outputs: list[int] = field(default_factory=list)
    zero_tangents: dict[int, torch.Tensor] = field(default_factory=dict)  # -1 entries above
    # B's outputs: (parameter, position) and (received slot, position).
    param_grads: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    input_grads: list[tuple[int, int]] = field(default_factory=list)
    # I's outputs: input gradients (received slot each), then the carry for W.
    i_input_slots: list[int] = field(default_factory=list)
    # W's outputs: the parameter each gradient belongs to.
    w_params: list[torch.Tensor] = field(default_factory=list)
    saved_bytes: int = 0          # bytes of `saved` per microbatch (parameters excluded)
    saved_input_bytes: int = 0    # of the received values `saved` keeps (not in saved_bytes)
    carry_bytes: int = 0          # bytes of the carry I hands W (the same rule)
    # Positions of sizes (ints, a dynamic capture) in `saved` and in the carry:
    # the executor holds tensors only, so the runner boxes them as 0-dim tensors.
    saved_sizes: list[int] = field(default_factory=list)
    carry_sizes: list[int] = field(default_factory=list)
    draws_rng: bool = False       # F has random ops: seed it per (stage, microbatch)
    graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)  # F, B, I, W


def program_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The operations a program computes (call_function targets, getitem excluded)."""
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]


class _Traced(torch.nn.Module):
    """The callable AOTAutograd traces: the stage module, then on the last
    stage the loss; sent outputs that alias an input or another output are
    cloned (a functional program returns fresh tensors)."""

    def __init__(self, stage: torch.fx.GraphModule, *, num_user: int, num_received: int,
                 num_sent: int, loss: Callable[[tuple, tuple, list], torch.Tensor] | None,
                 clone_outputs: frozenset[int]) -> None:
        super().__init__()
        self.stage = stage
        self.num_user = num_user
        self.num_received = num_received
        self.num_sent = num_sent
        self.loss = loss
        self.clone_outputs = clone_outputs

    def forward(self, *flat: Any) -> tuple:
        k = self.num_user + self.num_received
        out = self.stage(*flat[:k])
        if self.loss is not None:
            loss = self.loss(tuple(out[self.num_sent:]), flat[:self.num_user], list(flat[k:]))
            return (loss.clone() if 0 in self.clone_outputs else loss,)
        # Sent values are traced contiguous: their gradients come back from the
        # transport contiguous, and B's tangents must have the traced strides
        # (a transposed q/k crossing a cut would otherwise meet a view in B).
        return tuple((o.clone() if i in self.clone_outputs else o).contiguous()
                     for i, o in enumerate(out[:self.num_sent]))


def _viewed_input(node: torch.fx.Node, inputs: set[str]) -> str | None:
    """The placeholder named in ``inputs`` that ``node`` is or views (``t``,
    ``permute``, ``view``, ``expand``: an op whose schema says its result
    aliases its first argument, without writing it), or None: a value that
    owns no memory of its own, which the saved-bytes accounting skips."""
    while node.op != "placeholder":
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if alias is None or alias.is_write or not node.args or \
                not isinstance(node.args[0], torch.fx.Node):
            return None
        node = node.args[0]
    return node.name if node.name in inputs else None


def _views_input(node: torch.fx.Node, inputs: set[str]) -> bool:
    """Whether ``node`` is a placeholder named in ``inputs`` or a view of one
    (:func:`_viewed_input`)."""
    return _viewed_input(node, inputs) is not None


def _nbytes(t: Any) -> int:
    """Bytes of a tensor (its size hint when symbolic; no guards); 0 for a size."""
    if not isinstance(t, torch.Tensor):
        return 0
    from torch_mpmd.graph.capture import size_hint

    return math.prod(size_hint(d) for d in t.shape) * t.element_size()


def _is_size(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _is_random(node: torch.fx.Node) -> bool:
    """A random op, or one run under a saved generator state (the forward of
    a recomputed random op, NOTE [Recompute of random ops])."""
    if node.op != "call_function":
        return False
    target = node.target
    from torch._prims.rng_prims import run_and_save_rng_state

    return target is run_and_save_rng_state or \
        torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _decompositions(compiler: Compiler | None) -> dict | None:
    """Inductor lowers graphs decomposed by its own table (as its AOTAutograd
    path does); FX programs and other compilers get aten as traced."""
    if compiler is _inductor:
        from torch._inductor import config
        from torch._inductor.decomposition import select_decomp_table

        # The table _inductor compiles with (fallback_random): random ops
        # (dropout) stay aten's, drawing what eager draws under the same seed.
        with config.patch(fallback_random=True):
            return select_decomp_table()
    return None


def _export(traced: _Traced, args: tuple, decompositions: dict | None
            ) -> tuple[torch.fx.GraphModule, Any]:
    """AOTAutograd's joint graph of ``traced`` at ``args`` and its metadata."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    stack = contextlib.ExitStack()
    with stack:
        jd = aot_export_joint_with_descriptors(stack, traced, args,
                                               decompositions=decompositions)
        return jd.graph_module, jd._aot_state.fw_metadata


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a program reads for a parameter or buffer: a DTensor's
    (tensor parallel) local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _local_shards(joint: torch.fx.GraphModule, d: Any) -> None:
    """Describe a joint graph over DTensor parameters (tensor parallel) as one
    over their local shards, in place.

    NOTE [DTensor parameters in programs]: AOTAutograd desugars a DTensor
    parameter into two inputs, its local shard
    (``SubclassGetAttrAOTInput(ParamAOTInput(fqn), "_local_tensor")``) and its
    DeviceMesh (``attr="device_mesh"``), and its gradient likewise into two
    outputs; the graph between them is over local shards, with the
    tensor-parallel collectives as ``_c10d_functional`` ops. The mesh inputs
    are only passed through (the collectives name their group by its string
    name), so they are dropped, as are the gradients' mesh outputs, and the
    local-shard inputs and outputs take their base's descriptor: the rest of
    build_stage_programs then sees ordinary parameters (fed their local
    shards, see _local) and gradients (accumulated into the DTensor's
    ``.grad`` by the runner). A DTensor crossing stages is a plain local
    shard at the program's edge already (the stage graph converts it, NOTE
    [DTensor boundaries] in stage.py); a subclass anywhere else (a DTensor
    user input or loss) stays as it is and is refused below."""
    graph = joint.graph
    out = graph.output_node()
    descs = out.meta.get("desc")
    changed = False
    if descs is not None:
        values, kept = [], []
        for v, desc in zip(out.args[0], descs):
            if (isinstance(desc, d.SubclassGetAttrAOTOutput) and
                    isinstance(desc.base, d.GradAOTOutput)):
                changed = True
                if desc.attr != "_local_tensor":
                    continue  # the gradient's mesh
                desc = desc.base
            values.append(v)
            kept.append(desc)
        out.args = (tuple(values),)
        out.meta["desc"] = kept
    for node in list(graph.nodes):
        desc = node.meta.get("desc") if node.op == "placeholder" else None
        if not (isinstance(desc, d.SubclassGetAttrAOTInput) and
                isinstance(desc.base, (d.ParamAOTInput, d.BufferAOTInput))):
            continue
        changed = True
        if desc.attr == "_local_tensor":
            node.meta["desc"] = desc.base
        elif not node.users:
            graph.erase_node(node)
        else:
            raise ProgramsUnsupported(f"the program reads {desc.attr!r} of the DTensor "
                                      f"{desc.base.target!r}, not only its local shard")
    if changed:
        joint.recompile()


def build_stage_programs(stage: int, module: torch.fx.GraphModule, *, num_user: int,
                         received: Sequence[torch.Tensor], received_grad: Sequence[bool],
                         user_inputs: Sequence[Any], num_sent: int,
                         loss: Callable[[tuple, tuple, list], torch.Tensor] | None,
                         target_leaves: Sequence[torch.Tensor], split_backward: bool,
                         compiler: Compiler | None, run_backward: bool = True,
                         hooks_run_later: bool = False) -> StagePrograms:
    """Trace ``module`` (the stage) and cut it into programs.

    ``received``: example values of the received inputs (fresh tensors of the
    right shape); ``received_grad``: which of them carry a gradient back.
    ``loss(flat_outputs, user_inputs, target_leaves)`` is given on the last
    stage (training): F then returns the microbatch's loss as its one output.
    ``split_backward``: build I and W; ``run_backward``: B runs too (compiled
    only when it does). ``hooks_run_later``: parameters' gradient hooks are
    the caller's to run (the compile door hands the gradients to autograd
    after the step). Raises ProgramsUnsupported when the stage cannot be expressed this way.
    """
    from torch._functorch._aot_autograd import descriptors as d

    for name, t in module.named_parameters():
        hooked = t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None)
        if not hooks_run_later and t.requires_grad and hooked:
            raise ProgramsUnsupported(f"parameter {name!r} has gradient hooks, which run only "
                                      "under the autograd engine")
    if any(not isinstance(u, torch.Tensor) and not _is_size(u) for u in user_inputs):
        raise ProgramsUnsupported("a non-tensor user input reaches the stage")
    args = (*user_inputs,
            *[r.detach().requires_grad_(g) if r.is_floating_point() else r.detach()
              for r, g in zip(received, received_grad)],
            *target_leaves)
    clone: frozenset[int] = frozenset()
    try:
        for _attempt in range(2):
            traced = _Traced(module, num_user=num_user, num_received=len(received),
                             num_sent=num_sent, loss=loss, clone_outputs=clone)
            # NOTE [Export memo]: the same stage (or one alike) traced before.
            joint, meta = export_memo.exported(
                module, args, num_user=num_user, num_received=len(received), num_sent=num_sent,
                clone_outputs=clone, loss=loss, decomposed=compiler is _inductor, prefix="stage.",
                export=lambda: _export(traced, args, _decompositions(compiler)))
            aliased = frozenset(i for i, info in enumerate(meta.output_info)
                                if info.output_type.name != "non_alias")
            if not aliased:
                break
            clone = clone | aliased
        else:
            raise ProgramsUnsupported(f"outputs {sorted(aliased)} alias inputs or each other")
    except ProgramsUnsupported:
        raise
    except Exception as e:  # noqa: BLE001  (AOTAutograd raises many kinds)
        raise ProgramsUnsupported(f"AOTAutograd could not trace the stage: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e

    _local_shards(joint, d)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    out_node = joint.graph.output_node()
    out_descs = out_node.meta["desc"]
    named_params = dict(traced.named_parameters(remove_duplicate=False))
    named_buffers = dict(traced.named_buffers(remove_duplicate=False))
    num_primals = sum(1 for p in placeholders if not isinstance(p.meta["desc"], d.TangentAOTInput))
    state: list[torch.Tensor] = []
    num_plain = 0
    for p in placeholders[:num_primals]:
        desc = p.meta["desc"]
        if isinstance(desc, d.ParamAOTInput):
            state.append(_local(named_params[desc.target]))
        elif isinstance(desc, d.BufferAOTInput):
            state.append(_local(named_buffers[desc.target]))
        elif isinstance(desc, d.PlainAOTInput):
            if desc.idx != num_plain:
                raise ProgramsUnsupported(f"unexpected input order at {desc}")
            num_plain += 1
        else:
            raise ProgramsUnsupported(f"an input the runner does not handle: {desc}")
    if len(state) + num_plain != num_primals or num_plain != len(args):
        raise ProgramsUnsupported("parameters, buffers and inputs are not in the expected order")

    # Forward outputs: mutations, then the stage's outputs (PlainAOTOutput).
    num_fwd = meta.num_forward_returns
    mutations: list[tuple[int, torch.Tensor]] = []
    num_outputs = 0
    for i, desc in enumerate(out_descs[:num_fwd]):
        if isinstance(desc, d.InputMutationAOTOutput):
            m = desc.mutated_input
            if isinstance(m, d.ParamAOTInput):
                mutations.append((i, _local(named_params[m.target])))
            elif isinstance(m, d.BufferAOTInput):
                mutations.append((i, _local(named_buffers[m.target])))
            # a mutated received value or user input: the program works on its
            # own copy (as the autograd path feeds such a stage a clone)
        elif isinstance(desc, d.PlainAOTOutput):
            if desc.idx != num_outputs:
                raise ProgramsUnsupported(f"unexpected output order at {desc}")
            num_outputs += 1
        else:
            raise ProgramsUnsupported(f"an output the runner does not handle: {desc}")
    output_offset = num_fwd - num_outputs
    # Tangents: of the stage's outputs, or zeros for a received value the
    # stage writes in place (the write stays local, as on the autograd path,
    # where such a stage is fed a clone).
    tangent_outputs: list[int] = []
    zero_tangents: dict[int, torch.Tensor] = {}
    for k, p in enumerate(placeholders[num_primals:]):
        out = p.meta["desc"].output
        if isinstance(out, d.PlainAOTOutput):
            tangent_outputs.append(out.idx)
        elif (isinstance(out, d.InputMutationAOTOutput) and
              isinstance(out.mutated_input, d.PlainAOTInput)):
            v = p.meta["val"]
            if any(isinstance(n, torch.SymInt) for n in v.shape):
                raise ProgramsUnsupported("a received value of a dynamic shape is written in "
                                          "place")
            zero_tangents[k] = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
            tangent_outputs.append(-1)
        else:
            raise ProgramsUnsupported(f"a tangent the runner does not handle: {out}")

    # NOTE [Partitions kept]: a stage traced before was partitioned before.
    fw, bw = export_memo.partitioned(
        joint, lambda: forward_and_backward(joint, placeholders, num_fwd),
        shared=compiler is None)
    fw_outs = list(fw.graph.output_node().args[0])
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_names = [n.name for n in fw_outs[num_fwd:]]
    if [n.name for n in bw_placeholders[:len(saved_names)]] != saved_names:
        raise ProgramsUnsupported(
            "the backward graph does not read the saved values in order: saved "
            f"{saved_names[:8]}, backward reads {[n.name for n in bw_placeholders[:8]]}")
    saved_vals = [n.meta.get("val") for n in fw_outs[num_fwd:]]
    if any(not isinstance(v, torch.Tensor) and not _is_size(v) for v in saved_vals):
        raise ProgramsUnsupported("the forward saves values that are neither tensors nor sizes")

    # Gradients: one per primal, by descriptor.
    param_grads: list[tuple[torch.Tensor, int]] = []
    input_grads: list[tuple[int, int]] = []
    bw_outs = list(bw.graph.output_node().args[0])
    for pos, desc in enumerate(out_descs[num_fwd:]):
        if desc is None or bw_outs[pos] is None:
            continue
        of = desc.grad_of
        if isinstance(of, d.ParamAOTInput):
            param_grads.append((named_params[of.target], pos))
        elif isinstance(of, d.PlainAOTInput):
            slot = of.idx - num_user
            if 0 <= slot < len(received):
                input_grads.append((slot, pos))
        elif isinstance(of, d.BufferAOTInput):
            continue
        else:
            raise ProgramsUnsupported(f"a gradient the runner does not handle: {desc}")

    # Bytes a microbatch's `saved` holds beyond what already exists: values F
    # computes (placeholders passed through, parameters and inputs, are not
    # new; nor are views of them, such as a linear's transposed weight).
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    saved_bytes = sum(_nbytes(n.meta["val"]) for n in fw_outs[num_fwd:]
                      if not _views_input(n, fw_inputs))
    # The received values F saves (or a view of): no new bytes for this stage,
    # but new where a planner joins this stage's program to the one before
    # it, which then produces them (planning: a unit inside a stage).
    received_names = {p.name for p in placeholders[:num_primals]
                      if isinstance(p.meta["desc"], d.PlainAOTInput)
                      and num_user <= p.meta["desc"].idx < num_user + len(received)}
    kept = {_viewed_input(n, received_names) for n in fw_outs[num_fwd:]} - {None}
    fw_by_name = {n.name: n for n in fw.graph.nodes if n.op == "placeholder"}
    saved_input_bytes = sum(_nbytes(fw_by_name[name].meta["val"]) for name in kept)

    programs = StagePrograms(
        stage=stage, forward=fw, backward=bw, state_tensors=state, num_user=num_user,
        num_received=len(received), num_target=len(target_leaves), mutations=mutations,
        output_offset=output_offset, num_outputs=num_outputs, num_saved=len(saved_names),
        tangent_outputs=tangent_outputs, zero_tangents=zero_tangents, param_grads=param_grads, input_grads=input_grads,
        saved_bytes=saved_bytes, saved_input_bytes=saved_input_bytes,
        saved_sizes=[i for i, v in enumerate(saved_vals) if _is_size(v)],
        draws_rng=any(_is_random(n) for n in fw.graph.nodes),
        graphs={"F": fw, "B": bw})
    # FX programs are called through .forward: they are our own GraphModules,
    # with no module hooks to run (nn.Module.__call__ costs microseconds).
    programs.forward, programs.backward = fw.forward, bw.forward
    if split_backward:
        existing = {n.name for n in fw_outs[num_fwd:] if _views_input(n, fw_inputs)}
        _split(programs, bw, param_grads, input_grads, existing)
    if compiler is not None:
        _compile(programs, compiler, skip=() if run_backward else ("B",))
    return programs


# ------------------------------------------------------------------ I/W split


def _split(programs: StagePrograms, bw: torch.fx.GraphModule,
           param_grads: list[tuple[torch.Tensor, int]],
           input_grads: list[tuple[int, int]], existing: set[str]) -> None:
    """Cut B into I and W with the C++ partitioner (NOTE [Backward split]).
    ``existing``: saved values that are F's own inputs (parameters, inputs) or views of them,
    not counted in the carry's bytes."""
    nodes = [n for n in bw.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    outs = list(bw.graph.output_node().args[0])
    reads = [[index[a] for a in n.all_input_nodes] for n in nodes]
    is_ph = [n.op == "placeholder" for n in nodes]
    # Elements of a tuple-valued op (getitem) are projections: computed in I
    # when their op is, so only tensors are carried (NOTE [Backward split]).
    is_proj = [n.op == "call_function" and n.target is operator.getitem for n in nodes]
    in_outs = [index[outs[pos]] for _, pos in input_grads]
    w_outs = [index[outs[pos]] for _, pos in param_grads]
    split = _C.split_backward(reads, is_ph, in_outs, w_outs, is_proj)
    in_i = split.input_part
    in_w = split.weight_part
    carry = list(split.carry)
    # Sizes (a dynamic capture) go to W too, used or not: a compiled W binds
    # its symbols from its inputs, and a carried [s0*s1, d] tensor names
    # neither s0 nor s1 alone.
    carry += [i for i, n in enumerate(nodes) if is_ph[i] and i not in carry and
              isinstance(n.meta.get("val"), torch.SymInt)]

    graph_i = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, n in enumerate(nodes):
        if is_ph[i]:
            env[n] = graph_i.placeholder(n.name)
            env[n].meta = dict(n.meta)
        elif in_i[i]:
            env[n] = graph_i.node_copy(n, lambda a: env[a])
    graph_i.output(tuple([env[nodes[j]] for j in in_outs] + [env[nodes[j]] for j in carry]))
    graph_w = torch.fx.Graph()
    env_w: dict[torch.fx.Node, torch.fx.Node] = {}
    for j in carry:
        env_w[nodes[j]] = graph_w.placeholder(nodes[j].name)
        env_w[nodes[j]].meta = dict(nodes[j].meta)
    for i, n in enumerate(nodes):
        if in_w[i]:
            env_w[n] = graph_w.node_copy(n, lambda a: env_w[a])
    graph_w.output(tuple(env_w[nodes[j]] for j in w_outs))
    gi = torch.fx.GraphModule(bw, graph_i, class_name=f"Stage{programs.stage}I")
    gw = torch.fx.GraphModule(bw, graph_w, class_name=f"Stage{programs.stage}W")
    programs.input_backward = gi.forward
    programs.weight_backward = gw.forward
    programs.i_input_slots = [slot for slot, _ in input_grads]
    programs.carry_bytes = sum(_nbytes(nodes[j].meta["val"]) for j in carry
                               if not _views_input(nodes[j], existing))
    programs.carry_sizes = [k for k, j in enumerate(carry) if _is_size(nodes[j].meta["val"])]
    programs.w_params = [p for p, _ in param_grads]
    programs.graphs.update({"I": gi, "W": gw})


# ------------------------------------------------------------------ compile


def _symbolic(v: Any) -> bool:
    return isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())))


def _examples(gm: torch.fx.GraphModule) -> list[Any]:
    """A program's example inputs for the compiler: real tensors of their
    shapes, or with symbolic sizes (a dynamic capture) the fake values
    themselves, all of one fake mode."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if any(_symbolic(v) for v in vals):
        return vals
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            if isinstance(v, torch.Tensor) else v for v in vals]


def _compile(programs: StagePrograms, compiler: Compiler, skip: Sequence[str] = ()) -> None:
    for kind, attr in (("F", "forward"), ("B", "backward"), ("I", "input_backward"),
                       ("W", "weight_backward")):
        gm = programs.graphs.get(kind)
        if gm is None:
            continue
        if kind in skip:  # a program the schedule never runs for this stage
            setattr(programs, attr, None)
            continue
        setattr(programs, attr, compiler(gm, _examples(gm)))


def flatten_target(target: Any) -> list[Any]:
    return pytree.tree_leaves(target) if target is not None else []


def loss_tail(loss_fn: Callable[..., torch.Tensor] | None, rebuild_output: Callable,
              user_names: Sequence[str], target_spec: Any) -> Callable:
    """The loss as the last stage's program computes it (runner._loss's
    contract), carrying its key for the export memo (``memo_key``)."""

    def loss(flat: tuple, user: tuple, target_leaves: list) -> torch.Tensor:
        output = rebuild_output(flat, dict(zip(user_names, user)))
        target = (pytree.tree_unflatten(target_leaves, target_spec)
                  if target_spec is not None else None)
        try:
            return microbatch_loss(loss_fn, output, target, needs_grad=torch.is_grad_enabled())
        except ValueError as e:  # the autograd path raises it again, to the caller
            raise ProgramsUnsupported(f"the loss: {e}") from e

    loss.memo_key = export_memo.loss_key(  # type: ignore[attr-defined]
        loss_fn, rebuild_output, user_names, target_spec)
    return loss
