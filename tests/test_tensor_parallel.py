"""Tensor parallelism inside pipeline stages: a GPT with torchtitan's DTensor
plan on every block (tests/models.py TPGPT, q/k/v and fc column-parallel,
projections row-parallel), pipelined on a ("pp", "tp") = (2, 2) mesh of 4
gloo ranks, against one process stepping the same model without tensor
parallelism on the same batch (tests/tp_worker.py).

One launch runs every 4-rank case: 1f1b, zero_bubble (I/W split) and
interleaved_1f1b with FX programs, 1f1b with Inductor; clip_grad_norm_ over
mixed DTensor and plain gradients, eval_step and the forward-only call on a
mesh named in the other order ("tp", "pp"); sharded data parallel over
tensor-parallel parameters (dp2 x tp2: 2-D DTensor shards, NOTE [Sharding
with tensor parallel] in torch_mpmd/sharding.py); DTensors crossing the
stage boundary as their local shards (a sequence-sharded residual stream,
and a Replicate value with a Partial gradient: NOTE [DTensor boundaries] in
torch_mpmd/stage.py); the errors (an unknown mesh dim, DTensor boundaries
that cannot cross as local shards) and the cost model's local shapes. A
second launch runs ("dp", "pp", "tp") = (2, 2, 2) on 8 ranks, replicated
and sharded over "dp".
Differences come back scaled by the fp32 tolerance (atol 1e-5, rtol 1e-4):
a value <= 1 is within it.
"""

from __future__ import annotations

import pytest

from dist_harness import GridRun

SCHEDULES = ("1f1b", "zero_bubble", "interleaved_1f1b")
CASES = [dict(id=f"train-{s}", kind="train", schedule=s) for s in SCHEDULES] + [
    dict(id="train-1f1b-inductor", kind="train", schedule="1f1b", kwargs={"compile": True}),
    dict(id="clip_eval-tp_pp", kind="clip_eval", schedule="1f1b", dims=("tp", "pp")),
    # No "pp" dim: dp2 x tp2, one one-stage pipeline per rank.
    dict(id="train-dp_tp-no_pp", kind="train", schedule="1f1b", dims=("dp", "tp"), dp=2),
    dict(id="train-dp_tp-shard", kind="train", schedule="zero_bubble", dims=("dp", "tp"), dp=2,
         kwargs={"data_parallel": "shard"}),
    dict(id="clip_eval-dp_tp-shard", kind="clip_eval", schedule="1f1b", dims=("dp", "tp"),
         dp=2, kwargs={"data_parallel": "shard"}),
    # DTensors crossing the pp2 boundary as local shards (tp_worker.BOUNDARIES).
    dict(id="train-sequence-1f1b", kind="train", schedule="1f1b", model="sequence"),
    dict(id="train-sequence-zero_bubble", kind="train", schedule="zero_bubble",
         model="sequence"),
    dict(id="train-sequence-1f1b-inductor", kind="train", schedule="1f1b", model="sequence",
         kwargs={"compile": True}),
    dict(id="clip_eval-sequence", kind="clip_eval", schedule="1f1b", model="sequence"),
    dict(id="train-replicated-zero_bubble", kind="train", schedule="zero_bubble",
         model="replicated"),
    dict(id="door-1f1b", kind="door", schedule="1f1b"),
    dict(id="errors", kind="errors"),
    dict(id="local_costs", kind="local_costs"),
    dict(id="memo", kind="memo"),
]
_GRID = GridRun(4, "tp_worker:grid", CASES, task="tp", timeout=400)
# ("dp", "pp", "tp") = (2, 2, 2): global rank = 4 dp + 2 pp + tp.
DP_CASES = [dict(id="train-dp_pp_tp-1f1b", kind="train", schedule="1f1b",
                 dims=("dp", "pp", "tp"), dp=2),
            dict(id="clip_eval-dp_pp_tp", kind="clip_eval", schedule="1f1b",
                 dims=("dp", "pp", "tp"), dp=2),
            dict(id="train-dp_pp_tp-shard", kind="train", schedule="1f1b",
                 dims=("dp", "pp", "tp"), dp=2, kwargs={"data_parallel": "shard"})] + [
    dict(id=f"train-dp_pp_tp-shard-{s}", kind="train", schedule=s, dims=("dp", "pp", "tp"),
         dp=2, kwargs={"data_parallel": "shard"}) for s in ("zero_bubble", "interleaved_1f1b")]
