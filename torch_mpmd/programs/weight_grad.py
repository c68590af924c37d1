"""The weight-gradient half of a split backward (zero-bubble I/W).

NOTE [Weight-gradient split]: zero-bubble schedules split a stage's backward
into I (gradients of the stage's inputs, needed by the previous stage now)
and W (gradients of its weights, needed only by the optimizer, so scheduled
into bubbles). The stage graph is rewritten to also return Z, the output of
every node that reads a trainable parameter (a "weight node"), and X, the
activation input of the nodes W computes by formula. I asks autograd for the
gradients of the received values and of every Z at once (one engine call;
the weights are not among the requested inputs, so their gradients are not
computed). W then turns each dZ into its weights' gradients:

- linear (dW = dZ^T X, db = sum dZ), layer_norm (dW = sum dZ * norm(X),
  db = sum dZ) and embedding (dense backward of the indices) by formula, a
  few kernels with no autograd engine call;
- any other weight node by one engine call from Z restricted to its
  parameters (so the engine walks the part of the graph upstream of Z).

Gradients that flow from one weight node to another along activations are in
dZ already, so no contribution is counted twice. A parameter read by several
nodes (tied weights) gets the sum of their local contributions, which needs a
formula for each of them. When a node does not produce one tensor, or a shared
parameter has a reader without a formula, there is no plan and W is a second
backward over the stage restricted to the weights (also used for a step where
a shared parameter's reader needs the engine). A node takes the engine call
instead of its formula in a step where its parameters have tensor or
post-accumulate hooks (so they run), where Z or X was written in place after
the node ran (the formula would miss the write; views share the version
counter, so `_version` tells), or where autocast made X's dtype differ from
dZ's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["WeightNode", "WeightGradPlan"]

_ENGINE = torch.autograd.Variable._execution_engine


def _attr(gm: torch.nn.Module, fqn: str) -> Any:
    return operator.attrgetter(fqn)(gm)


@dataclass
class WeightNode:
    """One node reading trainable parameters, and how W gets their gradients."""

    node: torch.fx.Node
    params: list[torch.Tensor]         # its trainable parameters (engine rule)
    rule: str                          # "linear", "layer_norm", "embedding" or "engine"
    weight: torch.Tensor | None = None  # formula rules: the parameter per role
    bias: torch.Tensor | None = None
    x_index: int = -1                  # formula rules: position of X among the extra outputs
    shared: bool = False               # reads a parameter another node reads too

    def hooked(self) -> bool:
        return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                   for p in self.params)


def _formula_rule(node: torch.fx.Node, trainable: dict[torch.fx.Node, str],
                  gm: torch.nn.Module) -> tuple[str, Any, Any] | None:
    """(rule, weight, bias) when the node's weight gradient has a formula here."""
    args, kwargs = node.args, node.kwargs
    if node.op != "call_function" or kwargs:
        return None

    def param(a: Any) -> Any:
        return _attr(gm, trainable[a]) if isinstance(a, torch.fx.Node) and a in trainable \
            else None

    if node.target in (torch._C._nn.linear, F.linear) and 2 <= len(args) <= 3:
        bias = args[2] if len(args) == 3 else None
        if isinstance(args[0], torch.fx.Node) and args[0] not in trainable and \
                (bias is None or isinstance(bias, torch.fx.Node)):
            weight = param(args[1])
            if weight is None or weight.dim() == 2:
                return "linear", weight, param(bias)
    if node.target is F.layer_norm and len(args) == 5 and isinstance(args[0], torch.fx.Node) \
            and args[0] not in trainable and isinstance(args[1], (tuple, list)):
        return "layer_norm", param(args[2]), param(args[3])
    if node.target is F.embedding and len(args) == 7 and args[3] is None and not args[6] \
            and isinstance(args[0], torch.fx.Node) and args[1] in trainable:
        return "embedding", param(args[1]), None
    return None


