"""Runtime overhead per action: near-empty stages, both systems, side by side.

    torchrun --standalone --nproc-per-node 2 scripts/bench_overhead.py

(or `bash scripts/bench_overhead.sh`). Stages are one 8x8 linear layer on
microbatches of one sample, so a step is almost all runtime. Two measurements,
1F1B-family schedules, gloo, 1 thread per rank, systems stepping alternately
in the same processes (median of --rounds):

1. Overhead per compute action, no communication: each rank runs a
   one-stage pipeline of its own (a one-rank group) next to the loop that does
   the same compute directly. Overhead = (pipeline step - direct loop) / the
   step's 2m compute actions (F and B). The direct loop for torch_mpmd runs the
   very stage graph the runtime runs (the captured GraphModule, the loss, one
   autograd engine call per microbatch); for torch.distributed.pipelining the
   eager module with `loss.backward()`, what its stage runs.
2. Per compute action on 2 ranks: step time / the rank's 2m compute actions,
   transfers included (a gloo round trip between two processes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import torch_mpmd as mpmd

_ENGINE = torch.autograd.Variable._execution_engine


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def medians(steps: dict[str, Callable[[], None]], rounds: int,
            barrier: Callable[[], None]) -> dict[str, float]:
    for step in steps.values():  # warm up (capture, first-step measurements)
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def one_rank_overhead(m: int, rounds: int, solo: object) -> dict[str, float]:
    """Part 1 on this rank alone (``solo``: a group of this rank only)."""
    torch.manual_seed(0)
    x, y = torch.randn(m, 8), torch.randn(m, 8)
    xs, ys = x.chunk(m), y.chunk(m)
    eager = Tiny()
    ours = mpmd.pipeline(Tiny(), loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=m,
                         group=solo)
    theirs = ScheduleGPipe(PipelineStage(Tiny(), 0, 1, torch.device("cpu"), group=solo),
                           n_microbatches=m, loss_fn=F.mse_loss)
    ours.step(x, target=y)  # capture, so the stage graph exists
    graph = ours.inspect().stages[0]
    inv_m = torch.full((), 1.0 / m)

    def direct_graph() -> None:  # what torch_mpmd's runner computes, with nothing around it
        for a, b in zip(xs, ys):
            loss = F.mse_loss(graph.forward(a)[0], b)
            _ENGINE.run_backward((loss,), (inv_m,), False, False, (), True, True)

    def direct_eager() -> None:  # what torch's stage computes, with nothing around it
        for a, b in zip(xs, ys):
            (F.mse_loss(eager(a), b) / m).backward()

    steps = {"graph": direct_graph, "torch_mpmd": lambda: ours.step(x, target=y),
             "eager": direct_eager, "torch": lambda: theirs.step(x, target=y)}
    med = medians(steps, rounds, lambda: None)
    return {"torch_mpmd": (med["torch_mpmd"] - med["graph"]) / (2 * m) * 1e6,
            "torch": (med["torch"] - med["eager"]) / (2 * m) * 1e6,
            "graph": med["graph"] / (2 * m) * 1e6, "eager": med["eager"] / (2 * m) * 1e6}


def two_rank_per_action(m: int, rounds: int, rank: int) -> dict[str, float]:
    """Part 2: a 2-rank 1F1B pipeline, transfers included."""
    torch.manual_seed(0)
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

    med = medians({"torch_mpmd": lambda: ours.step(x, target=y), "torch": theirs_step},
                  rounds, dist.barrier)
    return {k: v / (2 * m) * 1e6 for k, v in med.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with 2 ranks"
    m = args.microbatches
    solos = [dist.new_group([r]) for r in range(world)]
    one = one_rank_overhead(m, args.rounds, solos[rank])
    dist.barrier()
    two = two_rank_per_action(m, args.rounds, rank)
    mine = torch.tensor([one["torch_mpmd"], one["torch"], one["graph"], one["eager"],
                         two["torch_mpmd"], two["torch"]], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        print(f"near-empty stages (8x8 linear), m={m}, 1 thread per rank (gloo), median of "
              f"{args.rounds} alternating steps")
        print("1. overhead per compute action, one-rank pipeline vs the same compute run "
              "directly (no communication)")
        for r, t in enumerate(everyone):
            ours, theirs, graph, eager = t.tolist()[:4]
            print(f"  rank {r}: torch_mpmd {ours:6.1f} us (direct {graph:5.1f} us/action)   "
                  f"torch {theirs:6.1f} us (direct {eager:5.1f} us/action)   "
                  f"torch/torch_mpmd {theirs / max(ours, 0.1):5.1f}x")
        print("2. per compute action, 2-rank 1f1b pipeline, transfers included")
        for r, t in enumerate(everyone):
            ours, theirs = t.tolist()[4:]
            print(f"  rank {r}: torch_mpmd {ours:6.1f} us   torch {theirs:6.1f} us   "
                  f"ratio {ours / theirs:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
