"""What keeping the ranks in lockstep costs per call (NOTE [Lockstep] in lockstep.py).

    torchrun --standalone --nproc-per-node 2 scripts/bench_lockstep.py

Two ranks, a small pipeline (SkipChain d=16, 2 stages, 1f1b, m=4). Printed on
rank 0, medians over --rounds, measured side by side in alternating blocks:
one all_reduce of a float on the pipeline group, for scale; one begin+end
exchange pair alone (two all_gathers of 80 bytes on the exchanges' gloo
group); Pipeline.step with the exchanges and with them
switched off (the runtime's ledger set to None: what a step cost before);
and the per-step record kept for the statistics (StepRecord: the trace as one
tensor, the peaks).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import models  # noqa: E402
import torch_mpmd as mpmd  # noqa: E402


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--block", type=int, default=20, help="steps per alternating block")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = models.SkipChain(d=16, depth=8)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=4,
                         split_points=["layers.4"], timeout=60)
    for _ in range(5):
        pipe.step(x, target=y)
    rt = pipe.session.runtime
    ledger = rt.ledger

    pair = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        ledger.begin("step", timeout_s=60, step=0, digest=rt.digest)
        ledger.end("step", timeout_s=60, step=0, digest=rt.digest)
        pair.append(time.perf_counter() - t0)

    # For scale: one all_reduce of a float on the pipeline group (what the
    # step's loss broadcast costs, about).
    single = []
    one = torch.zeros(1)
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(one, group=rt.group)
        single.append(time.perf_counter() - t0)

    with_ex, without = [], []
    for r in range(2 * (args.rounds // args.block)):
        on = r % 2 == 0
        rt.ledger = ledger if on else None
        dist.barrier()
        for _ in range(args.block):
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            (with_ex if on else without).append(time.perf_counter() - t0)
    rt.ledger = ledger

    record = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        pipe.calls.record(rt, rt.executor)
        record.append(time.perf_counter() - t0)

    if dist.get_rank() == 0:
        a, b = _median_us(with_ex), _median_us(without)
        print(f"one all_reduce of a float (scale):   {_median_us(single):8.1f} us")
        print(f"exchange pair (begin + end), alone: {_median_us(pair):8.1f} us")
        print(f"Pipeline.step with exchanges:        {a:8.1f} us")
        print(f"Pipeline.step without exchanges:     {b:8.1f} us")
        print(f"  difference per step:               {a - b:8.1f} us ({(a - b) / b:+.1%})")
        print(f"step record (statistics) per step:   {_median_us(record):8.1f} us "
              f"({len(rt.executor.program)} actions)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
