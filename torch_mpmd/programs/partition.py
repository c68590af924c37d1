"""A stage's joint graph cut into F and B (torch's default partitioner), and
what the programs need of the cut: generator states and sizes named the way
B reads them, F's saved values in B's order.

Depends on: torch (the partitioner), programs.errors.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx

from torch_mpmd.programs.errors import ProgramsUnsupported

__all__ = ["forward_and_backward"]


def forward_and_backward(joint: torch.fx.GraphModule, placeholders: list[torch.fx.Node],
                         num_fwd: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """F and B of ``joint`` (``placeholders``: its inputs; ``num_fwd``: F's
    outputs before the saved values): F returns ``(*forward outputs,
    *saved)`` with ``saved`` in the order B's first inputs read it, by name.
    Raises ProgramsUnsupported where F and B cannot be made to agree."""
    from torch._functorch.partitioners import default_partition

    with _joint_fake_mode(placeholders):
        fw, bw = default_partition(joint, None, num_fwd_outputs=num_fwd)
    fw_outs = list(fw.graph.output_node().args[0])
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    _name_rng_states(fw, fw_outs[num_fwd:], bw_placeholders)
    if _save_unbound_sizes(fw, bw):
        fw_outs = list(fw.graph.output_node().args[0])
        bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    _saved_in_backward_order(fw, fw_outs, num_fwd, bw_placeholders)
    return fw, bw


def _joint_fake_mode(placeholders: list[torch.fx.Node]) -> contextlib.AbstractContextManager:
    """The joint graph's own fake mode as the current tracing context, for the
    partitioner. NOTE [Recompute of random ops]: with activation
    checkpointing around a random op (dropout; SDPA, whose CPU and flash
    kernels are tagged ``nondeterministic_seeded`` for their dropout_p), the
    partitioner makes the recompute replay the forward's random numbers
    (``functionalize_rng_ops``: F returns the generator's state before the op,
    as a saved value, and B runs the op again under that state). It describes
    that state as a fake tensor of the fake mode it finds with
    ``detect_fake_mode()``, which AOTAutograd's own compile path has active
    and a program built from an exported joint graph does not: give it the
    mode the joint's values belong to (not an enclosing Dynamo's, the compile
    door's, whose fakes the programs never see). On CUDA the partitioner
    would otherwise pass the generator itself into the programs (graph-safe
    RNG, for CUDA graphs): the state is saved as a tensor there too, which
    the executor holds like any saved value."""
    from torch._functorch import config as functorch_config

    stack = contextlib.ExitStack()
    stack.enter_context(functorch_config.patch(graphsafe_rng_functionalization=False))
    fake_mode = torch._guards.detect_fake_mode(
        [p.meta.get("val") for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor)])
    if fake_mode is not None:
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
    return stack


def _free_symbols(v: Any) -> set:
    """The symbols a program input's value mentions (sizes, strides, offset)."""
    if isinstance(v, torch.SymInt):
        return set(v.node.expr.free_symbols)
    if not isinstance(v, torch.Tensor):
        return set()
    return {sym for n in (*v.shape, *v.stride(), v.storage_offset())
            if isinstance(n, torch.SymInt) for sym in n.node.expr.free_symbols}


