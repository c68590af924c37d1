"""Ranks of tests/test_microbatches.py: explicit microbatches of different
lengths (``step(microbatches=[(args, kwargs), ...], targets=[...])``) against
one process computing the same microbatches.

A small language model (embedding, four tanh layers, head) on token
sequences, each microbatch of its own length, so every activation and
gradient crossing a stage has the microbatch's own shape. The reference is
the loss contract computed in one process: the mean over microbatches of the
per-microbatch loss (scalar loss_fn), or the sum of token losses over the
token count (a ``(sum, count)`` loss_fn). Per case: a step against the
reference (loss, every gradient), a second step with another mix and another
microbatch count, eval_step and the forward call with microbatches, and a
run of 20 mixes that must reuse the one capture and the one set of programs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_mpmd as mpmd
from dist_harness import run_grid
from optim_replay import full
from token_worker import (LM, V, _diff, tiny_gpt_and_documents, tiny_llama,  # the same models,
                          token_loss)  # loss and tolerances


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def microbatches(lengths: list[int], seed: int, rows: int = 2
                 ) -> tuple[list[tuple[tuple, dict]], list[torch.Tensor]]:
    """One microbatch of ``rows`` sequences per length; the labels mask the
    last position of each row (-100), so token counts differ too."""
    g = torch.Generator().manual_seed(seed)
    mbs, targets = [], []
    for n in lengths:
        x = torch.randint(0, V, (rows, n), generator=g)
        y = torch.randint(0, V, (rows, n), generator=g)
        y[:, -1] = -100
        mbs.append(((x,), {}))
        targets.append(y)
    return mbs, targets


def reference(model: nn.Module, mbs: list, targets: list, loss_fn: Any) -> torch.Tensor:
    """The loss contract in one process, with its gradients in ``model``."""
    model.zero_grad()
    if loss_fn is token_loss:
        pairs = [token_loss(model(*a, **k), t) for (a, k), t in zip(mbs, targets)]
        loss = sum(s for s, _ in pairs) / sum(int(n) for _, n in pairs)
    else:
        loss = sum(mean_loss(model(*a, **k), t) for (a, k), t in zip(mbs, targets)) / len(mbs)
    loss.backward()
    return loss.detach()


def _compare(pipe: Any, ref: nn.Module, loss: torch.Tensor, want: torch.Tensor
             ) -> dict[str, Any]:
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"loss": _diff(loss, want),
            "grads": {n: _diff(full(p.grad), ref_grads[n]) for n, p in pipe.named_parameters()}}


# Mixes of lengths (each length a microbatch); the first two are compared
# with one process, the rest only run (the compile count).
FIRST = [7, 3, 12, 5]
SECOND = [4, 9, 2, 6, 11, 3]


def train(case: dict[str, Any]) -> dict[str, Any]:
    loss_fn = token_loss if case.get("loss") == "token" else mean_loss
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    spr = case.get("spr", 1)
    splits = ["layers.2"] if spr == 1 else ["layers.1", "layers.2", "layers.3"]
    pipe = mpmd.pipeline(model, loss_fn=loss_fn, schedule=case["schedule"],
                         num_microbatches=len(FIRST), split_points=splits, dynamic=True,
                         compile=case.get("compile", False))
    res: dict[str, Any] = {}
    mbs, targets = microbatches(FIRST, seed=1)
    want = reference(ref, mbs, targets, loss_fn)
    res["first"] = _compare(pipe, ref, pipe.step(microbatches=mbs, targets=targets), want)
    res["local"] = [n for n, _ in pipe.named_parameters()]  # (captured: this rank's)
    view = pipe.inspect()
    res["functional"] = view.uses_programs
    programs = {s: id(p) for s, p in view.programs.items()}
    # Another mix, and another microbatch count (the schedule for 6).
    pipe.zero_grad()
    mbs, targets = microbatches(SECOND, seed=2)
    want = reference(ref, mbs, targets, loss_fn)
    res["second"] = _compare(pipe, ref, pipe.step(microbatches=mbs, targets=targets), want)
    res["stats_shapes"] = pipe.last_step_stats["microbatch_shapes"]
    with torch.no_grad():
        res["eval"] = _diff(pipe.eval_step(microbatches=mbs, targets=targets), want)
        outs = pipe(microbatches=mbs)
        res["outputs"] = max(_diff(o, ref(*a, **k)) for o, (a, k) in zip(outs, mbs))
        res["output_shapes"] = [list(o.shape) for o in outs]
    # Twenty mixes more: one capture, the same programs.
    g = torch.Generator().manual_seed(5)
    for i in range(case.get("mixes", 20)):
        count = 4 + i % 3
        lengths = torch.randint(2, 16, (count,), generator=g).tolist()
        mbs, targets = microbatches(lengths, seed=10 + i)
        pipe.step(microbatches=mbs, targets=targets)
    view = pipe.inspect()
    res["captures"] = view.captures
    res["same_programs"] = {s: id(p) for s, p in view.programs.items()} == programs
    return res


def replicas(case: dict[str, Any]) -> dict[str, Any]:
    """pp2 x dp2: each data-parallel replica is given its own microbatches (4
    of some lengths on one, 6 of others on the other) with a token-weighted
    loss: the step equals one process's token mean over all ten."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    calls = [microbatches(FIRST, seed=1), microbatches(SECOND, seed=2)]
    every = [mb for mbs, _ in calls for mb in mbs], [t for _, ts in calls for t in ts]
    want = reference(ref, *every, token_loss)
    pipe = mpmd.pipeline(model, loss_fn=token_loss, schedule=case["schedule"],
                         num_microbatches=4, split_points=["layers.2"], dynamic=True, mesh=mesh,
                         data_parallel=case.get("data_parallel", "replicate"))
    mbs, targets = calls[replica]
    res = _compare(pipe, ref, pipe.step(microbatches=mbs, targets=targets), want)
    res["local"] = [n for n, _ in pipe.named_parameters()]
    return res


