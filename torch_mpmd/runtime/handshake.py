"""The start-up handshake of a rank's runtime: every rank of the pipeline (all
replicas) compares its partition plan and settings with the others' in one
exchange before any transfer (NOTE [Lockstep] in parallel/lockstep.py), and
they agree on a seed; where they differ, every rank raises PipelineError
naming the settings that differ, with their values."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torch_mpmd.parallel import lockstep
from torch_mpmd.parallel.lockstep import Ledger, PipelineError
from torch_mpmd.runtime.contents import as_int64

__all__ = ["agree", "plan_digest", "settings_digest", "SETTING_CHARS"]

SETTING_CHARS = 300  # of a setting's value, in the start-up mismatch error

# wait(work, what, timeout_s): a bounded wait for a collective (RankRuntime.wait)
Wait = Callable[[Any, str, float], None]


def plan_digest(plan: Any, *, dynamic: bool) -> int:
    """What the ranks compare of their partition plans: its hash, or for a
    dynamic capture the plan without the transferred values' bytes, which
    follow the sizes each rank captured with (data-parallel replicas capture
    from their own first microbatch: the same plan at other sizes)."""
    if not dynamic:
        return as_int64(plan.hash)
    structure = (plan.num_stages, list(plan.node_stage),
                 [(v.node, v.producer_stage, list(v.consumer_stages))
                  for v in plan.cross_stage_values],
                 [(p.fqn, list(p.stages)) for p in plan.parameters])
    digest = hashlib.sha256(repr(structure).encode()).digest()
    return as_int64(int.from_bytes(digest[:8], "little"))


def settings_digest(settings: Mapping[str, str]) -> int:
    """What the ranks compare of their settings (nonzero: 0 is not compared)."""
    digest = hashlib.sha256(json.dumps(list(settings.items())).encode()).digest()
    return as_int64(int.from_bytes(digest[:8], "little")) or 1


def agree(ledger: Ledger, settings: Mapping[str, str], mine: Sequence[int], *,
          seed_rank: int, rank: int, timeout_s: float, wait: Wait) -> int:
    """The handshake exchange of ``mine`` (plan digest, settings digest, seed)
    within ``timeout_s``: PipelineError (on every rank) where the ranks'
    settings or plans differ; else the seed of global rank ``seed_rank``.
    ``settings``: this rank's, by name; ``rank``: its pipeline rank."""
    outcome = ledger.exchange("handshake", timeout_s=timeout_s, payload=mine)
    ledger.raise_for(outcome, "the start-up comparison of plans", ended=False)
    rows = [lockstep.payload(row) for row in outcome.rows]
    _compare(ledger, rows, settings, rank=rank, timeout_s=timeout_s, wait=wait)
    return rows[ledger.ranks.index(seed_rank)][2]


def _compare(ledger: Ledger, rows: list[list[int]], settings: Mapping[str, str], *,
             rank: int, timeout_s: float, wait: Wait) -> None:
    """PipelineError (on every rank) where the ranks' settings or plans
    differ: the settings first (they explain a plan that differs), named
    with their values on this rank and on the first peer whose differ,
    else each rank's hash; ``rows``: (plan hash, settings digest, seed)
    per rank of the ledger."""
    ranks = ledger.ranks
    cols = (("pipeline settings or schedule", 1), ("partition plan", 0))
    for what, col in cols:
        values = {r: row[col] & 0xFFFFFFFFFFFFFFFF for r, row in zip(ranks, rows)}
        if len(set(values.values())) > 1:
            # Every rank sees the same rows, so all take this branch together.
            named = _settings_difference(ledger, settings, timeout_s, wait) if col == 1 else ""
            listing = ", ".join(f"{ledger.name(r)}: {v:016x}" for r, v in values.items())
            problem = (f"the ranks' settings differ: {named}" if named else
                       f"the ranks disagree on the {what} (hashes {listing})")
            err = PipelineError(
                f"{ledger.name(ledger.me)}: {problem}; every rank must build the "
                "same model and call pipeline() with the same arguments and the same input "
                "shapes", rank=rank)
            raise lockstep.settle(err)  # every rank raises it, in step


def _settings_difference(ledger: Ledger, settings: Mapping[str, str], timeout_s: float,
                         wait: Wait) -> str:
    """Each setting in which this rank differs from the first peer that
    differs, with both values ('' if none does). Called by every rank
    together once the settings digests disagree: one more exchange, of
    every rank's settings (a rare error path), bounded by the start-up
    timeout."""
    me, theirs = ledger.me, _gather_settings(ledger, settings, timeout_s, wait)
    for rank, other in zip(ledger.ranks, theirs):
        names = [k for k in {**settings, **other}
                 if k not in settings or k not in other
                 or settings[k][:SETTING_CHARS] != other[k]]
        if rank == me or not names:
            continue
        return "; ".join(
            f"{k} is {settings.get(k, '(not set)')[:SETTING_CHARS]} on "
            f"{ledger.name(me)} (this rank) but {other.get(k, '(not set)')} on "
            f"{ledger.name(rank)}" for k in names)
    return ""


def _gather_settings(ledger: Ledger, settings: Mapping[str, str], limit: float,
                     wait: Wait) -> list[dict[str, str]]:
    """Every ledger rank's settings (values cut to SETTING_CHARS), by an
    all_gather of their sizes, then of the JSON texts padded to the largest."""
    mine = json.dumps([[k, v[:SETTING_CHARS]] for k, v in settings.items()]).encode()
    n, group = len(ledger.ranks), ledger.group
    sizes = torch.zeros(n, 1, dtype=torch.int64)
    wait(lockstep.all_gather(list(sizes.unbind(0)), torch.tensor([len(mine)]), group, limit),
         "the exchange of settings sizes (all_gather)", limit)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    texts = torch.zeros(n, padded.numel(), dtype=torch.uint8)
    wait(lockstep.all_gather(list(texts.unbind(0)), padded, group, limit),
         "the exchange of settings (all_gather)", limit)
    return [dict(json.loads(bytes(texts[i, :int(sizes[i])].tolist()))) for i in range(n)]