_GRID8 = GridRun(8, "tp_worker:grid", DP_CASES, task="tp", timeout=400)


def check_training(got: list[dict], replicas: list[list[int]], *, sharded: bool = False
                   ) -> None:
    """Losses, every gradient (full tensors) of both steps and the parameters
    after two AdamW steps equal the reference's, on every rank; the stage
    programs ran (no autograd fallback); DTensor parameters have DTensor
    gradients of their placements, plain ones plain gradients."""
    for rank, r in enumerate(got):
        assert r["fallback"] is None, f"rank {rank} fell back to autograd: {r['fallback']}"
        assert all(d <= 1 for d in r["loss"]), (rank, r["loss"])
        for step, (name, d) in enumerate(r["grads"]):
            assert d <= 1, f"rank {rank} step {step}: gradient of {name} off by {d} tolerances"
        name, d = r["params"]
        assert d <= 1, f"rank {rank}: parameter {name} off by {d} tolerances after 2 steps"
        want = (["DTensor:DTensor:same"] if sharded else
                ["DTensor:DTensor:same", "Parameter:Tensor:same"])
        assert r["grad_layouts"] == want, (rank, r["grad_layouts"])
    # Every parameter is on some rank; every replica's pp rank k holds the
    # same stages.
    assert set().union(*(r["names"] for r in got)) == set(got[0]["all_names"])
    for pp_rank in range(len(replicas[0])):
        held = {tuple(got[replica[pp_rank]]["names"]) for replica in replicas}
        assert len(held) == 1, (pp_rank, held)
    # One pipeline replica per (dp, tp) coordinate, its ranks by pp rank.
    assert all(r["replicas"] == replicas for r in got), got[0]["replicas"]
    check_tied_sum(got, replicas)


def check_tied_sum(got: list[dict], replicas: list[list[int]]) -> None:
    """The embedding tied to the head (first and last stage) is summed over
    pp and dp by one all-reduce, posted by the REDUCE_GRAD of the stage that
    reads it, over a group of whole pipeline replicas (those of this rank's
    tp coordinate), the same on every member."""
    for rank, r in enumerate(got):
        if len(replicas[0]) == 1:  # no "pp": nothing is shared across ranks
            assert r["tied"] is None, (rank, r["tied"])
            continue
        pp_rank = next(rep.index(rank) for rep in replicas if rank in rep)
        stage = min(r["local_stages"]) if pp_rank == 0 else max(r["local_stages"])
        assert r["tied"]["count"] == 1, (rank, r["tied"])
        assert r["tied"]["posted_by"] == [f"{stage}REDUCE_GRAD"], (rank, r["tied"])
        group = set(r["tied"]["groups"][0])
        assert rank in group and all(set(rep) <= group or not set(rep) & group
                                     for rep in replicas), (rank, group)
        assert all(got[m]["tied"]["groups"] == r["tied"]["groups"] for m in group)


def check_clip_eval(got: list[dict]) -> None:
    for rank, r in enumerate(got):
        assert r["accumulated_grads"][1] <= 1, (rank, r["accumulated_grads"])
        assert r["norm"] <= 1, (rank, r["norm_value"], r["ref_norm_value"])
        assert r["norm_value"] > 0.1  # the clip did scale
        assert r["clipped_grads"][1] <= 1, (rank, r["clipped_grads"])
        assert r["inf_norm"] <= 1, (rank, r["inf_norm"])
        assert r["eval"] <= 1 and r["eval_kept_grads"] == 0, (rank, r)
        assert r["forward"] <= 1, (rank, r["forward"])
        assert r["step_after"] <= 1 and r["grads_after"][1] <= 1, (rank, r)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_tp2_training_equals_one_process(schedule):
    check_training(_GRID.results(f"train-{schedule}"), [[0, 2], [1, 3]])


