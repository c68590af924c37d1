"""Ranks of tests/test_sharded_dp.py: sharded data parallel (ZeRO-3) on a
("dp", "pp") mesh of 4 gloo ranks (dist_harness), against one process.

The reference is the unsplit model stepping on the global batch (the dp
replicas' batches concatenated, replica k holding rows [k*B/dp, (k+1)*B/dp)),
a mean-reduced loss, so the pipeline's global mean loss and its dp-averaged
gradients are the reference's. Every case catches its own error and reports
it (``{"error": traceback}``), so one failing case does not hide the others;
gradients, parameters and optimizer moments are compared here, in the ranks
(``DTensor.full_tensor()``, collective over each parameter's dp group), and
the results are the differences.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import models
import torch_mpmd as mpmd
from dist_harness import error_text as _error_text, partial_result, run_grid
from optim_replay import AdamWReplay, full, max_diff, step_both

RTOL, ATOL = 1e-4, 1e-5
BATCH = 8   # the global batch
M = 2       # microbatches per replica
LR = 1e-2
# AdamW's eps: the attention's key bias has a gradient of zero in exact
# arithmetic (softmax ignores a constant per query), ~1e-9 of rounding in fp32,
# which Adam's m / sqrt(v) with the default eps=1e-8 turns into steps of ~lr
# in arbitrary directions; eps=1e-5 keeps those steps below 1e-6.
EPS = 1e-5


# ------------------------------------------------------------------ models and data

class OddMLP(nn.Module):
    """Dims that do not split evenly over 2 ranks: Linear(7, 5) (5 rows),
    Linear(5, 3), a 1-row head (dp rank 1 holds no row of it), and a 0-dim
    parameter ``scale`` used in forward (Replicate)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 7)
        self.b = nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.c = nn.Linear(5, 3)
        self.d = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        h = F.gelu(self.b(h)) * self.scale
        h = F.gelu(self.c(h))
        h = F.gelu(self.d(h))
        return self.head(h)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


SPLITS = {("gpt", 2): ["blocks.2"], ("gpt", 4): ["blocks.1", "blocks.2", "blocks.3"],
          ("gpt", 1): None,
          ("mlp", 2): ["c"], ("mlp", 4): ["b", "c", "d"], ("mlp", 1): None}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":  # the unembedding tied to the embedding: stages 0 and last
        return models.CharGPT(vocab=32, d=32, n_layer=4, n_head=4, block_size=16)
    if name == "mlp":
        return OddMLP()
    raise ValueError(name)


def loss_for(name: str) -> Callable[..., torch.Tensor]:
    return gpt_loss if name == "gpt" else F.mse_loss


def batch(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return (torch.randint(0, 32, (BATCH, 16), generator=g),
                torch.randint(0, 32, (BATCH, 16), generator=g))
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def deterministic_init(mod: nn.Module) -> None:
    """Values from each tensor's shape only (as regression_worker's meta test):
    the same whatever the rank or the order."""
    for t in list(mod._parameters.values()) + list(mod._buffers.values()):
        if t is not None:
            with torch.no_grad():
                t.copy_(torch.linspace(-0.2, 0.2, t.numel()).reshape(t.shape).cos() * 0.1)


# ------------------------------------------------------------------ helpers

def make_mesh(dp: int, pp: int) -> Any:
    return init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))


def ref_params(ref: nn.Module) -> dict[str, nn.Parameter]:
    return dict(ref.named_parameters(remove_duplicate=False))


def compare_grads(pipe: Any, ref: nn.Module) -> dict[str, float]:
    want = ref_params(ref)
    return {n: max_diff(full(p.grad), want[n].grad) for n, p in pipe.named_parameters()}


def compare_params(pipe: Any, ref: nn.Module | AdamWReplay) -> dict[str, float]:
    """Each parameter against ``ref``'s (after optimizer steps: an
    AdamWReplay, see optim_replay.py)."""
    want = ref_params(ref)
    return {n: max_diff(full(p.detach()), want[n].detach()) for n, p in pipe.named_parameters()}


