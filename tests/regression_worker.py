"""2-rank workers for tests/test_pipeline_regressions.py (run by dist_harness)."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import models
import torch_mpmd as mpmd


class BNNet(nn.Module):
    """Dropout and BatchNorm on stage 1: outputs depend on train/eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.bn(torch.relu(self.a(x)))))


class InplaceOnReceived(nn.Module):
    """Stage 1 writes the value it receives in place (`h += 1`, ReLU(inplace))."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mpmd.stage_boundary()
        h += 1
        return self.b(self.act(h))


def _max_grad_diff(pipe: Any, ref: nn.Module) -> float:
    want = dict(ref.named_parameters())
    return max(float((p.grad - want[n].grad).abs().max()) for n, p in pipe.named_parameters())


def regressions() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)

    # Train/eval mode switches re-capture (and the capture is kept per mode).
    model = BNNet()
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, split_points=["bn"])
    pipe.step(x, target=y)
    pipe.eval()
    ref = copy.deepcopy(model).eval()
    stats = model.bn.running_mean.clone()
    with torch.no_grad():
        got = pipe(x)
        # BatchNorm lives on rank 1's stage: only its copy of the model has the
        # trained running stats; rank 0 checks it received the same output.
        out["eval_output_diff"] = float((got - ref(x)).abs().max()) if rank == 1 else 0.0
        out["eval_output_sum"] = float(got.sum())
    out["eval_changed_running_mean"] = bool((model.bn.running_mean != stats).any())
    pipe.train()
    pipe.step(x, target=y)
    out["captures"] = pipe.inspect().captures

    # A first call under no_grad must not lose gradients across stages.
    torch.manual_seed(1)
    model = InplaceOnReceived()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2)
    with torch.no_grad():
        pipe(x)
    loss = pipe.step(x, target=torch.ones(8, 8))
    ref_loss = F.mse_loss(ref(x), torch.ones(8, 8))
    ref_loss.backward()
    out["inplace_loss_diff"] = float((loss - ref_loss).abs())
    out["inplace_grad_diff"] = _max_grad_diff(pipe, ref)
    out["no_grad_first_call_all_grads"] = all(p.grad is not None for p in pipe.parameters())

    # Frozen tied weights stay without a gradient; a full checkpoint loads on every rank.
    torch.manual_seed(2)
    gpt = models.CharGPT(vocab=32, d=16, n_layer=2, n_head=2, block_size=8)
    gpt.wte.weight.requires_grad_(False)
    ids, tgt = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    pipe = mpmd.pipeline(gpt, loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1),
                                                                    t.flatten()),
                         num_microbatches=2, split_points=["blocks.1"])
    pipe.step(ids, target=tgt)
    out["frozen_tied_grad_is_none"] = gpt.wte.weight.grad is None
    full = {k: torch.zeros_like(v) for k, v in
            models.CharGPT(vocab=32, d=16, n_layer=2, n_head=2, block_size=8).state_dict().items()}
    pipe.load_state_dict(full)  # strict: this rank's keys are all there
    out["full_checkpoint_loaded"] = all(float(v.abs().sum()) == 0 for v in pipe.state_dict().values())
    try:
        pipe.load_state_dict({**full, "not.a.key": torch.zeros(1)})
        out["unknown_key_rejected"] = False
    except RuntimeError as e:
        out["unknown_key_rejected"] = "not.a.key" in str(e)

    # torch.compile path: a second forward before backward is refused on every rank.
    torch._dynamo.reset()
    c = torch.compile(models.MLP(d=8, depth=2, markers=True), backend="mpmd")
    o1, o2 = c(x), c(x)
    try:
        (o1.sum() + o2.sum()).backward()
        out["compile_two_forwards"] = "no error"
    except RuntimeError as e:
        out["compile_two_forwards"] = str(e)
    # Ranks that split the model differently fail at start-up, naming the hashes.
    torch.manual_seed(3)
    mlp = models.MLP(d=8, depth=4, markers=False)
    pipe = mpmd.pipeline(mlp, loss_fn=F.mse_loss, num_microbatches=2,
                         split_points=["blocks.1" if rank == 0 else "blocks.2"])
    try:
        pipe.step(x, target=torch.zeros(8, 4))
        out["plan_mismatch"] = "no error"
    except mpmd.PipelineError as e:
        out["plan_mismatch"] = str(e)
    out["rank"] = rank
    return out


def data_parallel(schedules: list[str]) -> dict[str, Any]:
    """dp=2 x pp=2 over 4 ranks: every replica steps on its half of the global
    batch; loss and gradients must equal one process's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    out: dict[str, Any] = {"rank": dist.get_rank()}

    def lm(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.flatten(0, 1), t.flatten())

    torch.manual_seed(0)
    base = models.CharGPT(vocab=32, d=16, n_layer=4, n_head=2, block_size=8)
    ids, tgt = torch.randint(0, 32, (16, 8)), torch.randint(0, 32, (16, 8))
    ref = copy.deepcopy(base)
    ref_loss = lm(ref(ids), tgt)
    ref_loss.backward()
    # Two steps without zero_grad: the second must add, not re-reduce, the first.
    ref_loss2 = lm(ref(ids), tgt)
    ref_loss2.backward()
    mine = slice(8 * dp_rank, 8 * (dp_rank + 1))
    for name in schedules:
        spr = 2 if name in ("interleaved_1f1b", "zbv") else 1
        splits = [f"blocks.{k}" for k in range(1, 2 * spr)] if spr == 2 else ["blocks.2"]
        model = copy.deepcopy(base)
        pipe = mpmd.pipeline(model, loss_fn=lm, schedule=name, num_microbatches=2,
                             split_points=splits, mesh=mesh)
        loss = pipe.step(ids[mine], target=tgt[mine])
        loss2 = pipe.step(ids[mine], target=tgt[mine])
        want = dict(ref.named_parameters())
        out[name] = {
            "loss_diff": float((loss - ref_loss).abs()),
            "loss2_diff": float((loss2 - ref_loss2).abs()),
            "grad_diff": max(float((p.grad - want[n].grad).abs().max())
                             for n, p in pipe.named_parameters()),
            "params": sorted(n for n, _ in pipe.named_parameters()),
            "dp_size": pipe.dp_size, "pp_size": pipe.pp_size,
            # Process groups of this rank (NOTE [Groups kept]): the tied
            # weights' and the exchanges' groups are made by the first pipeline.
            "groups": len(dist.distributed_c10d._world.pg_map),
        }
    return out