def test_pp2_tp2_inductor_training_equals_one_process():
    check_training(_GRID.results("train-1f1b-inductor"), [[0, 2], [1, 3]])


def test_mesh_without_pp_dim_runs_one_stage_per_replica():
    check_training(_GRID.results("train-dp_tp-no_pp"), [[0], [1], [2], [3]])


def test_dp2_pp2_tp2_training_equals_one_process():
    """8 ranks: dp replicas step on their halves of the batch and average
    their (DTensor and plain) gradients over "dp" only."""
    check_training(_GRID8.results("train-dp_pp_tp-1f1b"), [[0, 2], [1, 3], [4, 6], [5, 7]])


def test_dp2_pp2_tp2_clip_eval_forward():
    check_clip_eval(_GRID8.results("clip_eval-dp_pp_tp"))


def test_the_compile_door_trains_the_tensor_parallel_model_like_one_process():
    """torch.compile(forward + loss, backend="mpmd") over the ("pp", "tp")
    mesh: loss.backward() hands each rank's stages' DTensor and plain
    parameters their gradients; two AdamW steps follow the reference."""
    for rank, r in enumerate(_GRID.results("door-1f1b")):
        assert all(d <= 1 for d in r["loss"]), (rank, r["loss"])
        for step, (name, d) in enumerate(r["grads"]):
            assert d <= 1, f"rank {rank} step {step}: gradient of {name} off by {d} tolerances"
        assert r["with_grad"] > 0, rank
        name, d = r["params"]
        assert d <= 1, f"rank {rank}: parameter {name} off by {d} tolerances after 2 steps"


def test_clip_eval_forward_with_tensor_parallel():
    """clip_grad_norm_ counts each TP shard once and each plain (replicated
    over tp) gradient once: torch's norm on the reference, 2-norm and
    inf-norm; eval_step and pipe(x) equal the reference; a mesh named
    ("tp", "pp") enumerates its replicas by its dims' names."""
    check_clip_eval(_GRID.results("clip_eval-tp_pp"))


# Per microbatch (batch 8, 2 microbatches): 4 sequences of 16 tokens, d=32.
_RESIDUAL = [4, 16, 32]
_HALF_SEQUENCE = [4, 8, 32]


@pytest.mark.parametrize("case", ["train-sequence-1f1b", "train-sequence-zero_bubble",
                                  "train-sequence-1f1b-inductor"])
def test_sequence_sharded_boundary_crosses_as_local_half(case):
    """The blocks hand on a Shard(1) DTensor: it crosses the stage boundary as
    each tp rank's half of the sequence, forward and gradient (the
    transport's shapes and the plan's bytes are local), and training equals
    one process with FX and Inductor programs."""
    got = _GRID.results(case)
    check_training(got, [[0, 2], [1, 3]])
    for r in got:
        assert r["transfers"]["shapes"] == {"0->1": [_HALF_SEQUENCE],
                                            "1->0 grad": [_HALF_SEQUENCE]}, r["transfers"]
        assert r["transfers"]["bytes"] == [4 * 8 * 32 * 4], r["transfers"]


def test_replicated_boundary_with_partial_gradient_equals_one_process():
    """ln1's Replicate output crosses (split before blocks.2.attn) beside the
    plain residual; the consumer's gradient of it is Partial and is
    all-reduced to Replicate before it is sent back (NOTE [DTensor
    boundaries]); zero_bubble, so the reduction runs in I."""
    got = _GRID.results("train-replicated-zero_bubble")
    check_training(got, [[0, 2], [1, 3]])
    for r in got:
        assert r["transfers"]["shapes"] == {"0->1": [_RESIDUAL, _RESIDUAL],
                                            "1->0 grad": [_RESIDUAL, _RESIDUAL]}, r


