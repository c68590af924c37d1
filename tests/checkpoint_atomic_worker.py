"""Rank functions for tests/test_checkpoint_atomic.py (launched by dist_harness):
two gloo ranks save a 2-stage pipeline, then rank 1 stalls or dies inside
``checkpoint.load`` while rank 0 loads with a short ``timeout=`` (the process
group's own timeout is far longer: only the checkpoint's bound can end the wait).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader

import models
import torch_mpmd as mpmd
from dist_harness import partial_result

TIMEOUT_S = 3.0


def _step(pipe: Any, opt: Any, value: float) -> None:
    pipe.step(torch.full((4, 8), value), target=torch.ones(4, 4))
    opt.step()
    opt.zero_grad()


def peer_fails_in_load(directory: str, how: str) -> dict[str, Any]:
    """``how``: "stall" (rank 1 waits inside load, before its first exchange,
    until rank 0 is done) or "die_in_dcp" (rank 1's process exits while DCP
    reads its data). Rank 0 returns its error and whether its pipeline and
    optimizer were left as they were."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    pipe = mpmd.pipeline(models.MLP(d=8, depth=2, markers=True), loss_fn=F.mse_loss,
                         num_microbatches=2, schedule="1f1b", timeout=TIMEOUT_S)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    _step(pipe, opt, 0.5)
    mpmd.checkpoint.save(pipe, opt, directory)
    _step(pipe, opt, 0.25)   # now every entry differs from the checkpoint's
    done = os.path.join(directory, "rank0_done")
    if rank == 1 and how == "stall":
        def stall(*args: Any, **kwargs: Any) -> Any:
            partial_result({"stalled": True})
            while not os.path.exists(done):
                time.sleep(0.05)
            os._exit(0)

        from torch_mpmd.checkpoint import loading
        loading.read_manifests = stall
    elif rank == 1 and how == "die_in_dcp":
        def die(*args: Any, **kwargs: Any) -> Any:
            partial_result({"died": True})
            os._exit(1)

        FileSystemReader.read_data = die  # type: ignore[method-assign]
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    try:
        mpmd.checkpoint.load(pipe, opt, directory)
        error = None
    except Exception as e:  # the test checks the type and the text
        error = f"{type(e).__name__}: {e}"
    untouched = (all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
                 and all(torch.equal(v, moments[id(p)][k])
                         for p, s in opt.state.items() for k, v in s.items())
                 and len(opt.state) == len(moments))
    open(done, "w").close()
    return {"error": error, "untouched": untouched}