def replayed(replay: AdamWReplay) -> dict[str, torch.Tensor]:
    """The parameters AdamW gives from the pipeline's own gradients: what its
    shards must hold after the steps. Not the reference's after its AdamW
    steps: those amplify last-bit gradient differences by up to lr / eps (the
    embeddings' rows 7 tolerances off with MKL's AVX2 kernels)."""
    return {n: p.detach() for n, p in ref_params(replay).items()}


def worst(diffs: dict[str, float]) -> list[Any]:
    """[name, scaled difference] of the largest difference."""
    if not diffs:
        return ["<none>", float("inf")]
    name = max(diffs, key=lambda n: diffs[n])
    return [name, diffs[name]]


def expected_rows(t: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """This dp rank's rows of ``t`` as torch.chunk splits them (Shard(0))."""
    chunks = torch.chunk(t, dp, dim=0)
    return chunks[dp_rank] if dp_rank < len(chunks) else t[t.shape[0]:]


def layout(pipe: Any, values: dict[str, torch.Tensor], dp: int, dp_rank: int,
           *, exact: bool) -> dict[str, Any]:
    """Every parameter a DTensor over the dp sub-mesh with Shard(0) (0-dim:
    Replicate), of the full shape, whose local tensor is this rank's
    torch.chunk rows of ``values`` (``exact``: bit for bit)."""
    bad: list[str] = []
    local_rows: dict[str, list[int]] = {}
    for n, p in pipe.named_parameters():
        want = values[n]
        if not isinstance(p, DTensor) or not isinstance(p, nn.Parameter):
            bad.append(f"{n}: {type(p).__name__}")
            continue
        placement = (Replicate(),) if want.dim() == 0 else (Shard(0),)
        if tuple(p.placements) != placement:
            bad.append(f"{n}: placements {p.placements}")
        if tuple(p.device_mesh.mesh_dim_names or ()) != ("dp",):
            bad.append(f"{n}: mesh {p.device_mesh}")
        if tuple(p.shape) != tuple(want.shape):
            bad.append(f"{n}: shape {tuple(p.shape)}")
        local = p.to_local()
        rows = want if want.dim() == 0 else expected_rows(want, dp, dp_rank)
        if local.shape != rows.shape:
            bad.append(f"{n}: local shape {tuple(local.shape)}, want {tuple(rows.shape)}")
        elif exact and not torch.equal(local, rows):
            bad.append(f"{n}: local values differ")
        elif not exact and max_diff(local, rows) > 1:
            bad.append(f"{n}: local values differ by {max_diff(local, rows)}")
        local_rows[n] = list(local.shape[:1])
    return {"bad": bad, "local_rows": local_rows}


def _mine(dp: int, dp_rank: int) -> slice:
    share = BATCH // dp
    return slice(share * dp_rank, share * (dp_rank + 1))


def _pipeline(model: nn.Module, name: str, schedule: str, mesh: Any, pp: int, mode: str,
              spr: int | None = None, **kwargs: Any) -> Any:
    spr = spr or (2 if schedule == "interleaved_1f1b" else 1)
    extra = {"stages_per_rank": spr} if spr != 1 else {}
    return mpmd.pipeline(model, loss_fn=loss_for(name), schedule=schedule, num_microbatches=M,
                         split_points=SPLITS[(name, pp * spr)], mesh=mesh, data_parallel=mode,
                         timeout=60, **extra, **kwargs)


# ------------------------------------------------------------------ gathered bytes

@contextlib.contextmanager
def stages_under_autograd() -> Any:
    """Every stage built meanwhile runs on the runner's autograd path (its
    fallback for stages that cannot become programs), forced."""
    from torch_mpmd.runtime import program_runner
    from torch_mpmd.programs.stage_programs import ProgramsUnsupported

    build = program_runner.build_stage_programs

    def refuse(*_: Any, **__: Any) -> Any:
        raise ProgramsUnsupported("forced: the stages run under autograd")

    program_runner.build_stage_programs = refuse
    try:
        yield
    finally:
        program_runner.build_stage_programs = build


class GatheredProbe:
    """The bytes of a sharded pipeline's gathered parameters alive on this
    rank, seen from outside ShardedStages: after each gather (``ready``) the
    storages the stage's compute parameters then use are remembered by weak
    reference, so a storage that anything keeps alive (tensors saved for
    backward included) still counts, with the bytes it holds when read. They
    are read when a compute action starts (before its own gather) and right
    after every RESHARD. Call ``reset()`` before each step.

    ``peak``: the most bytes of all local stages' gathered storages together
    at the start of a compute action; ``waiting[s]``: the most bytes of stage
    s's own when another stage starts a compute action while s waits for its
    backward (its forwards all done, no B or I begun; absent when that never
    happens); ``waiting_total``: the most bytes of all stages' together at
    those points; ``after_reshard[s]``: s's bytes right after each RESHARD."""

    def __init__(self, pipe: Any) -> None:
        view = pipe.inspect()
        self.runner = view.runner
        self.params = {s: [getattr(p, "_local_tensor", p) for p in stage.parameters()]
                       for s, stage in view.stages.items()}
        self.full_bytes = {s: sum(t.numel() * t.element_size() for t in ts)
                           for s, ts in self.params.items()}
        # Bytes of s's parameters that another local stage reads too (tied weights).
        self.shared_bytes = {s: sum(t.numel() * t.element_size() for t in ts if any(
            t is u for o, us in self.params.items() if o != s for u in us))
            for s, ts in self.params.items()}
        self.storages: dict[int, list[Any]] = {}
        self.reset()
        for name in ("forward", "backward", "backward_weight"):  # called by name per action
            setattr(self.runner, name, self._compute(name, getattr(self.runner, name)))
        dp = view.data_parallel
        ready, reshard = dp.ready, dp.reshard

        def on_ready(stage: int) -> None:
            from torch.multiprocessing.reductions import StorageWeakRef

            ready(stage)
            self.storages[stage] = [StorageWeakRef(t.untyped_storage())
                                    for t in self.params[stage]]

        def on_reshard(stage: int) -> None:
            reshard(stage)
            self.after_reshard[stage].append(self.live([stage]))

        dp.ready, dp.reshard = on_ready, on_reshard

    def reset(self) -> None:
        self.peak = self.waiting_total = 0
        self.waiting: dict[int, int] = {}
        self.after_reshard: dict[int, list[int]] = {s: [] for s in self.params}
        self.forwards = {s: 0 for s in self.params}
        self.backward_begun: set[int] = set()

    def live(self, stages: Any) -> int:
        """Bytes of the stages' gathered storages now (each storage once)."""
        refs = {r.cdata: r for s in stages for r in self.storages.get(s, ()) if not r.expired()}
        return sum(torch.UntypedStorage._new_with_weak_ptr(c).nbytes() for c in refs)

    def _compute(self, kind: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def call(stage: int, *args: Any) -> Any:
            total = self.live(self.params)
            self.peak = max(self.peak, total)
            for s in self.params:
                if s != stage and self.forwards[s] == self.runner.num_microbatches \
                        and s not in self.backward_begun:
                    self.waiting[s] = max(self.waiting.get(s, 0), self.live([s]))
                    self.waiting_total = max(self.waiting_total, total)
            if kind == "forward":
                self.forwards[stage] += 1
            else:
                self.backward_begun.add(stage)
            return run(stage, *args)
        return call

    def report(self) -> dict[str, Any]:
        return {"full_bytes": self.full_bytes, "shared_bytes": self.shared_bytes,
                "peak": self.peak, "waiting": self.waiting,
                "waiting_total": self.waiting_total, "after_reshard": self.after_reshard}


# ------------------------------------------------------------------ training cases

_SEEN: dict[tuple[str, str, str], dict[str, Any]] = {}  # losses and full gradients per run


def train(case: dict[str, Any]) -> dict[str, Any]:
    """Two AdamW steps of the pipeline (``case``: model, schedule, mode and
    pipeline keywords; ``autograd``: its stages under autograd) against the
    reference: losses, every gradient after each step, every parameter after
    both, and the DTensor layout before the first step and after the last;
    with "shard", the gathered bytes of the second step (GatheredProbe)."""
    if case.get("autograd"):
        with stages_under_autograd():
            return _train(case)
    return _train(case)


def _train(case: dict[str, Any]) -> dict[str, Any]:
    name, schedule, mode = case["model"], case["schedule"], case.get("mode", "shard")
    dp, pp = 2, 2
    mesh = make_mesh(dp, pp)
    dp_rank = mesh.get_local_rank("dp")
    mine = _mine(dp, dp_rank)
    model = build(name)
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in ref_params(ref).items()}
    pipe = _pipeline(model, name, schedule, mesh, pp, mode, case.get("spr"),
                     **case.get("kwargs", {}))
    res: dict[str, Any] = {}
    if mode == "shard":
        res["layout_before"] = layout(pipe, initial, dp, dp_rank, exact=True)
        res["listed_before"] = len(list(pipe.parameters()))
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)   # built before the first step
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    loss_fn = loss_for(name)
    seen = {"losses": [], "grads": []}
    res["loss"], res["grads"] = [], []
    probe = None
    for seed in (1, 2):
        x, y = batch(name, seed)
        loss = pipe.step(x[mine], target=y[mine])
        if mode == "shard" and probe is None:  # watches the next step
            probe = GatheredProbe(pipe)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.reshape(()), ref_loss.detach()))
        diffs = compare_grads(pipe, ref)
        res["grads"].append(worst(diffs))
        seen["losses"].append(loss.detach().clone())
        seen["grads"].append({n: full(p.grad).clone() for n, p in pipe.named_parameters()})
        res["grad_types"] = sorted({type(p.grad).__name__ for p in pipe.parameters()})
        replay.step(pipe)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    res["params"] = worst(compare_params(pipe, replay))
    res["names"] = sorted(n for n, _ in pipe.named_parameters())
    res["all_names"] = sorted(n for n, _ in ref.named_parameters())   # tied: once
    res["num_parameters"] = len(list(ref.parameters()))
    res["local_stages"] = list(pipe.local_stages)
    res["listed_after"] = len(list(pipe.parameters()))
    res["param_types"] = sorted({type(p).__name__ for p in pipe.parameters()})
    if mode == "shard":   # against the replay's values, as "params" (optim_replay.py)
        res["layout_after"] = layout(pipe, replayed(replay), dp, dp_rank, exact=False)
        res["optimizer_state_types"] = sorted(
            {type(v).__name__ for p in pipe.parameters() for k, v in opt.state[p].items()
             if k != "step"})
    res["functional"] = pipe.inspect().uses_programs
    # The step's peak of gathered full parameters (0 unless sharded) and its
    # bound: every local stage's full parameters at once.
    res["peak_gathered_bytes"] = pipe.last_step_stats["peak_gathered_bytes"]
    res["peak_held_bytes"] = pipe.last_step_stats["peak_held_bytes"]
    res["peak_live_bytes"] = pipe.last_step_stats["peak_live_bytes"]
    res["stages_full_bytes"] = sum(p.numel() * p.element_size()
                                   for stage in pipe.inspect().stages.values()
                                   for p in stage.parameters())
    if probe is not None:
        res["probe"] = probe.report()
        res["gathered_peak_bytes"] = pipe.last_step_stats["collectives"]["gathered_peak_bytes"]
    # The sum of the tied embedding's gradient over pp and dp (tied.py).
    res["tied"] = pipe.last_step_stats.get("collectives", {}).get("tied_all_reduce")
    res["tied_bytes"] = sum(p.numel() * p.element_size() for n, p in ref.named_parameters()
                            if n == "wte.weight")
    res["actions"] = pipe.schedule.action_text[pipe.rank]
    res["action_fields"] = [(a.stage, mpmd.schedules.kind_name(a.kind))
                            for a in pipe.schedule.actions[pipe.rank]]
    _SEEN[(name, schedule, mode)] = seen
    other = _SEEN.get((name, schedule, "shard" if mode == "replicate" else "replicate"))
    if other is not None:   # replicate vs shard, full tensors
        res["vs_other_mode"] = {
            "loss": max(max_diff(a, b) for a, b in zip(seen["losses"], other["losses"])),
            "grads": max(max_diff(g[n], o.get(n)) for g, o in zip(seen["grads"], other["grads"])
                         for n in g)}
    return res


