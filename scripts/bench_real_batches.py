"""Real batches on the example GPT, 2 ranks: packed documents, variable-length
microbatches and their order, side by side in one run (issue 22).

    torchrun --standalone --nproc-per-node 2 scripts/bench_real_batches.py [--steps N]

(or `bash scripts/bench_real_batches.sh`). Every step draws the same
documents for every contender: ``--docs`` token sequences of fine-tuning-like
lengths (lognormal, mean ~300 tokens, clipped to [16, 2048]). Each contender
is a torch_mpmd pipeline (1F1B, FX stage programs unless ``--compile``,
``dynamic=True``, a token-weighted loss) stepping on them in turn, after
``--warmup`` steps each:

- pad:      the documents padded to the step's longest, one batch split into
            ``--microbatches`` microbatches (today's way);
- packed:   ``mpmd.pack`` into rows of at most 2,048 tokens (padded to a
            multiple of 64), one row per explicit microbatch, attention kept
            within each document;
- varlen:   the documents sorted by length into ``--microbatches`` explicit
            microbatches, each padded to its own longest (multiple of 64);
- varlen+order: the same microbatches in ``mpmd.microbatch_order``'s order;
- fixed:    as many microbatches of one shape holding the same padded
            token count (the runtime's cost of varying shapes is
            varlen's overhead per action over fixed's).

Prints real tokens/s per contender, the step-time spread (p90/p50), the
runtime's own time per action (step span minus time inside programs), and
the captures and stage-program builds after the warm-up (both should be 0).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_mpmd as mpmd  # noqa: E402
from torch_mpmd import trace  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

MAX_LEN = 2048


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    return total, (labels != -100).sum()


def documents(step: int, n: int, vocab: int) -> list[torch.Tensor]:
    """``n`` documents of lognormal lengths (mean ~300, clipped to [16, 2048])."""
    g = torch.Generator().manual_seed(1000 + step)
    sigma = 1.0
    mu = math.log(300) - sigma ** 2 / 2
    lengths = torch.empty(n).log_normal_(mu, sigma, generator=g).round().clamp(16, MAX_LEN)
    return [torch.randint(1, vocab, (int(k),), generator=g) for k in lengths.tolist()]


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _padded(docs: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids and next-token labels, padded to ``length`` (labels -100)."""
    x = torch.zeros(len(docs), length, dtype=torch.long)
    y = torch.full((len(docs), length), -100, dtype=torch.long)
    for i, d in enumerate(docs):
        x[i, :len(d)] = d
        y[i, :len(d) - 1] = d[1:]
    return x, y


def pad_call(docs: list[torch.Tensor], m: int) -> dict[str, Any]:
    x, y = _padded(docs, max(len(d) for d in docs))
    return {"args": (x,), "target": y}


def packed_call(docs: list[torch.Tensor], m: int) -> dict[str, Any]:
    rows = mpmd.pack(docs, tokens_per_microbatch=MAX_LEN, pad_to_multiple=64)
    mbs, targets = [], []
    for k in range(len(rows)):
        mbs.append(((rows.input_ids[k][None],), {"position_ids": rows.position_ids[k][None],
                                                  "document_ids": rows.document_ids[k][None]}))
        targets.append(rows.labels[k][None])
    return {"microbatches": mbs, "targets": targets}


def varlen_microbatches(docs: list[torch.Tensor], m: int) -> tuple[list, list]:
    by_length = sorted(docs, key=len)
    per = len(docs) // m
    mbs, targets = [], []
    for k in range(m):
        group = by_length[k * per:(k + 1) * per]
        x, y = _padded(group, _round_up(max(len(d) for d in group), 64))
        mbs.append(((x,), {}))
        targets.append(y)
    return mbs, targets


