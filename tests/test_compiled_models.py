"""More model kinds through functional stage programs on 2 gloo ranks, with
the programs as FX graphs and compiled by Inductor: BatchNorm (buffers
written by every forward), activation checkpointing, dropout, Hugging Face
GPT-2 and Llama from tiny configs. Loss, every gradient and every buffer equal
one process stepping the same microbatches (tests/models_worker.py); dropout
models give the same loss and gradients under every schedule. One launch
runs every case (tests look their case up)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_harness import GridRun

SCHEDULES = {False: ("1f1b", "zero_bubble", "zbv", "dualpipev"), "inductor": ("1f1b", "zbv")}
MODELS = ("bn_cnn", "checkpointed", "hf_gpt2", "hf_llama")
# The dropout model's marker fixes 2 stages: no V schedules; two schedules per
# compile setting to compare.
CASES = [dict(id=f"{model}-{schedule}-{'inductor' if compile else 'fx'}", model=model,
              schedule=schedule, compile=compile)
         for compile, schedules in SCHEDULES.items() for schedule in schedules
         for model in MODELS]
CASES += [dict(id=f"dropout-{schedule}-{'inductor' if compile else 'fx'}", model="dropout",
               schedule=schedule, compile=compile)
          for compile in (False, "inductor") for schedule in ("1f1b", "zero_bubble")]
# A non-contiguous value crossing the cut: its gradient comes back contiguous.
CASES += [dict(id=f"transposed-{schedule}-fx", model="transposed", schedule=schedule,
               compile=False) for schedule in ("1f1b", "zero_bubble")]
CASE_IDS = [c["id"] for c in CASES]
_GRID = GridRun(2, "models_worker:grid", CASES, task="models")


def _results(case_id: str) -> list[dict]:
    return _GRID.results(case_id)


@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if not c.startswith("dropout")])
def test_loss_grads_and_buffers_match_one_process(case_id):
    bad = []
    for rank, res in enumerate(_results(case_id)):
        assert res["functional"] is None, f"rank {rank} fell back: {res['functional']}"
        if not res["loss_diff"]["ok"]:
            bad.append(f"rank {rank} loss: {res['loss_diff']}")
        bad += [f"rank {rank} {n}: {d}" for n, d in res["grads"].items() if not d["ok"]]
        bad += [f"rank {rank} buffer {n}: {d}" for n, d in res["buffers"].items() if not d["ok"]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("compile", ["fx", "inductor"])
def test_dropout_is_the_same_under_every_schedule(compile):
    ids = [c for c in CASE_IDS if c.startswith("dropout-") and c.endswith(compile)]
    first = _results(ids[0])
    for case_id in ids[1:]:
        for rank, (res, want) in enumerate(zip(_results(case_id), first)):
            assert res["functional"] is None
            assert_close(res["loss"], want["loss"], rtol=1e-6, atol=1e-7,
                         msg=lambda m: f"rank {rank} {case_id} vs {ids[0]}: {m}")
            for n, g in want["grad_values"].items():
                assert_close(torch.tensor(res["grad_values"][n]), torch.tensor(g),
                             rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n}: {m}")