def _save_unbound_sizes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> bool:
    """Make B take, as a size input, every symbol its inputs' shapes mention
    (a dynamic capture).

    NOTE [Symbols B cannot bind]: a compiled program binds each symbol from
    its inputs (a size input, or a tensor dim that is the symbol). The
    partitioner saves the sizes B's own nodes read, but not a symbol that
    only shapes a saved tensor as part of an expression: a loss over a
    target that is an input of the compiled function (the compile door, where
    ``y`` of ``[s6, s81]`` is its own input) saves ``y.view(-1)`` of
    ``[s6*s81]`` for cross entropy's backward, and Inductor, given B alone,
    cannot find s6 and s81 ("expected [s6, s81] to have been codegen-ed").
    (pipeline()'s target is traced with its sizes in the inputs' symbols,
    which the partitioner does save.) F reads such a symbol as a dim of one of
    its inputs: it returns that size as one more saved size, which B takes as
    an input. A symbol that only a tensor input's dim binds is made a size
    input too: W, cut from B, gets every size input but not every tensor
    (NOTE [Backward split]). True when F and B changed."""
    bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    mentioned, bound = set(), set()
    for n in bw_inputs:
        v = n.meta.get("val")
        mentioned |= _free_symbols(v)
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            bound.add(v.node.expr)
    missing = mentioned - bound
    if not missing:
        return False
    sources: dict[Any, tuple[torch.fx.Node, int | None, torch.SymInt]] = {}
    for p in (n for n in fw.graph.nodes if n.op == "placeholder"):
        v = p.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            sources.setdefault(v.node.expr, (p, None, v))
        elif isinstance(v, torch.Tensor):
            for dim, n in enumerate(v.shape):
                if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                    sources.setdefault(n.node.expr, (p, dim, n))
    taken = {n.name for n in fw.graph.nodes} | {n.name for n in bw.graph.nodes}
    out = fw.graph.output_node()
    extra = []
    for sym in sorted(missing & sources.keys(), key=str):
        p, dim, size = sources[sym]
        if dim is None:
            node = p
        else:
            name = f"{p.name}_size_{dim}"
            while name in taken:
                name += "_"
            with fw.graph.inserting_before(out):
                node = fw.graph.call_function(torch.ops.aten.sym_size.int, (p, dim), name=name)
            node.meta["val"] = size
        taken.add(node.name)
        with bw.graph.inserting_before(bw_inputs[0]):
            read = bw.graph.placeholder(node.name)
        read.meta["val"] = size
        if read.name != node.name:
            raise ProgramsUnsupported(f"the size {sym} cannot be named in B")
        extra.append(node)
    if not extra:
        return False
    out.args = ((*out.args[0], *extra),)
    fw.recompile()
    bw.recompile()
    return True


def _name_rng_states(fw: torch.fx.GraphModule, saved: list[torch.fx.Node],
                     bw_placeholders: list[torch.fx.Node]) -> None:
    """Give each generator state F saves for a recomputed random op (NOTE
    [Recompute of random ops]) the name of the B input that reads it: the
    partitioner names them apart (F's ``getitem``, B's ``rng_state_output_k``),
    and `saved` is matched to B's inputs by name. They pair up in order:
    the partitioner appends both, one random op at a time."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    states = [n for n in saved if n.op == "call_function" and n.target is operator.getitem
              and n.args[0].target is run_and_save_rng_state and n.args[1] == 0]
    reads = [p for p in bw_placeholders
             if any(u.target is run_with_rng_state and u.args[0] is p for u in p.users)]
    if len(states) != len(reads):
        raise ProgramsUnsupported(f"F saves {len(states)} generator states for recomputed "
                                  f"random ops, B reads {len(reads)}")
    for state, read in zip(states, reads):
        state._rename(read.name)
        if state.name != read.name:
            raise ProgramsUnsupported(f"the generator state {read.name!r} cannot be named "
                                      "in F")
    if states:
        fw.recompile()


def _saved_in_backward_order(fw: torch.fx.GraphModule, fw_outs: list, num_fwd: int,
                             bw_placeholders: list) -> None:
    """Make F return `saved` in the order B reads it: the partitioner puts the
    saved sizes (a dynamic capture) last among F's outputs but first among B's
    inputs."""
    saved = fw_outs[num_fwd:]
    by_name = {n.name: n for n in saved}
    order = [n.name for n in bw_placeholders[:len(saved)]]
    if order == [n.name for n in saved] or set(order) != set(by_name):
        return
    out = fw.graph.output_node()
    out.args = ((*fw_outs[:num_fwd], *[by_name[name] for name in order]),)
    fw.recompile()
