"""Explicit microbatches of different lengths (``step(microbatches=[...],
targets=[...])``): each schedule's step equals one process computing the same
microbatches (losses, every gradient), with FX and Inductor programs, with a
microbatch count that changes between steps; eval_step and the forward call
take them too; twenty mixes of lengths reuse one capture and one set of
programs; bad input is a clear error before any transfer
(tests/microbatch_worker.py)."""

from __future__ import annotations

import pytest

from dist_harness import GridRun
from torch_mpmd.schedules import facts, schedule_names

# Every schedule of the table, at the fewest stages per rank that show what it is for.
SCHEDULES = [(s, facts(s).typical_stages_per_rank) for s in schedule_names()]
CASES = ([dict(id=f"fx-{s}", kind="train", schedule=s, spr=spr,
               mixes=20 if s == "1f1b" else 3) for s, spr in SCHEDULES]
         + [dict(id="fx-token-zero_bubble", kind="train", schedule="zero_bubble", loss="token",
                 mixes=3),
            dict(id="inductor-zero_bubble", kind="train", schedule="zero_bubble", compile=True,
                 mixes=20),
            dict(id="errors", kind="errors")]
         + [dict(id=f"packed-{s}", kind="packed", schedule=s) for s in ("1f1b", "zero_bubble")]
         + [dict(id="bucketed-zero_bubble", kind="bucketed", schedule="zero_bubble"),
            dict(id="hf-llama-zero_bubble", kind="hf_llama", schedule="zero_bubble")])
_GRID = GridRun(2, "microbatch_worker:grid", CASES, task="microbatches", timeout=900)
_GRID4 = GridRun(4, "microbatch_worker:grid",
                 [dict(id=f"replicas-{dp}", kind="replicas", schedule="1f1b", data_parallel=dp)
                  for dp in ("replicate", "shard")], task="microbatches", timeout=600)


@pytest.mark.parametrize("case", [c["id"] for c in CASES if c["kind"] == "train"])
def test_microbatches_of_different_lengths_equal_one_process(case):
    held = set()
    for rank, r in enumerate(_GRID.results(case)):
        held |= set(r["local"])
        for step in ("first", "second"):
            assert r[step]["loss"] <= 1, f"rank {rank} {step}: loss off by {r[step]['loss']}"
            assert r[step]["grads"], f"rank {rank} holds no parameter"
            bad = {n: d for n, d in r[step]["grads"].items() if d > 1}
            assert not bad, f"rank {rank} {step}: gradients off (inf: missing): {bad}"
        assert r["eval"] <= 1, f"rank {rank}: eval_step's loss off by {r['eval']}"
        assert r["outputs"] <= 1, f"rank {rank}: outputs off by {r['outputs']}"
        assert [s[1] for s in r["output_shapes"]] == [4, 9, 2, 6, 11, 3], r["output_shapes"]
        assert r["stats_shapes"] == [[2, n] for n in (4, 9, 2, 6, 11, 3)], r["stats_shapes"]
        assert r["functional"], f"rank {rank}: ran under autograd, not stage programs"
        assert r["captures"] == 1, f"rank {rank}: {r['captures']} captures"
        assert r["same_programs"], f"rank {rank}: the stage programs were built again"
    assert len(held) == 11, sorted(held)


def test_bad_microbatches_are_clear_errors_on_every_rank():
    for rank, r in enumerate(_GRID.results("errors")):
        assert r["ranks_differ"] and "given different microbatches" in r["ranks_differ"], \
            (rank, r["ranks_differ"])
        assert r["ranks_differ"].startswith("PipelineError"), r["ranks_differ"]
        assert r["too_few"] and "num_microbatches=3 must be >= 2 * num_ranks=2" in \
            r["too_few"], (rank, r["too_few"])
        assert r["static"] and "need pipeline(dynamic=True)" in r["static"], r["static"]
        assert r["entry"] and "microbatches[0] is a Tensor" in r["entry"], r["entry"]
        assert r["targets"] and "targets= has 2 entries for 4 microbatches" in r["targets"], \
            r["targets"]
        assert r["both"] and "together with a batch (positional arguments)" in r["both"], \
            r["both"]
        assert r["target_rows"] and "microbatch 0: target has batch size 1" in \
            r["target_rows"], r["target_rows"]
        assert r["guard"] and "microbatch 4's sizes cannot run on the capture made from " \
            "microbatch 0" in r["guard"] and "at least 2" in r["guard"], r["guard"]
        assert r["after"] is None, r["after"]


