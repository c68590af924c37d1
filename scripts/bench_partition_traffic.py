"""Balanced split by compute alone (bytes_cost=0) against the default price of
traffic (bytes_cost=None: torch_mpmd._C.DEFAULT_BYTES_COST), side by side in
one run: where each cuts, the bytes crossing its cuts per microbatch, its
largest stage's estimated compute, and its measured step time.

    torchrun --standalone --nproc-per-node 2 scripts/bench_partition_traffic.py

(or `bash scripts/bench_partition.sh traffic`). The model is a Hugging Face
Llama built from a config, by default the case of issue 13 (6 layers on 2
ranks: compute alone cuts inside a decoder layer's attention). Both pipelines live in the same two processes (1 thread
each); rounds alternate between them, so the machine's drift hits both
alike. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import torch_mpmd as mpmd
from torch_mpmd import _C


def llama(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def cuts(split) -> list[str]:
    """Each boundary as 'last module before / first module after'."""
    compute = [n for n in split.ir.graph.nodes if n.kind == _C.NodeKind.COMPUTE]
    stage = split.plan.node_stage
    return [f"{a.module_fqn or a.name} / {b.module_fqn or b.name}"
            for a, b in zip(compute, compute[1:]) if stage[a.id] != stage[b.id]]


def bytes_sent(split) -> int:
    """Activation bytes sent between stages per microbatch (each gradient
    travels back the same way)."""
    return sum(v.bytes * len(v.consumer_stages) for v in split.plan.cross_stage_values)


def timed_step(pipe, ids: torch.Tensor) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    pipe.step(ids, labels=ids, use_cache=False)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages-per-rank", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = llama(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    schedule = "1f1b" if args.stages_per_rank == 1 else "interleaved_1f1b"
    settings = {"compute alone (bytes_cost=0)": 0.0,
                f"default (bytes_cost={_C.DEFAULT_BYTES_COST:g})": None}
    pipes = {}
    for label, bytes_cost in settings.items():
        # loss_fn=None: the model returns its loss (labels= are split like ids).
        pipes[label] = mpmd.pipeline(copy.deepcopy(model), schedule=schedule,
                                     num_microbatches=args.microbatches,
                                     stages_per_rank=args.stages_per_rank, bytes_cost=bytes_cost)
        timed_step(pipes[label], ids)  # capture and warm up
    times: dict[str, list[float]] = {label: [] for label in pipes}
    for _ in range(args.rounds):
        for label, pipe in pipes.items():
            times[label].append(timed_step(pipe, ids))
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    print(f"Llama {args.layers} layers, d={args.d_model}, batch {args.batch} x {args.seq} tokens, "
          f"{args.microbatches} microbatches, {dist.get_world_size()} ranks x "
          f"{args.stages_per_rank} stage(s), {schedule}, median of {args.rounds} steps")
    print("| split | bytes crossing cuts per microbatch | largest stage compute (est.) "
          "| step time | cuts |")
    print("|---|---|---|---|---|")
    base = statistics.median(times[next(iter(pipes))])
    for label, pipe in pipes.items():
        median = statistics.median(times[label])
        print(f"| {label} | {bytes_sent(pipe.split):,} | {max(pipe.split.plan.stage_cost):.3g} "
              f"| {median * 1e3:.1f} ms ({median / base:.2f}x) | {'; '.join(cuts(pipe.split))} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
