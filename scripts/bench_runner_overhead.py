"""Where one rank's runtime overhead goes, near-empty stage, no communication.

    torchrun --standalone --nproc-per-node 1 scripts/bench_runner_overhead.py

A one-stage pipeline of one 8x8-linear model (m=32). Alternating, median of
--rounds: the stage's functional programs called directly (F, then B with
the loss's 1/m tangent, gradients added into .grad), the same through the
ProgramRunner's methods, through the C++ executor (which calls the runner and
holds the saved values), and the whole Pipeline.step. Each line prints the
microseconds per compute action above the direct loop: the runtime's
overhead, the programs' own time excluded.
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
    rt = pipe.session.runtime
    runner = rt.runner
    prog = runner.programs[0]
    inv_m = torch.full((), 1.0 / m)
    inputs = pipe.split.named_microbatches((x,), {}, m)
    params = [p for p, _ in prog.param_grads]
    positions = [pos for _, pos in prog.param_grads]

    def direct() -> None:
        with torch.no_grad():
            for a, b in zip(xs, ys):
                outs = prog.forward(*prog.state_tensors, a, b)
                grads = prog.backward(*outs[prog.output_offset + prog.num_outputs:], inv_m)
                for p, pos in zip(params, positions):
                    p.grad.add_(grads[pos])

    @torch.no_grad()  # as Pipeline.step runs the executor
    def through_runner() -> None:
        runner.begin_step(inputs, list(ys), F.mse_loss, 1, 1, training=True)
        for k in range(m):
            _, saved = runner.forward(0, k, [])
            runner.backward(0, k, [], False, saved)

    @torch.no_grad()
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
