"""``stage_boundary()``: the marker a user puts in ``forward`` where a stage ends.

It is the custom op ``torch.ops.mpmd.stage_boundary`` (no arguments, returns
None). Dynamo records it as a call in the captured graph; it is registered as
side-effectful so dead-code elimination keeps it although nothing reads its
result. Called eagerly it does nothing, so a model with markers runs unchanged
without torch_mpmd.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.library import custom_op

__all__ = ["stage_boundary", "STAGE_BOUNDARY_OP", "is_stage_boundary"]


@custom_op("mpmd::stage_boundary", mutates_args=())
def _stage_boundary_op() -> None:
    return None


@_stage_boundary_op.register_fake
def _stage_boundary_fake() -> None:
    return None


STAGE_BOUNDARY_OP = torch.ops.mpmd.stage_boundary.default
"""The OpOverload that marks a stage boundary in a captured graph."""

# Keep the marker through DCE (torch.fx.Node.is_impure consults this set).
torch.fx.node.has_side_effect(STAGE_BOUNDARY_OP)
torch.fx.node.has_side_effect(torch.ops.mpmd.stage_boundary)


def stage_boundary() -> None:
    """End the current pipeline stage here (JaxPP's ``pipeline_yield``).

    Everything ``forward`` computes before the call belongs to earlier stages,
    everything after it to later ones. A no-op when the model runs eagerly.
    """
    STAGE_BOUNDARY_OP()


def is_stage_boundary(target: object) -> bool:
    """Whether an FX call target is the stage-boundary marker."""
    return target is STAGE_BOUNDARY_OP or target is torch.ops.mpmd.stage_boundary
