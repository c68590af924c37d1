"""Ranks of tests/test_3d_checkpoint.py: checkpoints across 3-D layouts
(pipeline x tensor parallel x data parallel) and meta-device models with
tensor parallelism, on 4 gloo ranks (dist_harness).

The model is tests/models.py's TPGPT with tp_worker's plan (q/k/v and fc
column-parallel, projections row-parallel) applied before ``pipeline()``;
"no tp" layouts pipeline the same model without the plan. Every case
catches its own error and reports it (``{"error": traceback}``); tensors are
compared here, in the ranks, as full tensors (``DTensor.full_tensor()``,
collective over each parameter's mesh), and the results are exact
equalities or differences scaled by the fp32 tolerance (<= 1: within it).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import models
import torch_mpmd as mpmd
from dist_harness import error_text as _error_text, partial_result, run_grid
from optim_replay import AdamWReplay, step_both
from tp_worker import (EPS, LR, PLAN, VOCAB, SEQ, _mine, _pipeline, batch,
                       full, gpt_loss, make_mesh, max_diff, worst)


def _new_model(mesh: Any | None, *, scramble: bool) -> nn.Module:
    """A TPGPT (seed 0, or random values when ``scramble``: everything must
    then come from the checkpoint) with the TP plan over ``mesh["tp"]`` when
    the mesh has a "tp" dim."""
    torch.manual_seed(0)
    model = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    if scramble:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    if mesh is not None and "tp" in mesh.mesh_dim_names:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], PLAN)
    return model


def _state_of(pipe: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stages hold and its AdamW moments, full."""
    out: dict[str, torch.Tensor] = {}
    for n, p in pipe.named_parameters():
        out[n] = full(p.detach()).clone()
        for stat in ("exp_avg", "exp_avg_sq"):
            if stat in opt.state.get(p, {}):
                out[f"{n} {stat}"] = full(opt.state[p][stat]).clone()
    return out


def _gather_states(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every rank's ``state``."""
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, state)
    out: dict[str, torch.Tensor] = {}
    for part in everything:
        out.update(part)
    return out


def _compare_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                    ) -> dict[str, Any]:
    """Exact equality of ``got``'s entries with ``want``'s."""
    unequal = [k for k, v in got.items() if k in want and not torch.equal(v, want[k])]
    return {"compared": len([k for k in got if k in want]), "unequal": unequal[:10],
            "unknown": [k for k in got if k not in want][:10],
            "moments": len([k for k in got if k.endswith("exp_avg") and k in want])}


