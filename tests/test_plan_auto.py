"""mpmd.plan and pipeline(plan=...): a profile measured once (cached), the same
plan on every rank, a plan that trains exactly like one process for the
schedules it picks, plan="auto" equal to the explicit plan, constraints and
limits kept (tests/plan_worker.py, 2 gloo ranks); and profile() in one
process (units, bytes, the cache key)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import GridRun
from torch_mpmd.planning import profile as profiling

SCHEDULES = ["1f1b", "zbv"]
SCHEDULES4 = ["interleaved_1f1b", "zbv"]  # pipeline size 4
# The compile door with options={"plan": "auto"}: a mean loss with a schedule
# constraint, and a (sum, count) pair planned freely.
DOOR = [dict(id="door-mean-1f1b", kind="door", options={"schedule": "1f1b"}),
        dict(id="door-pair", kind="door", loss="pair")]
CASES = ([dict(id=s, kind="train", schedule=s) for s in SCHEDULES]
         + [dict(id="limits", kind="limits"), dict(id="refined", kind="refined"),
            dict(id="hf_llama", kind="hf_llama"), dict(id="compiled", kind="compiled")]
         + DOOR)
_GRID = GridRun(2, "plan_worker:grid", CASES, task="plans", timeout=600)


_GRID4 = GridRun(4, "plan_worker:grid", [dict(id=s, kind="train", schedule=s) for s in SCHEDULES4],
                 task="plans on 4 ranks", timeout=400)


def _check_trained_plan(results: list[dict[str, Any]], schedule: str) -> None:
    """Every rank's plan is the same, runs as planned, trains exactly like one
    process (its own step and plan="auto"'s), and the profile was measured once."""
    r0 = results[0]
    for rank, r in enumerate(results):
        assert r["plan"] == r0["plan"], (rank, r["plan"], r0["plan"])
        assert r["config"] == [schedule, r0["plan"]["num_microbatches"],
                               r0["plan"]["stages_per_rank"], r0["plan"]["split_points"]]
    assert r0["plan"]["schedule"] == schedule and not any(r0["plan"]["recompute"])
    # The profile's units: the model's own, and finer ones inside a block
    # where whole blocks do not balance (NOTE [Refined units]); the plan cuts
    # only at units.
    assert {"tok", "ln_f"} | {f"blocks.{i}" for i in range(4)} <= set(r0["units"]), r0["units"]
    assert set(r0["plan"]["split_points"]) <= set(r0["units"]), r0["plan"]["split_points"]
    for rank, r in enumerate(results):
        for key in ("step", "auto_step"):
            assert r[key]["loss"] <= 1, f"rank {rank} {key}: loss off by {r[key]['loss']}"
            assert r[key]["grads"], f"rank {rank} {key}: holds no parameter"
            bad = {n: d for n, d in r[key]["grads"].items() if d > 1}
            assert not bad, f"rank {rank} {key}: gradients off (inf: missing): {bad}"
        assert r["round_trip"] and r["json_config_equal"] and r["again_equal"]
        assert r["auto_plan_equal"], (rank, r["auto_plan"], r["plan"], r["auto_measured"])
        assert r["auto_program_equal"], f"rank {rank}: plan='auto' runs other actions"
        assert r["auto_split_equal"], f"rank {rank}: plan='auto' split otherwise"
        assert r["replan"] == r0["replan"]
    # The profile is measured once, on rank 0; the second plan and "auto" load it.
    assert [r["measured"] for r in results] == [1] + [0] * (len(results) - 1)
    assert all(r["auto_measured"] == 0 for r in results)
    assert r0["replan"][1].startswith(("the current plan", "a different plan")), r0["replan"][1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_plan_is_the_same_on_every_rank_and_trains_like_one_process(schedule):
    _check_trained_plan(_GRID.results(schedule), schedule)


@pytest.mark.parametrize("schedule", SCHEDULES4)
def test_a_plan_on_four_pipeline_ranks_trains_like_one_process(schedule):
    # Every stage of every rank is checked against one process, for schedules
    # of one stage per rank, of loops and of V shapes at p = 4.
    results = _GRID4.results(schedule)
    assert len({r["plan"]["stages_per_rank"] for r in results}) == 1
    _check_trained_plan(results, schedule)


def test_constraints_and_limits():
    for rank, r in enumerate(_GRID.results("limits")):
        assert r["m"] == 4 and r["auto_m"] == 4, (rank, r["m"], r["auto_m"])
        assert r["infeasible"] and "no plan fits memory_limit=" in r["infeasible"] and \
            "smallest predicted peak" in r["infeasible"], r["infeasible"]
        assert r["contradiction"] and "num_microbatches=2 contradicts the plan's " \
            "num_microbatches=4" in r["contradiction"], r["contradiction"]
        step = r["recompute_step"]
        assert step["loss"] <= 1, f"rank {rank}: recomputing plan's loss off by {step['loss']}"
        bad = {n: d for n, d in step["grads"].items() if d > 1}
        assert step["grads"] and not bad, f"rank {rank}: recomputing plan's gradients {bad}"
        if r["stage0_local"]:  # the rank holding stage 0 holds fewer bytes for backward
            plain, recomputing = ({int(k): v for k, v in h.items()} for h in r["held"])
            assert recomputing[0] < plain[0], r["held"]
        assert r["unknown"] and "recompute names ['blocks.9'], which are not submodules" in \
            r["unknown"], r["unknown"]


def test_a_compiled_plan_is_calibrated_on_its_compiled_programs():
    for rank, r in enumerate(_GRID.results("compiled")):
        # Every rank's calibration stage ran compiled programs; rank 0 also
        # profiled the units with them.
        assert r["calls"]["calibration"] > 0, (rank, r["calls"])
        assert r["calls"]["trials"] > 0, (rank, r["calls"])  # the finalists ran compiled
        assert (r["calls"]["profile"] > 0) == (rank == 0), (rank, r["calls"])
        assert r["step_calls"] > 0, rank
        step = r["step"]
        assert step["loss"] <= 1, f"rank {rank}: loss off by {step['loss']}"
        bad = {n: d for n, d in step["grads"].items() if d > 1}
        assert step["grads"] and not bad, f"rank {rank}: gradients {bad}"


def _whole(units: list[str]) -> list[str]:
    """The units that are no other unit's submodule (the profile's first
    units, before any is refined)."""
    return [u for u in units if not any(u.startswith(v + ".") for v in units)]


def test_a_unit_costing_more_than_a_stage_is_cut_at_its_head():
    r0, r1 = _GRID.results("refined")
    # The last unit is cut at its head (and the blocks, too coarse for two
    # ranks' V stages, at their attention and MLP: units.coarse).
    assert _whole(r0["units"]) == ["tok", "blocks.0", "blocks.1", "ln_f", "head"], r0["units"]
    assert r0["units"][-2:] == ["ln_f", "head"], r0["units"]
    assert r0["plan"] == r1["plan"] == ["head"], (r0["plan"], r1["plan"])
    for rank, r in enumerate((r0, r1)):
        for name in ("best", "at_head", "at_head_recompute"):
            step = r[name]
            assert step["loss"] <= 1, f"rank {rank} {name}: loss off by {step['loss']}"
            bad = {n: d for n, d in step["grads"].items() if d > 1}
            assert step["grads"] and not bad, f"rank {rank} {name}: gradients {bad}"
    # Stage 0 (everything before the head) recomputes: it holds fewer bytes.
    plain, recomputing = r0["at_head"]["held"], r0["at_head_recompute"]["held"]
    assert recomputing["0"] < plain["0"], (plain, recomputing)


def test_a_hugging_face_llama_is_planned_and_trains_like_one_process():
    r0, r1 = _GRID.results("hf_llama")
    assert _whole(r0["units"]) == ["model.embed_tokens"] + \
        [f"model.layers.{i}" for i in range(4)] + ["model.norm"], r0["units"]
    assert r0["plan"] == r1["plan"], (r0["plan"], r1["plan"])
    for rank, r in enumerate((r0, r1)):
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']}"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert r["grads"] and not bad, f"rank {rank}: gradients (inf: missing) {bad}"


@pytest.mark.parametrize("case", DOOR, ids=[c["id"] for c in DOOR])
def test_plan_auto_through_the_mpmd_backend(case):
    r0, r1 = _GRID.results(case["id"])
    assert r0["plan"] == r1["plan"] and r0["config"] == r1["config"], (r0["plan"], r1["plan"])
    if "schedule" in case.get("options", {}):
        assert r0["config"][0] == case["options"]["schedule"], r0["config"]
    for rank, r in enumerate((r0, r1)):
        assert r["no_grad_first"] and "chooses the plan at the first training call" in \
            r["no_grad_first"], r["no_grad_first"]
        assert r["module_first"] and "returns 1 output(s) that are not its loss" in \
            r["module_first"], r["module_first"]
        for call in ("first", "second"):
            step = r[call]
            assert step["loss"] <= 1, f"rank {rank} {call}: loss off by {step['loss']}"
            bad = {n: d for n, d in step["grads"].items() if d > 1}
            assert step["grads"] and not bad, f"rank {rank} {call}: gradients (inf: missing) {bad}"
            assert not step["stray"], f"rank {rank}: gradients on parameters it does not hold"
        assert r["same_pipeline"] and r["measured_again"] == 0, (rank, r["measured_again"])
    assert (r0["measured"], r1["measured"]) == (1, 0)  # rank 0 profiles, once


# ------------------------------------------------------------------ one process


def _gpt(n_layer: int = 3):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=n_layer, n_head=2, d_model=16))


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class _HFLike(nn.Module):
    """Hugging Face's layout: model.embed_tokens, model.layers (a ModuleList), lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, 16)
        self.model.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                          for _ in range(3))
        self.model.extra = nn.ModuleList([nn.Identity(), nn.Identity()])  # a smaller list
        self.lm_head = nn.Linear(16, 32)

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h)


def test_profile_finds_the_blocks_and_measures_positive_costs(tmp_path):
    model = _gpt()
    x, y = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    # The embeddings, the blocks, and the final norm with the head (given
    # units are measured as given: only the default ones are refined).
    assert profiling.find_units(model) == ["tok", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    sheet = mpmd.profile(model, (x,), loss_fn=_ce, target=y, cache_dir=tmp_path, pp_size=2,
                         repeats=2, units=profiling.find_units(model))
    assert [u.name for u in sheet.units] == ["tok", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    assert sheet.global_batch == 4 and sheet.pp_size == 2 and sheet.reference_microbatch == 1
    for u in sheet.units:
        assert u.forward > 0 and u.backward_input + u.backward_weight > 0, u
        assert u.saved_bytes > 0 and u.param_bytes > 0, u
    # What crosses a cut: one microbatch's residual stream, (1, 16, 16) float32.
    assert [u.output_bytes for u in sheet.units] == [1024.0] * 4 + [0.0]
    assert sheet.units[0].param_bytes == (32 + 16) * 16 * 4  # token and position embeddings
    assert sheet.units[4].param_bytes == (16 + 16 + 16 * 32) * 4  # ln_f and the head
    assert sheet.input_bytes == 16 * 8  # int64 ids
    hf = _HFLike()
    units = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
             "lm_head"]
    assert profiling.find_units(hf) == units
    s2 = mpmd.profile(hf, (x,), loss_fn=_ce, target=y, cache_dir=False, repeats=1)
    assert [u.name for u in s2.units] == units
    assert s2.units[-2].param_bytes == (16 * 16 + 16) * 4  # layer 2
    assert s2.units[-1].param_bytes == (16 * 32 + 32) * 4  # lm_head
    with pytest.raises(ValueError, match="no nn.ModuleList or nn.Sequential of blocks"):
        profiling.find_units(nn.Sequential(nn.Linear(2, 2)))


def test_a_block_cut_into_units_keeps_about_the_bytes_of_the_whole_block():
    """The inputs a unit's forward keeps for backward (a LayerNorm's, a
    Linear's) are new bytes where an earlier unit of the stage makes them
    (``saved_input_bytes``): a stage holding a block cut into units holds
    about what it holds of the whole block (within 4% here; without them,
    its predicted peak came out 12% short)."""
    model, x, y = _gpt(2), torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    whole = mpmd.profile(model, (x,), loss_fn=_ce, target=y, cache_dir=False, repeats=1,
                         pp_size=2, units=["tok", "blocks.0", "blocks.1", "ln_f"])
    fine = mpmd.profile(model, (x,), loss_fn=_ce, target=y, cache_dir=False, repeats=1,
                        pp_size=2, units=["tok", "blocks.0", "blocks.0.attn", "blocks.0.ln2",
                                          "blocks.0.mlp", "blocks.1", "ln_f"])
    kept = {u.name: u.saved_input_bytes for u in fine.units}
    assert kept["tok"] == 0 and kept["blocks.0.attn"] > 0 and kept["blocks.0.mlp"] > 0, kept

    def stage0(sheet: Any) -> float:  # rank 0's stage: the embedding and block 0
        plan = mpmd.planning.evaluate_plan(sheet, "1f1b", num_microbatches=4,
                                           split_points=["blocks.1"])
        return plan.predicted_peak_bytes[0]

    assert abs(stage0(fine) / stage0(whole) - 1) < 0.05, (stage0(fine), stage0(whole))
    bare = dataclasses.replace(fine, units=tuple(dataclasses.replace(u, saved_input_bytes=0.0)
                                                 for u in fine.units))
    assert stage0(bare) < stage0(fine), (stage0(bare), stage0(fine))


def test_profile_cache_is_reused_and_keyed_by_shapes(tmp_path, monkeypatch):
    model = _gpt(2)
    x, y = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    monkeypatch.setenv("MPMD_PROFILE_CACHE", str(tmp_path))
    before = profiling.measurements
    a = mpmd.profile(model, (x,), loss_fn=_ce, target=y, repeats=1)
    b = mpmd.profile(model, (x,), loss_fn=_ce, target=y, repeats=1)
    assert a == b and profiling.measurements == before + 1
    assert len(list(tmp_path.glob("*.json"))) == 1
    key = dict(loss_fn=_ce, units=profiling.find_units(model), sizes=[1], compile=False,
               pp_size=1, device="cpu")
    k1 = profiling.profile_key(model, (x,), {}, y, **key)
    assert k1 == profiling.profile_key(model, (x.clone(),), {}, y, **key)
    assert k1 != profiling.profile_key(model, (x[:, :8],), {}, y[:, :8], **key)
    assert k1 != profiling.profile_key(_gpt(3), (x,), {}, y, **key)
    assert k1 != profiling.profile_key(model, (x,), {}, y, **{**key, "compile": True})
    mpmd.profile(model, (x[:, :8],), loss_fn=_ce, target=y[:, :8], repeats=1)
    assert profiling.measurements == before + 2


def test_recompute_checkpoints_the_named_modules_during_capture_only():
    import torch

    from torch_mpmd.graph.recompute import checkpointed, stage_modules

    model = _gpt(3)
    calls = []
    original = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return original(fn, *args, **kwargs)

    x = torch.randint(0, 32, (2, 8))
    torch.utils.checkpoint.checkpoint = spy
    try:
        with checkpointed(model, ["blocks.0", "blocks.2"]):
            assert "forward" in model.blocks[0].__dict__
            model(x)
        model(x)
    finally:
        torch.utils.checkpoint.checkpoint = original
    assert calls == [False, False]  # two modules, inside the block only
    assert "forward" not in model.blocks[0].__dict__
    with pytest.raises(ValueError, match=r"recompute names \['nope'\]"):
        with checkpointed(model, ["nope"]):
            pass
    units = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert stage_modules(units, ["blocks.2"], [False, True]) == ["blocks.2", "blocks.3"]
    assert stage_modules(units, ["blocks.1", "blocks.3"], [True, False, True]) == \
        ["blocks.0", "blocks.3"]
    with pytest.raises(ValueError, match="split point 'head' is not one of the units"):
        stage_modules(units, ["head"], [True, False])


def test_inner_cuts_follow_the_call_order_one_level_down():
    from torch_mpmd.planning.units import call_order, inner_cuts, refine, too_big

    model = _gpt(2)
    x = torch.randint(0, 32, (1, 16))
    order = call_order(model, (x,), {})
    units = profiling.find_units(model)
    assert units == ["tok", "blocks.0", "blocks.1", "ln_f"]
    assert inner_cuts(model, order, "blocks.0", "blocks.1") == \
        ["blocks.0.attn", "blocks.0.ln2", "blocks.0.mlp"]  # not ln1: it starts with the block
    assert inner_cuts(model, order, "ln_f", None) == ["head"]
    assert inner_cuts(model, order, "tok", "blocks.0") == ["pos"]
    assert refine(model, order, units, [1, 3]) == \
        ["tok", "blocks.0", "blocks.0.attn", "blocks.0.ln2", "blocks.0.mlp", "blocks.1", "ln_f",
         "head"]
    assert too_big([1.0, 5.0, 1.0, 1.0], 2) == [1] and too_big([1.0, 1.0], 2) == []

    class Block(nn.Module):  # registers its norm after the MLP and calls it first
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Linear(4, 4)
            self.attn = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def forward(self, h):
            return self.mlp(self.attn(self.norm(h)))

    net = nn.Module()
    net.layers = nn.ModuleList([Block(), Block()])
    net.forward = lambda h: net.layers[1](net.layers[0](h))
    order = call_order(net, (torch.randn(2, 4),), {})
    assert inner_cuts(net, order, "layers.0", "layers.1") == ["layers.0.attn", "layers.0.mlp"]


def test_coarse_units_are_the_ones_holding_a_balanced_boundary() -> None:
    from torch_mpmd.planning.units import coarse

    # An embedding, 8 like blocks and a head as heavy as a block: 2 ranks
    # split 5:4 blocks at best (11% over a half), 4 stages 3:2:2:2; the
    # boundaries at a quarter, a half and three quarters fall inside
    # blocks 2, 4 and 6 (units 3, 5, 7).
    assert coarse([0.25] + [4.5] * 8 + [4.36], 2) == [3, 5, 7]
    assert coarse([1.0] * 8, 2) == []                  # 4:4 and 2:2:2:2 balance
    assert coarse([1.0] * 9, 2) == [2, 4, 6]           # 5:4 and 3:2:2:2 do not
    assert coarse([1.0] * 9, 2, tolerance=0.5) == []   # within a loose tolerance
    assert coarse([1.0, 1.0, 1.0], 4) == [] and coarse([2.0], 2) == []
    assert coarse([1.0] * 9, 1) == []                  # one rank
    assert coarse([1.0, 0.0, 1.0, 1.0], 2) == [0, 2, 3]  # never the empty unit (at 1.0)


def test_recompute_of_stages_cut_inside_a_unit():
    from torch_mpmd.graph.recompute import stage_modules

    units = ["tok", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "ln_f", "head"]
    # blocks.0 is cut at its MLP: stage 0 checkpoints the attention, not the whole block.
    assert stage_modules(units, ["blocks.0.mlp", "ln_f"], [True, True, False]) == \
        ["tok", "blocks.0.attn", "blocks.0.mlp", "blocks.1"]
    assert stage_modules(units, ["blocks.1"], [True, False]) == ["tok", "blocks.0"]
    # A plan's nested split point on the static units (a plan read from JSON).
    assert stage_modules(["blocks.0", "blocks.1"], ["blocks.0.mlp"], [False, True]) == \
        ["blocks.0.mlp", "blocks.1"]


class _LateNorm(nn.Module):
    """OPT's order: the final norm registered before the blocks, run after them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(16, 8), nn.LayerNorm(8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def test_a_plan_read_from_json_recomputes_the_units_of_its_stages_in_call_order():
    # A plan from JSON carries no profile: its units are found again, the
    # final norm after the blocks (it runs there), so recomputing the last
    # stage checkpoints it, and the first stage's recompute does not.
    from torch_mpmd.planning import Plan

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    x = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    for flags, want in (((False, True), ["blocks.2", "blocks.3", "norm"]),
                        ((True, False), ["emb", "blocks.0", "blocks.1"])):
        plan = Plan(schedule="interleaved_1f1b", num_microbatches=2, stages_per_rank=2,
                    split_points=("blocks.2",), recompute=flags, predicted_step_s=0.0,
                    predicted_peak_bytes=(0.0,))
        torch.manual_seed(0)
        model = _LateNorm()
        ref = copy.deepcopy(model)
        pipe = mpmd.pipeline(model, loss_fn=loss, plan=Plan.from_json(plan.to_json()))
        assert pipe.session.recompute_modules((x[:1],), {}) == want
        got = pipe.step(x, target=x)
        want_loss = loss(ref(x), x)
        want_loss.backward()
        torch.testing.assert_close(got, want_loss.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_the_fitted_action_overhead_predicts_the_calibration_run():
    from torch_mpmd.planning import CostSheet, Unit, evaluate_plan
    from torch_mpmd.planning.calibrate import RuntimeCosts, fit_sheet

    units = [Unit(f"blocks.{i}", 1e-3, 1e-3, 1e-3, forward_fixed=1e-4) for i in range(4)]
    sheet = CostSheet(units=units, global_batch=8, pp_size=2, reference_microbatch=2,
                      action_overhead=0.0, step_overhead=1e-3, link_latency=1e-4)

    def step(overhead: float) -> float:
        return evaluate_plan(dataclasses.replace(sheet, action_overhead=overhead), "1f1b",
                             num_microbatches=4, split_points=["blocks.2"]).predicted_step_s

    # A run that took what 300 us per action predicts: the fit finds 300 us.
    costs = RuntimeCosts(action_overhead=5e-5, step_overhead=1e-3, transfer_latency=1e-4,
                         split_points=("blocks.2",), num_microbatches=4, step_wall=step(3e-4))
    fitted = fit_sheet(sheet, costs, batch=8)
    assert fitted.action_overhead == pytest.approx(3e-4, rel=1e-6)
    assert fitted.units == sheet.units
    # A run faster than the timelines' own reading predicts: that reading stays.
    costs = dataclasses.replace(costs, step_wall=step(0.0))
    assert fit_sheet(sheet, costs, batch=8).action_overhead == pytest.approx(5e-5)
    assert fit_sheet(sheet, dataclasses.replace(costs, num_microbatches=0), batch=8) is sheet
    # The run's compute actions took 1.2x what the profile predicts of them
    # (4 microbatches of 2 samples, the reference: 4 units x 3 ms each): the
    # units' times, fixed parts included, scale by 1.2 before the fit.
    slow = fit_sheet(sheet, dataclasses.replace(costs, compute_seconds=1.2 * 4 * 4 * 3e-3),
                     batch=8)
    assert [u.forward for u in slow.units] == pytest.approx([1.2e-3] * 4)
    assert [u.forward_fixed for u in slow.units] == pytest.approx([1.2e-4] * 4)


def test_unit_times_are_fitted_with_their_fixed_parts():
    # 0.2 ms whatever the size, 0.5 ms per sample: at 4 samples 2.2 ms, 0.2 of it fixed.
    assert profiling._affine([2.2e-3, 1.2e-3], [4, 2], 4) == pytest.approx((2.2e-3, 0.2e-3))
    # A line below the origin: no fixed part, the line through the origin.
    total, fixed = profiling._affine([2.0e-3, 0.8e-3], [4, 2], 4)
    assert fixed == 0.0 and total == pytest.approx(4 * (2.0e-3 * 4 + 0.8e-3 * 2) / 20)
    assert profiling._affine([1e-3], [4], 4) == (1e-3, 0.0)
    assert profiling._sizes(None, 16, 2) == [4, 2] and profiling._sizes(None, 3, 2) == [1, 3]
    from torch_mpmd.planning import Unit
    with pytest.raises(ValueError, match=r"forward_fixed=0.002 must be at most units\[0\]"):
        mpmd.planning.CostSheet(units=[Unit("a", 1e-3, 0, 0, forward_fixed=2e-3)],
                                global_batch=1, pp_size=1)
