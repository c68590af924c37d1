"""The cost model against measured steps: every schedule, two models (issue 21 item 2).

    torchrun --standalone --nproc-per-node 2 scripts/bench_predict.py [--compile]

(or `bash scripts/bench_predict.sh`; `--nproc-per-node 4` for p=4). For the
example GPT and a deep MLP, each schedule steps ``--steps`` times after a
warm-up, barrier to barrier. The runtime's own constants are measured once,
on 1F1B's steps: the time per action (trace.action_overhead), the transfer
latency (trace.transfer_latencies) and the fixed time per step outside the
actions (trace.step_overhead). Every schedule is then predicted by the
simulator from its own stages' measured F/B/I/W means (what a profile gives
the planner) with those constants, and, second, with the time per action
fitted so that the simulated 1F1B step equals its measured one; both are
printed beside the measured median step. Third, what the planner itself
predicts: ``mpmd.profile`` of the model (its units timed alone, the
runtime's costs calibrated on the group: planning/calibrate.py) and
``evaluate_plan`` of each schedule's split and microbatches, measured
before any schedule runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from torch_mpmd import trace  # noqa: E402
from torch_mpmd.planning import calibrate  # noqa: E402
from bench_compiled import DeepMLP  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2),
             ("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2)]


def _gpt_case(m: int) -> tuple[Any, Any, tuple, Any, list[str]]:
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=8, n_head=4, d_model=128)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2 * m, 64))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return (lambda: GPT(cfg)), loss, (x,), torch.roll(x, -1, 1), "blocks"


def _mlp_case(m: int) -> tuple[Any, Any, tuple, Any, list[str]]:
    torch.manual_seed(0)
    x = torch.randn(8 * m, 256)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)
    return (lambda: DeepMLP(256, 8)), loss, (x,), torch.randn(8 * m, 256), "blocks"


def _splits(prefix: str, layers: int, stages: int) -> list[str]:
    return [f"{prefix}.{layers * k // stages}" for k in range(1, stages)]


def measure(make: Any, loss_fn: Any, args: tuple, target: Any, prefix: str, schedule: str,
            spr: int, m: int, steps: int, compile_: bool) -> dict[str, Any]:
    pp = dist.get_world_size()
    torch.manual_seed(0)
    pipe = mpmd.pipeline(make(), loss_fn=loss_fn, schedule=schedule, num_microbatches=m,
                         split_points=_splits(prefix, 8, pp * spr), compile=compile_,
                         timeout=600)
    walls, rows_all = [], []
    for step in range(2 + steps):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(*args, target=target)
        dist.barrier()
        wall = time.perf_counter() - t0
        pipe.zero_grad(set_to_none=True)
        if step >= 2:
            rows = pipe.timelines()
            walls.append(wall)
            rows_all.append(rows)
    latencies = [x for rows in rows_all for x in trace.transfer_latencies(rows)]
    return {"pipe": pipe, "wall": statistics.median(walls), "rows": rows_all,
            "action": statistics.median(trace.action_overhead(r) for r in rows_all),
            "step": statistics.median(trace.step_overhead(w, r)
                                      for w, r in zip(walls, rows_all)),
            "latency": statistics.median(latencies) if latencies else 0.0}


def fit_action_overhead(base: dict[str, Any]) -> float:
    """The time per action at which the simulated 1F1B step equals its
    measured median (planning/calibrate.py)."""
    rows = [row for step_rows in base["rows"] for row in step_rows]
    return calibrate.fit_action_overhead(base["pipe"].schedule, rows, base["wall"],
                                         latency_s=base["latency"], step_s=base["step"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, pp = dist.get_rank(), dist.get_world_size()
    m = args.microbatches
    for name, case in (("example GPT (8 layers, d=128, batch 16x64)", _gpt_case),
                       ("deep MLP (8 blocks, d=256, batch 64)", _mlp_case)):
        make, loss_fn, inputs, target, prefix = case(m)
        torch.manual_seed(0)
        sheet = mpmd.profile(make(), inputs, loss_fn=loss_fn, target=target, cache_dir=False,
                             compile=args.compile)
        planned = {s: mpmd.planning.evaluate_plan(
            sheet, s, stages_per_rank=spr, num_microbatches=m,
            split_points=_splits(prefix, 8, pp * spr)).predicted_step_s * 1e3
            for s, spr in SCHEDULES}
        results = {s: measure(make, loss_fn, inputs, target, prefix, s, spr, m, args.steps,
                              args.compile) for s, spr in SCHEDULES}
        base = results["1f1b"]
        if rank != 0:
            continue
        fitted = fit_action_overhead(base)
        print(f"\n{name}, p={pp} x 1 thread, m={m}, "
              f"{'Inductor' if args.compile else 'FX'} programs; measured on 1F1B: "
              f"{base['action'] * 1e6:.0f} us per action (trace.action_overhead), "
              f"{base['latency'] * 1e6:.0f} us per transfer, {base['step'] * 1e3:.2f} ms per "
              f"step outside the actions; per action fitted to 1F1B's step: "
              f"{fitted * 1e6:.0f} us")
        print(f"the profile's sheet: {sheet.action_overhead * 1e6:.0f} us per action (fitted), "
              f"{sheet.step_overhead * 1e3:.2f} ms per step, {sheet.link_latency * 1e6:.0f} us "
              f"per transfer, units {[u.name for u in sheet.units]}")
        print("| schedule | measured | predicted (measured constants) | ratio "
              "| predicted (per-action time fitted on 1F1B) | ratio "
              "| planner (profile) | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for s, _ in SCHEDULES:
            r = results[s]
            rows = [row for step_rows in r["rows"] for row in step_rows]
            wall = r["wall"] * 1e3
            predicted = [trace.simulate_measured(
                r["pipe"].schedule, rows, comm_latency_s=base["latency"],
                action_overhead_s=overhead, step_overhead_s=base["step"],
                statistic="mean").makespan for overhead in (base["action"], fitted)]
            print(f"| {s} | {wall:.1f} ms | {predicted[0]:.1f} ms | {predicted[0] / wall:.2f} | "
                  f"{predicted[1]:.1f} ms | {predicted[1] / wall:.2f} | "
                  f"{planned[s]:.1f} ms | {planned[s] / wall:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
