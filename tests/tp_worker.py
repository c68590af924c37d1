"""Ranks of tests/test_tensor_parallel.py: tensor parallelism inside pipeline
stages (DTensor plans applied before ``pipeline()``) on a ("pp", "tp") mesh of
4 gloo ranks, or ("dp", "pp", "tp") of 8, against one process.

The reference is the same model without tensor parallelism, with the same
initial values (the TP model loads the reference's state dict before its
plan shards it), stepping on the global batch with a mean-reduced loss:
tensor-parallel peers step on the same batch, dp replicas on their rows of
it. Every case catches its own error and reports it (``{"error":
traceback}``); gradients and parameters are compared here, in the ranks
(``DTensor.full_tensor()``, collective over "tp"), and the results are the
differences scaled by the fp32 tolerance (<= 1: within it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               parallelize_module)

import models
import torch_mpmd as mpmd
from dist_harness import run_grid
from optim_replay import AdamWReplay
from sharded_worker import full, max_diff, worst

BATCH = 8   # the global batch
M = 2       # microbatches per replica
LR = 1e-2
EPS = 1e-5  # AdamW's (see sharded_worker.py: near-zero key-bias gradients)
VOCAB, SEQ = 32, 16

# torchtitan's plan for a block: heads split over "tp" (q, k, v column-wise),
# attn.proj and the MLP's second layer row-wise; block outputs are plain
# (replicated) local tensors (use_local_output=True, the default).
PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
SPLITS = {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}


def _sequence_sharded_boundaries(model: nn.Module, tp: Any) -> None:
    """Blocks hand the residual stream on as a Shard(1) DTensor (each tp rank
    holds half the tokens, sequence parallel's layout between blocks): every
    block but the last ends by keeping its rows of the sequence, every block
    but the first begins by gathering them. The stage boundary before
    blocks.2 carries the DTensor, sent as its local half."""
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        if i > 0:
            parallelize_module(block, tp, PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=True))
        if i < last:
            parallelize_module(block, tp, PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                use_local_output=False))


def _replicated_attention_inputs(model: nn.Module, tp: Any) -> None:
    """ln1's output stays a Replicate DTensor that q, k and v read as it is:
    its gradient comes out of the column-parallel projections Partial. The
    split before blocks.2.attn puts it on the boundary, so the consumer's
    gradient is redistributed to Replicate before it is sent (NOTE [DTensor
    boundaries])."""
    for block in model.blocks:
        parallelize_module(block.ln1, tp, PrepareModuleOutput(
            output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),),
            use_local_output=False))


# Variants of the plan, by the case's "model": what crosses the pp2 split.
# "blocks": plain local tensors (the plan's defaults); "sequence": a Shard(1)
# DTensor; "replicated": a Replicate DTensor with a Partial gradient.
BOUNDARIES: dict[str, tuple[Callable[[nn.Module, Any], None] | None, list[str]]] = {
    "blocks": (None, SPLITS[2]),
    "sequence": (_sequence_sharded_boundaries, SPLITS[2]),
    "replicated": (_replicated_attention_inputs, ["blocks.2.attn"]),
}


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(mesh: Any, variant: str = "blocks") -> tuple[nn.Module, nn.Module]:
    """(model with the TP plan on every block over ``mesh["tp"]``, and the
    boundary layout of ``variant`` (BOUNDARIES), reference)."""
    torch.manual_seed(0)
    ref = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    model = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    model.load_state_dict(ref.state_dict())
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    boundaries, _ = BOUNDARIES[variant]
    if boundaries is not None:
        boundaries(model, mesh["tp"])
    return model, ref


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


# ------------------------------------------------------------------ helpers

def compare_grads(pipe: Any, ref: nn.Module) -> dict[str, float]:
    want = dict(ref.named_parameters(remove_duplicate=False))
    return {n: max_diff(full(p.grad), want[n].grad) for n, p in pipe.named_parameters()}


def compare_params(pipe: Any, ref: nn.Module | AdamWReplay) -> dict[str, float]:
    """Each parameter against ``ref``'s (after optimizer steps: an
    AdamWReplay, see optim_replay.py)."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    return {n: max_diff(full(p.detach()), want[n].detach()) for n, p in pipe.named_parameters()}