def train_tp(case: dict[str, Any]) -> dict[str, Any]:
    """Sharded over "dp" with tensor-parallel blocks (tp_worker's TPGPT and
    plan) on a ("dp", "tp") = (2, 2) mesh, both stages on every rank (no pp;
    ``case``'s pipeline keywords): two AdamW steps against one process, and
    the gathered bytes of the second step (GatheredProbe; the compute
    parameters of the blocks are DTensors, their local shards gathered, and
    the tied embedding is read by both stages)."""
    import tp_worker as T

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mine = T._mine(mesh)
    model, ref = T.build(mesh)
    pipe = mpmd.pipeline(model, loss_fn=T.gpt_loss, schedule=case["schedule"],
                         num_microbatches=T.M, split_points=T.SPLITS[2], stages_per_rank=2,
                         mesh=mesh, data_parallel="shard", timeout=60, **case.get("kwargs", {}))
    opt = torch.optim.AdamW(pipe.parameters(), lr=T.LR, eps=T.EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=T.LR, eps=T.EPS)
    replay = AdamWReplay(ref, lr=T.LR, eps=T.EPS)
    res: dict[str, Any] = {"loss": [], "grads": []}
    probe = None
    for seed in (1, 2):
        x, y = T.batch(seed)
        loss = pipe.step(x[mine], target=y[mine])
        probe = probe or GatheredProbe(pipe)
        ref_loss = T.gpt_loss(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.reshape(()), ref_loss.detach()))
        res["grads"].append(worst(T.compare_grads(pipe, ref)))
        replay.step(pipe)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    res["params"] = worst(T.compare_params(pipe, replay))
    res["local_stages"] = list(pipe.local_stages)
    view = pipe.inspect()
    res["functional"] = view.uses_programs
    res["dtensor_compute"] = sum(isinstance(p, DTensor) for stage in view.stages.values()
                                 for p in stage.parameters())
    res["probe"] = probe.report()
    res["gathered_peak_bytes"] = pipe.last_step_stats["collectives"]["gathered_peak_bytes"]
    return res


