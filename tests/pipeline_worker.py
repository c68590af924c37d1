"""Functions run inside the ranks that tests/dist_harness.py launches.

Each returns a JSON-serializable value and, where it runs many cases, catches
every case's error and reports it instead of raising, so one bad case does not
hide the others. Cases are plain dicts (see ``grid_cases``) so the pytest side
can build the same list to name its tests.
"""

from __future__ import annotations

import copy
import datetime
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from torch_mpmd.schedules import facts, schedule_names
from dist_harness import partial_result

RTOL, ATOL = 1e-5, 1e-6
COMPILED_TOL = (1e-4, 1e-5)  # Inductor fuses and reorders float arithmetic
# A model's output against the reference's, relative to the output's largest
# magnitude, not element by element: a logit near 0 is a sum of terms as large
# as the others, so its rounding is theirs. Microbatches change the matmuls'
# row counts, and MKL's AVX2 kernels sum another way for each: the GPT's logits
# (up to 35) then differ by 1 ulp of the large ones (3.8e-6) where the value is
# under 0.3, beyond RTOL elementwise; the fp32 reference itself is 8e-6 from fp64.
OUTPUT_RTOL = 1e-6
BATCH = 8
# The schedule table's schedules, each at the stages per rank it is for.
SCHEDULES = tuple(schedule_names())
STAGES_PER_RANK = {name: facts(name).typical_stages_per_rank for name in SCHEDULES}
V_SCHEDULES = tuple(name for name in SCHEDULES if facts(name).v_placement)
MICROBATCHES = (1, 2, 4, 8)
# The GPT's capture costs twice the skip model's, on every rank: on 4 ranks it runs at
# m=8 only (every schedule), while the skip model sweeps every m there. Keeps the suite
# near 3 minutes on 2 cores.
GPT_MICROBATCHES = {1: MICROBATCHES, 2: MICROBATCHES, 4: (8,)}

# Split points for each stage count; every list keeps the tied lm_head on the last stage.
GPT_SPLITS = {1: None, 2: ["blocks.1"], 4: ["blocks.0.mlp", "blocks.1", "blocks.1.mlp"],
              8: ["blocks.0.attn", "blocks.0.ln2", "blocks.0.mlp", "blocks.1",
                  "blocks.1.attn", "blocks.1.mlp", "ln_f"]}
SKIP_SPLITS = {1: None, 2: ["layers.4"], 4: ["layers.2", "layers.4", "layers.6"],
               8: [f"layers.{i}" for i in range(1, 8)]}


# ------------------------------------------------------------------ models and data

def build_model(name: str) -> torch.nn.Module:
    """The model ``name`` with parameters fixed by a seed (the same on every rank)."""
    torch.manual_seed(0)
    if name == "gpt":  # tied embedding/unembedding
        return models.CharGPT(vocab=32, d=32, n_layer=2, n_head=4, block_size=16)
    if name == "skip":  # skip connections over stage boundaries, split points
        return models.SkipChain(d=16, depth=8)
    if name == "skipnet":  # 4 stages from markers, tuple output
        return models.SkipNet(d=16)
    if name == "dropout":
        return models.DropoutMLP(d=16)
    raise ValueError(f"unknown model {name!r}")


def make_batch(name: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return (torch.randint(0, 32, (BATCH, 8), generator=g),
                torch.randint(0, 32, (BATCH, 8), generator=g))
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def skipnet_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], target) + out[1].square().mean()


def loss_fn_for(name: str):
    return {"gpt": gpt_loss, "skipnet": skipnet_loss}.get(name, F.mse_loss)


def split_points_for(name: str, num_stages: int) -> list[str] | None:
    if name == "skipnet":
        return None  # its markers fix 4 stages
    return (GPT_SPLITS if name == "gpt" else SKIP_SPLITS)[num_stages]