_MESHES: dict[tuple, Any] = {}


def make_mesh(case: dict[str, Any]) -> Any:
    """The case's mesh, one per layout for the worker's process group: the
    cases of a grid share it as a training process keeps one (a new mesh
    makes new process groups, and a capture over other groups is not
    reused: NOTE [Capture memo])."""
    names = tuple(case.get("dims", ("pp", "tp")))
    sizes = {"dp": case.get("dp", 1), "pp": case.get("pp", 2), "tp": 2}
    shape = tuple(sizes[n] for n in names)
    key = (names, shape, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _pipeline(model: nn.Module, mesh: Any, schedule: str, variant: str = "blocks",
              **kwargs: Any) -> Any:
    spr = 2 if schedule == "interleaved_1f1b" else 1
    extra = {"stages_per_rank": spr} if spr != 1 else {}
    pp = mesh.size(mesh.mesh_dim_names.index("pp")) if "pp" in mesh.mesh_dim_names else 1
    splits = BOUNDARIES[variant][1] if pp * spr == 2 else SPLITS.get(pp * spr)
    return mpmd.pipeline(model, loss_fn=gpt_loss, schedule=schedule, num_microbatches=M,
                         split_points=splits, mesh=mesh, timeout=60, **extra, **kwargs)


def transfers(pipe: Any) -> dict[str, Any]:
    """What crosses each stage edge per microbatch: the transport's tensor
    shapes ("0->1", gradients "1->0 grad") and the plan's bytes per value."""
    shapes = {edge: [list(s) for s in specs] for edge, specs in pipe.inspect().transfers.items()}
    return {"shapes": shapes,
            "bytes": [v.bytes for v in pipe.split.plan.cross_stage_values]}


def _mine(mesh: Any) -> slice:
    """This dp replica's rows of the global batch (all of it without "dp")."""
    names = mesh.mesh_dim_names
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    k = mesh.get_local_rank("dp") if "dp" in names else 0
    share = BATCH // dp
    return slice(share * k, share * (k + 1))


# ------------------------------------------------------------------ cases

def train(case: dict[str, Any]) -> dict[str, Any]:
    """Two AdamW steps against the reference: losses, every gradient after
    each step, every parameter after both (against AdamW replayed on the
    pipeline's gradients: optim_replay.py); the parameters' and gradients'
    types and whether the stage programs ran (no autograd fallback)."""
    mesh = make_mesh(case)
    mine = _mine(mesh)
    variant = case.get("model", "blocks")
    model, ref = build(mesh, variant)
    pipe = _pipeline(model, mesh, case["schedule"], variant, **case.get("kwargs", {}))
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    res: dict[str, Any] = {"loss": [], "grads": []}
    for seed in (1, 2):
        x, y = batch(seed)
        loss = pipe.step(x[mine], target=y[mine])
        ref_loss = gpt_loss(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.reshape(()), ref_loss.detach()))
        res["grads"].append(worst(compare_grads(pipe, ref)))
        # A DTensor parameter has a DTensor gradient of its placements.
        # With data_parallel="shard" every parameter is a DTensor (its shard).
        res["grad_layouts"] = sorted(
            {f"{type(p).__name__}:{type(p.grad).__name__}"
             f"{':same' if not isinstance(p, DTensor) or p.grad.placements == p.placements else ':other'}"
             for p in pipe.parameters()})
        replay.step(pipe)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    res["params"] = worst(compare_params(pipe, replay))
    res["names"] = sorted(n for n, _ in pipe.named_parameters())
    res["all_names"] = sorted(n for n, _ in ref.named_parameters())
    res["fallback"] = pipe.inspect().fallback_reason
    res["replicas"] = pipe.replicas
    res["transfers"] = transfers(pipe)
    res["tied"] = pipe.last_step_stats.get("collectives", {}).get("tied_all_reduce")
    res["local_stages"] = list(pipe.local_stages)
    return res


