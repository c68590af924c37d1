"""Ranks of tests/test_plan_auto.py: ``mpmd.plan`` (profile + search, collective)
and ``pipeline(plan=...)`` / ``plan="auto"`` on the example GPT, 2 gloo ranks.

Per schedule case: a plan forced to that schedule (``schedules=[s]``), the
plan's JSON on every rank, one step of ``pipeline(plan=plan)`` against one
process (loss and every gradient), a second ``mpmd.plan`` call (the profile
cache: no measurement), ``plan="auto"`` with the same constraint (its
plan, programs and split equal the explicit plan's), ``pipeline(plan=<JSON
text>)``, and ``pipe.replan()``. The "limits" case: a user constraint
(num_microbatches=4) kept, an infeasible memory_limit's error, a
contradicting setting's error, a plan recomputing stage 0 (exact, fewer
bytes held there) and recompute= naming no submodule. The "compiled" case:
the profile's calibration runs the programs compiled as ``compile=`` says.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid
from torch_mpmd.planning import Plan
from torch_mpmd.planning import profile as profiling

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

V = 32
RTOL, ATOL = 1e-5, 1e-6


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=4, n_head=2, d_model=16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (8, 16), generator=g), torch.randint(0, V, (8, 16), generator=g)


_MADE: list[str] = []


def _cache() -> str:
    """One cache directory per case, the same name on every rank (rank 0 uses it),
    also for plan="auto" (MPMD_PROFILE_CACHE)."""
    box = [tempfile.mkdtemp(prefix="mpmd_profiles_") if dist.get_rank() == 0 else None]
    if box[0] is not None:
        _MADE.append(box[0])
    dist.broadcast_object_list(box, src=0)
    os.environ["MPMD_PROFILE_CACHE"] = box[0]
    return box[0]


def _diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| scaled so that <= 1 is within tolerance; inf when missing."""
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    got, want = got.detach().double(), want.detach().double()
    return float(((got - want).abs() / (ATOL + RTOL * want.abs())).max())


def _train_and_compare(pipe: Any, ref: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                       ) -> dict[str, Any]:
    ref.zero_grad()
    want = loss_fn(ref(x), y)
    want.backward()
    got = pipe.step(x, target=y)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    return {"loss": _diff(got, want),
            "grads": {n: _diff(p.grad, ref_grads[n])
                      for n, p in pipe.named_parameters(remove_duplicate=False)}}


def _program(pipe: Any) -> list[str]:
    return [str(a) for a in pipe.inspect().actions["step"]]


def train(case: dict[str, Any]) -> dict[str, Any]:
    cache = _cache()
    model = _model()
    ref = copy.deepcopy(model)
    x, y = _batch()
    res: dict[str, Any] = {}
    before = profiling.measurements
    plan = mpmd.plan(model, (x,), loss_fn=loss_fn, target=y, schedules=[case["schedule"]],
                     cache_dir=cache)
    res["plan"] = plan.to_dict() | {"search": None}
    res["describe"] = plan.describe()
    res["units"] = [u.name for u in plan.sheet.units]
    again = mpmd.plan(model, (x,), loss_fn=loss_fn, target=y, schedules=[case["schedule"]],
                      cache_dir=cache)
    res["measured"] = profiling.measurements - before  # rank 0: 1 (the second call loads)
    res["again_equal"] = again == plan
    res["round_trip"] = Plan.from_json(plan.to_json()) == plan

    pipe = mpmd.pipeline(model, loss_fn=loss_fn, plan=plan)
    res["config"] = [pipe.config.schedule, pipe.config.num_microbatches,
                     pipe.config.stages_per_rank, list(pipe.config.split_points)]
    res["step"] = _train_and_compare(pipe, ref, x, y)
    res["program"] = _program(pipe)
    res["split"] = pipe.describe()
    pipe.step(x, target=y)
    best, sentence = pipe.replan()
    res["replan"] = [best.to_dict() | {"search": None}, sentence]

    # plan="auto" with the same constraint: profiled from the cache, the same plan.
    auto_model = _model()
    before = profiling.measurements
    auto = mpmd.pipeline(auto_model, loss_fn=loss_fn, plan="auto", schedule=case["schedule"])
    res["auto_step"] = _train_and_compare(auto, copy.deepcopy(_model()), x, y)
    res["auto_measured"] = profiling.measurements - before
    res["auto_plan_equal"] = auto.config.plan == plan
    res["auto_plan"] = auto.config.plan.to_dict() | {"search": None}
    res["auto_program_equal"] = _program(auto) == res["program"]
    res["auto_split_equal"] = auto.describe() == res["split"]

    # The plan's JSON text as the setting.
    text = mpmd.pipeline(_model(), loss_fn=loss_fn, plan=plan.to_json())
    res["json_config_equal"] = text.config == pipe.config
    return res