def expected_local_stages(schedule: str, rank: int, p: int, spr: int) -> list[int]:
    """Stage ids on ``rank``: V placement for zbv/dualpipev, else round robin."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(spr)]


def grid_cases(p: int) -> list[dict[str, Any]]:
    """Every (schedule, m, model) the schedule allows on ``p`` ranks."""
    cases = []
    for schedule in SCHEDULES:
        spr = STAGES_PER_RANK[schedule]
        for m in MICROBATCHES:
            if m < facts(schedule).min_microbatches(p):
                continue
            for model in ("gpt", "skip"):
                if model == "gpt" and m not in GPT_MICROBATCHES[p]:
                    continue
                cases.append(dict(id=f"{schedule}-p{p}-m{m}-{model}", model=model,
                                  schedule=schedule, m=m, p=p, spr=spr))
            # The marker model always has 4 stages: p * spr == 4, or all 4 on one rank
            # under the round-robin schedules.
            skipnet_spr = 4 // p
            if (p * spr == 4 or (p == 1 and schedule in ("interleaved_1f1b", "looped_bfs"))) \
                    and m in (2, 8):
                cases.append(dict(id=f"{schedule}-p{p}-m{m}-skipnet", model="skipnet",
                                  schedule=schedule, m=m, p=p, spr=skipnet_spr))
    if p == 2:  # every schedule with its stages compiled by Inductor
        for schedule in SCHEDULES:
            for model in ("gpt", "skip"):
                cases.append(dict(id=f"{schedule}-p2-m4-{model}-inductor", model=model,
                                  schedule=schedule, m=4, p=2,
                                  spr=STAGES_PER_RANK[schedule], compile="inductor"))
    return cases


# ------------------------------------------------------------------ helpers

def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fresh_group():
    """A new group over all ranks for one case: messages a failed case leaves
    behind cannot be matched by the next case's receives."""
    _, world = _rank_world()
    return dist.new_group(backend="gloo") if world > 1 else None


def _drop_group(group) -> None:
    if group is not None:
        dist.destroy_process_group(group)


def _error_text() -> str:
    text = traceback.format_exc()
    return text if len(text) < 6000 else text[:1500] + "\n...\n" + text[-4500:]


def _diff(got: torch.Tensor | None, want: torch.Tensor | None, rtol: float = RTOL,
          atol: float = ATOL) -> dict[str, Any]:
    if got is None or want is None:
        return dict(ok=False, max_abs=None,
                    why=f"grad is None (pipeline: {got is None}, reference: {want is None})")
    if got.shape != want.shape:
        return dict(ok=False, max_abs=None, why=f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    got, want = got.detach().double(), want.detach().double()
    ok = bool(torch.allclose(got, want, rtol=rtol, atol=atol))
    return dict(ok=ok, max_abs=float((got - want).abs().max()) if got.numel() else 0.0, why="")


def _canonical_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(t): n for n, t in model.named_parameters()}


