"""Sharded data parallel (ZeRO-3, ``pipeline(..., data_parallel="shard")``) on
a ("dp", "pp") = (2, 2) mesh of 4 gloo ranks, against one process stepping
the unsplit model on the global batch (tests/sharded_worker.py).

Three launches: the training grid (schedules, replicate vs shard,
reshard_after_forward and the gathered bytes it frees, on FX and Inductor
programs, under autograd and with tensor-parallel DTensors on a ("dp", "tp")
mesh, Inductor, clip/eval/forward, a meta-device model), the
checkpoints (saved sharded, loaded sharded, replicated, on another mesh and
into a plain module through DCP alone), and a rank dying at its all-gather.
Differences come back scaled by the fp32 tolerance (atol 1e-5, rtol 1e-4):
a value <= 1 is within it.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import models
import sharded_worker as W
import torch_mpmd as mpmd
from dist_harness import GridRun, run_ranks

DP, PP = 2, 2
SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")


def _cases() -> list[dict]:
    cases = [dict(id=f"train-{model}-{schedule}", kind="train", model=model, schedule=schedule)
             for model in ("gpt", "mlp") for schedule in SCHEDULES]
    # After the shard runs of the same model and schedule: compared with them.
    cases += [dict(id=f"replicate-{model}-1f1b", kind="train", model=model, schedule="1f1b",
                   mode="replicate") for model in ("gpt", "mlp")]
    cases += [
        # Two stages per rank: another stage's compute runs between a stage's
        # forwards and its backwards, so its parameters are freed in between
        # (stage programs, and the autograd path).
        dict(id="reshard_after_forward-gpt-gpipe", kind="train", model="gpt", schedule="gpipe",
             spr=2, kwargs={"reshard_after_forward": True}),
        dict(id="reshard_after_forward-gpt-gpipe-autograd", kind="train", model="gpt",
             schedule="gpipe", spr=2, kwargs={"reshard_after_forward": True}, autograd=True),
        # Inductor programs; OddMLP's 0-dim ``scale`` (one element, replicated).
        dict(id="reshard_after_forward-mlp-gpipe-inductor", kind="train", model="mlp",
             schedule="gpipe", spr=2, kwargs={"reshard_after_forward": True, "compile": True}),
        # DTensor compute parameters (tensor parallel), dp2 x tp2, both stages
        # on every rank (looped_bfs: 0F 0F 1F 1F 1B 1B 0B 0B): the tied
        # embedding is read by both.
        dict(id="reshard_after_forward-tp-looped_bfs", kind="train_tp", schedule="looped_bfs",
             kwargs={"reshard_after_forward": True}),
        dict(id="clip_eval-gpt-1f1b", kind="clip_eval", model="gpt", schedule="1f1b"),
        dict(id="meta_init-gpt-1f1b", kind="meta_init", schedule="1f1b"),
        dict(id="compile-mlp-1f1b", kind="train", model="mlp", schedule="1f1b",
             kwargs={"compile": True}),
    ]
    return cases


CASES = _cases()
_GRID = GridRun(DP * PP, "sharded_worker:grid", CASES, task="sharded", timeout=400)


def dp_rank(rank: int) -> int:
    return rank // PP   # the mesh is (dp, pp): global rank = dp * PP + pp


def pp_rank(rank: int) -> int:
    return rank % PP


def check_training(got: list[dict]) -> None:
    """Losses and every gradient (full tensors) of both steps, and the
    parameters after two AdamW steps, equal the reference's."""
    for rank, r in enumerate(got):
        assert all(d <= 1 for d in r["loss"]), (rank, r["loss"])
        for step, (name, d) in enumerate(r["grads"]):
            assert d <= 1, f"rank {rank} step {step}: gradient of {name} off by {d} tolerances"
        name, d = r["params"]
        assert d <= 1, f"rank {rank}: parameter {name} off by {d} tolerances after 2 steps"
    # Every parameter is somewhere, and this rank's stages' only after capture.
    assert set().union(*(r["names"] for r in got)) == set(got[0]["all_names"])
    for r in got:
        assert len(r["names"]) == r["listed_after"] < r["num_parameters"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_sharded_training_equals_one_process(model, schedule):
    got = _GRID.results(f"train-{model}-{schedule}")
    check_training(got)
    for rank, r in enumerate(got):
        # Before the first step: all of the module's parameters, as DTensor
        # shards (Shard(0); 0-dim: Replicate) holding torch.chunk's rows.
        assert r["listed_before"] == r["num_parameters"]
        assert not r["layout_before"]["bad"], (rank, r["layout_before"]["bad"])
        assert not r["layout_after"]["bad"], (rank, r["layout_after"]["bad"])
        assert r["optimizer_state_types"] == ["DTensor"]
        assert r["param_types"] == ["DTensor"] and r["grad_types"] == ["DTensor"]
        # last_step_stats: the gathered storages' peak (ShardedStages.report's
        # too), at most every local stage's full parameters at once.
        assert 0 < r["peak_gathered_bytes"] <= r["stages_full_bytes"], \
            (rank, r["peak_gathered_bytes"], r["stages_full_bytes"])
        if "gathered_peak_bytes" in r:
            assert r["peak_gathered_bytes"] == r["gathered_peak_bytes"], rank
        # The bytes beyond the shards at once: at least a gathered stage's,
        # at most held + gathered + every local stage's full gradients.
        assert r["peak_live_bytes"] > 0, rank
        assert r["peak_live_bytes"] <= r["peak_held_bytes"] + r["peak_gathered_bytes"] + \
            r["stages_full_bytes"], (rank, r["peak_live_bytes"], r["peak_held_bytes"],
                                     r["peak_gathered_bytes"], r["stages_full_bytes"])
        if model == "mlp":   # uneven dim 0 over dp=2: ceil(rows / 2) on dp rank 0
            rows = r["layout_before"]["local_rows"]
            want = {"a.weight": [4, 3], "b.weight": [3, 2], "b.bias": [3, 2],
                    "c.weight": [2, 1], "head.weight": [1, 0], "head.bias": [1, 0],
                    "scale": [None, None]}
            for name, per_dp in want.items():
                expected = [] if per_dp[dp_rank(rank)] is None else [per_dp[dp_rank(rank)]]
                assert rows[name] == expected, (rank, name, rows[name])
    check_tied_sum(model, got)


def check_tied_sum(model: str, got: list[dict]) -> None:
    """The gpt's embedding, tied to its head, lives on both pipeline ranks; its
    gradient is summed over pp and averaged over dp by one all-reduce over
    all four ranks, posted by the REDUCE_GRAD of the stage that reads it (the
    first stage on pp rank 0, the last on pp rank 1), never after the step."""
    for rank, r in enumerate(got):
        if model != "gpt":
            assert r["tied"] is None, (rank, r["tied"])
            continue
        assert "wte.weight" in r["names"], (rank, r["names"])
        stage = min(r["local_stages"]) if pp_rank(rank) == 0 else max(r["local_stages"])
        assert r["tied"] == {"count": 1, "bytes": r["tied_bytes"],
                             "posted_by": [f"{stage}REDUCE_GRAD"],
                             "groups": [[0, 1, 2, 3]]}, (rank, r["tied"])
        assert f"{stage}REDUCE_GRAD" in r["actions"]


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_replicate_and_shard_give_the_same_losses_and_gradients(model):
    got = _GRID.results(f"replicate-{model}-1f1b")
    check_training(got)
    for rank, r in enumerate(got):
        assert r["param_types"] == ["Parameter"] and r["grad_types"] == ["Tensor"]
        assert r["peak_gathered_bytes"] == 0, rank   # nothing gathered
        assert r["peak_live_bytes"] == r["peak_held_bytes"], rank
        assert "vs_other_mode" in r, "the shard run of this case did not finish first"
        assert r["vs_other_mode"]["loss"] <= 1 and r["vs_other_mode"]["grads"] <= 1, \
            (rank, r["vs_other_mode"])
    check_tied_sum(model, got)


def gathered_bytes_while_waiting(r: dict) -> tuple[int, int, int, int, int]:
    """(bytes of the rank's first stage's gathered parameters alive while it
    waits for its backward, their full size, the part of them the other
    local stage reads too, all of the rank's gathered bytes alive then, the
    other stage's full size), from the worker's GatheredProbe over the second
    step (a rank's first stage's forwards end before its other stage
    computes, its backwards begin after)."""
    probe = r["probe"]
    first, other = (str(s) for s in r["local_stages"])
    return (probe["waiting"][first], probe["full_bytes"][first], probe["shared_bytes"][first],
            probe["waiting_total"], probe["full_bytes"][other])


def test_without_reshard_after_forward_a_stage_keeps_its_parameters_while_others_compute():
    """The control of the next test: the probe sees the gathered bytes a
    stage keeps, here the whole of them."""
    for rank, r in enumerate(_GRID.results("train-gpt-interleaved_1f1b")):
        own, full, _, total, other = gathered_bytes_while_waiting(r)
        assert own == full > 0 and total == full + other, (rank, r["probe"])
        assert r["gathered_peak_bytes"] == full + other, (rank, r["gathered_peak_bytes"])


def check_freed_while_waiting(got: list[dict]) -> None:
    """The first stage's full parameters (which its forwards saved views of)
    hold no bytes from its RESHARD after forward to its backward's gather,
    nor after its last RESHARD, but those the other stage reads and holds:
    only the other stage's are alive. Failed before RESHARD emptied the
    storages: in the gpt cases 86% of stage 0's bytes stayed alive (the
    transposed weights its forwards saved, programs and autograd alike)."""
    for rank, r in enumerate(got):
        own, full, shared, total, other = gathered_bytes_while_waiting(r)
        assert own == shared and total == other > 0, (rank, r["probe"])
        after = r["probe"]["after_reshard"][str(r["local_stages"][0])]
        assert len(after) >= 2 and not any(after), (rank, after)
        assert r["gathered_peak_bytes"] == max(full, other), (rank, r["gathered_peak_bytes"])


@pytest.mark.parametrize("path", ["programs", "autograd", "inductor"])
def test_reshard_after_forward_frees_between_forward_and_backward_and_trains_alike(path):
    got = _GRID.results({"programs": "reshard_after_forward-gpt-gpipe",
                         "autograd": "reshard_after_forward-gpt-gpipe-autograd",
                         "inductor": "reshard_after_forward-mlp-gpipe-inductor"}[path])
    check_training(got)
    for rank, r in enumerate(got):
        assert r["functional"] == (path != "autograd"), rank
    check_freed_while_waiting(got)
    for rank, r in enumerate(got):
        assert not r["layout_after"]["bad"], (rank, r["layout_after"]["bad"])
        for stage in r["local_stages"]:
            mine = [(i, kind) for i, (s, kind) in enumerate(r["action_fields"]) if s == stage]
            last_f = max(i for i, k in mine if k == "F")
            first_b = min(i for i, k in mine if k in ("B", "I"))
            between = [k for i, k in mine if last_f < i < first_b]
            if stage == r["local_stages"][0]:   # the other stage runs in between
                assert "RESHARD" in between and "UNSHARD" in between, (rank, r["actions"])


def test_reshard_after_forward_frees_tensor_parallel_local_shards_and_trains_alike():
    got = _GRID.results("reshard_after_forward-tp-looped_bfs")
    for rank, r in enumerate(got):
        assert all(d <= 1 for d in r["loss"]), (rank, r["loss"])
        assert all(d <= 1 for _, d in r["grads"]), (rank, r["grads"])
        assert r["params"][1] <= 1, (rank, r["params"])
        assert r["functional"] and r["dtensor_compute"] > 0, rank
        assert r["probe"]["shared_bytes"]["0"] > 0, rank   # the tied embedding
    check_freed_while_waiting(got)


def test_compiled_stages_with_shard_equal_one_process():
    got = _GRID.results("compile-mlp-1f1b")
    check_training(got)
    assert all(r["functional"] for r in got)   # Inductor-compiled stage programs ran


def test_clip_grad_norm_eval_step_and_forward_with_shard_equal_one_process():
    got = _GRID.results("clip_eval-gpt-1f1b")
    for rank, r in enumerate(got):
        # Two steps without zero_grad: the DTensor gradients accumulate.
        assert r["accumulated_grads"][1] <= 1, (rank, r["accumulated_grads"])
        assert r["norm"] <= 1, (rank, r["norm_value"], r["ref_norm_value"])
        assert r["norm_value"] > 0.1 * 2   # the clip did scale the gradients
        assert r["clipped_grads"][1] <= 1, (rank, r["clipped_grads"])
        assert r["eval"] <= 1 and r["eval_kept_grads"] == 0, (rank, r)
        assert r["forward"] <= 1, (rank, r["forward"])
        assert r["step_after"] <= 1 and r["grads_after"][1] <= 1, (rank, r)
    assert len({r["norm_value"] for r in got}) == 1   # the same on every rank


def test_meta_device_model_holds_a_quarter_of_the_parameters_per_rank_and_trains_exactly():
    got = _GRID.results("meta_init-gpt-1f1b")
    total = got[0]["total_bytes"]
    for rank, r in enumerate(got):
        assert not r["still_meta"]
        assert all(d <= 1 for d in r["loss"]), (rank, r["loss"])
        assert all(d <= 1 for _, d in r["grads"]), (rank, r["grads"])
        assert r["params"][1] <= 1, (rank, r["params"])
        assert not r["layout_after"]["bad"], (rank, r["layout_after"]["bad"])
        # 1/(pp*dp) of the model, give or take the split's balance and the tied
        # embedding (held by both pipeline ranks).
        share = r["local_bytes"] / total
        assert 0.5 / (DP * PP) < share < 1.5 / (DP * PP), (rank, r["local_bytes"], total)
        # What the pipeline reports holding is what it holds (its local rows;
        # buffers none here).
        assert r["parameter_bytes"] == r["local_bytes"], (rank, r["parameter_bytes"])
    # The replicas of a pipeline rank hold disjoint rows: theirs add up to
    # its stages' parameters, and the pipeline ranks' to the model (+ tied).
    assert sum(r["local_bytes"] for r in got) >= total


# ------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sharded_ckpt"))
    run = run_ranks(DP * PP, "sharded_worker:checkpoints", directory, timeout=300)
    return run.results


def test_checkpoint_saved_sharded_holds_the_reference_state(checkpoints):
    for rank, r in enumerate(checkpoints):
        assert r["save_error"] is None, f"rank {rank}:\n{r['save_error']}"
        # Gradients equal the reference's every step; the saved and continued
        # parameters and moments are AdamW's of them (optim_replay.py).
        assert len(r["grads_vs_ref"]) == 3 and max(r["grads_vs_ref"]) <= 1, (rank, r)
        assert r["saved_vs_ref"] <= 1 and r["continuation_vs_ref"] <= 1, (rank, r)


@pytest.mark.parametrize("into", ["a_pp2_dp2_shard", "b_pp2_dp2_replicate", "c_pp1_dp4_shard",
                                  "c_pp4_dp1_shard", "d_plain_module"])
def test_checkpoint_saved_sharded_loads_resharded_and_continues(checkpoints, into):
    ranks = [0] if into == "d_plain_module" else range(DP * PP)
    for rank in ranks:
        r = checkpoints[rank]
        assert r["save_error"] is None, f"rank {rank}:\n{r['save_error']}"
        got = r[into]
        assert got["error"] is None, f"rank {rank}:\n{got['error']}"
        loaded = got["loaded"]
        # Parameters and AdamW moments bit for bit as saved.
        assert loaded["compared"] > 0 and loaded["moments"] > 0, (rank, loaded)
        assert not loaded["unequal"] and not loaded["unknown"], (rank, loaded)
        if into != "d_plain_module":
            assert got["step"] == 2
            assert got["types"] == (["DTensor"] if into in ("a_pp2_dp2_shard",
                                                            "c_pp1_dp4_shard") else ["Parameter"])
        # One more step equals the saving run's next step.
        assert got["loss"] < 1e-5, (rank, got["loss"])
        assert got["continued"][1] <= 1, (rank, got["continued"])


# ------------------------------------------------------------------ failures

def test_rank_dying_at_its_all_gather_makes_every_other_rank_raise_naming_it():
    timeout = 10.0
    run = run_ranks(DP * PP, "sharded_worker:die_in_all_gather", timeout, timeout=120,
                    failure_grace=None, check=False)
    assert not run.timed_out, "a surviving rank never gave up:\n" + run.describe()
    assert run.returncodes[3] == 3, run.describe([3])
    for rank in (0, 1, 2):
        r = run.results[rank]
        assert r is not None and r.get("first_step"), run.describe([rank])
        assert r.get("raised") == "PipelineError", (rank, r, run.describe([rank]))
        assert r["seconds"] < timeout + 10, (rank, r["seconds"])
    # Global rank 1 is rank 3's dp partner: its all-gather is the one left waiting.
    message = run.results[1]["message"]
    assert "all-gather" in message and "data-parallel group" in message, message
    assert re.search(r"global ranks \[1, 3\]", message), message


# ------------------------------------------------------------------ one process

def test_unknown_data_parallel_mode_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"data_parallel='shrd'"):
        mpmd.pipeline(models.MLP(), loss_fn=F.mse_loss, num_microbatches=2,
                      data_parallel="shrd")