def clip_eval(case: dict[str, Any]) -> dict[str, Any]:
    """Two steps without zero_grad (gradients accumulate), clip_grad_norm_
    against torch's on the reference (plain and DTensor gradients mixed),
    eval_step and the forward-only call, then one more step."""
    mesh = make_mesh(case)
    mine = _mine(mesh)
    variant = case.get("model", "blocks")
    model, ref = build(mesh, variant)
    pipe = _pipeline(model, mesh, case["schedule"], variant, **case.get("kwargs", {}))
    res: dict[str, Any] = {}
    for seed in (1, 2):
        x, y = batch(seed)
        pipe.step(x[mine], target=y[mine])
        gpt_loss(ref(x), y).backward()
    res["accumulated_grads"] = worst(compare_grads(pipe, ref))
    norm = pipe.clip_grad_norm_(0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    res["norm"] = max_diff(norm.reshape(()), ref_norm)
    res["norm_value"], res["ref_norm_value"] = float(norm), float(ref_norm)
    res["clipped_grads"] = worst(compare_grads(pipe, ref))
    inf_norm = pipe.clip_grad_norm_(1e9, norm_type=float("inf"))   # scales nothing
    res["inf_norm"] = max_diff(inf_norm.reshape(()), torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters()], float("inf")))
    before = {n: full(p.grad).clone() for n, p in pipe.named_parameters()}

    x, y = batch(3)
    with torch.no_grad():
        ref_eval = gpt_loss(ref(x), y)
        ref_out = ref(x[mine])
    res["eval"] = max_diff(pipe.eval_step(x[mine], target=y[mine]).reshape(()), ref_eval)
    res["eval_kept_grads"] = max(max_diff(full(p.grad), before[n])
                                 for n, p in pipe.named_parameters())
    res["forward"] = max_diff(pipe(x[mine]), ref_out)
    pipe.zero_grad()
    ref.zero_grad()
    x, y = batch(4)
    loss = pipe.step(x[mine], target=y[mine])
    ref_loss = gpt_loss(ref(x), y)
    ref_loss.backward()
    res["step_after"] = max_diff(loss.reshape(()), ref_loss.detach())
    res["grads_after"] = worst(compare_grads(pipe, ref))
    return res


