"""Ranks of tests/test_plan_trials.py: measured finalists (planning/trials.py)
on the example GPT, 2 gloo ranks.

"exact": ``plan="auto"`` with an AdamW built from ``pipe.parameters()``
before the first step, whose trials run real steps on the model first: the
first step's loss and every gradient equal one process, and so do the
parameters after the optimizer's step. "forced": two finalists (1F1B at
m=1 and m=8): every rank returns the same trials and the plan of the
least measured median; a second call takes the cached decision without
trials, ``trials_again=True`` runs them again. "relative": a profile whose
cached entry was measured in another launch is fitted to this launch's own
calibration (NOTE [Relative profiles]).
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torch_mpmd as mpmd
from dist_harness import run_grid
from plan_worker import _MADE, _batch, _cache, _diff, _model, loss_fn
from torch_mpmd.planning import profile as profiling


def _trials(plan: Any) -> list[dict[str, Any]]:
    return [dict(fields=[t.schedule, t.stages_per_rank, t.num_microbatches,
                         list(t.split_points)], steps=list(t.steps_s), default=t.default)
            for t in plan.search.trials]


def exact(case: dict[str, Any]) -> dict[str, Any]:
    _cache()
    model, ref = _model(), _model()
    x, y = _batch()
    pipe = mpmd.pipeline(model, loss_fn=loss_fn, plan="auto", plan_trials=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = loss_fn(ref(x), y)
    want.backward()
    got = pipe.step(x, target=y)
    refs = dict(ref.named_parameters())
    res: dict[str, Any] = {"loss": _diff(got, want)}
    res["grads"] = {n: _diff(p.grad, refs[n].grad) for n, p in pipe.named_parameters()}
    # The step itself is compared from equal gradients: AdamW's first step
    # divides a gradient by its own size, and a key bias's gradient is zero in
    # exact arithmetic, so rounding noise there would move the two copies by
    # +-lr apart. What trials could break (the optimizer's parameters, its
    # state, values left by trial steps) shows with equal gradients too.
    # A held parameter without a gradient fails above ("inf: missing") and
    # here (no gradient to copy), never skipped.
    for n, p in pipe.named_parameters():
        assert p.grad is not None, f"rank {dist.get_rank()}: {n} has no gradient"
        refs[n].grad = p.grad.detach().clone()
    opt.step()
    ref_opt.step()
    res["params"] = {n: _diff(p, refs[n]) for n, p in pipe.named_parameters()}
    # Parameters this rank does not hold were not stepped by anyone: as built.
    held = {id(p) for p in pipe.parameters()}
    untouched = _model()
    res["others"] = {n: _diff(p, dict(untouched.named_parameters())[n])
                     for n, p in model.named_parameters() if id(p) not in held}
    gc.collect()  # the trials' pipelines (and the calibration's) are freed after the choice
    res["pipelines_alive"] = sum(isinstance(o, mpmd.Pipeline) for o in gc.get_objects())
    search = pipe.config.plan.search
    res["decided_by"] = search.decided_by
    res["trials"] = _trials(pipe.config.plan)
    res["opt_params"] = sum(len(g["params"]) for g in opt.param_groups)
    res["held"] = len(held)
    return res


def forced(case: dict[str, Any]) -> dict[str, Any]:
    cache = _cache()
    model = _model()
    x, y = _batch()
    kw = dict(loss_fn=loss_fn, target=y, schedules=["1f1b"], num_microbatches=[1, 8],
              trials=2, cache_dir=cache)
    plan = mpmd.plan(model, (x,), **kw)
    res: dict[str, Any] = {"plan": [plan.schedule, plan.stages_per_rank,
                                    plan.num_microbatches, list(plan.split_points)],
                           "decided_by": plan.search.decided_by,
                           "trials": _trials(plan), "describe": plan.describe(),
                           "summary": plan.planning_summary()}
    again = mpmd.plan(model, (x,), **kw)
    res["again_equal"] = again == plan
    res["again_decided_by"] = again.search.decided_by
    res["again_trials_equal"] = _trials(again) == res["trials"]
    fresh = mpmd.plan(model, (x,), **kw, trials_again=True)
    res["fresh_decided_by"] = fresh.search.decided_by
    res["fresh_trials_differ"] = _trials(fresh) != res["trials"]
    return res


def relative(case: dict[str, Any]) -> dict[str, Any]:
    cache = _cache()
    model = _model()
    x, y = _batch()
    first = profiling.profile(model, (x,), loss_fn=loss_fn, target=y, cache_dir=cache)
    res: dict[str, Any] = {"first_action": first.action_overhead}
    if dist.get_rank() == 0:  # another launch's constants, far from this one's
        [entry] = [p for p in Path(cache).glob("*.json") if ".decision-" not in p.name]
        data = json.loads(entry.read_text())
        units = json.loads(data["units_sheet"])
        units["action_overhead"], units["step_overhead"] = 9.0, 9.0
        data["units_sheet"] = json.dumps(units)
        entry.write_text(json.dumps(data))
    dist.barrier()
    before = profiling.measurements
    second = profiling.profile(model, (x,), loss_fn=loss_fn, target=y, cache_dir=cache)
    res["measured_again"] = profiling.measurements - before
    res["second_action"] = second.action_overhead
    res["second_step"] = second.step_overhead
    res["units_equal_names"] = [u.name for u in second.units] == [u.name for u in first.units]
    return res


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return run_grid(cases, {"exact": exact, "forced": forced, "relative": relative})
    finally:
        for path in _MADE:
            shutil.rmtree(path, ignore_errors=True)


