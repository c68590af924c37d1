"""Replicated vs sharded data parallel around a pipeline, side by side (issue 14 §6).

    torchrun --standalone --nproc-per-node 4 scripts/bench_sharded.py [--rounds 6]

pp2 x dp2 on 4 ranks (gloo, one thread each), the example GPT (examples/gpt_model.py,
--layers 8, --d-model 128), 1f1b, 4 microbatches. Two pipelines over the same
model and batches, one per data_parallel mode, run in alternating blocks of
steps (so load on this machine affects both alike); each step is
pipe.step + AdamW.step + zero_grad. Printed on rank 0:
- the median step time of each and their ratio;
- per rank, the bytes of parameters, gradients and optimizer state it holds
  (local shards; stand-ins hold none);
- with "shard": the step's all-gathers (count, bytes) and the share of their
  time hidden behind other work (Pipeline.last_step_stats["collectives"]);
- the simulated step (the schedule's actions with the measured per-stage F/B
  times, and the measured all-gather time as the UNSHARD cost) against the
  measured span of rank 0's step.
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
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if not mpmd.meta_init.is_standin(t):
            total += t.numel() * t.element_size()
    return total


def _state_bytes(pipe: mpmd.Pipeline, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(pipe.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _local_bytes(params), "grads": _local_bytes(grads),
            "optimizer": _local_bytes(state)}


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def pp2_dp2_gpt(layers: int, d_model: int) -> tuple:
    """The set-up this script and bench_reshard_memory.py share: gloo on 4
    ranks, a ("dp", "pp") = (2, 2) mesh, the example GPT's config, and this dp
    replica's batch (16 x 64 tokens): (mesh, cfg, x, y)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4 (pp2 x dp2)")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=layers, n_head=4, d_model=d_model)
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))
    x = torch.randint(0, 64, (16, 64), generator=gen)
    y = torch.randint(0, 64, (16, 64), generator=gen)
    return mesh, cfg, x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6, help="alternating blocks")
    p.add_argument("--block", type=int, default=3, help="steps per block")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--schedule", default="1f1b",
                   help="1f1b (1 stage per rank) or interleaved_1f1b (2 per rank)")
    args = p.parse_args()
    mesh, cfg, x, y = pp2_dp2_gpt(args.layers, args.d_model)
    world = dist.get_world_size()

    spr = 2 if args.schedule == "interleaved_1f1b" else 1
    points = [f"blocks.{args.layers * k // (2 * spr)}" for k in range(1, 2 * spr)]
    runs = {}
    for mode in ("replicate", "shard"):
        torch.manual_seed(0)  # the same model in both modes
        pipe = mpmd.pipeline(GPT(cfg), loss_fn=lm_loss, schedule=args.schedule,
                             num_microbatches=4, mesh=mesh, data_parallel=mode,
                             split_points=points, stages_per_rank=spr, timeout=120)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        runs[mode] = {"pipe": pipe, "opt": opt, "times": [], "hidden": []}

    def one_step(run: dict) -> float:
        t0 = time.perf_counter()
        run["pipe"].step(x, target=y)
        t1 = time.perf_counter()
        run["opt"].step()
        run["opt"].zero_grad()
        t2 = time.perf_counter()
        run.setdefault("pipe_s", []).append(t1 - t0)
        run.setdefault("opt_s", []).append(t2 - t1)
        return t2 - t0

    for run in runs.values():  # capture and warm up
        for _ in range(2):
            one_step(run)
    for _ in range(args.rounds):
        for mode, run in runs.items():
            for _ in range(args.block):
                run["times"].append(one_step(run))
                if mode == "shard":
                    gathers = run["pipe"].last_step_stats["collectives"]["all_gather"]
                    run["hidden"].append(gathers["hidden_fraction"])

    # Memory held between steps: gradients as they are after the step (before zero_grad).
    for run in runs.values():
        run["pipe"].step(x, target=y)
        run["memory"] = _state_bytes(run["pipe"], run["opt"])
        run["opt"].zero_grad()
    shard = runs["shard"]["pipe"]
    stats = shard.last_step_stats
    gathers = stats["collectives"]["all_gather"]
    # Simulated step with the collectives: measured F/B per stage, the measured
    # mean all-gather time as UNSHARD's cost (REDUCE_GRAD's reduce-scatter moves
    # the same bytes: the same cost).
    times = shard.stage_times()
    gather_s = gathers["seconds"] / max(1, gathers["count"])
    local = {s: {"F": t["F"], "B": t["B"], "UNSHARD": gather_s, "REDUCE_GRAD": gather_s}
             for s, t in times.items()}
    hidden = statistics.median(runs["shard"]["hidden"])
    everyone: list[dict] = [None] * world  # type: ignore[list-item]
    tied = stats["collectives"].get("tied_all_reduce")
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), "stages": local,
                                      "memory": {m: r["memory"] for m, r in runs.items()},
                                      "span": stats["span_s"], "hidden": hidden,
                                      "gathers": gathers, "tied": tied})
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    stage_costs = {}
    for entry in everyone:
        stage_costs.update({int(s): c for s, c in entry["stages"].items()})
    # The tied embedding's sum over pp and dp (REDUCE_GRAD posts it on each of
    # its ranks): an all-reduce moves about twice a reduce-scatter's bytes,
    # priced at the measured all-gather rate.
    cross = []
    tied_posts = [e["tied"] for e in everyone if e["tied"]]
    if tied_posts:
        stages = sorted({int(a[:-len("REDUCE_GRAD")]) for t in tied_posts for a in t["posted_by"]})
        g0 = everyone[0]["gathers"]
        per_byte = g0["seconds"] / max(1, g0["bytes"])
        cross = [(stages, 2 * tied_posts[0]["bytes"] * per_byte)]
    sim = shard.schedule.simulate(stage_costs=[stage_costs[s] for s in sorted(stage_costs)],
                                  cross_rank_reduces=cross)
    med = {m: statistics.median(r["times"]) for m, r in runs.items()}
    print(f"GPT {args.layers}x{args.d_model}, pp2 x dp2 (4 ranks x 1 thread, gloo), "
          f"{args.schedule}, m=4, "
          f"{args.rounds} blocks of {args.block} steps")
    print(f"step time (median): replicate {med['replicate'] * 1e3:.1f} ms, shard "
          f"{med['shard'] * 1e3:.1f} ms, shard/replicate {med['shard'] / med['replicate']:.2f}")
    print("  of which pipe.step: " + ", ".join(
        f"{m} {statistics.median(r['pipe_s']) * 1e3:.1f} ms" for m, r in runs.items()) +
        "; AdamW step + zero_grad: " + ", ".join(
        f"{m} {statistics.median(r['opt_s']) * 1e3:.1f} ms" for m, r in runs.items()))
    print("bytes held per rank (params + grads + AdamW state), replicate -> shard:")
    for entry in everyone:
        mem = entry["memory"]
        r, s = sum(mem["replicate"].values()), sum(mem["shard"].values())
        print(f"  rank {entry['rank']}: {r / 2**20:.2f} MiB -> {s / 2**20:.2f} MiB "
              f"({s / r:.2f}); shard: params {mem['shard']['params'] / 2**20:.2f}, grads "
              f"{mem['shard']['grads'] / 2**20:.2f}, optimizer "
              f"{mem['shard']['optimizer'] / 2**20:.2f} MiB")
    for entry in everyone:
        g = entry["gathers"]
        print(f"rank {entry['rank']} all-gathers per step: {g['count']} of "
              f"{g['bytes'] / max(1, g['count']) / 2**20:.2f} MiB, "
              f"{g['seconds'] / max(1, g['count']) * 1e3:.2f} ms each; hidden behind other "
              f"work (median over steps): {entry['hidden']:.0%}")
    if cross:
        print(f"tied sum over stages {cross[0][0]}: {tied_posts[0]['bytes'] / 2**10:.1f} KiB, "
              f"priced {cross[0][1] * 1e3:.2f} ms")
    print(f"simulated step with collectives {sim.makespan * 1e3:.1f} ms, measured span "
          f"(rank 0) {everyone[0]['span'] * 1e3:.1f} ms, measured/simulated "
          f"{everyone[0]['span'] / sim.makespan:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