def _compare_grads(pipe_params, model: torch.nn.Module, ref: torch.nn.Module,
                   tol: tuple[float, float] = (RTOL, ATOL)) -> dict[str, Any]:
    """``.grad`` of each (name, param) the pipeline holds vs the reference's of that FQN."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    canon = _canonical_names(model)
    grads, names, foreign = {}, [], []
    for name, param in pipe_params:
        if id(param) not in canon:
            foreign.append(name)  # not one of the user module's own tensors
        names.append(canon.get(id(param), name))
        if name not in ref_params:
            grads[name] = dict(ok=False, max_abs=None, why="FQN not in the reference model")
            continue
        grads[name] = _diff(param.grad, ref_params[name].grad, *tol)
    return dict(grads=grads, names=names, foreign=foreign)


# ------------------------------------------------------------------ the central grid

def run_case(case: dict[str, Any], group, timeout: float) -> dict[str, Any]:
    rank, _ = _rank_world()
    res: dict[str, Any] = dict(id=case["id"], rank=rank, error=None)
    try:
        name, p, spr = case["model"], case["p"], case["spr"]
        model = build_model(name)
        ref = copy.deepcopy(model)
        x, y = make_batch(name)
        loss_fn = loss_fn_for(name)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        res["ref_loss"] = float(ref_loss.detach())
        res["all_names"] = sorted(n for n, _ in ref.named_parameters())
        kwargs = {}
        if case["schedule"] == "interleaved_1f1b":
            kwargs["stages_per_rank"] = spr  # agrees with the split points: accepted
        compile = case.get("compile", False)
        tol = COMPILED_TOL if compile else (RTOL, ATOL)
        pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule=case["schedule"],
                             num_microbatches=case["m"],
                             split_points=split_points_for(name, p * spr),
                             group=group, timeout=timeout, compile=compile, **kwargs)
        loss = pipe.step(x, target=y)
        res["loss"] = float(loss)
        res["loss_meta"] = dict(dim=loss.dim(), requires_grad=loss.requires_grad)
        res["loss_diff"] = _diff(loss.reshape(()), ref_loss.detach(), *tol)
        res.update(_compare_grads(pipe.named_parameters(), model, ref, tol))
        view = pipe.inspect()
        res["functional"] = view.uses_programs
        if res["functional"]:
            res["memory"] = dict(
                peak_bytes=pipe.last_step_stats["peak_activation_bytes"],
                saved_bytes={s: p.saved_bytes for s, p in view.programs.items()},
                simulated_peak_forwards=pipe.schedule.simulate().peak_activations[pipe.rank])
        res["layout"] = dict(rank=pipe.rank, pp_size=pipe.pp_size, num_stages=pipe.num_stages,
                             local_stages=list(pipe.local_stages))
        res["expected_layout"] = dict(
            rank=rank, pp_size=p, num_stages=p * spr,
            local_stages=expected_local_stages(case["schedule"], rank, p, spr))
    except Exception:
        res["error"] = _error_text()
    return res


_PROGRESS: dict[str, Any] = {}


def _report(task: str, value: Any) -> None:
    """Record a task's result so far: the parent gets it even if the rank dies later."""
    _PROGRESS[task] = value
    partial_result(_PROGRESS)


def grid(cases: list[dict[str, Any]], timeout: float = 30.0, *, task: str = "grid",
         run: Any = None) -> dict[str, Any]:
    """Run every case on this rank (``run(case, group, timeout)``, default
    run_case); {case id: this rank's result}."""
    run = run or run_case
    out: dict[str, Any] = {}
    for case in cases:
        start = time.perf_counter()
        torch._dynamo.reset()
        group = _fresh_group()
        out[case["id"]] = run(case, group, timeout)
        out[case["id"]]["seconds"] = round(time.perf_counter() - start, 3)
        _drop_group(group)
        _report(task, out)
    return out


def tasks(task_list: list[list[Any]]) -> dict[str, Any]:
    """Run several worker functions in one launch (a launch costs seconds of imports).

    ``task_list``: [name, function name in this module, args...] entries, run in order;
    {name: return value, or {"error": traceback}}. Results so far survive a crash or
    a hang of a later task (see dist_harness.partial_result).
    """
    for name, func, *args in task_list:
        try:
            torch._dynamo.reset()
            value = globals()[func](*args, **({"task": name} if func == "grid" else {}))
        except Exception:
            value = {"error": _error_text()}
        _report(name, value)
    return dict(_PROGRESS)


# ------------------------------------------------------------------ other properties

def harness_smoke(extra: int) -> dict[str, Any]:
    rank, world = _rank_world()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return dict(rank=rank, world=world, sum=float(t), extra=extra,
                env={k: os.environ[k] for k in ("LOCAL_RANK", "OMP_NUM_THREADS", "MASTER_ADDR")})


def raise_on_rank(bad_rank: int) -> int:
    rank, _ = _rank_world()
    if rank == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    return rank


