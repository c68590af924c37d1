"""Token-weighted losses (``loss_fn`` returns ``(sum, count)``): the step's loss
and gradients are the whole batch's token mean, as one process computes it,
under every schedule, with FX and Inductor programs, and with data parallel
(replicated and sharded) over the global count (tests/token_worker.py)."""

from __future__ import annotations

import pytest

from dist_harness import GridRun
from torch_mpmd.schedules import facts, schedule_names

# Every schedule of the table, at the fewest stages per rank that show what it is for.
SCHEDULES = [(s, facts(s).typical_stages_per_rank) for s in schedule_names()]
CASES = ([dict(id=f"fx-{s}", kind="train", schedule=s, spr=spr) for s, spr in SCHEDULES]
         + [dict(id="inductor-zero_bubble", kind="train", schedule="zero_bubble",
                 compile=True),
            dict(id="errors", kind="errors")]
         + [dict(id=f"packed-{s}", kind="packed", schedule=s, spr=spr)
            for s, spr in (("1f1b", 1), ("zero_bubble", 1), ("zbv", 2))]
         + [dict(id=f"packed-hf-llama-{s}", kind="packed_hf", schedule=s)
            for s in ("1f1b", "zero_bubble")])
_GRID = GridRun(2, "token_worker:grid", CASES, task="token", timeout=900)
_GRID4 = GridRun(4, "token_worker:grid",
                 [dict(id="dp-replicate", kind="train", schedule="1f1b", dp=2),
                  dict(id="dp-shard", kind="train", schedule="1f1b", dp=2,
                       data_parallel="shard")],
                 task="token", timeout=600)


def _check(ranks: list[dict]) -> None:
    held = set()
    for rank, r in enumerate(ranks):
        held |= set(r["local"])
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']} tolerances"
        assert r["eval"] <= 1, f"rank {rank}: eval_step's loss off by {r['eval']}"
        assert r["grads"], f"rank {rank} holds no parameter"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
        bad = {n: d for n, d in r["accumulated"].items() if d > 1}
        assert not bad, f"rank {rank}: accumulated gradients off: {bad}"
        assert r["functional"], f"rank {rank}: ran under autograd, not stage programs"
    assert len(held) == 11, sorted(held)  # emb, 4 layers (weight, bias), head (weight, bias)


@pytest.mark.parametrize("case", [c["id"] for c in CASES if c["kind"] == "train"])
def test_token_weighted_loss_equals_the_token_mean_of_one_process(case):
    _check(_GRID.results(case))


@pytest.mark.parametrize("case", ["dp-replicate", "dp-shard"])
def test_token_weighted_loss_over_data_parallel_replicas_uses_the_global_count(case):
    _check(_GRID4.results(case))


def test_a_negative_count_or_a_mixed_step_is_a_value_error_on_every_rank():
    for rank, r in enumerate(_GRID.results("errors")):
        assert r["negative"] and "token count -1.0" in r["negative"], (rank, r["negative"])
        assert r["mixed"] and "a scalar for some microbatches and a (sum, count) pair" in \
            r["mixed"], (rank, r["mixed"])


@pytest.mark.parametrize("case", ["packed-1f1b", "packed-zero_bubble", "packed-zbv",
                                  "packed-hf-llama-1f1b", "packed-hf-llama-zero_bubble"])
def test_packed_documents_train_like_the_documents_one_by_one(case):
    held, every = set(), set()
    for rank, r in enumerate(_GRID.results(case)):
        held |= set(r["local"])
        every |= set(r["all"])
        assert r["rows"] == 4, r["rows"]  # 64 tokens of 10 documents in rows of 16
        assert r["loss"] <= 1, f"rank {rank}: loss off by {r['loss']} tolerances"
        assert r["tokens"][0] == r["tokens"][1], f"rank {rank}: token count {r['tokens']}"
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
        assert r["functional"], f"rank {rank}: ran under autograd, not stage programs"
    assert every <= held, sorted(every - held)  # every parameter of the GPT on some rank