@pytest.mark.parametrize("case", ["packed-1f1b", "packed-zero_bubble"])
def test_packed_rows_of_their_own_lengths_train_like_the_documents_one_by_one(case):
    held, every = set(), set()
    for rank, r in enumerate(_GRID.results(case)):
        held |= set(r["local"])
        every |= set(r["all"])
        assert len(set(r["lengths"])) > 1, r["lengths"]  # rows of different lengths
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']} tolerances"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
    assert held == every, sorted(every - held)


def test_buckets_on_a_static_capture_capture_once_per_bucket_and_train_exactly():
    for rank, r in enumerate(_GRID.results("bucketed-zero_bubble")):
        assert r["first"]["loss"] <= 1, f"rank {rank}: loss off by {r['first']['loss']}"
        bad = {n: d for n, d in r["first"]["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
        # Step 0 pads to 8, step 1 to 16: two captures, then none.
        assert r["captures"][:2] == [1, 2] and set(r["captures"][2:]) == {2}, r["captures"]


def test_bucketing_pads_inputs_and_targets_of_the_microbatch_length_only():
    import torch

    import torch_mpmd as mpmd
    from torch_mpmd.microbatch import bucket_length

    mbs = [((torch.ones(2, n, dtype=torch.long), torch.ones(2, 3)),
            {"pos": torch.arange(n).expand(2, n)}) for n in (5, 9)]
    out, targets = mpmd.bucket_microbatches(mbs, [torch.ones(2, 5), torch.ones(2, 9)],
                                            multiple=8, fill={0: 7, "pos": -1})
    assert [tuple(a[0].shape) for a, _ in out] == [(2, 8), (2, 16)]
    assert tuple(out[0][0][1].shape) == (2, 3)  # not the microbatch's length: unchanged
    assert out[0][0][0][0, 5:].tolist() == [7, 7, 7] and out[0][1]["pos"][0, 5:].tolist() == \
        [-1, -1, -1]
    assert targets[1][0, 9:].tolist() == [-100.0] * 7
    assert bucket_length(17, buckets=[8, 16, 32]) == 32
    with pytest.raises(ValueError, match="length 40 fits none of buckets=\\[8, 16, 32\\]"):
        bucket_length(40, buckets=[32, 8, 16])
    with pytest.raises(ValueError, match="exactly one of multiple= .* or buckets="):
        bucket_length(4)
    with pytest.raises(ValueError, match="targets has 1 entries for 2 microbatches"):
        mpmd.bucket_microbatches(mbs, [None], multiple=8)


@pytest.mark.parametrize("dp", ["replicate", "shard"])
def test_data_parallel_replicas_take_their_own_microbatches(dp):
    held = set()
    for rank, r in enumerate(_GRID4.results(f"replicas-{dp}")):
        held |= set(r["local"])
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']} tolerances"
        assert r["grads"], f"rank {rank} holds no parameter"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
    assert len(held) == 11, sorted(held)


def test_a_hugging_face_llama_with_its_own_loss_on_microbatches_of_different_lengths():
    held, every = set(), set()
    for rank, r in enumerate(_GRID.results("hf-llama-zero_bubble")):
        held |= set(r["local"])
        every |= set(r["all"])
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']} tolerances"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
    assert held == every, sorted(every - held)