def dataclasses_replace(config: Any, **changes: Any) -> Any:
    import dataclasses
    return dataclasses.replace(config, **changes)


def limits(case: dict[str, Any]) -> dict[str, Any]:
    cache = _cache()
    model = _model()
    x, y = _batch()
    res: dict[str, Any] = {}
    plan = mpmd.plan(model, (x,), loss_fn=loss_fn, target=y, num_microbatches=4,
                     cache_dir=cache)
    res["m"] = plan.num_microbatches
    auto = mpmd.pipeline(_model(), loss_fn=loss_fn, plan="auto", num_microbatches=4)
    auto.step(x, target=y)
    res["auto_m"] = auto.num_microbatches
    try:
        mpmd.plan(model, (x,), loss_fn=loss_fn, target=y, memory_limit=1000, cache_dir=cache)
        res["infeasible"] = None
    except ValueError as e:
        res["infeasible"] = str(e)
    try:
        mpmd.pipeline(model, loss_fn=loss_fn, plan=plan, num_microbatches=2)
        res["contradiction"] = None
    except ValueError as e:
        res["contradiction"] = str(e)
    # A plan that recomputes stage 0: its units' activations are computed
    # again in backward (fewer bytes held), and the step is exact.
    plain = mpmd.pipeline(_model(), loss_fn=loss_fn, plan=plan)
    plain.step(x, target=y)
    recomputing = dataclasses_replace(plan, recompute=(True,) + plan.recompute[1:])
    ref = _model()
    pipe = mpmd.pipeline(_model(), loss_fn=loss_fn, plan=recomputing)
    res["recompute_step"] = _train_and_compare(pipe, ref, x, y)
    res["held"] = [plain.last_step_stats["peak_activation_bytes"],
                   pipe.last_step_stats["peak_activation_bytes"]]
    res["stage0_local"] = 0 in pipe.inspect().local_stages
    try:
        mpmd.pipeline(_model(), loss_fn=loss_fn, num_microbatches=4,
                      recompute=["blocks.9"]).step(x, target=y)
        res["unknown"] = None
    except ValueError as e:
        res["unknown"] = str(e)
    return res


def refined(case: dict[str, Any]) -> dict[str, Any]:
    """A GPT whose head (an 8192-word vocabulary) costs more than a balanced
    stage: the profile cuts the unit after the blocks at the head (NOTE
    [Refined units]); a plan cutting there, and one recomputing both stages,
    train like one process."""
    cache = _cache()

    def wide() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=2, n_head=2, d_model=32))

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 8192, (8, 16), generator=g), torch.randint(0, 8192, (8, 16), generator=g)
    sheet = mpmd.profile(wide(), (x,), loss_fn=loss_fn, target=y, cache_dir=cache)
    res: dict[str, Any] = {"units": [u.name for u in sheet.units]}
    # The search's own choice (trials=0): it prices the refined units. Trials
    # would let the machine's timing pick among near-equal splits.
    plan = mpmd.plan(wide(), (x,), loss_fn=loss_fn, target=y, cache_dir=cache,
                     schedules=["1f1b"], num_microbatches=2, trials=0)
    forced = mpmd.planning.evaluate_plan(sheet, "1f1b", num_microbatches=2,
                                         split_points=["head"])
    res["plan"] = plan.split_points
    for name, chosen in (("best", plan), ("at_head", forced),
                         ("at_head_recompute", dataclasses_replace(forced,
                                                                   recompute=(True, True)))):
        pipe = mpmd.pipeline(wide(), loss_fn=loss_fn, plan=chosen)
        res[name] = _train_and_compare(pipe, wide(), x, y)
        res[name]["held"] = pipe.last_step_stats["peak_activation_bytes"]
    return res