def _layout_kwargs(layout: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    mesh = make_mesh(layout)
    kwargs = {"data_parallel": layout["mode"]} if "dp" in layout.get("dims", ()) else {}
    return mesh, kwargs


def _saving_run(directory: str, layout: dict[str, Any], out: dict[str, Any]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float] | None:
    """Two AdamW steps in ``layout`` against the one-process reference, save,
    then a third step (the continuation). Returns (saved state, continued
    state, continued loss), all ranks' union; None when the save failed.
    Every step's gradients are compared with the reference's; the saved and
    continued parameters and moments with AdamW replayed on the pipeline's
    gradients (optim_replay.py)."""
    mesh, kwargs = _layout_kwargs(layout)
    mine = _mine(mesh)
    ref = _new_model(None, scramble=False)
    model = _new_model(mesh, scramble=False)
    pipe = _pipeline(model, mesh, "1f1b", **kwargs)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    out["grads_vs_ref"] = []

    def train_step(seed: int) -> float:
        loss, worst = step_both(pipe, opt, ref, ropt, replay, *batch(seed), mine, gpt_loss)
        out["grads_vs_ref"].append(worst)
        return float(loss)

    for seed in (1, 2):
        train_step(seed)
    try:
        out["saved_in"] = mpmd.checkpoint.save(pipe, opt, directory)
        out["save_error"] = None
    except Exception:
        out["save_error"] = _error_text()
        return None
    saved_all = _gather_states(_state_of(pipe, opt))
    ref_state = _plain_state(replay, replay.optimizer)
    out["saved_vs_ref"] = max(max_diff(v, ref_state[k]) for k, v in saved_all.items())
    loss3 = train_step(3)
    cont_all = _gather_states(_state_of(pipe, opt))
    ref_state = _plain_state(replay, replay.optimizer)
    out["continuation_vs_ref"] = max(max_diff(v, ref_state[k]) for k, v in cont_all.items())
    out["names_saved"] = len(saved_all)
    dist.barrier()
    return saved_all, cont_all, loss3


def _plain_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().clone()
        for stat in ("exp_avg", "exp_avg_sq"):
            if stat in opt.state.get(p, {}):
                out[f"{n} {stat}"] = opt.state[p][stat].clone()
    return out


def _resume(directory: str, layout: dict[str, Any], saved_all: dict[str, torch.Tensor],
            cont_all: dict[str, torch.Tensor], cont_loss: float) -> dict[str, Any]:
    """Load the checkpoint into a fresh pipeline in ``layout`` (scrambled
    values; ``capture_first``: after a first step, so the optimizer is
    trimmed at load), compare with the saved state, take the third step."""
    res: dict[str, Any] = {"error": None}
    try:
        mesh, kwargs = _layout_kwargs(layout)
        mine = _mine(mesh)
        model = _new_model(mesh, scramble=True)
        pipe = _pipeline(model, mesh, "1f1b", **kwargs)
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
        if layout.get("capture_first"):
            x, y = batch(9)
            pipe.step(x[mine], target=y[mine])
            opt.zero_grad()
        got = mpmd.checkpoint.load(pipe, opt, directory)
        res["step"] = got["step"]
        res["loaded"] = _compare_states(_state_of(pipe, opt), saved_all)
        res["types"] = sorted({type(p).__name__ for p in pipe.parameters()})
        x3, y3 = batch(3)
        loss = float(pipe.step(x3[mine], target=y3[mine]))
        opt.step()
        opt.zero_grad()
        res["loss"] = abs(loss - cont_loss)
        after = _state_of(pipe, opt)
        res["continued"] = worst({k: max_diff(v, cont_all[k]) for k, v in after.items()})
    except Exception:
        res["error"] = _error_text()
    return res


def _plain_load(target: str, saved_all: dict[str, torch.Tensor],
                cont_all: dict[str, torch.Tensor], cont_loss: float) -> dict[str, Any]:
    """One process, torch.distributed.checkpoint alone, into the plain module."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model = _new_model(None, scramble=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"model": model.state_dict(),
             "optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=target, no_dist=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=options)
    res: dict[str, Any] = {"loaded": _compare_states(_plain_state(model, opt), saved_all)}
    x3, y3 = batch(3)
    loss = gpt_loss(model(x3), y3)
    loss.backward()
    opt.step()
    res["loss"] = abs(float(loss) - cont_loss)
    res["continued"] = worst({k: max_diff(v, cont_all[k])
                              for k, v in _plain_state(model, opt).items() if k in cont_all})
    return res


def _manifest_chunks(target: str) -> dict[str, Any]:
    """From every rank's manifest: per model key, the chunks (offsets) with a
    CRC32 recorded, and whether any chunk was recorded twice."""
    import json

    chunks: dict[str, list[Any]] = {}
    for r in range(dist.get_world_size()):
        with open(os.path.join(target, f"rank_{r}.json"), encoding="utf-8") as f:
            for e in json.load(f)["items"]:
                if e["key"].startswith("model."):
                    chunks.setdefault(e["key"], []).append(e["chunk"])
    return {k: sorted(v, key=str) for k, v in chunks.items()}


PP_TP = dict(dims=("pp", "tp"))
PP_DP_SHARD = dict(dims=("dp", "pp"), dp=2, mode="shard")
DP_TP_SHARD = dict(dims=("dp", "tp"), dp=2, mode="shard")


def checkpoints(case: dict[str, Any]) -> dict[str, Any]:
    """Save from ``case["save"]`` (a layout), load into each of
    ``case["into"]`` ({key: layout}, "plain": rank 0's plain module)."""
    directory = case["directory"]
    out: dict[str, Any] = {}
    saved = _saving_run(directory, case["save"], out)
    if saved is None:
        return out
    saved_all, cont_all, cont_loss = saved
    if dist.get_rank() == 0:
        out["manifest_chunks"] = _manifest_chunks(out["saved_in"])
    for key, layout in case["into"].items():
        if layout == "plain":
            if dist.get_rank() == 0:
                res: dict[str, Any] = {"error": None}
                try:
                    res.update(_plain_load(mpmd.checkpoint.latest(directory), saved_all,
                                           cont_all, cont_loss))
                except Exception:
                    res["error"] = _error_text()
                out[key] = res
            dist.barrier()
        else:
            out[key] = _resume(directory, layout, saved_all, cont_all, cont_loss)
        partial_result({"ckpt3d": {case["id"]: {**out, "error": None}}})
    return out


# ------------------------------------------------------------------ meta device

def init_value(shape: torch.Size) -> torch.Tensor:
    """A full init value from the global shape only: normal(0, 0.2) from a
    generator seeded by the shape (not sharded_worker's cosine, which makes
    this GPT's LayerNorm inputs constant and its gradients rounding noise,
    which AdamW then amplifies differently in every layout)."""
    seed = 1 + sum(s * 1009 ** i for i, s in enumerate(shape))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g) * 0.2


def deterministic_init(mod: nn.Module) -> None:
    """Values from each tensor's global shape only, for a DTensor its local
    part of that full value (cut with distribute_tensor, src_data_rank=None:
    no communication)."""
    for t in list(mod._parameters.values()) + list(mod._buffers.values()):
        if t is None:
            continue
        value = init_value(t.shape)
        with torch.no_grad():
            if isinstance(t, DTensor):
                local = distribute_tensor(value.to(t.dtype), t.device_mesh, t.placements,
                                          src_data_rank=None).to_local()
                t.to_local().copy_(local)
            else:
                t.copy_(value)


def meta_init(case: dict[str, Any]) -> dict[str, Any]:
    """A TPGPT built on the meta device, the TP plan applied on meta, then
    pipelined in ``case["layout"]``: this rank's materialized bytes, and two
    AdamW steps against a reference built with the same init."""
    layout = case["layout"]
    mesh, kwargs = _layout_kwargs(layout)
    mine = _mine(mesh)
    ref = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    ref.apply(deterministic_init)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())   # tied: once
    with torch.device("meta"):
        model = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    pipe = _pipeline(model, mesh, "1f1b", init_fn=deterministic_init, **kwargs)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    res: dict[str, Any] = {"loss": [], "grads": []}
    for seed in (1, 2):
        x, y = batch(seed)
        loss = pipe.step(x[mine], target=y[mine])
        if seed == 1:
            from torch_mpmd.parallel.meta_init import is_standin

            locals_ = [p.to_local() if isinstance(p, DTensor) else p
                       for p in pipe.parameters()]
            res["local_bytes"] = sum(t.numel() * t.element_size() for t in locals_
                                     if not is_standin(t))
            res["parameter_bytes"] = pipe.parameter_bytes
            res["total_bytes"] = total
            res["still_meta"] = any(t.is_meta for t in locals_) or any(
                (p.to_local() if isinstance(p, DTensor) else p).is_meta
                for p in model.parameters())
        ref_loss = gpt_loss(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.reshape(()), ref_loss.detach()))
        res["grads"].append(worst({n: max_diff(full(p.grad), dict(
            ref.named_parameters(remove_duplicate=False))[n].grad)
            for n, p in pipe.named_parameters()}))
        replay.step(pipe)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    want = dict(replay.named_parameters())
    res["params"] = worst({n: max_diff(full(p.detach()), want[n].detach())
                           for n, p in pipe.named_parameters()})
    res["names"] = sorted(n for n, _ in pipe.named_parameters())
    res["expected_bytes"] = expected_bytes(ref, res["names"], tp=2,
                                           dp=2 if kwargs.get("data_parallel") == "shard" else 1)
    return res


