"""Gathered parameter bytes with reshard_after_forward False vs True, side by side.

    torchrun --standalone --nproc-per-node 4 scripts/bench_reshard_memory.py \
        [--schedule looped_bfs|gpipe|interleaved_1f1b] [--path fx|inductor|autograd]

pp2 x dp2 on 4 gloo ranks, two stages per rank (so other stages compute
between a stage's last forward and its first backward), the example GPT
(examples/gpt_model.py, --layers 8, --d-model 128), 4 microbatches,
``data_parallel="shard"``. Two pipelines over the same model and batches,
one per reshard_after_forward setting; after a capture step, ``--steps``
steps of each, alternating. What is measured is the storage of the compute
parameters' gathered values, from outside ShardedStages
(tests/sharded_worker.py GatheredProbe: weak references to the storages each
gather leaves the parameters on, read at the start of every compute action,
so what tensors saved for backward keep alive counts). Printed on rank 0,
per rank, False -> True, over the last step:
- the peak bytes of gathered parameters alive at once, with the pipeline's
  own account beside it (``last_step_stats["collectives"]
  ["gathered_peak_bytes"]``);
- the most bytes alive while a stage waits for its backward (its forwards
  done, its backward not begun, another stage computing), and per such
  stage its own part of them against its parameters' full bytes;
- the median step time (pipe.step; the second gather's cost).

``--path autograd`` runs the stages under the autograd engine (the runner's
fallback when a stage cannot become programs; forced here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import GPT  # noqa: E402
from sharded_worker import GatheredProbe, stages_under_autograd  # noqa: E402
from bench_sharded import lm_loss, pp2_dp2_gpt  # noqa: E402  (this folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", default="looped_bfs",
                   help="looped_bfs, gpipe or interleaved_1f1b (2 stages per rank)")
    p.add_argument("--path", default="fx", choices=("fx", "inductor", "autograd"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    args = p.parse_args()
    mesh, cfg, x, y = pp2_dp2_gpt(args.layers, args.d_model)

    points = [f"blocks.{args.layers * k // 4}" for k in range(1, 4)]
    runs = {}
    for reshard in (False, True):
        torch.manual_seed(0)  # the same model in both
        pipe = mpmd.pipeline(GPT(cfg), loss_fn=lm_loss, schedule=args.schedule,
                             num_microbatches=4, mesh=mesh, data_parallel="shard",
                             split_points=points, stages_per_rank=2, timeout=120,
                             compile="inductor" if args.path == "inductor" else False,
                             reshard_after_forward=reshard)
        with (stages_under_autograd() if args.path == "autograd" else contextlib.nullcontext()):
            pipe.step(x, target=y)  # capture (and build the programs)
        runs[reshard] = {"pipe": pipe, "probe": GatheredProbe(pipe), "times": []}
    for _ in range(args.steps):
        for run in runs.values():
            run["probe"].reset()
            start = time.perf_counter()
            run["pipe"].step(x, target=y)
            run["times"].append(time.perf_counter() - start)
            run["pipe"].zero_grad()
    mine = {str(r): {"probe": run["probe"].report(), "step_s": statistics.median(run["times"]),
                     "functional": run["pipe"].inspect().uses_programs,
                     "stats": run["pipe"].last_step_stats["collectives"]["gathered_peak_bytes"]}
            for r, run in runs.items()}
    everyone: list[dict] = [None] * 4  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        _print(args, everyone)
    dist.destroy_process_group()


def _print(args: argparse.Namespace, everyone: list[dict]) -> None:
    mib = 2 ** 20
    paths = {e[k]["functional"] for e in everyone for k in e}
    print(f"GPT {args.layers}x{args.d_model}, pp2 x dp2 (4 gloo ranks), 2 stages per rank, "
          f"{args.schedule}, m=4, {args.path} ({'programs' if paths == {True} else 'autograd'}), "
          f"median of {args.steps} steps")
    print("gathered parameter bytes alive on a rank, reshard_after_forward False -> True:")
    for rank, e in enumerate(everyone):
        off, on = e["False"]["probe"], e["True"]["probe"]
        print(f"  rank {rank}: peak over the step {off['peak'] / mib:.2f} -> "
              f"{on['peak'] / mib:.2f} MiB ({on['peak'] / max(1, off['peak']):.2f}; "
              f"pipeline's account {e['False']['stats'] / mib:.2f} -> "
              f"{e['True']['stats'] / mib:.2f}); "
              f"while a stage waits for its backward {off['waiting_total'] / mib:.2f} -> "
              f"{on['waiting_total'] / mib:.2f} MiB "
              f"({on['waiting_total'] / max(1, off['waiting_total']):.2f}); step "
              f"{e['False']['step_s'] * 1e3:.0f} -> {e['True']['step_s'] * 1e3:.0f} ms")
        for s, full in off["full_bytes"].items():
            if s in off["waiting"]:
                print(f"    stage {s} ({full / mib:.2f} MiB of parameters), its own alive "
                      f"while it waits for its backward: {off['waiting'][s] / mib:.2f} -> "
                      f"{on['waiting'].get(s, 0) / mib:.2f} MiB")


if __name__ == "__main__":
    main()
