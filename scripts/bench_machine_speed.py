"""How fast one process computes, launch after launch: the noise under every timing here.

    for i in $(seq 16); do python3 scripts/bench_machine_speed.py; done

One thread times a block's MLP (a (512, 128) activation through 128 -> 512 ->
128 with GELU, as the example GPT's blocks at d=128) for about 1.5 s, pinned
to core ``--core``, and prints the median time per call. On the 2-core
machine of BENCHMARKS.md the medians of separate launches fall in two groups,
about 1.6x apart, with nothing changed between them (see "The machine's own
noise" there). Within one launch the time is steady. A pipeline's ranks are
separate processes, so each can land in either group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core % (os.cpu_count() or 1)})
    x, w1, w2 = torch.randn(512, 128), torch.randn(128, 512), torch.randn(512, 128)

    def call() -> torch.Tensor:
        return F.gelu(x @ w1) @ w2

    for _ in range(50):  # warm-up
        call()
    per_call = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(100):
            call()
        per_call.append((time.perf_counter() - start) * 10)  # ms per call
    print(f"core {args.core}: median {statistics.median(per_call):.2f} ms per call "
          f"(min {min(per_call):.2f}, max {max(per_call):.2f}, {len(per_call)} x 100 calls)")


if __name__ == "__main__":
    main()
