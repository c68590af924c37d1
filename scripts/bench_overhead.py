"""Executor overhead: near-empty stages, many microbatches, both systems.

    torchrun --standalone --nproc-per-node 2 scripts/bench_overhead.py

(or `bash scripts/bench_overhead.sh`). Each of the 2 stages is one 8x8 linear
layer on microbatches of one sample, so a step is almost all runtime: per
compute action (F or B, with its send/receive) the step time divided by the
rank's 2*m compute actions, for torch_mpmd and torch.distributed.pipelining
(1F1B, gloo, 1 thread per rank, alternating steps in the same processes). Also
torch_mpmd's own split: the time inside the stage runner's Python calls versus
the rest (the C++ executor and the transport), from the executor's trace.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import torch_mpmd as mpmd


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with 2 ranks"
    torch.manual_seed(0)
    m = args.microbatches
    x, y = torch.randn(m, 8), torch.randn(m, 8)
    ours = mpmd.pipeline(Tiny(), loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=m,
                         split_points=["b"])
    part = Tiny().a if rank == 0 else Tiny().b
    theirs = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu")), n_microbatches=m,
                          loss_fn=F.mse_loss)

    def theirs_step() -> None:
        if rank == 0:
            theirs.step(x)
        else:
            theirs.step(target=y)

    def ours_step() -> None:
        ours.step(x, target=y)

    times: dict[str, list[float]] = {"torch_mpmd": [], "torch": []}
    inside: list[float] = []
    for step in (ours_step, theirs_step):
        step()
        dist.barrier()
    for _ in range(args.rounds):
        for label, step in (("torch_mpmd", ours_step), ("torch", theirs_step)):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
            dist.barrier()
        inside.append(ours.last_step_stats["compute_s"])
    per_action = {k: statistics.median(v) / (2 * m) * 1e6 for k, v in times.items()}
    compute_us = statistics.median(inside) / (2 * m) * 1e6
    n_actions = len(ours.schedule.actions[rank])
    mine = torch.tensor([per_action["torch_mpmd"], per_action["torch"], compute_us,
                         statistics.median(times["torch_mpmd"]) * 1e6 / n_actions])
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        print(f"near-empty stages (8x8 linear), 1f1b, m={m}, 2 ranks x 1 thread (gloo), "
              f"median of {args.rounds} alternating steps")
        for r, t in enumerate(everyone):
            ours_us, theirs_us, compute, per_any = t.tolist()
            print(f"  rank {r}: per compute action  torch_mpmd {ours_us:7.1f} us   "
                  f"torch {theirs_us:7.1f} us   ratio {ours_us / theirs_us:.2f}; "
                  f"torch_mpmd F/B span incl. runner {compute:6.1f} us, any action "
                  f"{per_any:6.1f} us, {1e6 / per_any:,.0f} actions/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
