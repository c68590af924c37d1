"""Where one rank's runtime overhead goes, near-empty stage, no communication.

    torchrun --standalone --nproc-per-node 1 scripts/bench_runner_overhead.py

A one-stage pipeline of one 8x8-linear model (m=32). Alternating, median of
--rounds: the stage graph run directly (forward, loss, one engine call per
microbatch), the same through the StageRunner's Python methods, through the
C++ executor (which calls the runner), and the whole Pipeline.step. Each line
prints the microseconds per compute action above the direct loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_mpmd as mpmd  # noqa: E402
from bench_overhead import Tiny  # noqa: E402

_ENGINE = torch.autograd.Variable._execution_engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    m = args.microbatches
    torch.manual_seed(0)
    x, y = torch.randn(m, 8), torch.randn(m, 8)
    xs, ys = x.chunk(m), y.chunk(m)
    pipe = mpmd.pipeline(Tiny(), loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=m)
    pipe.step(x, target=y)
    rt = pipe._runtime()
    runner, graph = rt.runner, rt.runner.stages[0].module
    inv_m = torch.full((), 1.0 / m)
    inputs = pipe._mpmd_split.named_microbatches((x,), {}, m)

    def direct() -> None:
        for a, b in zip(xs, ys):
            loss = F.mse_loss(graph.forward(a)[0], b)
            _ENGINE.run_backward((loss,), (inv_m,), False, False, (), True, True)

    def through_runner() -> None:
        runner.begin_step(inputs, list(ys), F.mse_loss, 1, 1, training=True)
        for k in range(m):
            runner.forward(0, k, [])
            runner.backward(0, k, [], False)

    def through_executor() -> None:
        runner.begin_step(inputs, list(ys), F.mse_loss, 1, 1, training=True)
        rt.executor.run()

    steps = {"direct": direct, "runner": through_runner, "executor": through_executor,
             "Pipeline.step": lambda: pipe.step(x, target=y)}
    times: dict[str, list[int]] = {k: [] for k in steps}
    for step in steps.values():
        step()
    for _ in range(args.rounds):
        for label, step in steps.items():
            t0 = time.perf_counter_ns()
            step()
            times[label].append(time.perf_counter_ns() - t0)
    base = statistics.median(times["direct"])
    print(f"one-stage pipeline, 8x8 linear, m={m}, 1 thread, median of {args.rounds} rounds")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"  {label:14s} {med / m / 1e3:7.1f} us per microbatch, "
              f"+{(med - base) / (2 * m) / 1e3:5.1f} us per compute action over direct")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
