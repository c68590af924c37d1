"""Bad input to the data helpers and to explicit microbatches (issue 34): a clear
ValueError naming the value, never a silent conversion or torch's own error
naming no microbatch; and microbatches made as slices run like one process.
One process (world size 1: every stage local), no launch."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from torch_mpmd.microbatch import first_microbatch
from torch_mpmd.planning.plan import Plan


# ---------------------------------------------------------------- pack
@pytest.mark.parametrize("docs,message", [
    ([[3, 1.5]], r"document 0, token 1 is float 1.5; token ids must be ints"),
    ([[1], torch.tensor([2.0, 3.0])], r"document 1 is a tensor of dtype torch.float32 and "
                                      r"shape \(2,\); token ids must be integers"),
    ([[1, True]], r"document 0, token 1 is bool True"),
    ([torch.tensor([True])], r"document 0 is a tensor of dtype torch.bool"),
    ([[1], "str"], r"document 1 is str 'str'; each document is a 1-D integer tensor or a list "
                   r"of int token ids"),
    ([None], r"document 0 is None; each document is"),
    ("abc", r"sequences must be a list of documents .* got str 'abc'"),
    (torch.tensor([1, 2]), r"sequences must be a list of documents .* got a tensor of dtype "
                           r"torch.int64 and shape \(2,\)"),
])
def test_pack_refuses_what_is_no_token_id_naming_document_and_value(docs, message):
    with pytest.raises(ValueError, match=message):
        mpmd.pack(docs, tokens_per_microbatch=8)


def test_pack_takes_integer_ids_of_every_kind_alike_and_no_numpy_float():
    import numpy as np

    want = mpmd.pack([[3, 4]], tokens_per_microbatch=8).input_ids
    for doc in ([np.int64(3), 4], torch.tensor([3, 4], dtype=torch.int32), np.array([3, 4]),
                (3, 4), range(3, 5)):
        got = mpmd.pack([doc], tokens_per_microbatch=8).input_ids
        assert [t.tolist() for t in got] == [t.tolist() for t in want], doc
        assert got[0].dtype == torch.long
    with pytest.raises(ValueError, match="document 0 is a tensor of dtype torch.float64"):
        mpmd.pack([np.array([3.7, 4.0])], tokens_per_microbatch=8)  # before: [3, 4]


def test_pack_refuses_a_budget_that_is_no_multiple_of_pad_to_multiple():
    # Before: a full row was cut to the budget, 10 tokens, no multiple of 4.
    with pytest.raises(ValueError, match=r"tokens_per_microbatch=10 is not a multiple of "
                                         r"pad_to_multiple=4.* budget of 8 or 12"):
        mpmd.pack([list(range(1, 10))], tokens_per_microbatch=10, pad_to_multiple=4)
    rows = mpmd.pack([list(range(1, 10)), [1, 2]], tokens_per_microbatch=12, pad_to_multiple=4)
    assert [len(r) for r in rows.input_ids] == [12]  # 11 tokens padded to 12


# ---------------------------------------------------------------- microbatch_order
@pytest.mark.parametrize("sizes,message", [
    (["a"], r"sizes\[0\] is str 'a'; each size is a finite number >= 0"),
    ([4, None], r"sizes\[1\] is NoneType None"),
    ([4, float("nan")], r"sizes\[1\] is float nan"),
    ([True, 4], r"sizes\[0\] is bool True"),
    ("ab", r"sizes must be a list of numbers.* got str 'ab'"),
])
def test_microbatch_order_refuses_sizes_that_are_no_numbers(sizes, message):
    with pytest.raises(ValueError, match=message):
        mpmd.microbatch_order(sizes, pp_size=2)


# ---------------------------------------------------------------- plan JSON
def _plan_json() -> dict:
    from test_planner_sheet import _sheet

    return json.loads(mpmd.planning.plan_from_sheet(_sheet(), top_k=2).to_json())


@pytest.mark.parametrize("change,message", [
    # Before: "100" became 100.0 silently; "1 GB": could not convert string to float.
    (lambda d: d.update(predicted_peak_bytes=["100"] * len(d["predicted_peak_bytes"])),
     r"the plan: predicted_peak_bytes\[0\]='100' \(str\) must be a number"),
    (lambda d: d.update(predicted_peak_bytes="1 GB"),
     r"the plan: predicted_peak_bytes='1 GB' \(str\) must be a list of numbers"),
    # Before: "false" was True.
    (lambda d: d.update(recompute=["false"] * len(d["recompute"])),
     r"the plan: recompute\[0\]='false' \(str\) must be true or false"),
    (lambda d: d.update(num_microbatches="8"),
     r"the plan: num_microbatches='8' \(str\) must be an int >= 1"),
    (lambda d: d["search"].update(memory_limit="100"),
     r"the plan's search: memory_limit='100' \(str\) must be a number"),
    (lambda d: d["search"]["top"][0]["predicted_peak_bytes"].__setitem__(0, "1e9 bytes"),
     r"the plan's search.top\[0\]: predicted_peak_bytes\[0\]='1e9 bytes' \(str\) must be a "
     r"number"),
    (lambda d: d["search"]["rejected"].append({"schedule": "gpipe"}),
     r"the plan's search.rejected\[\d+\] has no 'num_microbatches'"),
])
def test_plan_json_fields_of_the_wrong_type_are_named(change, message):
    data = _plan_json()
    assert Plan.from_dict(json.loads(json.dumps(data))).to_dict()["schedule"] == data["schedule"]
    change(data)
    with pytest.raises(ValueError, match=message):
        Plan.from_json(json.dumps(data))


# ---------------------------------------------------------------- microbatches
def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _gpt_pipe(**kw):
    torch.manual_seed(0)
    model = models.CharGPT(vocab=32, d=16, n_layer=2, n_head=2, block_size=8)
    pipe = mpmd.pipeline(copy.deepcopy(model), loss_fn=lm_loss, num_microbatches=2,
                         split_points=["blocks.1"], schedule="gpipe", stages_per_rank=2, **kw)
    return model, pipe


@pytest.mark.parametrize("bad,message", [
    (lambda x: x[:, :0], r"microbatch 1: positional argument 0 has shape \(2, 0\), a dim of "
                         r"length 0"),
    (lambda x: x[:0, :5], r"microbatch 1: positional argument 0 has shape \(0, 5\), zero rows"),
])
def test_empty_explicit_microbatches_are_named_before_any_capture(bad, message):
    _, pipe = _gpt_pipe(dynamic=True)
    x = torch.randint(0, 32, (2, 8))
    b = bad(x)
    with pytest.raises(ValueError, match=message):
        pipe.step(microbatches=[((x[:, :5],), {}), ((b,), {})],
                  targets=[x[:, :5], torch.zeros(b.shape, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"microbatch 0: keyword argument 'idx' has shape"):
        pipe.step(microbatches=[((), {"idx": b})], targets=[x[:, :5]])
    with pytest.raises(ValueError, match=r"microbatch 1: target has shape"):
        pipe.step(microbatches=[((x[:, :5],), {}), ((x[:, :5],), {})],
                  targets=[x[:, :5], bad(x)])


def test_a_batch_with_a_zero_length_dim_is_named():
    with pytest.raises(ValueError, match=r"positional argument 0 has shape \(4, 0\): a dim of "
                                         r"length 0"):
        first_microbatch((torch.zeros(4, 0),), {}, 2)
    # Replicate takes an empty tensor whole, on purpose.
    first_microbatch((torch.zeros(4, 3), mpmd.Replicate(torch.zeros(0))), {}, 2)


def test_microbatches_made_as_slices_train_like_one_process():
    # Before: x[:, :5] keeps the batch's stride 8, which dynamic=True made a
    # symbol of its own: a CaptureError on stride().
    model, pipe = _gpt_pipe(dynamic=True)
    x = torch.randint(0, 32, (2, 8))
    y = torch.randint(0, 32, (2, 8))
    lengths = (5, 7, 3)
    loss = pipe.step(microbatches=[((x[:, :n],), {}) for n in lengths],
                     targets=[y[:, :n] for n in lengths])
    want = sum(lm_loss(model(x[:, :n]), y[:, :n]) for n in lengths) / len(lengths)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_batch_made_as_a_slice_trains_like_one_process(dynamic):
    # Before: dynamic=True failed at capture on the slice's stride; static,
    # a dense batch then a sliced one of its shape failed in a program's view.
    model, pipe = _gpt_pipe(dynamic=dynamic)
    x = torch.randint(0, 32, (4, 8))
    y = torch.randint(0, 32, (4, 8))
    grads = dict(pipe.named_parameters())
    for xs, ys in [(x[:, :5].contiguous(), y[:, :5].contiguous()), (x[:, :5], y[:, :5]),
                   (x[:, 2:7], y[:, 2:7])]:
        loss = pipe.step(xs, target=ys)
        want = sum(lm_loss(model(a), b) for a, b in zip(xs.chunk(2), ys.chunk(2))) / 2
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
        pipe.zero_grad()
        model.zero_grad()


def test_a_microbatch_longer_than_the_model_takes_is_named_in_the_error():
    # Known only when it runs (an embedding lookup past the position table
    # adds no guard): the failure names the microbatch and its inputs' shapes.
    _, pipe = _gpt_pipe(dynamic=True)
    x = torch.randint(0, 32, (2, 12))
    with pytest.raises(mpmd.PipelineError,
                       match=r"index out of range.*microbatch 1 \(inputs idx \(2, 12\)\)"):
        pipe.step(microbatches=[((x[:, :5],), {}), ((x[:, :12],), {})],
                  targets=[x[:, :5], x[:, :12]])
