"""Capture + partition time of the example GPT (issue 3, item 8).

    python scripts/bench_capture.py [--layers 4 8] [--repeats 5]

For each model size: median and best wall time of torch_mpmd.split_model
(Dynamo capture, fx_to_ir, C++ partition, building the stage GraphModules),
with split points (one stage per block group) and with the balanced
partitioner, next to one plain eager forward of the same batch for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

import torch_mpmd  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'layers':>6} {'params':>9} {'graph nodes':>11} {'split_points ms':>18} "
          f"{'balanced ms':>14} {'eager fwd ms':>13}   (median / best of {args.repeats})")
    for n_layer in args.layers:
        model = GPT(GPTConfig(n_layer=n_layer))
        idx = torch.randint(0, model.cfg.vocab_size, (8, model.cfg.block_size))
        points = [f"blocks.{i}" for i in range(n_layer // 4, n_layer, max(1, n_layer // 4))][:3]
        split = torch_mpmd.split_model(model, idx, split_points=points)
        nodes = sum(len(list(stage.graph.nodes)) for stage in split.stages)
        sp = timed(lambda: torch_mpmd.split_model(model, idx, split_points=points), args.repeats)
        bal = timed(lambda: torch_mpmd.split_model(model, idx, num_stages=4), args.repeats)
        with torch.no_grad():
            fwd = timed(lambda: model(idx), args.repeats)
        params = sum(p.numel() for p in model.parameters())
        print(f"{n_layer:>6} {params:>9} {nodes:>11} {sp[0]:>9.0f} / {sp[1]:<6.0f} "
              f"{bal[0]:>6.0f} / {bal[1]:<5.0f} {fwd[0]:>6.1f} / {fwd[1]:<5.1f}")


if __name__ == "__main__":
    main()
