"""mpmd.pack and mpmd.document_mask in one process: rows of whole documents,
labels and positions per document, and attention that keeps each document to
itself (the multi-rank training runs are in tests/test_token_weighted.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torch_mpmd as mpmd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402


def test_pack_fills_rows_first_fit_with_labels_and_positions_per_document():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
    rows = mpmd.pack(docs, tokens_per_microbatch=8, pad_to_multiple=4, pad_id=0)
    assert len(rows) == 2  # [doc0, doc1] (8 tokens), [doc2, doc3] (6 -> padded to 8)
    assert rows.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert rows.input_ids[1].tolist() == [9, 10, 11, 12, 13, 14, 0, 0]
    assert rows.labels[0].tolist() == [2, 3, -100, 5, 6, 7, 8, -100]
    assert rows.labels[1].tolist() == [10, -100, 12, 13, 14, -100, -100, -100]
    assert rows.position_ids[1].tolist() == [0, 1, 0, 1, 2, 3, 0, 0]
    assert rows.document_ids[1].tolist() == [0, 0, 1, 1, 1, 1, -1, -1]
    assert [c.tolist() for c in rows.cu_seqlens] == [[0, 3, 8], [0, 2, 6]]
    batch = rows.batch()
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (2, 8), "labels": (2, 8), "position_ids": (2, 8), "document_ids": (2, 8)}


def test_pack_refuses_what_does_not_fit_naming_it():
    with pytest.raises(ValueError, match=r"document 1 has 5 tokens, more than "
                                         r"tokens_per_microbatch=4"):
        mpmd.pack([[1], [1, 2, 3, 4, 5]], tokens_per_microbatch=4)
    with pytest.raises(ValueError, match="document 0 is empty"):
        mpmd.pack([[]], tokens_per_microbatch=4)
    with pytest.raises(ValueError, match="pad_to_multiple=8 must be None or an int from 1"):
        mpmd.pack([[1]], tokens_per_microbatch=4, pad_to_multiple=8)
    with pytest.raises(ValueError, match="length=2 is shorter than the longest packed row"):
        mpmd.pack([[1, 2, 3]], tokens_per_microbatch=4).batch(2)


def test_document_mask_is_block_diagonal_causal_and_never_empty():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = mpmd.document_mask(ids)[0, 0]
    assert mask.shape == (6, 6)
    assert mask[3].tolist() == [False, False, True, True, False, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # padding attends itself
    assert mask.any(dim=-1).all()


def test_a_packed_document_sees_only_itself():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16))
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 32, (n,), generator=g) for n in (5, 9, 3, 7, 12, 2)]
    rows = mpmd.pack(docs, tokens_per_microbatch=16)
    batch = rows.batch(16)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        for r in range(len(rows)):
            cu = rows.cu_seqlens[r].tolist()
            for start, end in zip(cu, cu[1:]):
                alone = model(batch["input_ids"][r:r + 1, start:end])[0]
                torch.testing.assert_close(logits[r, start:end], alone, rtol=1e-5, atol=1e-5)


def test_packed_rows_whose_boundaries_do_not_add_up_are_refused_naming_the_row():
    import dataclasses

    rows = mpmd.pack([torch.arange(1, n + 1) for n in (5, 9, 3, 7)], tokens_per_microbatch=16)
    with pytest.raises(ValueError, match=r"row 0: document_ids do not follow cu_seqlens "
                                         r"\[0, 5, 13\]"):
        dataclasses.replace(rows, cu_seqlens=[torch.tensor([0, 5, 13]), *rows.cu_seqlens[1:]])
    with pytest.raises(ValueError, match=r"row 1: cu_seqlens \[0, 9, 40\] must rise from 0"):
        dataclasses.replace(rows, cu_seqlens=[rows.cu_seqlens[0], torch.tensor([0, 9, 40])])
    with pytest.raises(ValueError, match="row 0: labels has 3 entries, input_ids 14"):
        dataclasses.replace(rows, labels=[rows.labels[0][:3], *rows.labels[1:]])


def test_packed_rows_as_explicit_microbatches_keep_their_own_lengths():
    rows = mpmd.pack([torch.arange(1, n + 1) for n in (5, 9, 3, 7, 12, 2)],
                     tokens_per_microbatch=16)
    mbs, targets = rows.microbatches()
    assert [tuple(args[0].shape) for args, _ in mbs] == [(1, 16), (1, 10), (1, 12)]
    assert [tuple(t.shape) for t in targets] == [(1, 16), (1, 10), (1, 12)]
    assert all(set(kw) == {"position_ids", "document_ids"} for _, kw in mbs)
    assert torch.equal(mbs[1][1]["position_ids"][0], rows.position_ids[1])
    two, _ = rows.microbatches(rows_per_microbatch=2)
    assert [tuple(args[0].shape) for args, _ in two] == [(2, 16), (1, 12)]
    with pytest.raises(ValueError, match="keys \\['mask'\\] are not per-token fields"):
        rows.microbatches(keys=("mask",))
