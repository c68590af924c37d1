"""mpmd.plan against the default a user starts from, measured side by side.

    torchrun --standalone --nproc-per-node 2 scripts/bench_plan_auto.py [--layers 8] [--wide-head] [--ffn-widths W,...]

The example GPT (untied head; ``--wide-head``: a 16x larger vocabulary, so
the embedding and head outweigh a block: the heterogeneous shape of real
LLMs; ``--ffn-widths 2,2,4,4,6,6,8,8``: each block's MLP width in multiples
of d_model instead of 4, blocks of different widths as in NAS-pruned
models such as Nemotron-51B, where a split by layer count is wrong), batch 16 x 64 tokens, 2 ranks x 1 thread (gloo), FX programs. Prints
the planning time (profile + search, and a second call that loads the
cached profile), the plan (``describe()``), then the median step of the
plan and of the default (1f1b, m=8, split in the middle by layer count),
alternating, with the plan's predicted step and ``pipe.replan()``'s verdict;
``--grid``: also every entry of the grid a diligent user would try (1f1b,
interleaved_1f1b, zero_bubble x m in {4, 8, 16} x an even split by layer
count or the balanced split), and the plan against its best;
``--memory-limit-mib L``: plan under L MiB per rank, print each contender's
peak (parameters, gradients, AdamW's states and the bytes held for
backward: ``measured_peak``) and compare with the fastest grid entry under
the limit.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def model_of(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    vocab = args.vocab or 96 * (16 if args.wide_head else 1)
    m = GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=args.layers, n_head=4,
                      d_model=args.d_model))
    m.head.weight = torch.nn.Parameter(m.tok.weight.detach().clone())  # untied
    for block, width in zip(m.blocks, args.ffn_widths or ()):
        d = args.d_model
        block.mlp = torch.nn.Sequential(torch.nn.Linear(d, width * d), torch.nn.GELU(),
                                        torch.nn.Linear(width * d, d))
    return m


def torch_bounds(args: argparse.Namespace, plan: Any, n_stages: int, split: str) -> list[int]:
    """Where torch's stages start and end, in blocks: ``even`` by layer
    count, or ``balanced``: the exact min-max split of the blocks' measured
    costs (the plan's profile, finer units summed into their block; the
    embedding counted with the first block, the head with the last), the
    balanced split a torch user would have to work out by hand."""
    if split == "even":
        return [args.layers * k // n_stages for k in range(n_stages + 1)]
    cost = [0.0] * args.layers
    for u in plan.sheet.units:
        parts = u.name.split(".")
        at = int(parts[1]) if parts[0] == "blocks" else (0 if u.name in ("tok", "pos")
                                                          else args.layers - 1)
        cost[at] += u.forward + u.backward_input + u.backward_weight
    return list(mpmd._C.min_max_split(cost, n_stages)) + [args.layers]


def torch_step(args: argparse.Namespace, schedule: str, spr: int, m: int, x: torch.Tensor,
               y: torch.Tensor, bounds: list[int], *, compile_stages: bool) -> Any:
    """One step of torch.distributed.pipelining on the same model (this
    rank's stages as bench_vs_torch's Parts: the blocks from ``bounds[s]``
    to ``bounds[s + 1]``, the embedding first and the head last), each stage
    module torch.compile'd with ``compile_stages`` (torchtitan's way)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    from bench_vs_torch import Part

    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = world * spr
    model = model_of(args)
    ids = [rank + world * v for v in range(spr)]
    parts = [Part(model, bounds[s], bounds[s + 1]) for s in ids]
    if compile_stages:
        # Every contender's Parts share one forward: past Dynamo's default 8
        # recompiles of it, the later contenders would silently run eager.
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        parts = [torch.compile(part) for part in parts]
    stages = [PipelineStage(part, s, n_stages, torch.device("cpu"))
              for part, s in zip(parts, ids)]
    if schedule == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    elif schedule == "zero_bubble":  # ZB1P: B split into I and W by autograd
        sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        sched = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
    first, last = 0 in ids, n_stages - 1 in ids

    def step() -> None:
        kwargs = {"target": y} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        model.zero_grad()

    return step


