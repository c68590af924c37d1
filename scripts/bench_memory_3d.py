"""Parameter, gradient and optimizer bytes per rank across 3-D layouts (issue 14 §4).

    torchrun --standalone --nproc-per-node 8 scripts/bench_memory_3d.py

The example GPT (examples/gpt_model.py, 8 layers, d=256, vocab 64, tied
embedding) on 8 ranks in four layouts, one after another in one run: pp2 x dp4
replicated, pp2 x dp4 sharded, pp2 x dp2 x tp2 replicated, pp2 x dp2 x tp2
sharded (tensor parallel: gpt_model.tensor_parallel_plan on every block). After
one pipe.step + AdamW.step each rank counts the bytes it holds in parameters,
gradients and AdamW state (local shards; stand-ins hold none). Printed on
rank 0: per layout, the largest and smallest rank and the share of the
unsplit model's bytes (parameters + gradients + two AdamW moments = 4x the
parameters) that the largest rank holds.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import torch_mpmd as mpmd  # noqa: E402
from bench_sharded import _local_bytes as _held  # noqa: E402  (bytes of local shards)
from gpt_model import GPT, GPTConfig, tensor_parallel_plan  # noqa: E402

LAYOUTS = [("pp2 x dp4, replicate", (4, 2, 1), "replicate"),
           ("pp2 x dp4, shard", (4, 2, 1), "shard"),
           ("pp2 x dp2 x tp2, replicate", (2, 2, 2), "replicate"),
           ("pp2 x dp2 x tp2, shard", (2, 2, 2), "shard")]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 8:
        raise SystemExit("run with torchrun --nproc-per-node 8")
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, d_model=256)
    x = torch.randint(0, 64, (8, 32))
    y = torch.randint(0, 64, (8, 32))

    def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    torch.manual_seed(0)
    model_bytes = 4 * sum(p.numel() * p.element_size() for p in GPT(cfg).parameters())
    rows = []
    for name, (dp, pp, tp), mode in LAYOUTS:
        mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        torch.manual_seed(0)
        model = GPT(cfg)
        if tp > 1:
            for block in model.blocks:
                parallelize_module(block, mesh["tp"], tensor_parallel_plan())
        pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=2, mesh=mesh,
                             data_parallel=mode, split_points=["blocks.4"], timeout=120)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        pipe.step(x[: 8 // dp], target=y[: 8 // dp])
        opt.step()
        params = list(pipe.parameters())
        state = [v for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        mine = torch.tensor([_held(params) + _held([p.grad for p in params if p.grad is not None])
                             + _held(state)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(8)]
        dist.all_gather(every, mine)
        rows.append((name, [float(t) for t in every]))
        del pipe, opt, model
    if dist.get_rank() == 0:
        print(f"GPT 8x256 (vocab 64), {model_bytes / 2**20:.1f} MiB of parameters + gradients + "
              "AdamW state unsplit; bytes held per rank after one step:")
        for name, per_rank in rows:
            print(f"  {name:28s} max {max(per_rank) / 2**20:6.2f} MiB, min "
                  f"{min(per_rank) / 2**20:6.2f} MiB, max share {max(per_rank) / model_bytes:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
