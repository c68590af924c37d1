"""Rank functions for tests/test_checkpoint.py (launched by dist_harness).

A 2-stage MLP on 2 ranks, AdamW, a StepLR scheduler, and data that depends on a
position (a list of batches) and on each rank's own RNG (noise drawn every
step into the input and the target; the ranks are seeded alike, as every rank
of a pipeline is given the same batch), so a resumed run matches an
uninterrupted one only if the step, scheduler, data position and every rank's
RNG come back (a rank whose RNG did not would be given another batch than its
peer: a PipelineError).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter

import models
import torch_mpmd as mpmd
from dist_harness import partial_result

STEPS = 4      # the uninterrupted run
SAVE_AT = 2    # the checkpoint is taken after this many steps


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))
            for _ in range(STEPS)]


def _setup(init_seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(init_seed)
    model = models.MLP(d=8, depth=2, markers=True)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, schedule="1f1b")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return pipe, opt, sched


def _train(pipe: Any, opt: Any, sched: Any, data: dict[str, int], n: int) -> dict[str, list]:
    out: dict[str, list] = {"losses": [], "lrs": []}
    batches = _batches()
    for _ in range(n):
        x, y = batches[data["pos"]]
        x = x + 0.1 * torch.randn(x.shape)       # this rank's RNG (seeded alike)
        y = y + 0.1 * torch.randn(y.shape)
        out["losses"].append(float(pipe.step(x, target=y)))
        opt.step()
        opt.zero_grad()
        sched.step()
        out["lrs"].append(sched.get_last_lr()[0])
        data["pos"] += 1
    return out


def _values(pipe: Any, opt: Any) -> dict[str, list]:
    """This rank's parameters and optimizer moments, exactly (JSON floats)."""
    out = {k: v.flatten().tolist() for k, v in pipe.state_dict().items()}
    for name, p in pipe.named_parameters():
        for stat, v in opt.state.get(p, {}).items():
            out[f"optimizer {name} {stat}"] = v.flatten().tolist()
    return out


def _save(pipe: Any, opt: Any, sched: Any, data: dict[str, int], directory: str) -> str:
    return mpmd.checkpoint.save(pipe, opt, directory,
                                extra={"step": pipe.step_count, "lr_scheduler": sched,
                                       "data": dict(data)},
                                extra_per_rank={"rng": mpmd.checkpoint.RNGState(),
                                                "rank": dist.get_rank()})


def train(directory: str) -> dict[str, Any]:
    """The first run: SAVE_AT steps, save, then the rest (the reference)."""
    pipe, opt, sched = _setup(0)
    torch.manual_seed(100)  # alike on every rank: the same batch
    data = {"epoch": 0, "pos": 0}
    _train(pipe, opt, sched, data, SAVE_AT)
    saved_in = _save(pipe, opt, sched, data, directory)
    saved = _values(pipe, opt)
    lr = sched.get_last_lr()[0]
    rest = _train(pipe, opt, sched, data, STEPS - SAVE_AT)
    return {"saved_in": saved_in, "saved": saved, "lr": lr, **rest}


def second_run_dies_saving(directory: str) -> dict[str, Any]:
    """Another run (other weights) reaches the same step and saves it; rank 1
    dies part-way through writing its data."""
    pipe, opt, sched = _setup(1)
    torch.manual_seed(200)
    data = {"epoch": 0, "pos": 0}
    _train(pipe, opt, sched, data, SAVE_AT)
    if dist.get_rank() == 1:
        write_data = FileSystemWriter.write_data

        def die_mid_write(self: Any, plan: Any, planner: Any) -> Any:
            half = dataclasses.replace(plan, items=plan.items[:len(plan.items) // 2])
            write_data(self, half, planner).wait()   # a part of this rank's data is on disk
            partial_result({"died_writing": os.fspath(self.path)})
            os._exit(1)

        FileSystemWriter.write_data = die_mid_write  # type: ignore[method-assign]
    _save(pipe, opt, sched, data, directory)
    return {"saved": True}


def resume(directory: str) -> dict[str, Any]:
    """A fresh run: other weights and RNG, captured by one step; first a load
    of a copy without rank 0's shard (must fail on both ranks, though rank 1
    need not read that file), then the checkpoint, then the rest of the steps."""
    rank = dist.get_rank()
    pipe, opt, sched = _setup(2)
    torch.manual_seed(300 + rank)
    x, y = _batches()[0]
    pipe.step(x, target=y)   # captured: this rank holds its stage only
    opt.zero_grad()
    out: dict[str, Any] = {}

    broken = directory + "_broken"
    if rank == 0:
        shutil.copytree(directory, broken)
        os.remove(os.path.join(mpmd.checkpoint.latest(broken), "__0_0.distcp"))
    dist.barrier()
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    try:
        mpmd.checkpoint.load(pipe, opt, broken)
        out["broken_error"] = None
    except mpmd.checkpoint.CheckpointError as e:
        out["broken_error"] = str(e)
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())

    got = mpmd.checkpoint.load(pipe, opt, directory, extra={"lr_scheduler": sched},
                               extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    out["loaded"] = _values(pipe, opt)
    out["result"] = got
    out["lr"] = sched.get_last_lr()[0]
    data = dict(got["extra"]["data"])
    out.update(_train(pipe, opt, sched, data, STEPS - SAVE_AT))
    return out



# ------------------------------------------------------ tests/test_checkpoint_security.py

def save_for_tampering(directory: str) -> dict[str, Any]:
    """One step, then a save with extra {"step": 5} and extra_per_rank
    {"rank": r}; the test then tampers with copies of it."""
    pipe, opt, _ = _setup(0)
    x, y = _batches()[0]
    pipe.step(x, target=y)
    opt.step()
    opt.zero_grad()
    saved_in = mpmd.checkpoint.save(pipe, opt, directory, extra={"step": 5},
                                    extra_per_rank={"rank": dist.get_rank()})
    return {"saved_in": saved_in}


def load_each(directories: list[str]) -> dict[str, Any]:
    """A fresh run (other weights), captured by one step, loads each checkpoint
    in turn: per directory the error (type and text) or the extra state, and
    whether a failed load left the parameters as they were."""
    pipe, opt, _ = _setup(1)
    x, y = _batches()[0]
    pipe.step(x, target=y)
    opt.zero_grad()
    out: dict[str, Any] = {}
    for directory in directories:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        try:
            got = mpmd.checkpoint.load(pipe, opt, directory)
            out[directory] = {"error": None, "extra": got["extra"],
                              "extra_per_rank": got["extra_per_rank"]}
        except Exception as e:   # the test checks the type and the text
            out[directory] = {
                "error": f"{type(e).__name__}: {e}",
                "untouched": all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())}
    return out
