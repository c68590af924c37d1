"""torch_mpmd against torch.distributed.pipelining, side by side in one run.

    torchrun --standalone --nproc-per-node 2 scripts/bench_vs_torch.py

(or `bash scripts/bench_vs_torch.sh`). The same GPT-like model (untied head,
so both systems compute the same thing), the same split into stages at
`blocks.K`, the same schedule, microbatches and ranks (2 ranks, gloo, 1 thread
each); the two systems step alternately in the same processes, after a warm-up
step each. A third contender runs in the same rounds: rank 0 stepping the whole
model alone over the same microbatches (rank 1 waits at the barrier). Prints
median step times, the ratio torch_mpmd / torch per schedule, each system's
time as a fraction of the one-process step next to the schedule's ideal
fraction with free communication and perfectly balanced stages, and the best
ratio any runtime running the same kernels could reach against torch's
(ideal / torch's fraction); then torch_mpmd's zero_bubble against its 1f1b at
the same m, next to the simulator's ratio for unit costs (F=I=W=1, B=2).
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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import Block, GPTConfig  # noqa: E402


class UntiedGPT(nn.Module):
    """examples/gpt_model.py's GPT with its own head weight (not tied)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Part(nn.Module):
    """Blocks [lo, hi) of a model, with the embedding first / the head last."""

    def __init__(self, model: UntiedGPT, lo: int, hi: int) -> None:
        super().__init__()
        self.first = lo == 0
        self.last = hi == len(model.blocks)
        if self.first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=args.seq, n_layer=args.layers, n_head=4,
                    d_model=args.d_model)
    model = UntiedGPT(cfg)
    x = torch.randint(0, 96, (args.batch, args.seq))
    y = torch.randint(0, 96, (args.batch, args.seq))
    m = args.microbatches
    results = {}
    whole = copy.deepcopy(model)

    def one_process_step() -> None:
        if rank == 0:
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                (loss_fn(whole(xs), ys) / m).backward()

    for name in args.schedules.split(","):
        spr = 2 if name == "interleaved_1f1b" else 1
        n_stages = world * spr
        per = args.layers // n_stages
        ours_model = copy.deepcopy(model)
        ours = mpmd.pipeline(ours_model, loss_fn=loss_fn, schedule=name, num_microbatches=m,
                             split_points=[f"blocks.{per * s}" for s in range(1, n_stages)])
        theirs_model = copy.deepcopy(model)
        stage_ids = [rank + world * v for v in range(spr)]
        stages = [PipelineStage(Part(theirs_model, per * s, per * (s + 1) if s < n_stages - 1
                                     else args.layers), s, n_stages, torch.device("cpu"))
                  for s in stage_ids]
        if name == "interleaved_1f1b":
            sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
            sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
        has_first = any(s == 0 for s in stage_ids)
        has_last = any(s == n_stages - 1 for s in stage_ids)

        def theirs_step() -> None:
            kwargs = {"target": y} if has_last else {}
            if has_first:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)

        def ours_step() -> None:
            ours.step(x, target=y)

        contenders = {"torch_mpmd": ours_step, "torch": theirs_step, "one": one_process_step}
        times: dict[str, list[float]] = {label: [] for label in contenders}
        computing: list[float] = []  # torch_mpmd: F/B/I/W seconds on this rank per step
        for step in contenders.values():  # warm-up (capture, shape inference)
            step()
            dist.barrier()
        for _ in range(args.rounds):
            for label, step in contenders.items():
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                times[label].append(time.perf_counter() - t0)
                if label == "torch_mpmd":
                    computing.append(ours.last_step_stats["compute_s"])
        busiest = torch.tensor([statistics.median(computing)], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        # Free communication, equal stages: (m + (p - 1) / v) / (m p) of one process.
        ideal = (m + (world - 1) / spr) / (m * world)
        results[name] = (median_ms(times["torch_mpmd"]), median_ms(times["torch"]),
                         median_ms(times["one"]), ideal, float(busiest) * 1e3)

    pipes = {name: mpmd.pipeline(copy.deepcopy(model), loss_fn=loss_fn, schedule=name,
                                 num_microbatches=m,
                                 split_points=[f"blocks.{args.layers // world * s}"
                                               for s in range(1, world)])
             for name in ("1f1b", "zero_bubble")}
    for pipe in pipes.values():
        pipe.step(x, target=y)
    zb_times: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(args.rounds):
        for name, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            dist.barrier()
            zb_times[name].append(time.perf_counter() - t0)

    if rank == 0:
        print(f"GPT {args.layers} layers d={args.d_model}, batch {args.batch}x{args.seq}, "
              f"m={m}, {world} ranks x 1 thread (gloo), median of {args.rounds} alternating "
              "steps")
        print(f"  {'schedule':18s} {'torch_mpmd ms':>14s} {'torch ms':>10s} {'ratio':>7s}   "
              f"{'one process ms':>14s} {'torch_mpmd/one':>14s} {'torch/one':>10s} "
              f"{'ideal/one':>10s} {'best ratio':>10s}")
        for name, (ours_ms, theirs_ms, one_ms, ideal, _) in results.items():
            print(f"  {name:18s} {ours_ms:14.1f} {theirs_ms:10.1f} {ours_ms / theirs_ms:7.2f}   "
                  f"{one_ms:14.1f} {ours_ms / one_ms:14.2f} {theirs_ms / one_ms:10.2f} "
                  f"{ideal:10.2f} {ideal / (theirs_ms / one_ms):10.2f}")
        print("  compute on torch_mpmd's busiest rank against one process's share of it "
              "(inflation: two processes computing at once on this machine):")
        for name, (ours_ms, _, one_ms, ideal, busy_ms) in results.items():
            inflation = busy_ms / (one_ms / world)
            print(f"  {name:18s} {busy_ms:8.1f} ms = {inflation:.2f} x one/{world}; with it the "
                  f"schedule's limit is {ideal * inflation:.2f} of one process, "
                  f"torch_mpmd runs {ours_ms / one_ms:.2f}")
        a, b = median_ms(zb_times["zero_bubble"]), median_ms(zb_times["1f1b"])
        unit = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
        bound = (pipes["zero_bubble"].schedule.simulate(costs=unit).makespan /
                 pipes["1f1b"].schedule.simulate(costs=unit).makespan)
        print(f"  torch_mpmd zero_bubble {a:.1f} ms vs 1f1b {b:.1f} ms: ratio {a / b:.2f} "
              f"(simulated at unit costs: {bound:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