_COLWISE = {m for m, style in PLAN.items() if type(style).__name__ == "ColwiseParallel"}


def expected_bytes(ref: nn.Module, names: list[str], *, tp: int, dp: int) -> int:
    """The bytes a rank holding ``names`` should hold: tensor-parallel
    parameters (column-parallel weights and biases, row-parallel weights)
    1/tp; with sharding (dp > 1) a further 1/dp, except column-parallel
    biases (every dim split over tp: replicated over dp)."""
    params = dict(ref.named_parameters(remove_duplicate=False))
    total = 0
    for n in names:
        module, _, leaf = n.rpartition(".")
        short = module.split(".", 2)[-1] if module.startswith("blocks.") else ""
        col, row = short in _COLWISE, short in PLAN and short not in _COLWISE
        numel = params[n].numel()
        if col or (row and leaf == "weight"):
            numel //= tp
        if dp > 1 and not (col and leaf == "bias"):
            numel //= dp
        total += numel * params[n].element_size()
    return total


def meta_default_init(case: dict[str, Any]) -> dict[str, Any]:
    """A meta-device TPGPT on pp2 x tp2 initialized by its modules'
    reset_parameters() (random, drawn on each rank): the tensors tp peers
    share must come out equal (plain ones, Replicate DTensors), and the tp peers' losses
    (one model, two tp ranks) must be equal. ``shards_equal``: sharded
    parameters whose tp halves came out equal (torch's generator state
    decides; reported, not checked)."""
    mesh = make_mesh({})
    tp = mesh["tp"].get_group()
    torch.manual_seed(1000 + dist.get_rank())   # ranks' generators in different states
    with torch.device("meta"):
        model = models.TPGPT(vocab=VOCAB, d=32, n_layer=4, n_head=4, block_size=SEQ)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    pipe = _pipeline(model, mesh, "1f1b")
    x, y = batch(1)
    loss = pipe.step(x, target=y).detach().reshape(1)

    def peers(t: torch.Tensor) -> list[torch.Tensor]:
        got = [torch.empty_like(t) for _ in range(dist.get_world_size(tp))]
        dist.all_gather(got, t.contiguous(), group=tp)
        return got

    res: dict[str, Any] = {"shared_differ": [], "shards_equal": []}
    for n, p in pipe.named_parameters():
        replicated = not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)
        got = peers(p.to_local() if isinstance(p, DTensor) else p.detach())
        if replicated and not torch.equal(got[0], got[1]):
            res["shared_differ"].append(n)
        if not replicated and torch.equal(got[0], got[1]):
            res["shards_equal"].append(n)
    res["sharded"] = sum(isinstance(p, DTensor) and not p.placements[0].is_replicate()
                         for p in pipe.parameters())
    losses = peers(loss)
    res["loss_spread"] = float((losses[0] - losses[1]).abs())
    return res


CASES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "checkpoints": checkpoints, "meta_init": meta_init, "meta_default_init": meta_default_init}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every case on this rank; {"ckpt3d": {case id: result (with "error")}}."""
    return run_grid(cases, CASES, key="ckpt3d")