class WeightGradPlan:
    """The split of one stage graph (NOTE [Weight-gradient split]), or None from
    :meth:`build` when the graph does not allow it."""

    def __init__(self, module: torch.fx.GraphModule, nodes: list[WeightNode],
                 xs: list[torch.fx.Node]) -> None:
        self.nodes = nodes
        self.num_extra = len(nodes) + len(xs)
        graph = torch.fx.Graph()
        val_map: dict[torch.fx.Node, torch.fx.Node] = {}
        out = graph.graph_copy(module.graph, val_map)
        graph.output((*out, *[val_map[w.node] for w in nodes], *[val_map[x] for x in xs]))
        self.module = torch.fx.GraphModule(module, graph,
                                           class_name=f"{type(module).__name__}WithWeightNodes")

    @classmethod
    def build(cls, gm: torch.fx.GraphModule) -> "WeightGradPlan | None":
        trainable = {n: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"
                     and isinstance(_attr(gm, str(n.target)), torch.nn.Parameter)
                     and _attr(gm, str(n.target)).requires_grad}
        nodes: list[WeightNode] = []
        xs: list[torch.fx.Node] = []
        readers: dict[int, int] = {}  # id(parameter) -> nodes reading it (aliases too)
        for node in gm.graph.nodes:
            used = [trainable[a] for a in node.all_input_nodes if a in trainable]
            if not used:
                continue
            ex = node.meta.get("example_value", node.meta.get("val"))
            if not isinstance(ex, torch.Tensor):
                return None
            for u in used:
                readers[id(_attr(gm, u))] = readers.get(id(_attr(gm, u)), 0) + 1
            w = WeightNode(node, [_attr(gm, f) for f in used], "engine")
            formula = _formula_rule(node, trainable, gm)
            if formula is not None:
                w.rule, w.weight, w.bias = formula
                w.x_index = len(xs)
                xs.append(node.args[0])  # type: ignore[arg-type]
            nodes.append(w)
        shared = {p for p, n in readers.items() if n > 1}
        for w in nodes:
            w.shared = any(id(p) in shared for p in w.params)
            # A shared parameter's gradient is the sum of each reader's local
            # contribution, which only a formula gives (an engine call from one
            # reader would also reach the others through the activations).
            if w.shared and w.rule == "engine":
                return None
        if not nodes:
            return None
        return cls(gm, nodes, xs)

    def split_outputs(self, result: Sequence[Any]) -> tuple[Sequence[Any], list[torch.Tensor],
                                                             list[torch.Tensor]]:
        """The stage's own outputs, the Zs and the Xs of one forward of ``module``."""
        n_out = len(result) - self.num_extra
        zs = list(result[n_out:n_out + len(self.nodes)])
        return result[:n_out], zs, list(result[n_out + len(self.nodes):])

    @staticmethod
    def _by_engine(w: WeightNode, z: torch.Tensor, dz: torch.Tensor,
                   x: torch.Tensor | None) -> bool:
        """Whether this step takes ``w``'s gradients from the engine: no
        formula, hooks to run, or a formula that may not hold. A formula holds
        for the node's output and input as they were when it ran; an in-place
        write to Z or X afterwards (or to a view of them: views share the
        version counter), or autocast changing X's dtype inside the node, is
        known only to the graph autograd saved."""
        if w.rule == "engine" or w.hooked() or x is None:
            return True
        return z._version != 0 or x._version != 0 or (
            w.rule != "embedding" and x.dtype != dz.dtype)

    def can_accumulate(self, zs: Sequence[torch.Tensor], dzs: Sequence[torch.Tensor | None],
                       xs: Sequence[torch.Tensor]) -> bool:
        """False when a shared parameter's reader needs the engine this step
        (hooks, in-place writes, autocast): an engine call from one reader
        would also reach the others, so only a backward through the whole
        stage gives the parameter its gradient."""
        return not any(
            w.shared and dz is not None and self._by_engine(w, z, dz, xs[w.x_index])
            for w, z, dz in zip(self.nodes, zs, dzs))

    def accumulate(self, zs: Sequence[torch.Tensor], dzs: Sequence[torch.Tensor | None],
                   xs: Sequence[torch.Tensor]) -> None:
        """W: add every weight node's parameter gradients into ``.grad``
        (requires :meth:`can_accumulate`)."""
        for w, z, dz in zip(self.nodes, zs, dzs):
            if dz is None:  # no gradient reached this node
                continue
            x = xs[w.x_index] if w.x_index >= 0 else None
            if self._by_engine(w, z, dz, x):
                _ENGINE.run_backward((z,), (dz,), True, False, tuple(w.params), True, True)
                continue
            with torch.no_grad():
                if w.rule == "linear":
                    dz2 = dz.reshape(-1, dz.shape[-1])
                    _add(w.weight, lambda: dz2.t().mm(x.reshape(-1, x.shape[-1])))
                    _add(w.bias, lambda: dz2.sum(0))
                elif w.rule == "layer_norm":
                    shape = w.node.args[1]
                    dz2 = dz.reshape(-1, *shape)
                    _add(w.weight, lambda: (dz2 * F.layer_norm(
                        x, shape, None, None, w.node.args[4]).reshape(dz2.shape)).sum(0))
                    _add(w.bias, lambda: dz2.sum(0))
                else:  # embedding
                    weight = w.weight
                    padding = w.node.args[2]
                    if padding is None:
                        padding = -1
                    elif padding < 0:
                        padding += weight.shape[0]
                    _add(weight, lambda: torch.ops.aten.embedding_dense_backward(
                        dz, x, weight.shape[0], padding, w.node.args[5]))


def _add(param: torch.Tensor | None, grad: Any) -> None:
    """Accumulate like autograd's AccumulateGrad; ``grad`` may be a thunk (for
    parameters that are frozen or absent, nothing is computed)."""
    if param is None or not param.requires_grad:
        return
    if callable(grad):
        grad = grad()
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