def clip_eval(case: dict[str, Any]) -> dict[str, Any]:
    """Two steps without zero_grad (gradients accumulate), clip_grad_norm_(0.1)
    against torch's on the reference, eval_step and the pipeline call against
    the reference, then one more step (after the forward-only runs)."""
    name = case["model"]
    dp, pp = 2, 2
    mesh = make_mesh(dp, pp)
    dp_rank = mesh.get_local_rank("dp")
    mine = _mine(dp, dp_rank)
    model = build(name)
    ref = copy.deepcopy(model)
    pipe = _pipeline(model, name, case["schedule"], mesh, pp, "shard")
    loss_fn = loss_for(name)
    res: dict[str, Any] = {}
    for seed in (1, 2):
        x, y = batch(name, seed)
        pipe.step(x[mine], target=y[mine])
        loss_fn(ref(x), y).backward()
    res["accumulated_grads"] = worst(compare_grads(pipe, ref))
    norm = pipe.clip_grad_norm_(0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    res["norm"] = max_diff(norm.reshape(()), ref_norm)
    res["norm_value"] = float(norm)
    res["ref_norm_value"] = float(ref_norm)
    res["clipped_grads"] = worst(compare_grads(pipe, ref))
    before = {n: full(p.grad).clone() for n, p in pipe.named_parameters()}

    x, y = batch(name, 3)
    with torch.no_grad():
        ref_eval = loss_fn(ref(x), y)
        ref_out = ref(x[mine])
    ev = pipe.eval_step(x[mine], target=y[mine])
    res["eval"] = max_diff(ev.reshape(()), ref_eval)
    res["eval_kept_grads"] = max(max_diff(full(p.grad), before[n])
                                 for n, p in pipe.named_parameters())
    out = pipe(x[mine])
    res["forward"] = max_diff(out, ref_out)
    # A step after the forward-only runs: whatever they gathered was freed.
    pipe.zero_grad()
    ref.zero_grad()
    x, y = batch(name, 4)
    loss = pipe.step(x[mine], target=y[mine])
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    res["step_after"] = max_diff(loss.reshape(()), ref_loss.detach())
    res["grads_after"] = worst(compare_grads(pipe, ref))
    return res


def meta_init(case: dict[str, Any]) -> dict[str, Any]:
    """A CharGPT built on the meta device, sharded: this rank's bytes, and two
    AdamW steps against a reference built with the same (deterministic) init."""
    name = "gpt"
    dp, pp = 2, 2
    mesh = make_mesh(dp, pp)
    dp_rank = mesh.get_local_rank("dp")
    mine = _mine(dp, dp_rank)
    ref = build(name)
    ref.apply(deterministic_init)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())   # tied: once
    with torch.device("meta"):
        model = models.CharGPT(vocab=32, d=32, n_layer=4, n_head=4, block_size=16)
    pipe = _pipeline(model, name, case["schedule"], mesh, pp, "shard",
                     init_fn=deterministic_init)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    res: dict[str, Any] = {"loss": [], "grads": []}
    for seed in (1, 2):
        x, y = batch(name, seed)
        loss = pipe.step(x[mine], target=y[mine])
        if seed == 1:
            from torch_mpmd.parallel.meta_init import is_standin

            res["local_bytes"] = sum(
                p.to_local().numel() * p.to_local().element_size()
                for p in pipe.parameters() if not is_standin(p.to_local()))
            res["parameter_bytes"] = pipe.parameter_bytes
            res["total_bytes"] = total
            res["still_meta"] = any(t.is_meta for t in model.parameters()) or any(
                p.to_local().is_meta for p in pipe.parameters())
        ref_loss = gpt_loss(ref(x), y)
        ref_loss.backward()
        res["loss"].append(max_diff(loss.reshape(()), ref_loss.detach()))
        res["grads"].append(worst(compare_grads(pipe, ref)))
        replay.step(pipe)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    res["params"] = worst(compare_params(pipe, replay))
    res["layout_after"] = layout(pipe, replayed(replay), dp, dp_rank, exact=False)
    return res


