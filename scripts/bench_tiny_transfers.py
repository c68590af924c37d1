"""What a transfer takes on this machine as the microbatches grow: the limit
behind the tiny zoo model's prediction error (issue 31; BENCHMARKS.md, "The
tiny model and p=4: what two shared cores add").

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench_tiny_transfers.py [SCHEDULE]

The zoo's tiny MLP (scripts/bench_plan_zoo.py) as one pipeline per
microbatch count (2, 4, 8, 16; an even split), stepped round-robin, 15 timed
steps each barrier to barrier. Per count, on rank 0: the median step; every
transfer's time from its send's begin to its receive's end, where the
receiver was waiting for it (median, mean, 90th percentile); and the
simulator's step on the measured compute, gaps and step overhead with each
transfer taking the median or the mean of those. Then each rank's threads'
CPU (the main thread against gloo's TCP loop) over the run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COUNTS = (2, 4, 8, 16)
WAITING_S = 3e-5  # a receive longer than this waited for its message


def waited_transfers(rows: list) -> list[float]:
    """Seconds from each SEND's begin to its RECV's end, for the transfers
    whose receiver was there first or waited for the message (its span over
    WAITING_S): then the receive's end is the message's arrival."""
    from torch_mpmd.runtime import trace

    sends: dict = {}
    recvs: dict = {}
    for row in rows:
        for action, start, end in row:
            if action.kind not in trace._TRANSFERS:
                continue
            key = trace._transfer_key(action)
            if trace._TRANSFERS[action.kind][1]:
                sends[key] = start
            else:
                recvs[key] = (start, end)
    return [end - sends[k] for k, (start, end) in recvs.items()
            if k in sends and (start <= sends[k] or end - start > WAITING_S)]


def thread_ticks() -> dict[str, int]:
    """This process's CPU ticks (user + system) by thread name."""
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    return out


def main() -> None:
    import bench_plan_zoo as zoo

    import torch_mpmd as mpmd
    from torch_mpmd.runtime import trace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    schedule = sys.argv[1] if len(sys.argv) > 1 else "1f1b"
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    case = zoo.case_of("tiny")
    pipes = [mpmd.pipeline(case.make(), loss_fn=case.loss_fn, schedule=schedule,
                           num_microbatches=m, stages_per_rank=v,
                           split_points=zoo._even(case, 2 * v)) for m in COUNTS]
    runs: dict[int, tuple[list, list]] = {m: ([], []) for m in COUNTS}
    ticks0 = thread_ticks()
    for round_ in range(2 + 15):
        for m, pipe in zip(COUNTS, pipes):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(*case.args, target=case.target)
            dist.barrier()
            wall = time.perf_counter() - t0
            pipe.zero_grad()
            if round_ >= 2:
                runs[m][0].append(wall)
                runs[m][1].append(pipe.timelines())
    ticks = {k: v - ticks0.get(k, 0) for k, v in thread_ticks().items()}
    if dist.get_rank() == 0:
        print(f"| {schedule} m | step ms | transfers: median / mean / p90 us | "
              "simulated ms, median / mean transfer |")
        print("|---|---|---|---|")
        for m, pipe in zip(COUNTS, pipes):
            walls, rowss = runs[m]
            lat = sorted(t for rows in rowss for t in waited_transfers(rows))
            gap = statistics.median(trace.action_overhead(r) for r in rowss)
            out = statistics.median(trace.step_overhead(w, r) for w, r in zip(walls, rowss))
            flat = [row for rows in rowss for row in rows]

            def simulated(latency: float) -> float:
                return trace.simulate_measured(
                    pipe.schedule, flat, comm_latency_s=latency, action_overhead_s=gap,
                    step_overhead_s=out, statistic="mean").makespan

            med, mean = statistics.median(lat), statistics.fmean(lat)
            print(f"| {m} | {statistics.median(walls) * 1e3:.1f} | {med * 1e6:.0f} / "
                  f"{mean * 1e6:.0f} / {lat[int(0.9 * len(lat))] * 1e6:.0f} | "
                  f"{simulated(med):.1f} / {simulated(mean):.1f} |")
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(f"rank {r} CPU ticks by thread: {ticks}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
