"""mpmd.plan and pipeline(plan=...) on Hugging Face causal LMs of different
module layouts (tests/plan_hf_worker.py, 2 gloo ranks, one launch): the
units the profile finds, the same plan on every rank, and two training
steps (an SGD step between) equal to one process's loss and gradients, every
parameter held by some rank. And find_units in one process: the blocks, not
a list inside a block (a mixture of experts' experts).

The layouts: Qwen2 (tied embeddings; interleaved stages put the embedding
and the head on different ranks), Gemma2 (soft-capped attention and logits,
a sliding window shorter than the sequence, four norms per block; zbv with
every stage recomputing), GPT-NeoX (gpt_neox.layers, embed_out), OPT (the
layers under model.decoder, its final norm registered before them, learned
positions; a padded batch's attention mask, plan="auto"), GPT-2
(transformer.h, Conv1D, tied), BLOOM (ALiBi, a norm after the embedding; a
padded batch) and a user-written MoE (an nn.ModuleList of 8 experts in each
of 2 blocks). Llama is test_plan_auto.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_mpmd as mpmd
from dist_harness import GridRun
from torch_mpmd.planning import profile as profiling

M4 = {"num_microbatches": 4}
CASES = [
    dict(id="qwen2", arch="qwen2", schedules=["interleaved_1f1b"], **M4),
    dict(id="gemma2", arch="gemma2", schedules=["zbv"], recompute=True, seq=16, **M4),
    dict(id="gpt_neox", arch="gpt_neox", schedules=["1f1b"], **M4),
    dict(id="opt", arch="opt", schedules=["1f1b"], mask=True, auto=True, **M4),
    dict(id="gpt2", arch="gpt2", schedules=["interleaved_1f1b"], **M4),
    dict(id="bloom", arch="bloom", schedules=["1f1b"], mask=True, **M4),
    dict(id="moe_list", arch="moe_list", schedules=["1f1b"], **M4),
    dict(id="sequential", arch="sequential", schedules=["zbv"], layers=4, **M4),
]
for _case in CASES:
    _case["kind"] = "arch"
_GRID = GridRun(2, "plan_hf_worker:grid", CASES, task="hf", timeout=600)


def _blocks(prefix: str, n: int = 2) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


UNITS = {
    "qwen2": ["model.embed_tokens", *_blocks("model.layers"), "model.norm"],
    "gemma2": ["model.embed_tokens", *_blocks("model.layers"), "model.norm"],
    "gpt_neox": ["gpt_neox.embed_in", *_blocks("gpt_neox.layers"), "gpt_neox.final_layer_norm"],
    # OPT registers its final norm before its layers: by registration the
    # unit after them starts at the head (the profile takes the call order:
    # PROFILED).
    "opt": ["model.decoder.embed_tokens", *_blocks("model.decoder.layers"), "lm_head"],
    "gpt2": ["transformer.wte", *_blocks("transformer.h"), "transformer.ln_f"],
    "bloom": ["transformer.word_embeddings", *_blocks("transformer.h"), "transformer.ln_f"],
    "moe_list": ["model.embed_tokens", *_blocks("model.layers"), "model.norm"],
    # No ModuleList: the Sequential of blocks, not the longer head.
    "sequential": ["embed", *_blocks("blocks", 4), "head"],
}
# The profile's units before any is refined: by call order (NOTE [Outer units]).
PROFILED = UNITS | {"opt": ["model.decoder.embed_tokens", *_blocks("model.decoder.layers"),
                            "model.decoder.final_layer_norm"]}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_a_hugging_face_layout_is_planned_and_trains_like_one_process(case):
    r0, r1 = _GRID.results(case["id"])
    assert r0["units_found"] == UNITS[case["id"]], r0["units_found"]
    # The profile's units: those, in order, and maybe finer ones between
    # them (NOTE [Refined units]).
    want = PROFILED[case["id"]]
    assert [u for u in r0["units"] if u in want] == want, r0["units"]
    assert r0["plan"] == r1["plan"] and r0["stages"] == r1["stages"], (r0["plan"], r1["plan"])
    schedule, m, _, split = r0["stages"]
    assert [schedule] == case["schedules"] and m == case["num_microbatches"], r0["stages"]
    assert set(split) <= set(r0["units"]), (split, r0["units"])
    if case.get("recompute"):
        assert all(r0["plan"]["recompute"]), r0["plan"]["recompute"]
    for rank, r in enumerate((r0, r1)):
        for i, step in enumerate(r["steps"]):
            assert step["loss"] <= 1, f"rank {rank} step {i}: loss off by {step['loss']}"
            assert step["grads"], f"rank {rank}: holds no parameter"
            bad = {n: d for n, d in step["grads"].items() if d > 1}
            assert not bad, f"rank {rank} step {i}: gradients off (inf: missing): {bad}"
    assert set(r0["held"]) | set(r1["held"]) == set(r0["all_params"]), \
        set(r0["all_params"]) - set(r0["held"]) - set(r1["held"])


# ------------------------------------------------------------------ one process


class _Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))


def test_find_units_takes_the_blocks_not_a_list_inside_one():
    """A list inside a block (experts) is not the blocks even when longer;
    between lists of one length, the one holding more parameters."""
    model = nn.Module()
    model.embed = nn.Embedding(4, 8)
    model.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))  # registered first
    model.layers = nn.ModuleList(_Block(experts=6) for _ in range(2))
    model.head = nn.Linear(8, 4)
    assert profiling.find_units(model) == ["embed", "layers.0", "layers.1", "head"]
    # A ModuleList of stacks of blocks: the stacks.
    stacked = nn.ModuleList(nn.ModuleList(nn.Linear(2, 2) for _ in range(3)) for _ in range(2))
    assert profiling.find_units(stacked) == ["0", "1"]
    assert profiling.find_units(nn.ModuleList(nn.Linear(2, 2) for _ in range(3))) == \
        ["0", "1", "2"]


def test_find_units_takes_a_sequential_of_blocks_where_there_is_no_module_list():
    from plan_hf_worker import TinySequential

    model = TinySequential(3)
    assert profiling.find_units(model) == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    model.extra = nn.ModuleList(nn.LayerNorm(32) for _ in range(2))  # a list: it wins
    assert profiling.find_units(model) == ["embed", "extra.0", "extra.1"]
    assert profiling.find_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == \
        ["0", "1", "2"]


class _NormFirst(nn.Module):
    """Registers its final norm first and calls it last (as OPT does)."""

    def __init__(self) -> None:
        super().__init__()
        self.final = nn.LayerNorm(4)
        self.emb = nn.Embedding(10, 4)
        self.rope = nn.Identity()  # called first, no parameters
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rope(self.emb(x))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.final(h))


def test_outer_units_follow_the_call_order_when_a_forward_ran():
    from torch_mpmd.planning.units import call_order

    model, x = _NormFirst(), torch.randint(0, 10, (2, 3))
    blocks = ["layers.0", "layers.1", "layers.2"]
    assert profiling.find_units(model) == ["final", *blocks, "head"]  # registration
    order = call_order(model, (x,), {})
    assert profiling.find_units(model, order) == ["emb", *blocks, "final"]
    # The profile runs that forward: its units are the called ones.
    sheet = mpmd.profile(model, (x,), loss_fn=lambda out, y: out.float().mean(), target=x,
                         cache_dir=False, repeats=1)
    assert [u.name for u in sheet.units] == ["emb", *blocks, "final"]