CASES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "train": train, "train_tp": train_tp, "clip_eval": clip_eval, "meta_init": meta_init}


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every case on this rank; {case id: result (with "error")}."""
    return run_grid(cases, CASES)


# ------------------------------------------------------------------ checkpoints

def _state_of(pipe: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stages hold and its AdamW moments, full."""
    out: dict[str, torch.Tensor] = {}
    for n, p in pipe.named_parameters():
        out[n] = full(p.detach()).clone()
        for stat in ("exp_avg", "exp_avg_sq"):
            if stat in opt.state.get(p, {}):
                out[f"{n} {stat}"] = full(opt.state[p][stat]).clone()
    return out


def _plain_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():   # a tied weight under its first name, as pipelines
        out[n] = p.detach().clone()
        for stat in ("exp_avg", "exp_avg_sq"):
            if stat in opt.state.get(p, {}):
                out[f"{n} {stat}"] = opt.state[p][stat].clone()
    return out


def _compare_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                    ) -> dict[str, Any]:
    """Exact equality of ``got``'s entries with ``want``'s (names missing from
    ``want`` are listed)."""
    unequal = [k for k, v in got.items() if k in want and not torch.equal(v, want[k])]
    return {"compared": len([k for k in got if k in want]), "unequal": unequal[:10],
            "unknown": [k for k in got if k not in want][:10],
            "moments": len([k for k in got if k.endswith("exp_avg") and k in want])}


