"""plan="auto" decided by trials, on the planner zoo: what it chose in each launch against the
default and the grid, measured side by side in the same launch (issue 31, items 3-4).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench_plan_auto_zoo.py --model NAME [--keep K --from-json PATH]
    bash scripts/bench_plan_auto_zoo.sh       # every model, three launches each

One launch: ``mpmd.plan`` with a fresh profile cache (profile, search, and
its trials: ``trials=3`` finalists beside the default a user writes first),
then the chosen plan, the default (1F1B, m = 4p, the blocks split evenly)
and the entries of bench_plan_zoo's grid (schedules x m in ``--counts`` x
balanced / even split), each built once, one warm-up step, then ``--steps``
timed steps barrier to barrier, all in turn (A B C ... A B C); the median
per entry. ``--keep K --from-json PATH``: instead of the whole grid, the K
entries a first launch (its ``--json`` file) measured fastest, so that
later launches cost minutes, not tens of minutes, on two cores.
``--copies N``: the chosen plan built N more times and measured among the
others: how far apart two builds of one configuration measure (the floor
under auto / grid best).

Printed: the plan chosen; the planning's time (profile, search, trials);
each finalist's predicted / measured (from its trial); and the measured
ratios auto / default and auto / grid best. ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_plan_zoo as zoo  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=zoo.MODELS)
    ap.add_argument("--counts", default="2,4,8,16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--keep", type=int, default=0)
    ap.add_argument("--from-json", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--copies", type=int, default=0,
                    help="the chosen plan built this many more times, measured beside "
                         "it: the noise floor between two builds of one configuration")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    import torch_mpmd as mpmd
    from torch_mpmd.planning.trials import default_contender

    case = zoo.case_of(args.model)
    box = [tempfile.mkdtemp(prefix="mpmd_auto_zoo_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    t0 = time.perf_counter()
    plan = mpmd.plan(case.make(), case.args, case.kwargs, loss_fn=case.loss_fn,
                     target=case.target, cache_dir=box[0], trials=args.trials)
    planning = time.perf_counter() - t0
    default = default_contender(plan.sheet)
    entries = [{"name": "auto", "schedule": plan.schedule, "v": plan.stages_per_rank,
                "m": plan.num_microbatches, "split": list(plan.split_points)},
               {"name": "default", "schedule": default.schedule, "v": default.stages_per_rank,
                "m": default.num_microbatches, "split": list(default.split_points)}]
    if args.from_json:
        with open(args.from_json) as f:
            first = json.load(f)
        ranked = sorted(first["grid"], key=lambda e: e["median"])[:args.keep]
        grid = [{k: e[k] for k in ("name", "schedule", "v", "m", "split")} for e in ranked]
    else:
        grid = zoo.grid(case, plan.sheet, [int(c) for c in args.counts.split(",")])
    copies = [dict(entries[0], name=f"auto copy {k + 1}") for k in range(args.copies)]
    entries += [dict(e, name="grid " + e["name"]) for e in grid]
    zoo.measure(case, entries + copies, args.steps, 1)
    if rank == 0:
        for e in entries:
            e["median"] = statistics.median(e["walls"])
        auto, base = entries[0]["median"], entries[1]["median"]
        grid_entries = [e for e in entries[2:]]
        for e in copies:
            e["median"] = statistics.median(e["walls"])
        best = min(grid_entries, key=lambda e: e["median"])
        s = plan.search
        chosen = (f"{plan.schedule} v={plan.stages_per_rank} m={plan.num_microbatches} "
                  f"split {list(plan.split_points)}")
        print(f"[{args.model}] chosen: {chosen}")
        print(f"[{args.model}] planning {planning:.1f} s: profile {s.profile_s:.1f} s, search "
              f"{s.search_s:.3f} s, trials {s.trials_s:.1f} s ({s.decided_by})")
        for t in s.trials:
            print(f"[{args.model}]   finalist {t.label()}{' (default)' if t.default else ''}: "
                  f"predicted {t.predicted_step_s * 1e3:.1f} ms, measured "
                  f"{t.measured_step_s * 1e3:.1f} ms, {t.predicted_step_s / t.measured_step_s:.2f}")
        print(f"[{args.model}] auto {auto * 1e3:.1f} ms, default {base * 1e3:.1f} ms, grid best "
              f"{best['name']} {best['median'] * 1e3:.1f} ms ({len(grid_entries)} entries): "
              f"auto / default {auto / base:.3f}, auto / grid best {auto / best['median']:.3f}, "
              f"grid best / default {best['median'] / base:.3f}")
        if copies:
            same = [auto] + [e["median"] for e in copies]
            print(f"[{args.model}] the chosen plan built {len(same)} times: medians "
                  f"{', '.join(f'{x * 1e3:.1f}' for x in same)} ms, max / min "
                  f"{max(same) / min(same):.3f}")
        if args.json:
            out = {"model": args.model, "chosen": chosen, "planning_s": planning,
                   "profile_s": s.profile_s, "trials_s": s.trials_s,
                   "finalists": [[t.label(), t.default, t.predicted_step_s, t.measured_step_s]
                                 for t in s.trials],
                   "auto": auto, "default": base,
                   "grid": [{k: e[k] for k in ("name", "schedule", "v", "m", "split", "median")}
                            for e in entries[2:]],
                   "copies": [e["median"] for e in copies],
                   "walls": {e["name"]: e["walls"] for e in entries + copies}}
            for e in out["grid"]:
                e["name"] = e["name"].removeprefix("grid ")
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
