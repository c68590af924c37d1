"""Pipeline step time and live activations, measured side by side in one run.

    torchrun --standalone --nproc-per-node 2 scripts/bench_pipeline.py

(or `bash scripts/bench_pipeline.sh`). Rounds alternate, in the same two
processes (1 thread each): (a) a torch_mpmd step over both ranks, (b) rank 0
stepping the whole model alone (the same microbatches, gradient accumulation)
while rank 1 waits at a barrier. Prints median step times and their ratio,
then the measured 1f1b bubble per rank against the simulator's with the
measured stage costs, then, per schedule, the most forwards each rank held
before their backward (executor stats) next to the simulator's peak.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from torch_mpmd.trace import (bubble_fractions, simulate_measured,  # noqa: E402
                              transfer_latencies)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=args.layers, n_head=4,
                    d_model=args.d_model)
    model = GPT(cfg)
    x = torch.randint(0, 96, (args.batch, 64))
    y = torch.randint(0, 96, (args.batch, 64))
    m = args.microbatches
    per = args.layers // world
    splits = [f"blocks.{per * r}" for r in range(1, world)]

    pipe = mpmd.pipeline(copy.deepcopy(model), loss_fn=loss_fn, schedule="1f1b",
                         num_microbatches=m, split_points=splits)
    whole = copy.deepcopy(model)

    def single_step() -> None:
        for k in range(m):
            xs, ys = x.chunk(m)[k], y.chunk(m)[k]
            (loss_fn(whole(xs), ys) / m).backward()

    pipe.step(x, target=y)  # capture
    if rank == 0:
        single_step()
    piped, single = [], []
    # Per round: measured, simulated (free transfers), simulated with the round's
    # median measured transfer latency, that latency.
    bubbles: list[tuple[list[float], list[float], list[float], float]] = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        dist.barrier()
        piped.append(time.perf_counter() - t0)
        rows = pipe.timelines()
        if rank == 0:
            latency = statistics.median(transfer_latencies(rows) or [0.0])
            bubbles.append((bubble_fractions(rows),
                            list(simulate_measured(pipe.schedule, rows).bubble_fraction),
                            list(simulate_measured(pipe.schedule, rows,
                                                   comm_latency_s=latency).bubble_fraction),
                            latency))
        if rank == 0:
            t0 = time.perf_counter()
            single_step()
            single.append(time.perf_counter() - t0)
        dist.barrier()
    if rank == 0:
        a, b = statistics.median(piped), statistics.median(single)
        print(f"GPT {args.layers} layers d={args.d_model}, batch {args.batch}x64, 1f1b m={m}, "
              f"{world} ranks x 1 thread vs 1 process x 1 thread, {args.rounds} rounds")
        print(f"  torch_mpmd step   median {a * 1e3:8.1f} ms")
        print(f"  one process step  median {b * 1e3:8.1f} ms")
        print(f"  ratio (pipelined / one process): {a / b:.2f}  (speed-up {b / a:.2f}x)")

    # Measured bubble of each 1f1b step against the simulator's, fed that step's
    # measured per-stage compute times (so only runtime and transfers differ);
    # medians over the rounds.
    if rank == 0:
        def med(i: int) -> list[float]:
            return [statistics.median(b[i][r] for b in bubbles) for r in range(world)]

        def ratios(a: list[float], b: list[float]) -> str:
            return ", ".join(f"{x / y:.2f}" if y else "-" for x, y in zip(a, b))

        measured, free, linked = med(0), med(1), med(2)
        latency = statistics.median(b[3] for b in bubbles)
        print(f"  1f1b bubble per rank, median of {args.rounds} steps: measured "
              + ", ".join(f"{b:.1%}" for b in measured))
        print("    simulated with the measured stage costs, free transfers: "
              + ", ".join(f"{b:.1%}" for b in free) + f"; measured / simulated {ratios(measured, free)}")
        print(f"    same, each transfer taking the measured median {latency * 1e6:.0f} us: "
              + ", ".join(f"{b:.1%}" for b in linked)
              + f"; measured / simulated {ratios(measured, linked)}")

    # Live activations: the executor's count against the simulator's peak.
    for name in ("gpipe", "1f1b", "zero_bubble"):
        pp = mpmd.pipeline(copy.deepcopy(model), loss_fn=loss_fn, schedule=name,
                           num_microbatches=m, split_points=splits)
        pp.step(x, target=y)
        measured = torch.tensor([pp.last_step_stats["peak_live_forwards"]])
        everyone = [torch.zeros_like(measured) for _ in range(world)]
        dist.all_gather(everyone, measured)
        if rank == 0:
            sim = pp.schedule.simulate().peak_activations
            print(f"  {name:12s} peak live forwards per rank: measured "
                  f"{[int(t) for t in everyone]}, simulated {list(sim)}, "
                  f"bound {list(pp.schedule.activation_bound)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