def hang_on_rank(bad_rank: int) -> int:
    rank, _ = _rank_world()
    partial_result({"before_hang": rank})
    if rank == bad_rank:
        import sys
        import time
        print(f"rank {rank} about to hang", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    return rank


def optimizer_trajectory(steps: int = 5, schedule: str = "1f1b", m: int = 4,
                         timeout: float = 30.0) -> dict[str, Any]:
    """Losses of ``steps`` AdamW steps, pipelined and in one process, and the final
    parameters' distance to the reference's."""
    rank, p = _rank_world()
    model = build_model("gpt")
    ref = copy.deepcopy(model)
    batches = [make_batch("gpt", seed=10 + i) for i in range(steps)]
    # eps well above fp32 noise: the key bias's exact gradient is 0 (softmax ignores it),
    # and Adam would blow its rounding noise up to lr-sized, order-dependent steps.
    opt_kwargs = dict(lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kwargs)
    ref_losses = []
    for x, y in batches:
        loss = gpt_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    pipe = mpmd.pipeline(model, loss_fn=gpt_loss, schedule=schedule, num_microbatches=m,
                         split_points=GPT_SPLITS[p], timeout=timeout)
    opt = torch.optim.AdamW(pipe.parameters(), **opt_kwargs)
    losses = []
    for x, y in batches:
        losses.append(float(pipe.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    params = {n: float((t.detach() - ref_params[n].detach()).abs().max())
              for n, t in pipe.named_parameters()}
    return dict(losses=losses, ref_losses=ref_losses, param_max_abs=params)


def forward_only(timeout: float = 30.0) -> dict[str, Any]:
    """``pipe(x)`` before and after a step, against the reference output."""
    out: dict[str, Any] = {}
    for name, schedule, spr in (("gpt", "1f1b", 1), ("skipnet", "interleaved_1f1b", 2)):
        res: dict[str, Any] = dict(error=None)
        try:
            _, p = _rank_world()
            model = build_model(name)
            ref = copy.deepcopy(model)
            x, y = make_batch(name)
            with torch.no_grad():
                want = ref(x)
            pipe = mpmd.pipeline(model, loss_fn=loss_fn_for(name), schedule=schedule,
                                 num_microbatches=4, split_points=split_points_for(name, p * spr),
                                 timeout=timeout)
            for when in ("first call", "after a step"):
                if when == "after a step":
                    pipe.step(x, target=y)
                got = pipe(x)
                res[when] = _tree_diff(got, want)
        except Exception:
            res["error"] = _error_text()
        out[name] = res
    return out


def _tree_diff(got: Any, want: Any) -> dict[str, Any]:
    """An output (a tensor, or a tuple or list of them) against the reference's,
    each tensor within OUTPUT_RTOL of its largest magnitude."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return dict(ok=False, max_abs=None, why=f"got a {type(got).__name__}")
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        return _diff(got, want, rtol=0.0, atol=ATOL + OUTPUT_RTOL * scale)
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return dict(ok=False, max_abs=None, why=f"got {type(got).__name__}, want "
                                                 f"{type(want).__name__} of {len(want)}")
    parts = [_tree_diff(g, w) for g, w in zip(got, want)]
    return dict(ok=all(d["ok"] for d in parts), max_abs=[d["max_abs"] for d in parts],
                why="; ".join(d["why"] for d in parts if d["why"]))


def dropout_losses(m: int = 4, timeout: float = 30.0) -> dict[str, Any]:
    """One step's loss and gradients under several schedules with the same seed."""
    x, y = make_batch("dropout")
    model = build_model("dropout")
    with torch.no_grad():
        eval_loss = float(F.mse_loss(copy.deepcopy(model).eval()(x), y))
    out: dict[str, Any] = dict(eval_loss=eval_loss, runs={})
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        try:
            model = build_model("dropout")
            pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, schedule=schedule,
                                 num_microbatches=m, seed=1234, timeout=timeout)
            loss = pipe.step(x, target=y)
            out["runs"][schedule] = dict(
                loss=float(loss), error=None,
                grads={n: t.grad.flatten().tolist() if t.grad is not None else None
                       for n, t in pipe.named_parameters()})
        except Exception:
            out["runs"][schedule] = dict(error=_error_text())
    return out


COMPILE_CASES = {
    "skip-m1": dict(model="skip", options={"split_points": ["layers.4"]}),
    "skip-m4": dict(model="skip", options={"split_points": ["layers.4"], "num_microbatches": 4}),
    "skip-4stages": dict(model="skip", options={"split_points": SKIP_SPLITS[4]}),
    "gpt-m1": dict(model="gpt", options={"split_points": ["blocks.1"]}),
}


def compiled(case_names: list[str]) -> dict[str, Any]:
    """torch.compile(model, backend="mpmd"): output and local-stage gradients vs eager."""
    out: dict[str, Any] = {}
    for case_name in case_names:
        case = COMPILE_CASES[case_name]
        res: dict[str, Any] = dict(error=None)
        try:
            torch._dynamo.reset()
            name = case["model"]
            model = build_model(name)
            ref = copy.deepcopy(model)
            x, y = make_batch(name)
            loss_fn = loss_fn_for(name)
            want = ref(x)
            loss_fn(want, y).backward()
            fn = torch.compile(model, backend="mpmd", options=case["options"])
            got = fn(x)
            res["output"] = _diff(got, want)
            loss_fn(got, y).backward()
            ref_params = dict(ref.named_parameters())
            res["with_grad"] = sorted(n for n, t in model.named_parameters() if t.grad is not None)
            res["grads"] = {n: _diff(t.grad, ref_params[n].grad)
                            for n, t in model.named_parameters() if t.grad is not None}
        except Exception:
            res["error"] = _error_text()
        out[case_name] = res
    return out


# ------------------------------------------------------------------ failures

def die_in_loss_fn(schedule: str, dying_rank: int, timeout: float) -> str:
    """``dying_rank`` exits (code 3) mid-step, in its first forward of the last
    stage (where the loss is computed); the others must raise PipelineError,
    which this function lets escape so the rank exits non-zero. (The loss is
    part of the last stage's program, so the rank dies in the runner.)"""
    from torch_mpmd.runtime.program_runner import ProgramRunner

    rank, p = _rank_world()
    if rank == dying_rank:
        forward = ProgramRunner.forward

        def dying_forward(self, stage, mb, inputs):
            if stage == self.num_stages - 1:
                os._exit(3)
            return forward(self, stage, mb, inputs)

        ProgramRunner.forward = dying_forward
    x, y = make_batch("skip")
    splits = SKIP_SPLITS[p * STAGES_PER_RANK[schedule]]
    pipe = mpmd.pipeline(build_model("skip"), loss_fn=F.mse_loss, schedule=schedule,
                         num_microbatches=4, split_points=splits,
                         timeout=datetime.timedelta(seconds=timeout))  # a timedelta works too
    pipe.step(x, target=y)
    return "step returned although a peer died"


BAD_ARGUMENT_CASES = {
    # name: (model, pipeline kwargs, batch size)
    "stages-not-multiple-of-pp": ("skip", dict(schedule="1f1b", num_microbatches=2,
                                               split_points=["layers.3", "layers.6"]), BATCH),
    "batch-not-divisible": ("skip", dict(schedule="1f1b", num_microbatches=3,
                                         split_points=["layers.4"]), BATCH),
    "zbv-m-below-p": ("skip", dict(schedule="zbv", num_microbatches=1,
                                   split_points=SKIP_SPLITS[4]), BATCH),
    "spr-disagrees-with-markers": ("skipnet", dict(schedule="interleaved_1f1b",
                                                   num_microbatches=2, stages_per_rank=4), BATCH),
}


def bad_arguments(case_names: list[str], timeout: float = 5.0) -> dict[str, Any]:
    """For each case: the type and message of what pipeline()+step() raised."""
    out: dict[str, Any] = {}
    for case_name in case_names:
        model_name, kwargs, batch = BAD_ARGUMENT_CASES[case_name]
        group = _fresh_group()
        try:
            x, y = make_batch(model_name)
            pipe = mpmd.pipeline(build_model(model_name), loss_fn=loss_fn_for(model_name),
                                 group=group, timeout=timeout, **kwargs)
            pipe.step(x[:batch], target=y[:batch])
            out[case_name] = dict(type=None, message="no error")
        except Exception as e:
            out[case_name] = dict(type=type(e).__name__,
                                  is_value_error=isinstance(e, ValueError), message=str(e))
        _drop_group(group)
    return out