def hf_llama(case: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face Llama computing its own loss (``labels=`` among each
    microbatch's keyword arguments, loss_fn=None) on microbatches of different
    lengths: the mean of its losses and every gradient, as one process."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    mbs = []
    for n in FIRST:
        ids = torch.randint(1, 64, (2, n), generator=g)
        mbs.append(((), {"input_ids": ids, "labels": ids, "use_cache": False}))
    want = sum(ref(**kwargs).loss for _, kwargs in mbs) / len(mbs)
    want.backward()
    pipe = mpmd.pipeline(model, num_microbatches=len(mbs), schedule=case["schedule"],
                         dynamic=True, split_points=["model.layers.2"])
    res = _compare(pipe, ref, pipe.step(microbatches=mbs), want.detach())
    res["local"] = [n for n, _ in pipe.named_parameters()]
    res["all"] = [n for n, _ in ref.named_parameters()]
    return res


def packed(case: dict[str, Any]) -> dict[str, Any]:
    """Documents packed into rows (mpmd.pack), each row an explicit microbatch
    of its own length (Packed.microbatches), the example GPT attending within
    each document, a token-weighted loss: the step equals the documents run
    one by one in one process."""
    model, ref, docs = tiny_gpt_and_documents()
    rows = mpmd.pack(docs, tokens_per_microbatch=20, pad_to_multiple=2)
    mbs, targets = rows.microbatches()
    total = sum(F.cross_entropy(ref(d[None, :-1])[0], d[1:], reduction="sum") for d in docs)
    count = sum(len(d) - 1 for d in docs)
    (total / count).backward()
    pipe = mpmd.pipeline(model, loss_fn=token_loss, schedule=case["schedule"],
                         num_microbatches=len(mbs), split_points=["blocks.2"], dynamic=True)
    loss = pipe.step(microbatches=mbs, targets=targets)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"lengths": [args[0].shape[1] for args, _ in mbs], "loss": _diff(loss, total / count),
            "grads": {n: _diff(full(p.grad), ref_grads[n]) for n, p in pipe.named_parameters()},
            "local": [n for n, _ in pipe.named_parameters()],
            "all": [n for n, _ in ref.named_parameters()]}


def bucketed(case: dict[str, Any]) -> dict[str, Any]:
    """Microbatches of random lengths padded to buckets of 8 and 16
    (mpmd.bucket_microbatches, every microbatch of a step to the step's
    largest) on a static capture: one capture per bucket, none after both
    were seen; the first step equals one process on the unpadded
    microbatches (the padding's labels are -100)."""
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    pipe = mpmd.pipeline(model, loss_fn=token_loss, schedule=case["schedule"],
                         num_microbatches=4, split_points=["layers.2"], dynamic=False)
    g = torch.Generator().manual_seed(9)
    captures = []
    res: dict[str, Any] = {}
    for step in range(8):
        lengths = ([3, 7, 5, 6] if step == 0 else [12, 4, 9, 2] if step == 1 else
                   torch.randint(2, 17, (4,), generator=g).tolist())
        mbs, targets = microbatches(lengths, seed=20 + step)
        padded, padded_targets = mpmd.bucket_microbatches(mbs, targets, buckets=[8, 16],
                                                          uniform=True)
        loss = pipe.step(microbatches=padded, targets=padded_targets)
        if step == 0:
            res["first"] = _compare(pipe, ref, loss, reference(ref, mbs, targets, token_loss))
            res["local"] = [n for n, _ in pipe.named_parameters()]
        pipe.zero_grad()
        captures.append(pipe.inspect().captures)
    res["captures"] = captures
    return res


def errors(case: dict[str, Any]) -> dict[str, Any]:
    """Each bad input: the error's type and message on this rank (None: no error)."""
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(e).__name__}: {e}"

    def fresh(**settings: Any) -> Any:
        torch.manual_seed(0)
        return mpmd.pipeline(LM(), loss_fn=mean_loss, num_microbatches=4, timeout=30,
                             **{"schedule": "1f1b", "dynamic": True,
                                "split_points": ["layers.2"], **settings})

    mbs, targets = microbatches(FIRST, seed=1)
    # Different shapes on a static capture (first: Dynamo would otherwise
    # remember the dynamic captures below for this forward).
    attempt("static", lambda: fresh(dynamic=False).step(microbatches=mbs, targets=targets))
    # Ranks given lists of different lengths (rank 1 drops the last microbatch).
    rank = dist.get_rank()
    mine = mbs if rank == 0 else mbs[:-1]
    attempt("ranks_differ", lambda: fresh().step(microbatches=mine,
                                                 targets=targets[:len(mine)]))
    # A count the schedule cannot run: dualpipev needs m >= 2 * pp.
    attempt("too_few", lambda: fresh(schedule="dualpipev", split_points=[
        "layers.1", "layers.2", "layers.3"]).step(microbatches=mbs[:3], targets=targets[:3]))
    # Malformed entries, targets of another count, a batch beside the list.
    pipe = fresh()
    attempt("entry", lambda: pipe.step(microbatches=[mbs[0][0][0]], targets=targets[:1]))
    attempt("targets", lambda: pipe.step(microbatches=mbs, targets=targets[:2]))
    attempt("both", lambda: pipe.step(mbs[0][0][0], microbatches=mbs, targets=targets))
    # A microbatch whose target does not hold its samples.
    attempt("target_rows", lambda: pipe.step(microbatches=mbs,
                                             targets=[targets[0][:1], *targets[1:]]))
    # A microbatch whose sizes break the capture's guards (sizes of 1 are
    # specialized: the capture from microbatch 0 assumes at least 2).
    short, short_targets = microbatches([1], seed=4)
    attempt("guard", lambda: pipe.step(microbatches=mbs + short,
                                       targets=targets + short_targets))
    # The pipeline still steps after the local errors.
    attempt("after", lambda: pipe.step(microbatches=mbs, targets=targets))
    return out


def grid(cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_grid(cases, {"train": train, "errors": errors, "packed": packed,
                            "bucketed": bucketed, "replicas": replicas, "hf_llama": hf_llama})