def test_shard_without_a_mesh_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"data_parallel='shard'.*mesh"):
        mpmd.pipeline(models.MLP(), loss_fn=F.mse_loss, num_microbatches=2,
                      data_parallel="shard")


def test_worker_models_run_in_one_process():
    """The worker's models and batches as the reference sees them (no launch)."""
    for name in ("gpt", "mlp"):
        x, y = W.batch(name, 1)
        loss = W.loss_for(name)(W.build(name)(x), y)
        assert loss.dim() == 0 and torch.isfinite(loss)


def test_meta_device_one_element_parameters_are_initialized():
    """A module whose only tensors have one element (OddMLP's 0-dim ``scale``)
    is initialized on a meta-device model too (its stand-in is marked: its
    layout cannot tell it from a value)."""
    with torch.device("meta"):
        model = W.OddMLP()
    torch.manual_seed(0)
    reference = W.OddMLP()
    for mod in reference.modules():
        W.deterministic_init(mod)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2,
                         init_fn=W.deterministic_init)
    x, y = W.batch("mlp", 1)
    loss = pipe.step(x, target=y)
    assert float(model.scale) == pytest.approx(float(reference.scale))
    assert float(loss) == pytest.approx(float(F.mse_loss(reference(x), y)), rel=1e-5)


@pytest.mark.parametrize("mode", ["shard", "replicate"])
def test_a_stage_mixing_fp32_and_bf16_parameters_reduces_each_in_its_own_dtype(mode):
    run = run_ranks(2, "sharded_worker:mixed_dtypes", mode, timeout=120)
    for r in run.results:
        got, want = r["loss"]
        assert got == pytest.approx(want, rel=1e-5), r
        assert r["grads"]["w32"][0] == "torch.float32" and r["grads"]["w32"][1] < 1e-5, r
        dtype, diff, scale = r["grads"]["w16"]
        assert dtype == "torch.bfloat16" and diff <= 2 ** -7 * max(scale, 1.0), r


@pytest.mark.parametrize("backend, device, want", [
    ("gloo", "cuda", "gloo"), ("nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cpu:gloo", "cuda", None)])
def test_the_backend_for_a_device_is_read_from_the_groups_backend_name(backend, device, want):
    """What decides host staging of the sharded collectives (gloo or none for
    the parameters' device: buffers on the host)."""
    from torch_mpmd.parallel.sharding import backend_for
    assert backend_for(backend, device) == want
