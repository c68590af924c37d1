"""A call's loss as every rank of the pipeline gets it: the microbatches'
losses summarized on the last stage's rank (:func:`loss_summary`), and that
summary packed into, and read back from, the three int64 of the end
exchange's record (NOTE [Loss in the end exchange])."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

__all__ = ["LossSummary", "loss_summary", "LOSS_KINDS", "NO_LOSS", "pack_loss", "unpack_loss"]

LossSummary = tuple[float, float, bool]  # (value, count, token-weighted)


def loss_summary(losses: Sequence[torch.Tensor]) -> LossSummary:
    """The microbatches' losses as ``(value, count, weighted)``: the mean of
    scalar losses (count 0, not weighted), or for token-weighted ``[sum,
    count]`` losses the sum of their sums and of their counts (weighted)."""
    # One kind per step (the runner's record_loss refuses a mix).
    stacked = torch.stack(losses)
    if stacked.dim() == 2:
        total, count = stacked.double().sum(0).tolist()
        return total, count, True
    return float(stacked.float().mean()), 0.0, False


# NOTE [Loss in the end exchange]: the last stage's rank puts the call's
# loss in its end-exchange record, so the other ranks have it without the
# loss broadcast: the exchange costs a step one collective, not two
# (RankRuntime.call_loss). The record's payload: the float32 bits of
# the mean of the microbatches' losses and the flag 1; for token-weighted
# losses (NOTE [Token-weighted losses] in training.py) the float32 bits of
# the sum of their sums, the flag 2 and the float64 bits of their count.
LOSS_KINDS = ("step", "eval")  # the calls whose end exchange carries the loss
_MEAN, _WEIGHTED = 1, 2        # the payload's flag
NO_LOSS = (0, 0, 0)            # the payload of a record without a loss


def pack_loss(summary: LossSummary) -> tuple[int, int, int]:
    """The end exchange's payload carrying ``summary``."""
    value, count, weighted = summary
    bits = struct.unpack("<i", struct.pack("<f", value))[0]
    if weighted:
        return (bits, _WEIGHTED, struct.unpack("<q", struct.pack("<d", count))[0])
    return (bits, _MEAN, 0)


def unpack_loss(payload: Sequence[int]) -> LossSummary | None:
    """The summary :func:`pack_loss` put in a record's ``payload``
    (lockstep.payload of its row); None when the record carries no loss."""
    if payload[1] not in (_MEAN, _WEIGHTED):
        return None
    value = struct.unpack("<f", struct.pack("<i", int(payload[0])))[0]
    if payload[1] == _WEIGHTED:
        return value, struct.unpack("<d", struct.pack("<q", int(payload[2])))[0], True
    return value, 0.0, False
