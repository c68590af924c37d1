"""Activation checkpointing around SDPA attention, with dropout inside the
checkpointed region, through the functional stage programs on 2 gloo ranks
(issue 23): loss and every gradient equal one eager process drawing the same
random numbers, under 1F1B and zero bubble, with FX programs and Inductor;
the checkpointed attention and dropout are recomputed once, in B, or in I or
W where zero bubble splits B, never saved and never twice.
Hugging Face Qwen3 (SDPA attention) with gradient_checkpointing_enable()
trains exactly too. One launch runs every case (tests/ac_worker.py)."""

from __future__ import annotations

import collections

import pytest

from dist_harness import GridRun

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
DROPOUT = "aten.native_dropout.default"
CASES = [dict(id=f"attention-{schedule}-{'inductor' if compile_ else 'fx'}", model="attention",
              schedule=schedule, compile=compile_)
         for compile_ in (False, True) for schedule in ("1f1b", "zero_bubble")]
CASES += [dict(id="hf_qwen3-zero_bubble-fx", model="hf_qwen3", schedule="zero_bubble",
               compile=False)]
_GRID = GridRun(2, "ac_worker:grid", CASES, task="ac")


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_checkpointed_sdpa_trains_like_one_eager_process(case_id):
    ranks = _GRID.results(case_id)
    bad = []
    for rank, res in enumerate(ranks):
        assert res["functional"] is None, f"rank {rank} fell back: {res['functional']}"
        if not res["loss_diff"]["ok"]:
            bad.append(f"rank {rank} loss: {res['loss_diff']}")
        # Every parameter this rank holds has its gradient (None fails).
        bad += [f"rank {rank} {n}: {d}" for n, d in res["grads"].items() if not d["ok"]]
    assert not bad, "\n".join(bad)
    # Every parameter is held (and so checked) by some rank.
    assert set().union(*(r["grads"].keys() for r in ranks)) == set(ranks[0]["all_params"])
    if "eval_loss" in ranks[-1]:  # dropout is active in the step
        assert abs(ranks[-1]["loss"] - ranks[-1]["eval_loss"]) > 1e-3


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c["model"] == "attention"])
def test_checkpointed_attention_and_dropout_are_recomputed_once_where_needed(case_id):
    split = "zero_bubble" in case_id
    for rank, res in enumerate(_GRID.results(case_id)):
        (stage, ops), = res["programs"].items()  # one stage per rank, one block each
        ops = {k: collections.Counter(v) for k, v in ops.items()}
        for op in (SDPA, DROPOUT):
            # F runs it once, saving the generator state it ran under ...
            assert ops["F"][f"run_and_save_rng_state({op})"] == 1, (rank, op, ops["F"])
            assert ops["F"][op] == 0
            # ... and B recomputes it once under that state (not saved by F).
            assert ops["B"][f"run_with_rng_state({op})"] == 1, (rank, op, ops["B"])
            assert ops["B"][op] == 0
        if not split:
            assert set(ops) == {"F", "B"}
            continue
        # I and W together compute B's attention, dropout and their recompute,
        # each once. (Only these ops: Inductor rewrites the graphs it compiles,
        # views and aliases, and B is not compiled under zero bubble.)
        def kept(c):
            return {op: k for op, k in c.items() if "rng_state" in op or op == SDPA_BACKWARD}

        assert kept(ops["I"] + ops["W"]) == kept(ops["B"]), (rank, ops["I"], ops["W"], ops["B"])
        recompute = f"run_with_rng_state({SDPA})"
        if stage == "0":
            # No input gradient on stage 0: the recompute waits for W.
            assert not ops["I"] and ops["W"][recompute] == 1
        else:
            # The received value's gradient needs the attention's backward:
            # recomputed in I, which hands W what it needs (W recomputes nothing).
            assert ops["I"][recompute] == 1 and ops["I"][SDPA_BACKWARD] == 1
            assert ops["W"][recompute] == 0 and ops["W"][f"run_with_rng_state({DROPOUT})"] == 0