def schedule_bound(plan: Any, torch_grid: dict[str, tuple[str, int, int, list[int]]]) -> str:
    """What the plan's schedule and split alone give against torch's grid:
    the plan's predicted step over the best of torch's contenders
    (``torch_grid``: name -> (schedule, stages per rank, m, block bounds)),
    each on its own split, all simulated on the plan's sheet with the
    runtime's costs (per action, per step, per transfer) set to zero. A
    measured ratio below it comes from our runtime costing less than torch's
    around the same programs; one above it, from costing more."""
    import dataclasses

    from torch_mpmd.planning import evaluate_plan

    bare = dataclasses.replace(plan.sheet, action_overhead=0.0, step_overhead=0.0,
                               link_latency=0.0)
    ours = evaluate_plan(bare, plan.schedule, num_microbatches=plan.num_microbatches,
                         stages_per_rank=plan.stages_per_rank, split_points=plan.split_points,
                         recompute=plan.recompute).predicted_step_s
    theirs = {name: evaluate_plan(bare, schedule, num_microbatches=m, stages_per_rank=v,
                                  split_points=[f"blocks.{b}" for b in bounds[1:-1]]
                                  ).predicted_step_s
              for name, (schedule, v, m, bounds) in torch_grid.items()}
    best = min(theirs, key=theirs.get)
    return (f"schedule and split alone (the plan's sheet, no runtime costs): the plan "
            f"{ours * 1e3:.1f} ms, torch's best {best} {theirs[best] * 1e3:.1f} ms: "
            f"{ours / theirs[best]:.3f}")