class _BoundaryNet(nn.Module):
    """Two layers, a stage boundary, one more: ``proj``'s output crosses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.relu(self.fc(x)))
        mpmd.stage_boundary()
        return self.out(h)


def _refused_boundary(mesh: Any, dim: str, layout: Any) -> str:
    """The error of a step pipelined over ``mesh`` whose boundary value is
    ``proj``'s row-parallel output over ``mesh[dim]``, a DTensor of
    placement ``layout``."""
    torch.manual_seed(0)
    net = _BoundaryNet()
    parallelize_module(net, mesh[dim], {
        "fc": ColwiseParallel(),
        "proj": RowwiseParallel(output_layouts=layout, use_local_output=False),
        "out": PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)})
    pipe = mpmd.pipeline(net, loss_fn=F.mse_loss, num_microbatches=M, mesh=mesh, timeout=60)
    return _raises(lambda: pipe.step(torch.randn(4, 8), target=torch.randn(4, 8)))


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def errors(case: dict[str, Any]) -> dict[str, Any]:
    """A mesh dim name torch_mpmd does not know; DTensors at a stage boundary
    that cannot cross as local shards: one over the "pp" dim, a Partial one
    (refused at the split, on every rank, and the ranks stay usable)."""
    res: dict[str, Any] = {}
    model, _ = build(make_mesh({}))
    bad = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "model"))
    res["bad_name"] = _raises(lambda: mpmd.pipeline(model, loss_fn=gpt_loss,
                                                    num_microbatches=M, mesh=bad))
    mesh = make_mesh({})
    res["pp_mesh"] = _refused_boundary(mesh, "pp", Replicate())
    res["partial"] = _refused_boundary(mesh, "tp", Partial())
    return res


def local_costs(case: dict[str, Any]) -> dict[str, Any]:
    """The cost model sees this rank's local shapes (NOTE [Local shapes] in
    fx_to_ir.py): bytes of every linear's output in the captured TP model,
    by the module that computes it."""
    from torch_mpmd.graph.capture import capture
    from torch_mpmd.graph.fx_to_ir import _meta_value, value_bytes

    model, _ = build(make_mesh({}))
    captured = capture(model, (batch(1)[0],), {})
    out: dict[str, int] = {}
    for node in captured.gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and "linear" in str(node.target) and stack:
            fqn = list(stack.values())[-1][0]
            out.setdefault(fqn.split("].", 1)[-1], value_bytes(_meta_value(node)))
    return {"bytes": out}


def memo(case: dict[str, Any]) -> dict[str, Any]:
    """The memos over a tensor parallel model (NOTE [Capture memo], NOTE
    [Export memo]): the model built and parallelized again on the same mesh
    (new hook objects over the same layouts) reuses the capture and every
    stage's joint trace, and steps as the first did; on a mesh of the same
    layout over new process groups (torch's DeviceMesh compares equal) it
    is traced again."""
    from torch_mpmd.graph import capture_memo
    from torch_mpmd.programs import export_memo

    def first_step(mesh: Any) -> tuple[float, dict[str, int], dict[str, int]]:
        captures, exports = dict(capture_memo.stats()), dict(export_memo.stats())
        x, y = batch(1)
        loss = _pipeline(build(mesh)[0], mesh, "1f1b").step(x, target=y)
        return (float(loss), {k: v - captures[k] for k, v in capture_memo.stats().items()},
                {k: v - exports[k] for k, v in export_memo.stats().items()})

    mesh = make_mesh({})
    first = first_step(mesh)
    again = first_step(mesh)
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    fresh = first_step(other)
    return {"losses": [first[0], again[0], fresh[0]], "captures": [again[1], fresh[1]],
            "exports": [again[2], fresh[2]], "meshes_equal": other == mesh,
            "keys_equal": capture_memo.mesh_key(other) == capture_memo.mesh_key(mesh)}


def door(case: dict[str, Any]) -> dict[str, Any]:
    """The compile door over the TP model: torch.compile(forward + loss,
    backend="mpmd") on the ("pp", "tp") mesh, loss.backward(), AdamW over
    the module's own (DTensor and plain) parameters; two steps against the
    reference."""
    import torch._dynamo

    torch._dynamo.reset()
    mesh = make_mesh(case)
    model, ref = build(mesh)

    @torch.compile(backend="mpmd", options=dict(schedule=case["schedule"], num_microbatches=M,
                                                split_points=SPLITS[2], mesh=mesh, timeout=60))
    def train_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt_loss(model(x), y)

    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    want = dict(ref.named_parameters())
    res: dict[str, Any] = {"loss": [], "grads": []}
    for seed in (1, 2):
        x, y = batch(seed)
        loss = train_loss(x, y)
        loss.backward()
        ref_loss = gpt_loss(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.detach().reshape(()), ref_loss.detach()))
        # Every parameter this rank's pipeline holds has the reference's
        # gradient (a missing one is inf); the others have none.
        local = {n for n, _ in mpmd.pipeline_of(train_loss).named_parameters()}
        diffs = {n: max_diff(full(p.grad), want[n].grad)
                 for n, p in model.named_parameters() if n in local}
        diffs.update({n: float("inf") for n, p in model.named_parameters()
                      if n not in local and p.grad is not None})
        res["grads"].append(worst(diffs))
        res["with_grad"] = len(local)
        replay.step(model)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    replayed = dict(replay.named_parameters())
    res["params"] = worst({n: max_diff(full(p.detach()), replayed[n].detach())
                           for n, p in model.named_parameters() if n in local})
    return res


CASES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "train": train, "clip_eval": clip_eval, "errors": errors, "local_costs": local_costs,
    "door": door, "memo": memo}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every case on this rank; {case id: result (with "error")}."""
    return run_grid(cases, CASES)
