"""A forward call's outputs, from the last stage's rank to the ranks that asked.

``Pipeline.forward(output_rank=None)`` returns the model's output on every
rank: each output tensor is broadcast from the last stage's rank. With an
``output_rank`` it reaches that rank only, by one point-to-point transfer per
tensor on its own tag (never paired with the executor's transfers on the same
group), and nothing when it is the last stage's rank. Every rank knows each
output's shape from the capture, so no shape travels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torch_mpmd.parallel.lockstep import PipelineError

if TYPE_CHECKING:
    from torch_mpmd.runtime.rank import RankRuntime

__all__ = ["deliver_outputs"]

_OUTPUT_TAG = 0x6D6F  # p2p tag of outputs sent to one rank (the executor's transfers use 0)


def deliver_outputs(rt: RankRuntime, ir: Any, flat: tuple | None, output_rank: int | None,
                    device: torch.device, mb: int = 0) -> tuple | None:
    """The last stage's flat outputs of microbatch ``mb`` of the call just run
    (``flat``, None on other ranks): on every rank (``output_rank`` None), else
    on ``output_rank`` only (None elsewhere). ``ir``: the capture's graph IR
    (its output node gives the shapes; a dynamic capture's are evaluated for
    the microbatch's sizes). Collective over the ranks that take part."""
    if output_rank is not None and rt.rank not in (output_rank, rt.last_rank):
        return None
    out_node = ir.fx_nodes[-1]
    specs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [
        out_node.args[0]]
    result = []
    for i, spec in enumerate(specs):
        meta = spec.meta.get("example_value") if isinstance(spec, torch.fx.Node) else spec
        if isinstance(meta, torch.Tensor):
            t = (flat[i].detach().contiguous() if flat is not None else
                 torch.empty(_concrete_shape(rt, meta, mb), dtype=meta.dtype, device=device))
            if output_rank is None:
                rt.broadcast_from_last(t, f"model output {i}")
            elif output_rank != rt.last_rank:
                _send_output(rt, t, i, output_rank)
            result.append(t)
        elif isinstance(spec, torch.fx.Node):
            raise PipelineError(f"model output {i} is a {type(meta).__name__} computed by "
                                "the graph; only tensor outputs can be returned to other "
                                "ranks", rank=rt.rank)
        else:
            result.append(spec)
    return tuple(result) if output_rank is None or rt.rank == output_rank else None


def _concrete_shape(rt: RankRuntime, meta: torch.Tensor, mb: int) -> tuple[int, ...]:
    """An output's shape in microbatch ``mb``: the capture's, its symbols
    bound by the microbatch's sizes (a dynamic capture)."""
    shapes = rt.model.shapes
    if shapes is None or all(isinstance(d, int) for d in meta.shape):
        return tuple(meta.shape)
    return shapes.expected(meta, shapes.key(rt.runner.inputs[mb]))


def _send_output(rt: RankRuntime, t: torch.Tensor, i: int, output_rank: int) -> None:
    """Model output ``i`` from the last stage's rank to ``output_rank`` (the one
    of the two this rank is)."""
    if rt.rank == rt.last_rank:
        work = dist.isend(t, group=rt.group, group_dst=output_rank, tag=_OUTPUT_TAG)
    else:
        work = dist.irecv(t, group=rt.group, group_src=rt.last_rank, tag=_OUTPUT_TAG)
    rt.wait(work, f"model output {i} from rank {rt.last_rank} to rank {output_rank}")