def measured_peak(pipe: Any) -> int:
    """The largest rank's bytes at its peak, as the planner counts them: its
    parameters, their gradients, AdamW's two fp32 states (2 x the parameters'
    fp32 bytes, not allocated here), and the peak bytes held for backward in
    the last step (over all the rank's stages at once: ``peak_held_bytes``)."""
    params = list(pipe.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    adamw = sum(2 * p.numel() * 4 for p in params)
    held = pipe.last_step_stats["peak_held_bytes"]
    peak = torch.tensor([weights * 2 + adamw + held], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--wide-head", action="store_true")
    ap.add_argument("--ffn-widths", type=lambda t: [int(w) for w in t.split(",")],
                    default=None, help="each block's MLP width in multiples of d_model, "
                    "comma-separated (default 4 for every block)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="the vocabulary (default 96, or 1536 with --wide-head; the issue's "
                    "wide-head model: 12288)")
    ap.add_argument("--trials", type=int, default=3,
                    help="mpmd.plan's finalists run for real (0: the prediction decides)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--memory-limit-mib", type=float, default=0.0,
                    help="plan under this limit per rank; contenders whose measured peak "
                    "exceeds it are marked over")
    ap.add_argument("--compile", action="store_true",
                    help="Inductor stage programs for mpmd.plan's profile, the plan and the "
                    "default (the grid stays FX)")
    ap.add_argument("--vs-torch", action="store_true",
                    help="also torch.distributed.pipelining: 1f1b / interleaved_1f1b (and, "
                    "with eager stages, zero_bubble) x m in {4, 8, 16} x even / balanced split")
    ap.add_argument("--torch-compile", action="store_true",
                    help="with --vs-torch: torch.compile each stage module")
    ap.add_argument("--grid", action="store_true",
                    help="also measure 1f1b / interleaved_1f1b / zero_bubble x m in {4, 8, 16} "
                    "x even / balanced split")
    args = ap.parse_args()
    if args.ffn_widths and len(args.ffn_widths) != args.layers:
        ap.error(f"--ffn-widths has {len(args.ffn_widths)} widths for --layers {args.layers}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="mpmd_bench_profiles_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    g = torch.Generator().manual_seed(1)
    vocab = args.vocab or 96 * (16 if args.wide_head else 1)
    x = torch.randint(0, vocab, (16, 64), generator=g)
    y = torch.randint(0, vocab, (16, 64), generator=g)

    limit = args.memory_limit_mib * 2**20 if args.memory_limit_mib else None
    t0 = time.perf_counter()
    plan = mpmd.plan(model_of(args), (x,), loss_fn=loss_fn, target=y, cache_dir=box[0],
                     memory_limit=limit, compile=args.compile, trials=args.trials)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    mpmd.plan(model_of(args), (x,), loss_fn=loss_fn, target=y, cache_dir=box[0],
              memory_limit=limit, compile=args.compile, trials=args.trials)
    second = time.perf_counter() - t0
    if rank == 0:
        print(f"planning: {first:.2f} s (profile + search + trials: {plan.planning_summary()}),"
              f" {second:.2f} s with the cached profile and decision")
        s = plan.sheet
        print(f"profile's runtime constants: {s.action_overhead * 1e6:.0f} us per action "
              f"(fitted), {s.step_overhead * 1e3:.2f} ms per step outside the actions, "
              f"{s.link_latency * 1e6:.0f} us per transfer")
        print(plan.describe())

    pipes = {
        "plan": mpmd.pipeline(model_of(args), loss_fn=loss_fn, plan=plan,
                              compile=args.compile),
        "default 1f1b m=8 middle": mpmd.pipeline(
            model_of(args), loss_fn=loss_fn, schedule="1f1b", num_microbatches=8,
            split_points=[f"blocks.{args.layers // 2}"], compile=args.compile),
    }
    if args.grid:  # what a diligent user would try, each measured
        pp = dist.get_world_size()
        for schedule, spr in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
            stages = pp * spr
            for m in (4, 8, 16):
                for split in ("even", "balanced"):
                    where = ({"split_points": [f"blocks.{args.layers * k // stages}"
                                               for k in range(1, stages)]}
                             if split == "even" else {"num_stages": stages})
                    pipes[f"grid {schedule} m={m} {split}"] = mpmd.pipeline(
                        model_of(args), loss_fn=loss_fn, schedule=schedule,
                        num_microbatches=m, **where)
    steps = {name: functools.partial(pipe.step, x, target=y) for name, pipe in pipes.items()}
    torch_configs: dict[str, tuple[str, int, int, list[int]]] = {}
    if args.vs_torch:  # torch.distributed.pipelining on the same grid
        # (torch 2.13 refuses compiled stages in its zero-bubble schedules: it
        # cannot split their backward into I and W.)
        torch_grid = [("1f1b", 1), ("interleaved_1f1b", 2)] + \
            ([] if args.torch_compile else [("zero_bubble", 1)])
        for schedule, spr in torch_grid:
            for m in (4, 8, 16):
                for split in ("even", "balanced"):
                    bounds = torch_bounds(args, plan, dist.get_world_size() * spr, split)
                    name = f"torch {schedule} m={m} {split}"
                    steps[name] = torch_step(args, schedule, spr, m, x, y, bounds,
                                             compile_stages=args.torch_compile)
                    torch_configs[name] = (schedule, spr, m, bounds)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for name, step in steps.items():  # warm-up: capture, programs, compilation
        step()
        dist.barrier()
    for _ in range(args.steps):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            if name in pipes:
                pipes[name].zero_grad()
    peaks = {name: measured_peak(pipe) for name, pipe in pipes.items()}
    verdict = pipes["plan"].replan()[1]
    if rank == 0:
        base = statistics.median(times["default 1f1b m=8 middle"])
        for name, ts in times.items():
            med = statistics.median(ts)
            over = " OVER the limit" if limit and peaks.get(name, 0) > limit else ""
            peak = f"  peak {peaks[name] / 2**20:6.1f} MiB" if name in peaks else ""
            print(f"{name:<26} median step {med * 1e3:8.1f} ms  ({med / base:.2f}x the default)"
                  f"{peak}{over}")
        theirs = {k: statistics.median(v) for k, v in times.items() if k.startswith("torch ")}
        if theirs:
            best = min(theirs, key=theirs.get)
            print(f"plan / torch.distributed.pipelining's best ({best}): "
                  f"{statistics.median(times['plan']) / theirs[best]:.2f}")
            print(schedule_bound(plan, torch_configs))
        grid = {k: statistics.median(v) for k, v in times.items() if k.startswith("grid ")
                and not (limit and peaks[k] > limit)}
        if grid:
            best = min(grid, key=grid.get)
            print(f"plan / best of the grid{' within the limit' if limit else ''} ({best}): "
                  f"{statistics.median(times['plan']) / grid[best]:.2f}")
        if limit:
            print(f"memory limit {limit / 2**20:.1f} MiB per rank: the plan's measured peak "
                  f"{peaks['plan'] / 2**20:.1f} MiB, predicted "
                  f"{max(plan.predicted_peak_bytes) / 2**20:.1f} MiB")
        print(f"chosen: {plan.schedule} v={plan.stages_per_rank} m={plan.num_microbatches} "
              f"split {list(plan.split_points)}; plan / default "
              f"{statistics.median(times['plan']) / base:.3f}"
              + (f"; plan / grid best {statistics.median(times['plan']) / grid[best]:.3f}"
                 if grid else ""))
        print(f"plan predicted {plan.predicted_step_s * 1e3:.1f} ms, measured "
              f"{statistics.median(times['plan']) * 1e3:.1f} ms "
              f"({plan.predicted_step_s / statistics.median(times['plan']):.2f}); "
              f"replan: {verdict}")
        import shutil
        shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
