"""Ranks that call pipeline() with different settings fail at start-up, every
rank with an error naming the setting that differs and its value on this rank
and on the peer (issue 13 item 10), not only a pair of hashes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from dist_harness import run_ranks

PIPELINE_TIMEOUT = 10.0
LAUNCH_TIMEOUT = 120.0

# Per case: the pipeline() keyword set differently on rank 0 and rank 1.
CASES = {
    "num_microbatches": ({"num_microbatches": 2}, {"num_microbatches": 4}),
    "schedule": ({"schedule": "gpipe"}, {"schedule": "1f1b"}),
    "bytes_cost": ({"bytes_cost": None}, {"bytes_cost": 0.0}),
    "same": ({}, {}),
}


def differing_settings(case: str) -> dict:
    """Worker (run on each rank): one step of an MLP split in two by cost with
    this rank's side of ``case``; the PipelineError's message, or 'no error'."""
    rank = torch.distributed.get_rank()
    settings = {"schedule": "1f1b", "num_microbatches": 2, **CASES[case][rank]}
    torch.manual_seed(0)
    pipe = mpmd.pipeline(models.MLP(d=8, depth=4, markers=False), loss_fn=F.mse_loss,
                         timeout=PIPELINE_TIMEOUT, **settings)
    x, y = torch.randn(8, 8), torch.zeros(8, 4)
    try:
        pipe.step(x, target=y)
    except mpmd.PipelineError as e:
        return {"error": str(e)}
    return {"error": "no error"}


@pytest.mark.parametrize("case,values", [
    ("num_microbatches", ("2", "4")),
    ("schedule", ("gpipe", "1f1b")),
    ("bytes_cost", ("None", "0.0")),
])
def test_ranks_with_a_different_setting_both_raise_naming_it_and_both_values(case, values):
    run = run_ranks(2, "test_startup_mismatch:differing_settings", case,
                    timeout=LAUNCH_TIMEOUT)
    for rank in (0, 1):
        message = run.results[rank]["error"]
        peer = 1 - rank
        # "<setting> is <value here> on rank <me> (this rank) but <value there> on rank <peer>"
        expected = (rf"\b{re.escape(case)} is {re.escape(values[rank])} on rank {rank} "
                    rf"\(this rank\) but {re.escape(values[peer])} on rank {peer}\b")
        assert re.search(expected, message), f"rank {rank}: {message}"
        assert message.startswith(f"rank {rank}: the ranks' settings differ: "), message
        assert "same arguments" in message, message


def test_ranks_with_the_same_settings_agree():
    # The comparison that names settings raises only on a difference: the same
    # worker with both ranks' settings equal steps normally.
    run = run_ranks(2, "test_startup_mismatch:differing_settings", "same", timeout=LAUNCH_TIMEOUT)
    assert [r["error"] for r in run.results] == ["no error", "no error"]
