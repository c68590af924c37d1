"""Plan a Llama-3-70B-shaped pipeline on paper (issue 21 item 6): simulated, never measured.

    python scripts/plan_on_paper.py [--batch 64] [--tflops 400] [--memory-gib 128] [--json-dir out]

Builds a cost sheet from the model's shape (80 decoder layers, hidden 8192,
ffn 28672, 64 heads / 8 kv heads, vocab 128256, seq 8192, untied embedding
and head), then for p = 8, 16, 32, 64 pipeline ranks (one GPU each) prints
the plan torch_mpmd.planning chooses and, on the same sheet, the predicted
step of the configurations as commonly published (Megatron-LM / torchtitan:
Llama-3-70B PP8 with interleaved 1F1B and 5 virtual stages, 2 layers per
stage, microbatch size 1), and the default a user starts from (1F1B, layers
split evenly by count). Everything printed is a simulation on the stated
sheet.

The sheet's assumptions (stated, all editable by flags or in the JSON that
--json-dir writes):
  - compute: the 6 * N * tokens rule per unit, split 1:2 between forward and
    backward (I and W a half of B each), at --tflops effective per GPU (bf16);
    attention's score and value matmuls are not in 6N (about 8% more per layer
    at seq 8192). The embedding is a gather, priced as writing its output once
    at 3 TB/s;
  - memory, bf16 weights: parameters 2 bytes per parameter, fp32 main
    gradients (2.0 x the parameter bytes), AdamW's fp32 master weights and two
    moments (6.0 x) sharded over --dp 8 data-parallel replicas (Megatron's
    distributed optimizer), so 0.75 x;
  - saved activations of a layer per token (bf16, flash attention): the two
    norms' inputs and outputs, q, k, v, the attention output, gate, up and
    their product: 6*h + 2*kv + 3*ffn values; the head keeps its norm's input
    and output and the logits in fp32 for the loss; a cut carries h bf16
    values per token;
  - links: NVLink 450 GB/s between ranks of a node of 8, InfiniBand 50 GB/s
    between nodes, 20 us latency per transfer, 30 us runtime overhead per
    action (the order measured on CPU runs, BENCHMARKS.md);
  - memory limit per GPU: --memory-gib (128 GiB: an H200's 141 GB less
    room for the CUDA context, workspaces and fragmentation).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from torch_mpmd.planning import CostSheet, Unit, evaluate_plan, plan_from_sheet  # noqa: E402

GIB = float(1 << 30)

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, SEQ = 80, 8192, 28672, 64, 8, 128256, 8192


def llama70b_sheet(args: argparse.Namespace, pp: int, layers: int = LAYERS) -> CostSheet:
    h, f, v, s = HIDDEN, FFN, VOCAB, SEQ
    kv = h // HEADS * KV_HEADS
    rate = args.tflops * 1e12
    layer_params = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two norms
    head_params = v * h + h                                     # the unembedding and the final norm
    bf16 = 2
    cut_bytes = s * h * bf16                                    # the hidden state of one sample

    def matmul_unit(name: str, params: int, saved: float, out: float) -> Unit:
        flops = 6 * params * s                                  # one sample of SEQ tokens
        fwd, bwd = flops / 3 / rate, 2 * flops / 3 / rate
        return Unit(name, fwd, bwd / 2, bwd / 2, saved_bytes=saved, param_bytes=params * bf16,
                    output_bytes=out)

    units = [Unit("embed", cut_bytes / 3e12, cut_bytes / 3e12, cut_bytes / 3e12,
                  saved_bytes=s * 8, param_bytes=v * h * bf16, output_bytes=cut_bytes)]
    layer_saved = s * (6 * h + 2 * kv + 3 * f) * bf16
    units += [matmul_unit(f"layers.{i}", layer_params, layer_saved, cut_bytes) for i in range(layers)]
    units.append(matmul_unit("head", head_params, s * (2 * h * bf16 + v * 4), 0.0))
    return CostSheet(
        units,
        global_batch=args.batch,
        pp_size=pp,
        reference_microbatch=1,
        input_bytes=s * 8,
        action_overhead=30e-6,
        link_latency=20e-6,
        link_bandwidth=450e9,
        ranks_per_node=8,
        inter_node_bandwidth=50e9,
        grad_bytes_per_param_byte=2.0,
        optimizer_bytes_per_param_byte=6.0 / args.dp,
        memory_limit=args.memory_gib * GIB,
    )


def even_split(sheet: CostSheet, stages: int) -> list[str]:
    """Layers split evenly by count; the embedding joins stage 0, the head the last stage."""
    layers = len(sheet.units) - 2
    return [sheet.units[1 + (k * layers) // stages].name for k in range(1, stages)]


def describe_split(sheet: CostSheet, split: tuple[str, ...] | list[str]) -> str:
    """Units per stage, run-length coded: '11 + 10x6 + 12' style."""
    starts = [0] + [sheet.index_of(n) for n in split] + [len(sheet.units)]
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return " ".join(f"{size}x{count}" if count > 1 else f"{size}" for size, count in runs)


def row(label: str, plan, sheet: CostSheet, best_step: float) -> str:
    peak = max(plan.predicted_peak_bytes)
    fits = "" if peak <= sheet.memory_limit else "  OVER LIMIT"
    rec = sum(plan.recompute)
    return (f"  {label:<44} {plan.schedule:<17} v={plan.stages_per_rank} m={plan.num_microbatches:<4} "
            f"rec {rec:>2}/{len(plan.recompute):<3} step {plan.predicted_step_s:7.3f} s "
            f"({plan.predicted_step_s / best_step:5.3f}x)  peak {peak / GIB:6.1f} GiB{fits}")


def published(sheet: CostSheet, p: int, batch: int) -> list[tuple[str, str, int, int]]:
    """(label, schedule, v, m) of the configurations compared against, where the sheet can take them."""
    out = [("user default: 1F1B, even by layer count", "1f1b", 1, batch)]
    if p == 8:
        out.append(("published: Megatron/torchtitan PP8 VP5, mbs 1", "interleaved_1f1b", 5, batch))
    elif LAYERS % (p * 5) == 0:
        out.append((f"published-style: interleaved VP5 ({LAYERS // (p * 5)} layer/stage)",
                    "interleaved_1f1b", 5, batch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences per step per pipeline replica")
    parser.add_argument("--tflops", type=float, default=400.0, help="effective bf16 TFLOP/s per GPU")
    parser.add_argument("--memory-gib", type=float, default=128.0, help="memory limit per GPU, GiB")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel replicas sharding the optimizer")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--json-dir", type=pathlib.Path, default=None, help="write each sheet and plan here")
    args = parser.parse_args()

    print("Llama-3-70B-shaped sheet (simulated; see the docstring for every assumption): "
          f"seq {SEQ}, batch {args.batch} per pipeline, {args.tflops:g} TFLOP/s per GPU, "
          f"NVLink 450 GB/s in a node of 8, IB 50 GB/s across, limit {args.memory_gib:g} GiB per GPU")
    total_search, total_candidates = 0.0, 0
    for p in args.ranks:
        sheet = llama70b_sheet(args, p)
        t0 = time.perf_counter()
        try:
            plan = plan_from_sheet(sheet, top_k=5)
        except ValueError as e:
            print(f"\np={p}: no plan: {e}")
            continue
        wall = time.perf_counter() - t0
        total_search += plan.search.search_s
        total_candidates += plan.search.candidates
        print(f"\np={p}: {plan.search.candidates} candidates, {plan.search.simulations} simulations in "
              f"{wall:.2f} s ({plan.search.candidates / plan.search.search_s:,.0f} candidates/s)")
        print(row("chosen by the planner", plan, sheet, plan.predicted_step_s))
        print(f"    split (units per stage): {describe_split(sheet, plan.split_points)}")
        for label, name, v, m in published(sheet, p, args.batch):
            if p * v > len(sheet.units):
                continue
            split = even_split(sheet, p * v)
            other = evaluate_plan(sheet, name, num_microbatches=m, stages_per_rank=v, split_points=split)
            print(row(label, other, sheet, plan.predicted_step_s))
            if max(other.predicted_peak_bytes) > sheet.memory_limit:
                every = [True] * (p * v)
                other = evaluate_plan(sheet, name, num_microbatches=m, stages_per_rank=v,
                                      split_points=split, recompute=every)
                print(row("  ... with full recompute on every stage", other, sheet, plan.predicted_step_s))
        if args.json_dir is not None:
            args.json_dir.mkdir(parents=True, exist_ok=True)
            sheet.to_json(args.json_dir / f"llama70b_p{p}_sheet.json")
            plan.to_json(args.json_dir / f"llama70b_p{p}_plan.json")

    # The speed target: 64 units on 8 ranks.
    sheet = llama70b_sheet(args, 8, layers=62)
    plan = plan_from_sheet(sheet)
    s = plan.search
    print(f"\nsearch, 64 units x p=8 (62 layers + embedding + head, batch {args.batch}): "
          f"{s.search_s * 1e3:.1f} ms, {s.candidates} candidates ({s.simulations} simulations), "
          f"{s.candidates / s.search_s:,.0f} candidates/s, {s.simulations / s.search_s:,.0f} simulations/s")


if __name__ == "__main__":
    main()