def checkpoints(directory: str, phase: str) -> dict[str, Any]:
    """phase "train": 2 ranks, 1f1b, AdamW: 3 steps, save, 3 more steps (the
    losses after the save are the reference trajectory). phase "resume": a fresh
    pipeline of this launch's size loads the checkpoint before its first step
    (not captured yet: the whole module) and takes the 3 steps. Both report
    the digests of the parameters and optimizer state this rank holds right
    after the save or the load."""
    world = dist.get_world_size() if dist.is_initialized() else 1

    def lm(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.flatten(0, 1), t.flatten())

    torch.manual_seed(0)
    model = models.CharGPT(vocab=32, d=16, n_layer=4, n_head=2, block_size=8)
    if phase == "resume":  # other weights: everything must come from the checkpoint
        for p in model.parameters():
            torch.nn.init.normal_(p)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (8, 8), generator=gen),
                torch.randint(0, 32, (8, 8), generator=gen)) for _ in range(6)]
    splits = [f"blocks.{k}" for k in range(1, world)] if world > 1 else None
    pipe = mpmd.pipeline(model, loss_fn=lm, schedule="1f1b", num_microbatches=2,
                         split_points=splits)
    # Built before the first step, as in the README's example: it holds the whole
    # module's parameters; the checkpoint trims it to this rank's.
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    if phase == "train":
        for x, y in batches[:3]:
            pipe.step(x, target=y)
            opt.step()
            opt.zero_grad()
        mpmd.checkpoint.save(pipe, opt, directory)
    else:
        mpmd.checkpoint.load(pipe, opt, directory)
    state = _state_digests(pipe, opt)  # saved, or just loaded
    for x, y in batches[3:]:
        losses.append(float(pipe.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "world": world, "state": state}


def _state_digests(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, str]:
    """{name (and "name exp_avg" ...): sha256 of the bytes} of every parameter
    this rank holds and its optimizer state: equal digests, equal bits."""
    out: dict[str, str] = {}
    for name, p in pipe.named_parameters():
        out[name] = _digest(p.detach())
        for key, value in opt.state.get(p, {}).items():
            out[f"{name} {key}"] = _digest(torch.as_tensor(value))
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def _deterministic_init(mod: nn.Module) -> None:
    """Values from each tensor's shape only: the same whatever the order or rank."""
    for t in list(mod._parameters.values()) + list(mod._buffers.values()):
        if t is not None:
            with torch.no_grad():
                t.copy_(torch.linspace(-0.2, 0.2, t.numel()).reshape(t.shape).cos() * 0.1)


def meta_model(dp: int = 1) -> dict[str, Any]:
    """A tied GPT built on the meta device: only this rank's stages get memory,
    and training equals a real model initialized the same way (with dp > 1:
    replicas of a dp x 2 mesh, each on its share of the batch)."""
    def lm(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.flatten(0, 1), t.flatten())

    def build() -> nn.Module:
        return models.CharGPT(vocab=32, d=16, n_layer=4, n_head=2, block_size=8)

    ref = build()
    ref.apply(_deterministic_init)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    with torch.device("meta"):
        model = build()
    mesh, share = None, slice(None)
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp"))
        k = mesh.get_local_rank("dp")
        share = slice(8 // dp * k, 8 // dp * (k + 1))
    pipe = mpmd.pipeline(model, loss_fn=lm, num_microbatches=2, split_points=["blocks.2"],
                         init_fn=_deterministic_init, mesh=mesh)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (8, 8), generator=gen)
    tgt = torch.randint(0, 32, (8, 8), generator=gen)
    loss = pipe.step(ids[share], target=tgt[share])
    ref_loss = lm(ref(ids), tgt)
    ref_loss.backward()
    want = dict(ref.named_parameters())
    return {
        "loss_diff": float((loss - ref_loss).abs()),
        "grad_diff": max(float((p.grad - want[n].grad).abs().max())
                         for n, p in pipe.named_parameters()),
        "bytes": pipe.parameter_bytes, "total": total,
        "still_meta": any(t.is_meta for t in model.parameters()),
    }