def checkpoints(directory: str) -> dict[str, Any]:
    """Save from pp2 x dp2 shard after two AdamW steps (and take a third step:
    the continuation); load into (a) pp2 x dp2 shard, (b) pp2 x dp2
    replicate, (c) pp1 x dp4 shard, (d) on rank 0, a plain module and AdamW
    through DCP alone; each loaded state equals the saved one and one more
    step equals the continuation."""
    rank = dist.get_rank()
    name = "gpt"
    out: dict[str, Any] = {}
    x3, y3 = batch(name, 3)

    # ---- the run that saves
    mesh = make_mesh(2, 2)
    mine = _mine(2, mesh.get_local_rank("dp"))
    model = build(name)
    ref = copy.deepcopy(model)
    pipe = _pipeline(model, name, "1f1b", mesh, 2, "shard")
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    # Gradients against the reference's; the saved and continued parameters
    # and moments against AdamW replayed on the pipeline's gradients.
    replay = AdamWReplay(ref, lr=LR, eps=EPS)
    out["grads_vs_ref"] = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss, worst_diff = step_both(pipe, opt, ref, ropt, replay, x, y, mine, gpt_loss)
        out["grads_vs_ref"].append(worst_diff)
        return loss

    for seed in (1, 2):
        train_step(*batch(name, seed))
    try:
        out["saved_in"] = mpmd.checkpoint.save(pipe, opt, directory)
        out["save_error"] = None
    except Exception:
        out["save_error"] = _error_text()
        return out
    saved = _state_of(pipe, opt)
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {k: v for k, v in saved.items()})
    saved_all: dict[str, torch.Tensor] = {}
    for part in everything:
        saved_all.update(part)
    ref_saved = _plain_state(replay, replay.optimizer)
    out["saved_vs_ref"] = max(max_diff(v, ref_saved[k]) for k, v in saved_all.items())
    # The continuation: one more step from the saved state.
    loss3 = train_step(x3, y3)
    cont = _state_of(pipe, opt)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {"loss": float(loss3), "state": cont})
    cont_all: dict[str, torch.Tensor] = {}
    for part in everything:
        cont_all.update(part["state"])
    cont_loss = everything[0]["loss"]
    out["continuation_vs_ref"] = max(
        max_diff(v, _plain_state(replay, replay.optimizer)[k]) for k, v in cont_all.items())
    dist.barrier()

    def resume(key: str, dp: int, pp: int, mode: str, capture_first: bool) -> None:
        res: dict[str, Any] = {"error": None}
        try:
            mesh = make_mesh(dp, pp)
            dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
            mine = _mine(dp, dp_rank)
            model = build(name)
            with torch.no_grad():   # other weights: everything must come from the checkpoint
                for p in model.parameters():
                    p.normal_()
            pipe = _pipeline(model, name, "1f1b", mesh, pp, mode)
            opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
            if capture_first:
                x, y = batch(name, 9)
                pipe.step(x[mine], target=y[mine])
                opt.zero_grad()
            got = mpmd.checkpoint.load(pipe, opt, directory)
            res["step"] = got["step"]
            res["loaded"] = _compare_states(_state_of(pipe, opt), saved_all)
            res["types"] = sorted({type(p).__name__ for p in pipe.parameters()})
            loss = pipe.step(x3[mine], target=y3[mine])
            opt.step()
            opt.zero_grad()
            res["loss"] = abs(float(loss) - cont_loss)
            after = _state_of(pipe, opt)
            res["continued"] = worst({k: max_diff(v, cont_all[k]) for k, v in after.items()})
        except Exception:
            res["error"] = _error_text()
        out[key] = res
        partial_result(out)

    resume("a_pp2_dp2_shard", 2, 2, "shard", capture_first=False)
    resume("b_pp2_dp2_replicate", 2, 2, "replicate", capture_first=True)
    resume("c_pp1_dp4_shard", 4, 1, "shard", capture_first=True)
    resume("c_pp4_dp1_shard", 1, 4, "shard", capture_first=False)

    if rank == 0:   # (d): one process, torch.distributed.checkpoint only
        res = {"error": None}
        try:
            res.update(_plain_load(mpmd.checkpoint.latest(directory), saved_all, cont_all,
                                   cont_loss, x3, y3))
        except Exception:
            res["error"] = _error_text()
        out["d_plain_module"] = res
    dist.barrier()
    return out