def hf_llama(case: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face Llama (its units: the embedding, the decoder layers, the
    final norm with the head), planned with its keyword input and trained
    with the plan like one process."""
    from token_worker import tiny_llama

    _cache()

    def hf_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)
    plan = mpmd.plan(tiny_llama(), (x,), {"use_cache": False}, loss_fn=hf_loss, target=y)
    pipe = mpmd.pipeline(tiny_llama(), loss_fn=hf_loss, plan=plan)
    ref = tiny_llama()
    want = hf_loss(ref(x, use_cache=False), y)
    want.backward()
    got = pipe.step(x, use_cache=False, target=y)
    grads = dict(ref.named_parameters())
    return {"units": [u.name for u in plan.sheet.units], "plan": plan.to_dict() | {"search": None},
            "loss": _diff(got, want),
            "grads": {n: _diff(p.grad, grads[n].grad)
                      for n, p in pipe.named_parameters(remove_duplicate=False)}}


def door(case: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(fn, backend="mpmd", options={"plan": "auto", ...})``: the
    first training call profiles and plans (the schedule option kept as a
    constraint) and trains like one process; a second call runs the same
    plan without profiling again; a first call without grad is refused."""
    _cache()
    model = _model()
    ref = copy.deepcopy(model)
    x, y = _batch()
    pair = case.get("loss") == "pair"
    if pair:
        for i in range(y.shape[0]):  # sample i keeps i + 1 labelled positions
            y[i, i + 1:] = -100

    def loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        total = F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                reduction="sum" if pair else "mean")
        return (total, (y != -100).sum()) if pair else total

    options = {"plan": "auto", **case.get("options", {})}
    res: dict[str, Any] = {}
    cold = torch.compile(lambda x, y: loss(model, x, y), backend="mpmd", options=options)
    try:
        with torch.no_grad():
            cold(x, y)
        res["no_grad_first"] = None
    except ValueError as e:
        res["no_grad_first"] = str(e)

    try:  # a compiled module returns its logits, not a loss to plan from
        torch.compile(_model(), backend="mpmd", options=options)(x)
        res["module_first"] = None
    except ValueError as e:
        res["module_first"] = str(e)

    @torch.compile(backend="mpmd", options=options)
    def train_loss(x: torch.Tensor, y: torch.Tensor) -> Any:
        return loss(model, x, y)

    def check(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        ref.zero_grad()
        model.zero_grad()
        want = loss(ref, x, y)
        (want[0] / want[1] if pair else want).backward()
        got = train_loss(x, y)
        (got[0] / got[1] if pair else got).backward()
        want_loss, got_loss = (want[0], got[0]) if pair else (want, got)
        owned = {n for n, _ in mpmd.pipeline_of(train_loss).named_parameters()}
        ref_grads = dict(ref.named_parameters())
        return {"loss": _diff(got_loss.detach(), want_loss.detach()),
                "grads": {n: _diff(p.grad, ref_grads[n].grad)
                          for n, p in model.named_parameters() if n in owned},
                "stray": sorted(n for n, p in model.named_parameters()
                                if n not in owned and p.grad is not None)}

    before = profiling.measurements
    res["first"] = check(x, y)
    res["measured"] = profiling.measurements - before
    pipe = mpmd.pipeline_of(train_loss)
    res["plan"] = pipe.config.plan.to_dict() | {"search": None}
    res["config"] = [pipe.config.schedule, pipe.config.num_microbatches,
                     pipe.config.stages_per_rank, list(pipe.config.split_points)]
    g = torch.Generator().manual_seed(7)
    x2 = torch.randint(0, V, x.shape, generator=g)
    before = profiling.measurements
    res["second"] = check(x2, y)
    res["measured_again"] = profiling.measurements - before
    res["same_pipeline"] = mpmd.pipeline_of(train_loss) is pipe
    return res


def compiled(case: dict[str, Any]) -> dict[str, Any]:
    """``mpmd.plan(compile=compiler)`` with a compiler that runs each graph as
    it is and counts its calls: the profile's calibration pipeline runs the
    compiled programs (NOTE [Fitted action overhead]: it fits the runtime's
    costs around the programs the plan will run), and the plan trains with
    them like one process; so do the trials' pipelines."""
    from torch_mpmd.planning import calibrate, trials

    calls = {"profile": 0, "calibration": 0, "trials": 0}
    phase = ["profile"]

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            calls[phase[0]] += 1
            return gm(*args)
        return run

    def calibration(*args: Any, **kwargs: Any) -> Any:
        phase[0] = "calibration"
        try:
            return calibrate.measure_runtime(*args, **kwargs)
        finally:
            phase[0] = "profile"

    def run_trials(*args: Any, **kwargs: Any) -> Any:
        phase[0] = "trials"
        try:
            return real_trials(*args, **kwargs)
        finally:
            phase[0] = "profile"

    cache = _cache()
    x, y = _batch()
    real, profiling.measure_runtime = profiling.measure_runtime, calibration
    real_trials, trials.run_trials = trials.run_trials, run_trials
    try:
        plan = mpmd.plan(_model(), (x,), loss_fn=loss_fn, target=y, cache_dir=cache,
                         compile=compiler)
    finally:
        profiling.measure_runtime, trials.run_trials = real, real_trials
    res: dict[str, Any] = {"calls": dict(calls)}
    pipe = mpmd.pipeline(_model(), loss_fn=loss_fn, plan=plan, compile=compiler)
    res["step"] = _train_and_compare(pipe, _model(), x, y)
    res["step_calls"] = calls["profile"] - res["calls"]["profile"]
    return res


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return run_grid(cases, {"train": train, "limits": limits, "door": door,
                               "refined": refined, "hf_llama": hf_llama,
                               "compiled": compiled})
    finally:
        for path in _MADE:  # rank 0 made them
            shutil.rmtree(path, ignore_errors=True)