def varlen_call(docs: list[torch.Tensor], m: int) -> dict[str, Any]:
    mbs, targets = varlen_microbatches(docs, m)
    # Interleave short and long (sorted order is an unusually good start).
    mix = [i for pair in zip(range(m // 2), range(m - 1, m // 2 - 1, -1)) for i in pair]
    return {"microbatches": [mbs[i] for i in mix], "targets": [targets[i] for i in mix]}


def ordered_call(docs: list[torch.Tensor], m: int) -> dict[str, Any]:
    call = varlen_call(docs, m)
    sizes = [x.numel() for (x,), _ in call["microbatches"]]
    order = mpmd.microbatch_order(sizes, schedule="1f1b", pp_size=2)
    return {"microbatches": order.apply(call["microbatches"]),
            "targets": order.apply(call["targets"])}


def fixed_call(docs: list[torch.Tensor], m: int) -> dict[str, Any]:
    mbs, _ = varlen_microbatches(docs, m)
    rows = mbs[0][0][0].shape[0]
    length = _round_up(sum(x.numel() for (x,), _ in mbs) // (m * rows), 64)
    g = torch.Generator().manual_seed(len(docs))
    out, targets = [], []
    for _ in range(m):
        x = torch.randint(1, 64, (rows, length), generator=g)
        out.append(((x,), {}))
        targets.append(torch.roll(x, -1, 1))
    return {"microbatches": out, "targets": targets}


CONTENDERS = {"pad": pad_call, "packed": packed_call, "varlen": varlen_call,
              "varlen+order": ordered_call, "fixed": fixed_call}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=256, block_size=MAX_LEN, n_layer=args.layers, n_head=4,
                    d_model=args.d_model)
    pipes = {}
    for label in CONTENDERS:
        torch.manual_seed(0)
        pipes[label] = mpmd.pipeline(GPT(cfg), loss_fn=token_loss, schedule="1f1b",
                                     num_microbatches=args.microbatches, dynamic=True,
                                     compile=args.compile, timeout=600)
    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    tokens: dict[str, list[int]] = {k: [] for k in CONTENDERS}
    overhead: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    built: dict[str, Any] = {}
    for step in range(args.warmup + args.steps):
        docs = documents(step, args.docs, cfg.vocab_size)
        real = sum(len(d) - 1 for d in docs)  # labelled tokens
        for label, make in CONTENDERS.items():
            call = make(docs, args.microbatches)
            pipe = pipes[label]
            dist.barrier()
            t0 = time.perf_counter()
            if "args" in call:
                pipe.step(*call["args"], target=call["target"])
            else:
                pipe.step(microbatches=call["microbatches"], targets=call["targets"])
            dist.barrier()
            elapsed = time.perf_counter() - t0
            pipe.zero_grad(set_to_none=True)
            if step == args.warmup - 1:  # what the warm-up built
                view = pipe.inspect()
                built[label] = (view.captures, {s: id(p) for s, p in view.programs.items()})
            if step < args.warmup:
                continue
            times[label].append(elapsed)
            tokens[label].append(real if label != "fixed" else pipe.last_token_count)
            overhead[label].append(trace.action_overhead(pipe.timelines()))
    if rank != 0:
        dist.destroy_process_group()
        return
    print(f"example GPT d={args.d_model} x {args.layers} layers, 2 ranks x 1 thread, 1F1B, "
          f"{'Inductor' if args.compile else 'FX'} programs, {args.docs} documents per step "
          f"(lognormal, mean ~300 tokens, max {MAX_LEN}), {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"{'contender':<14}{'median step ms':>15}{'real tokens/s':>15}{'p90/p50':>9}"
          f"{'us/action':>11}{'captures+builds after warm-up':>31}")
    rate = {}
    for label in CONTENDERS:
        med = statistics.median(times[label])
        rate[label] = sum(tokens[label]) / sum(times[label])
        qs = statistics.quantiles(times[label], n=10)
        view = pipes[label].inspect()
        captures = view.captures - built[label][0]
        rebuilt = sum(1 for s, p in view.programs.items() if built[label][1].get(s) != id(p))
        print(f"{label:<14}{med * 1e3:>15.1f}{rate[label]:>15.0f}{qs[8] / qs[4]:>9.2f}"
              f"{statistics.median(overhead[label]) * 1e6:>11.1f}"
              f"{f'{captures} + {rebuilt}':>31}")
    print(f"packed / pad real tokens/s: {rate['packed'] / rate['pad']:.2f}x")
    fixed_step = statistics.median(times["fixed"])
    actions = len(pipes["varlen"].schedule.actions[0])
    extra = (statistics.median(overhead["varlen"]) - statistics.median(overhead["fixed"])) * \
        actions
    print(f"varlen / fixed step: {statistics.median(times['varlen']) / fixed_step:.3f} "
          f"(same padded tokens; attention is quadratic in length, so varlen computes more); "
          f"the runtime's own time, varlen over fixed: {extra * 1e3:+.2f} ms per step = "
          f"{extra / fixed_step:+.1%} of fixed's step")
    print(f"varlen+order / varlen step: "
          f"{statistics.median(times['varlen+order']) / statistics.median(times['varlen']):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
