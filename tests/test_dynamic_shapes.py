"""Symbolic sizes (issue 11 §4) on 2 gloo ranks: pipeline(dynamic=True), or a
sequence dim marked with torch._dynamo.mark_dynamic, captures once (the GPT, a
Hugging Face Llama) and builds
(and compiles) the stage programs once; each step sizes every transfer from
its own inputs. Several sequence lengths (and a batch size change) in turn:
loss and every gradient equal one process at each; a length the capture
cannot serve (1: symbols stand for sizes >= 2) captures again, with a log
line saying why. One launch runs every case (tests/dynamic_worker.py)."""

from __future__ import annotations

import pytest

from dist_harness import GridRun, tail

LENGTHS = [(4, 8), (4, 12), (4, 5), (4, 16)]
CASES = [
    dict(id="1f1b-fx", schedule="1f1b", compile=False, sizes=LENGTHS + [(8, 12)]),
    dict(id="zero_bubble-fx", schedule="zero_bubble", compile=False, sizes=LENGTHS),
    dict(id="zbv-inductor", schedule="zbv", compile="inductor", sizes=LENGTHS),
    dict(id="1f1b-inductor-marked", schedule="1f1b", compile="inductor", mark=True,
         sizes=LENGTHS),
    dict(id="hf_llama-1f1b-fx", model="hf_llama", schedule="1f1b", compile=False,
         sizes=[(4, 8), (4, 12), (4, 16)]),
    dict(id="1f1b-fx-length-1", schedule="1f1b", compile=False,
         sizes=[(4, 8), (4, 1), (4, 12), (4, 1)]),
]
_GRID = GridRun(2, "dynamic_worker:grid", CASES, task="dynamic")


def _results(case_id: str) -> list[dict]:
    return _GRID.results(case_id)


def _check_steps(ranks: list[dict]) -> None:
    bad = []
    for rank, res in enumerate(ranks):
        for size, step in res["steps"].items():
            assert step["functional"] is None, f"rank {rank} {size} fell back: {step}"
            if not step["loss"]["ok"]:
                bad.append(f"rank {rank} {size} loss: {step['loss']}")
            bad += [f"rank {rank} {size} {n}: {d}" for n, d in step["grads"].items()
                    if not d["ok"]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES[:5]])
def test_new_sequence_lengths_run_on_one_capture_and_one_compilation(case_id):
    ranks = _results(case_id)
    _check_steps(ranks)
    for rank, res in enumerate(ranks):
        assert res["captures"] == 1, f"rank {rank} captured {res['captures']} times"
    case = next(c for c in CASES if c["id"] == case_id)
    if case["compile"]:
        # F, and B or I and W, per local stage: compiled once, whatever the lengths.
        for rank, res in enumerate(ranks):
            kinds = 3 if case["schedule"] in ("zero_bubble", "zbv") else 2
            assert res["compilations"] == kinds * len(res["local_stages"]), (
                f"rank {rank}: {res['compilations']} compilations for stages "
                f"{res['local_stages']}")


def test_a_length_the_capture_cannot_serve_captures_again_once():
    ranks = _results("1f1b-fx-length-1")
    _check_steps(ranks)
    for rank, res in enumerate(ranks):
        assert res["captures"] == 2, f"rank {rank} captured {res['captures']} times"
    err = _GRID.run.stderr[0]
    assert "capturing again: the dynamic capture cannot serve these sizes " \
           "(idx.size(1)=1" in err, tail(err)