def _plain_load(target: str, saved_all: dict[str, torch.Tensor],
                cont_all: dict[str, torch.Tensor], cont_loss: float,
                x3: torch.Tensor, y3: torch.Tensor) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model = build("gpt")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"model": model.state_dict(),
             "optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=target, no_dist=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=options)
    res: dict[str, Any] = {"loaded": _compare_states(_plain_state(model, opt), saved_all)}
    loss = gpt_loss(model(x3), y3)
    loss.backward()
    opt.step()
    res["loss"] = abs(float(loss) - cont_loss)
    res["continued"] = worst({k: max_diff(v, cont_all[k])
                              for k, v in _plain_state(model, opt).items() if k in cont_all})
    return res


# ------------------------------------------------------------------ a rank dies

def die_in_all_gather(timeout: float) -> dict[str, Any]:
    """pp2 x dp2 shard, 1f1b: a first step; at the second, global rank 3
    (dp 1, pp 1) exits as it is about to post its stage's all-gather. The
    others' outcome: the exception's type and message, and how long it took."""
    from torch_mpmd.parallel.sharding import ShardedStages

    rank = dist.get_rank()
    mesh = make_mesh(2, 2)
    mine = _mine(2, mesh.get_local_rank("dp"))
    model = build("mlp")
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=M,
                         split_points=SPLITS[("mlp", 2)], mesh=mesh, data_parallel="shard",
                         timeout=timeout)
    x, y = batch("mlp", 1)
    pipe.step(x[mine], target=y[mine])
    out: dict[str, Any] = {"rank": rank, "first_step": True}
    partial_result(out)
    if rank == 3:
        def unshard(self: Any, stage: int) -> None:
            os._exit(3)

        ShardedStages.unshard = unshard  # type: ignore[method-assign]
    dist.barrier()
    start = time.monotonic()
    try:
        pipe.step(x[mine], target=y[mine])
        out["raised"] = None
    except BaseException as e:  # noqa: BLE001  (reported to the test)
        out["raised"] = type(e).__name__
        out["message"] = str(e)[:6000]
    out["seconds"] = time.monotonic() - start
    partial_result(out)
    return out


class MixedDtypeNet(nn.Module):
    """One stage whose parameters mix fp32 and bf16 (each gathered and
    reduced in its own flat buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w32 = nn.Parameter(torch.randn(8, 1) * 0.1 + 1.0 / 3)
        self.w16 = nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16) @ self.w16).float() @ self.w32


def mixed_dtypes(mode: str | None) -> dict[str, Any]:
    """dp2 of MixedDtypeNet, sharded (or ``mode``) against one process: loss,
    gradients (their dtypes and values, bf16 within its precision)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MixedDtypeNet()
    ref = MixedDtypeNet()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=1, mesh=mesh,
                         data_parallel=mode or "shard", timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    loss = pipe.step(x[2 * rank:2 * rank + 2], target=y[2 * rank:2 * rank + 2])
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    want = dict(ref.named_parameters())
    return {"loss": [float(loss), float(ref_loss)],
            "grads": {n: [str(p.grad.dtype),
                          float((full(p.grad).float() - want[n].grad.float()).abs().max()),
                          float(want[n].grad.float().abs().max())]
                      for n, p in pipe.named_parameters()}}
