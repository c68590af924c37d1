"""The CUDA checks of torch_mpmd on a machine with one GPU (no test runs one:
CI has no GPU). Every rank uses cuda:0.

    torchrun --nproc-per-node N scripts/gpu_check.py --backend gloo|nccl [--case NAME ...]

Per case, the example GPT (examples/gpt_model.py, tiny) is pipelined on
cuda:0 and trained for two steps against the same model stepping in one
process on the same device and batch; each rank prints one JSON line with the
loss and the worst gradient difference (scaled by the fp32 tolerance: <= 1
is within it) of the parameters its stages hold, or the error it raised.

Cases: ``pp`` (1f1b over all ranks), ``pp-inductor`` (the same with compiled
stage programs), ``interleaved`` (2 stages per rank), ``dp`` and ``shard``
(dp2 x pp, replicated or sharded data parallel: 4 ranks), ``timing`` (ms per step of the
pipeline vs the plain model, one process only). Two ranks on one GPU can
only talk over gloo (NCCL refuses two ranks on one device); gloo carries
CUDA tensors through host memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import torch_mpmd as mpmd  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_and_batch(device: torch.device, layers: int = 4
                    ) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=48, block_size=16, n_layer=layers, n_head=4, d_model=32))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 48, (8, 16), generator=g)
    y = torch.randint(0, 48, (8, 16), generator=g)
    return model.to(device), x.to(device), y.to(device)


def scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max()) if a.numel() else 0.0


def mine(p: torch.Tensor, g: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of gradient ``g`` of parameter ``p``, the same rows of
    ``want``): local, since DTensor's own gather over gloo crashes on CUDA."""
    if not hasattr(g, "to_local"):
        return g, want
    coord = p.device_mesh.get_coordinate()
    for i, pl in enumerate(p.placements):
        if pl.is_shard():
            want = torch.chunk(want, p.device_mesh.size(i), dim=pl.dim)[coord[i]]
    return g.to_local(), want


def run_case(case: str, device: torch.device) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, x, y = model_and_batch(device)
    ref = copy.deepcopy(model)
    mesh = None
    kwargs: dict = dict(loss_fn=lm_loss, num_microbatches=4, device=device, timeout=120)
    rows = slice(None)
    if case in ("shard", "dp"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "pp"))
        kwargs.update(mesh=mesh, data_parallel="shard" if case == "shard" else "replicate",
                      schedule="1f1b")
        d = mesh.get_local_rank("dp")
        rows = slice(d * 4, (d + 1) * 4)
    elif case == "interleaved":
        kwargs.update(schedule="interleaved_1f1b", stages_per_rank=2)
    else:
        kwargs.update(schedule="1f1b")
    if case == "pp-inductor":
        kwargs["compile"] = "inductor"
    pipe = mpmd.pipeline(model, **kwargs)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out: dict = {"case": case, "losses": [], "grads": []}
    for _ in range(2):
        loss = pipe.step(x[rows], target=y[rows])
        want = lm_loss(ref(x), y)
        want.backward()
        out["losses"].append(scaled(loss.reshape(()), want))
        refs = dict(ref.named_parameters())
        worst = max(((scaled(*mine(p, p.grad, refs[n].grad)), n)
                     for n, p in pipe.named_parameters() if p.grad is not None),
                    default=(0.0, None))
        out["grads"].append(worst)
        out["device_of_grads"] = sorted({str(getattr(p.grad, "_local_tensor", p.grad).device)
                                         for p in pipe.parameters()
                                         if p.grad is not None})
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    out["fallback"] = pipe.inspect().fallback_reason
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(device: torch.device) -> dict:
    """ms per training step: the plain model vs a one-rank pipeline of 2 stages
    (the runtime's overhead per action on a GPU), FX and Inductor programs."""
    res = {}
    for label, kw in (("fx", {}), ("inductor", {"compile": "inductor"})):
        model, x, y = model_and_batch(device, layers=8)
        pipe = mpmd.pipeline(model, loss_fn=lm_loss, num_microbatches=4, device=device,
                             schedule="interleaved_1f1b", stages_per_rank=2, **kw)
        for _ in range(3):
            pipe.step(x, target=y)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            pipe.step(x, target=y)
        _sync(device)
        res[f"pipeline_{label}_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    model, x, y = model_and_batch(device, layers=8)
    for _ in range(3):
        lm_loss(model(x), y).backward()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        for k in range(4):
            lm_loss(model(x[k * 2:(k + 1) * 2]), y[k * 2:(k + 1) * 2]).backward()
    _sync(device)
    res["plain_4_microbatches_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--case", action="append", default=None)
    p.add_argument("--device", default="cuda", help="cuda (cuda:0 on every rank) or cpu")
    args = p.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group(args.backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for case in args.case or ["pp"]:
        try:
            res = timing(device) if case == "timing" else run_case(case, device)
        except Exception as e:  # noqa: BLE001  (reported, the next case runs)
            res = {"case": case, "error": f"{type(e).__name__}: {e}"[:2000],
                   "trace": traceback.format_exc()[-3000:]}
        print(json.dumps({"rank": rank, "backend": args.backend, **res}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
