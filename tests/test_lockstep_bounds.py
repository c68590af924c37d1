"""The lockstep's bounds (issue 34): ranks of one pipeline given different
microbatch contents raise naming the value (NOTE [Microbatch contents] in
runtime/contents.py); a rank that stalls or dies in mpmd.plan's profiling is
named within the timeout, and so is one that stalls materializing a meta
model (NOTE [Named waits] in parallel/named_waits.py); with 4
ranks and rank 0 (the store's host) killed mid-step, every survivor names
rank 0."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from dist_harness import GridRun, run_ranks
from torch_mpmd.runtime import contents as contents_module
from torch_mpmd.runtime.contents import _device_digest, microbatch_contents

_GRID = GridRun(2, "lockstep_bounds_worker:grid", [dict(id="contents", kind="contents")],
                task="bounds", timeout=300)


# ------------------------------------------------------------------ contents compared

def test_ranks_given_different_batch_contents_raise_naming_the_microbatch_and_target():
    for rank, r in enumerate(_GRID.results("contents")):
        got = r["batch_target"]
        assert not got["ok"] and got["type"] == "PipelineError", (rank, got)
        assert re.search(rf"^rank {rank}: step not run: the ranks of one pipeline were given "
                         r"different microbatch contents: microbatch 2, target differs "
                         r"between rank 0, rank 1", got["message"]), got["message"]
        assert "still in step" in got["message"], got["message"]


def test_ranks_given_lists_differing_in_one_element_raise_naming_it_then_train_like_eager():
    for rank, r in enumerate(_GRID.results("contents")):
        got = r["list_input"]
        assert not got["ok"] and got["type"] == "PipelineError", (rank, got)
        assert re.search(r"microbatch 1, input '[^']+' differs between rank 0, rank 1 .*"
                         r"1 of \d+ values differ", got["message"]), got["message"]
        # Still in step: the same batch on every rank then trains like eager.
        assert r["same"]["ok"], r["same"]
        assert r["same"]["value"] == pytest.approx(r["reference"], rel=1e-5)
        assert r["grad_diff"] < 1e-5, r["grad_diff"]


def _digest(t):
    return microbatch_contents([{"x": t}], [None])[0]


@pytest.mark.parametrize("change", ["one-bit", "sign-flips", "swap", "shift-rows"])
def test_the_content_digest_sees_every_change(change):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 64, generator=g)
    u = t.clone()
    if change == "one-bit":
        u.view(torch.int32)[3, 5] ^= 1
    elif change == "sign-flips":  # two sign bits: cancel in a plain sum of words
        u[0, 0], u[0, 1] = -u[0, 0], -u[0, 1]
    elif change == "swap":
        u[2, 3], u[9, 40] = t[9, 40], t[2, 3]
    else:
        u = torch.roll(t, 1, 0)
    assert _digest(t) != _digest(u)
    assert _digest(t) == _digest(t.clone())
    # The on-device reduction (for tensors not on the CPU), run here on the CPU.
    flat = lambda v: v.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    assert _device_digest(flat(t)) != _device_digest(flat(u))
    assert _device_digest(flat(t)) == _device_digest(flat(t.clone()))


def test_the_content_digest_counts_non_tensor_values_and_reads_bytes_exactly():
    t = torch.arange(6)
    base = microbatch_contents([{"x": t, "k": 3}], [{"y": t}])
    assert base[1] == ["microbatch 0, input 'x'", "microbatch 0, input 'k'",
                       "microbatch 0, target"]
    assert microbatch_contents([{"x": t, "k": 4}], [{"y": t}])[2][1] != base[2][1]
    assert microbatch_contents([{"x": t, "k": 3}], [{"y": t + 1}])[2][2] != base[2][2]
    assert microbatch_contents([{"x": t.float(), "k": 3}], [{"y": t}])[2][0] != base[2][0]
    # A CPU tensor's digest is BLAKE2b over its bytes (after dtype and shape).
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(("torch.int64", (6,), "torch.strided")).encode())
    h.update(t.numpy().tobytes())
    assert int.from_bytes(h.digest(), "little") & (2**63 - 1) == base[2][0] & (2**63 - 1)


def test_the_on_device_path_reads_every_tensor_back_once_and_sees_a_change(monkeypatch):
    # Tensors off the CPU are reduced on their device; run that path on the
    # CPU (no tensor read in place) and compare with itself and a change.
    monkeypatch.setattr(contents_module, "_READ_IN_PLACE", ())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 9, (4, 3), generator=g)
    mbs, targets = [{"x": x[:2]}, {"x": x[2:]}], [y[:2], y[2:]]
    base = microbatch_contents(mbs, targets)
    assert base == microbatch_contents([{"x": x[:2].clone()}, {"x": x[2:].clone()}], targets)
    y2 = y.clone()
    y2[3, 1] += 1
    other = microbatch_contents(mbs, [y2[:2], y2[2:]])
    assert [a == b for a, b in zip(base[2], other[2])] == [True, True, True, False]


# ------------------------------------------------------------------ bounded planning

PLAN_TIMEOUT = 5.0


def _profile_fault(mode, grace):
    """``grace``: seconds the other rank gets once one exited non-zero."""
    return run_ranks(2, "lockstep_bounds_worker:fault_in_profiling", mode, PLAN_TIMEOUT,
                     timeout=150, pg_timeout=120, failure_grace=grace, check=False)


def test_a_rank_dying_before_profiling_is_named_within_the_timeout():
    # Before: rank 0 waited in broadcast_object_list for the process group's
    # timeout (here 120 s), then raised gloo's own error.
    run = _profile_fault("rank1_dies", grace=60)
    assert run.returncodes[1] == 3, run.describe([1])
    got = run.results[0]
    assert got is not None and "raised_after" in got, run.describe([0])
    assert got["type"] == "PipelineError", got
    assert re.search(r"^rank 0: profiling: waiting for the other ranks at .*timed out.*"
                     r"rank 1 never arrived", got["message"]), got["message"]
    assert got["peer"] == 1, got
    assert got["raised_after"] < PLAN_TIMEOUT + 30, got  # not the group's 120 s


def test_rank_zero_stalling_while_it_measures_is_named_by_the_rank_waiting_for_its_sheet():
    run = _profile_fault("rank0_stalls", grace=3)
    assert run.results[0] is not None and "stalled_at" in run.results[0], run.describe([0])
    got = run.results[1]
    assert got is not None and "raised_after" in got, run.describe([1])
    assert got["type"] == "PipelineError", got
    assert re.search(r"^rank 1: profiling: waiting for the other ranks at the broadcast of "
                     r"rank 0's profile .*rank 0 has not arrived \(its last record, [\d.]+ s "
                     r"ago: ", got["message"]), got["message"]
    assert got["raised_after"] < PLAN_TIMEOUT + 60, got  # not the group's 120 s
    assert got["peer"] == 0, got


def test_a_rank_stalling_in_meta_init_is_named_by_the_rank_waiting_for_the_tied_weights():
    # Before: the broadcast's own timeout, naming no rank.
    run = run_ranks(2, "lockstep_bounds_worker:stall_in_meta_init", PLAN_TIMEOUT, timeout=150,
                    pg_timeout=120, failure_grace=3, check=False)
    got = run.results[0]
    assert got is not None and "raised_after" in got, run.describe([0])
    assert re.search(r"^rank 0: materializing the meta model: waiting for the other ranks at "
                     r"the broadcast of the materialized tied parameters .*timed out.*rank 1 "
                     r"never arrived", got["message"]), got["message"]
    assert got["peer"] == 1, got


# ------------------------------------------------------------------ who died

def test_with_four_ranks_and_rank_zero_killed_mid_step_every_survivor_names_rank_zero():
    # Rank 0 hosts the job's store (no agent store): its death takes the
    # records of who died with it; the survivors infer it from the store
    # being gone. Rank 1 sees rank 0's connection close; ranks 2 and 3 only
    # see their neighbour stop.
    run = run_ranks(4, "lockstep_bounds_worker:die_mid_chain", 5.0, timeout=120, pg_timeout=60,
                    failure_grace=None, check=False)
    assert not run.timed_out, run.describe()
    assert run.returncodes[0] == 3, run.describe([0])
    for rank in (1, 2, 3):
        res = run.results[rank]
        assert res is not None and "message" in res, run.describe([rank])
        named = res["peer"] == 0 or re.search(r"rank 0 is gone: the job's store, which lives "
                                              r"in rank 0's process, cannot be reached",
                                              res["message"])
        assert named, f"rank {rank} does not name rank 0:\n{res['message']}"
    for rank in (2, 3):
        assert "rank 0 is gone" in run.results[rank]["message"], run.results[rank]["message"]
