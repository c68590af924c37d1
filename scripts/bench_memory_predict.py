"""The planner's predicted peak bytes per rank against the measured (issue 21 item 2).

    torchrun --standalone --nproc-per-node 2 scripts/bench_memory_predict.py
    torchrun --standalone --nproc-per-node 4 scripts/bench_memory_predict.py --dp 2

The example GPT (8 layers, d=128, untied head), batch 16 x 64, 2 ranks x 1
thread, FX programs. One profile (``mpmd.profile``) gives the sheet; for each
schedule the planner evaluates the plan (``planning.evaluate_plan``: its
memory model per rank: parameters, gradients and AdamW's two states, saved
activations walked over the rank's program, transfer buffers), and the
pipeline runs the same plan for two steps with AdamW. Measured per rank:
the bytes of the rank's parameters, their gradients and AdamW's states (read
off the tensors), plus the peak bytes held for backward (``last_step_stats
["peak_live_bytes"]``, here ``peak_held_bytes``: the stage programs' saved
tensors over all the rank's stages at once). Prints schedule,
rank, predicted, measured, predicted / measured.

``--dp 2``: 4 ranks on a ("dp", "pp") = (2, 2) mesh, each replica on its own
16 x 64 batch, for each schedule both data-parallel modes (``pipeline(mesh=,
data_parallel=)``; the sheet profiled with the mesh's dp group, the plan
evaluated with ``data_parallel=``). Measured: the parameters, gradients and
AdamW states as this rank holds them (in "shard" its DTensor shards' local
tensors), plus ``peak_live_bytes``: the most bytes beyond those at once,
sampled before each compute action: held for backward, and in "shard" the
full parameters gathered and the full gradients no REDUCE_GRAD has taken
yet (``peak_held_bytes`` and ``peak_gathered_bytes``, each at its own
moment, are printed beside it). Not measured (the planner counts them): the
all-gathers' and reductions' own buffers, the transfer buffers between
ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from torch_mpmd import planning  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2),
             ("zbv", 2)]
SCHEDULES_DP = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zbv", 2)]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=8, n_head=4, d_model=128))
    m.head.weight = torch.nn.Parameter(m.tok.weight.detach().clone())  # untied
    return m


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this rank holds: a DTensor's local shard, a plain tensor whole."""
    tensors = [getattr(t, "_local_tensor", t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (1 or 2)")
    dp = parser.parse_args().dp
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dp > 1:
        return main_dp(dp)
    rank, pp = dist.get_rank(), dist.get_world_size()
    x, y, box = _batch_and_cache(seed=1)
    m = 8
    sheet = mpmd.profile(model(), (x,), loss_fn=loss_fn, target=y, cache_dir=box[0],
                         microbatch_sizes=[16 // m], global_batch=16, pp_size=pp)
    rows = []
    for schedule, spr in SCHEDULES:
        stages = pp * spr
        units = [u.name for u in sheet.units]
        split = [units[len(units) * k // stages] for k in range(1, stages)]
        plan = planning.evaluate_plan(sheet, schedule, num_microbatches=m, stages_per_rank=spr,
                                      split_points=split)
        pipe = mpmd.pipeline(model(), loss_fn=loss_fn, schedule=schedule, num_microbatches=m,
                             split_points=split)
        measured, held, _ = _measured(pipe, _two_steps(pipe, x, y))
        mine = [schedule, rank, plan.predicted_peak_bytes[rank], measured, held]
        every = [None] * pp
        dist.all_gather_object(every, mine)
        rows += every
    if rank == 0:
        print(f"example GPT 8 x d=128 (untied), batch 16x64, m={m}, p={pp}, FX programs")
        print("| schedule | rank | predicted peak | measured peak | predicted / measured "
              "| of which held for backward |")
        print("|---|---|---|---|---|---|")
        for schedule, r, pred, meas, held in rows:
            print(f"| {schedule} | {r} | {pred / 2**20:.2f} MiB | {meas / 2**20:.2f} MiB | "
                  f"{pred / meas:.2f} | {held / 2**20:.2f} MiB |")
        import shutil
        shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


def _batch_and_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A 16 x 64 batch of ids and targets, and ``[cache directory]`` (global
    rank 0's, every rank told)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 96, (16, 64), generator=g)
    y = torch.randint(0, 96, (16, 64), generator=g)
    box = [tempfile.mkdtemp(prefix="mpmd_mem_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return x, y, box


def _two_steps(pipe, x: torch.Tensor, y: torch.Tensor) -> torch.optim.Optimizer:
    """Two steps with AdamW (its states exist after the first); the optimizer."""
    opt = None
    for _ in range(2):
        pipe.step(x, target=y)
        if opt is None:
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        opt.step()
    return opt


def _measured(pipe, opt) -> tuple[int, int, int]:
    """(total, peak_held_bytes, peak_gathered_bytes) of this rank after a step:
    total = its parameters, gradients and AdamW states as it holds them, plus
    ``peak_live_bytes``."""
    params = list(pipe.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    stats = pipe.last_step_stats
    held, gathered = stats["peak_held_bytes"], stats["peak_gathered_bytes"]
    return _bytes(params) + _bytes(grads) + _bytes(states) + stats["peak_live_bytes"], \
        held, gathered


def main_dp(dp: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    pp = dist.get_world_size() // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    rank = dist.get_rank()
    replica = mesh.get_local_rank("dp")
    x, y, box = _batch_and_cache(seed=1 + replica)  # each replica its own batch
    m = 8
    # Each replica profiles (collective over its pp group and the dp groups);
    # all use global rank 0's sheet, as mpmd.plan does (every rank must get
    # the same split).
    sheet = mpmd.profile(model(), (x,), loss_fn=loss_fn, target=y, cache_dir=box[0],
                         microbatch_sizes=[16 // m], global_batch=16,
                         group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"))
    text = [sheet.to_json()]
    dist.broadcast_object_list(text, src=0)
    sheet = type(sheet).from_json(text[0])
    rows = []
    for schedule, spr in SCHEDULES_DP:
        stages = pp * spr
        units = [u.name for u in sheet.units]
        split = [units[len(units) * k // stages] for k in range(1, stages)]
        for mode in ("replicate", "shard"):
            plan = planning.evaluate_plan(sheet, schedule, num_microbatches=m,
                                          stages_per_rank=spr, split_points=split,
                                          data_parallel=mode)
            extra = {"stages_per_rank": spr} if spr != 1 else {}
            pipe = mpmd.pipeline(model(), loss_fn=loss_fn, schedule=schedule,
                                 num_microbatches=m, split_points=split, mesh=mesh,
                                 data_parallel=mode, **extra)
            measured, held, gathered = _measured(pipe, _two_steps(pipe, x, y))
            mine = [schedule, mode, rank, plan.predicted_peak_bytes[pipe.rank], measured, held,
                    gathered]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            rows += every
    if rank == 0:
        print(f"example GPT 8 x d=128 (untied), batch 16x64 per replica, m={m}, "
              f"dp={dp} x pp={pp}, FX programs, 2 AdamW steps")
        print("| schedule | mode | rank | predicted peak | measured peak | predicted / measured "
              "| peak held for backward | peak gathered |")
        print("|---|---|---|---|---|---|---|---|")
        for schedule, mode, r, pred, meas, held, gathered in rows:
            print(f"| {schedule} | {mode} | {r} | {pred / 2**20:.2f} MiB | "
                  f"{meas / 2**20:.2f} MiB | {pred / meas:.2f} | {held / 2**20:.2f} MiB | "
                  f"{gathered / 2**20:.2f} MiB |")
        import shutil
        shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