def test_sequence_sharded_boundary_clip_eval_forward():
    """eval_step and the forward-only call run the stages under autograd:
    the same local-shard boundary there."""
    check_clip_eval(_GRID.results("clip_eval-sequence"))


def test_tensor_parallel_errors_name_the_values():
    for r in _GRID.results("errors"):
        assert r["bad_name"].startswith("ValueError") and "'model'" in r["bad_name"], r
        assert "'dp', 'pp' and 'tp'" in r["bad_name"], r["bad_name"]
        for key, why in (("pp_mesh", "mesh['tp']"), ("partial", "pending reduction")):
            refused = r[key]
            assert refused.startswith("ValueError") and "is a DTensor" in refused, refused
            assert "from stage 0 to stage 1" in refused and why in refused, refused
        assert "mesh dims ('pp',)" in r["pp_mesh"], r["pp_mesh"]
        assert "Partial" in r["partial"], r["partial"]


def test_costs_and_bytes_use_local_shards():
    """Batch 8 x 16 tokens, d=32, fp32: a column-parallel q (32 -> 32) and fc
    (32 -> 128) output half their columns on each tp rank; row-parallel
    projections and the plain head output whole rows."""
    for r in _GRID.results("local_costs"):
        got = r["bytes"]
        tokens = 8 * 16 * 4
        assert got["blocks.0.attn.q"] == tokens * 32 // 2, got
        assert got["blocks.3.fc"] == tokens * 128 // 2, got
        assert got["blocks.0.attn.proj"] == got["blocks.0.proj"] == tokens * 32, got
        assert got["head"] == tokens * 32, got


def test_sharded_data_parallel_over_tensor_parallel_equals_one_process():
    """data_parallel="shard" with "tp": every parameter a DTensor shard over
    ("dp", "tp") (tensor-parallel ones split over "dp" along the dim their tp
    placement leaves whole), zero_bubble's I/W split, equal to one process."""
    check_training(_GRID.results("train-dp_tp-shard"), [[0], [1], [2], [3]], sharded=True)


def test_sharded_over_tensor_parallel_clip_eval_forward():
    check_clip_eval(_GRID.results("clip_eval-dp_tp-shard"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dp2_pp2_tp2_sharded_training_equals_one_process(schedule):
    """3-D: sharded over "dp", pipelined over "pp", tensor parallel over "tp"
    (2-D DTensor shards), for every schedule; the tied embedding's gradient
    summed over pp and dp by its REDUCE_GRAD."""
    case = "train-dp_pp_tp-shard" + ("" if schedule == "1f1b" else f"-{schedule}")
    check_training(_GRID8.results(case), [[0, 2], [1, 3], [4, 6], [5, 7]], sharded=True)


def test_a_model_parallelized_again_on_its_mesh_reuses_its_traces_and_not_on_other_groups():
    """Built and parallelized again on the same mesh: the capture and each
    of the rank's stage traces come from the memos, and the first step's
    loss is the first model's bit for bit. On a mesh of the same layout
    over new process groups, which torch's DeviceMesh calls equal: traced
    again (a kept trace would communicate over the old groups)."""
    for r in _GRID.results("memo"):
        assert r["losses"][0] == r["losses"][1] == r["losses"][2], r
        again, fresh = r["captures"]
        assert again["hits"] == 1 and again["misses"] == 0, r
        assert fresh["hits"] == 0 and fresh["misses"] == 1, r
        again, fresh = r["exports"]
        assert again["hits"] >= 1 and again["misses"] == 0 and again["not_keyed"] == 0, r
        assert fresh["hits"] == 0 and fresh["misses"] >= 1 and fresh["not_keyed"] == 0, r
        assert r["meshes_equal"] and not r["keys_equal"], r
