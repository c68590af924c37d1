"""The planner's predictions against measured steps on a zoo of models (issue 31, item 2).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench_plan_zoo.py --model NAME
    bash scripts/bench_plan_zoo.sh            # every model, one launch each

Models (``--model``): ``wide_head`` (the example GPT, d=128, 8 blocks, an
untied 12,288-token head, batch 16 x 64), ``deep_narrow`` (24 thin blocks,
d=64), ``mixed_widths`` (8 blocks whose MLPs are 1..8 x d wide),
``moe`` (blocks with a router over 4 experts, top-2, dense compute),
``hf_llama`` (a Hugging Face Llama with SDPA, ``loss_fn=None`` with
``labels=``) and ``tiny`` (a latency-bound MLP: every action a few tens of
microseconds).

Each launch profiles the model once (``mpmd.profile``, ``cache_dir=False``,
FX programs, 2 gloo ranks of 1 thread each: its calibration fits the
runtime's constants, planning/calibrate.py), then takes every entry of a
grid: schedules 1f1b, interleaved_1f1b, zero_bubble and zbv x microbatch
counts ``--counts`` x two splits (the planner's balanced split, ``evaluate_plan``
with ``split_points=None``, and an even split by layer count). Each entry is
predicted by ``evaluate_plan`` on that launch's sheet and measured in the
same launch: its pipeline built once, ``--warmup`` steps, then ``--steps``
timed steps barrier to barrier, all entries stepped round-robin (A B C ... A
B C) so that the machine's drift hits all alike; the median step per entry.

Printed per model: entry, predicted ms, measured ms, predicted / measured;
the Spearman rank correlation of predicted against measured; the median
|predicted / measured - 1| raw and after the launch's own scaling (one
factor, the median of measured / predicted over the entries). Per entry
also what the steps' timelines say (``--explain``): the measured compute
(all ranks' F/B/I/W spans per step) against the sheet's, and the gaps per
action, to tell a wrong price per action from wrong compute.

``--json PATH``: everything (the sheet as fitted, the sheet before the fit
and the calibration's constants, every entry's measurements) for
re-analysis without a rerun (``--from-json PATH``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2))


# ------------------------------------------------------------------ the zoo


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _gpt(vocab: int, d: int, layers: int, heads: int, widths: list[int] | None = None
         ) -> nn.Module:
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=layers, n_head=heads,
                      d_model=d))
    m.head.weight = nn.Parameter(m.tok.weight.detach().clone())  # untied
    for block, width in zip(m.blocks, widths or ()):
        block.mlp = nn.Sequential(nn.Linear(d, width * d), nn.GELU(), nn.Linear(width * d, d))
    return m


class MoE(nn.Module):
    """A router over ``experts`` MLPs, top-``k`` per token, computed densely
    (every expert on every token, weighted by the renormalised top-k gates,
    zero elsewhere): the shape of an MoE block without its dispatch."""

    def __init__(self, d: int, experts: int, k: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        top, idx = gates.topk(self.k, dim=-1)
        weights = torch.zeros_like(gates).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        out = torch.stack([e(x) for e in self.experts], dim=-1)  # (..., d, E)
        return (out * weights.unsqueeze(-2)).sum(-1)


class MoEBlock(nn.Module):
    def __init__(self, d: int, heads: int, experts: int, k: int) -> None:
        super().__init__()
        from gpt_model import GPTConfig, SelfAttention

        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(GPTConfig(d_model=d, n_head=heads))
        self.moe = MoE(d, experts, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEModel(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 96, layers: int = 6, experts: int = 4,
                 k: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, 4, experts, k) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class TinyMLP(nn.Module):
    """Latency-bound: 8 residual blocks of width 32 on 16 samples; each
    action computes for a few tens of microseconds."""

    def __init__(self, d: int = 32, layers: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
                                    for _ in range(layers))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def _llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=96, intermediate_size=256,
                                   num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


@dataclasses.dataclass
class Case:
    """One zoo model: a factory (seeded), its batch, its loss, where its
    blocks are (for the split by layer count)."""

    make: Callable[[], nn.Module]
    args: tuple
    kwargs: dict
    target: Any
    loss_fn: Any
    blocks: str
    layers: int


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))


def case_of(name: str) -> Case:
    if name == "wide_head":
        x, y = _tokens(12288, 16, 64)
        return Case(lambda: _gpt(12288, 128, 8, 4), (x,), {}, y, _lm_loss, "blocks", 8)
    if name == "deep_narrow":
        x, y = _tokens(96, 16, 64)
        return Case(lambda: _gpt(96, 64, 24, 2), (x,), {}, y, _lm_loss, "blocks", 24)
    if name == "mixed_widths":
        x, y = _tokens(96, 16, 64)
        widths = [1, 1, 2, 2, 4, 4, 8, 8]
        return Case(lambda: _gpt(96, 128, 8, 4, widths), (x,), {}, y, _lm_loss, "blocks", 8)
    if name == "moe":
        x, y = _tokens(512, 16, 32)

        def make() -> nn.Module:
            torch.manual_seed(0)
            return MoEModel()
        return Case(make, (x,), {}, y, _lm_loss, "blocks", 6)
    if name == "hf_llama":
        x, y = _tokens(1024, 16, 32)
        return Case(_llama, (x,), {"labels": y, "use_cache": False}, None, None,
                    "model.layers", 6)
    if name == "tiny":
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)

        def make_tiny() -> nn.Module:
            torch.manual_seed(0)
            return TinyMLP()
        return Case(make_tiny, (x,), {}, y, _mse, "blocks", 8)
    raise SystemExit(f"--model {name!r}: one of {', '.join(MODELS)}")


MODELS = ("wide_head", "deep_narrow", "mixed_widths", "moe", "hf_llama", "tiny")


# ------------------------------------------------------------------ statistics


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks (ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var > 0 else 0.0


def errors(predicted: list[float], measured: list[float]) -> tuple[float, float, float]:
    """(median |p/m - 1| raw, the launch's scale: median m/p, median |p*s/m - 1|)."""
    ratios = [p / m for p, m in zip(predicted, measured)]
    raw = statistics.median(abs(r - 1) for r in ratios)
    scale = statistics.median(m / p for p, m in zip(predicted, measured))
    return raw, scale, statistics.median(abs(r * scale - 1) for r in ratios)


# ------------------------------------------------------------------ the grid


def _even(case: Case, stages: int) -> list[str]:
    return [f"{case.blocks}.{case.layers * k // stages}" for k in range(1, stages)]


def grid(case: Case, sheet: Any, counts: list[int]) -> list[dict[str, Any]]:
    """Every (schedule, m, split) entry with its prediction on ``sheet``."""
    from torch_mpmd.planning import evaluate_plan

    out = []
    for schedule, v in SCHEDULES:
        for m in counts:
            for split in ("balanced", "even"):
                points = None if split == "balanced" else _even(case, sheet.pp_size * v)
                try:
                    plan = evaluate_plan(sheet, schedule, num_microbatches=m,
                                         stages_per_rank=v, split_points=points)
                except ValueError as e:  # a schedule that does not take this m
                    print(f"skipped {schedule} m={m} {split}: {e}", file=sys.stderr)
                    continue
                out.append({"name": f"{schedule} m={m} {split}", "schedule": schedule,
                            "v": v, "m": m, "split": list(plan.split_points),
                            "split_kind": split})
    # Of two entries with the same split (balanced = even, as on equal
    # blocks), one, and in the other's place the even split moved one block
    # later (a split a user might also try), so the grid keeps its size.
    seen, unique = set(), []
    for e in out:
        key = (e["schedule"], e["m"], tuple(e["split"]))
        if key in seen:
            stages = sheet.pp_size * e["v"]
            e = dict(e, split_kind="shifted", name=e["name"].replace("even", "shifted"),
                     split=[f"{case.blocks}.{case.layers * k // stages + 1}"
                            for k in range(1, stages)])
            key = (e["schedule"], e["m"], tuple(e["split"]))
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return unique


def predict(sheet: Any, entries: list[dict[str, Any]]) -> list[float]:
    from torch_mpmd.planning import evaluate_plan

    return [evaluate_plan(sheet, e["schedule"], num_microbatches=e["m"],
                          stages_per_rank=e["v"], split_points=e["split"]).predicted_step_s
            for e in entries]


def sheet_compute(sheet: Any, m: int) -> float:
    """The sheet's compute of one step (all units' F, I, W, every microbatch), s."""
    ratio = sheet.global_batch / m / sheet.reference_microbatch
    return m * sum(getattr(u, k + "_fixed") + (getattr(u, k) - getattr(u, k + "_fixed")) * ratio
                   for u in sheet.units
                   for k in ("forward", "backward_input", "backward_weight"))


def measure(case: Case, entries: list[dict[str, Any]], steps: int, warmup: int
            ) -> None:
    """Every entry's pipeline built once, then stepped round-robin; fills
    each entry's "walls" and timeline summaries."""
    import torch_mpmd as mpmd
    from torch_mpmd.runtime import trace

    pipes = []
    for e in entries:
        pipes.append(mpmd.pipeline(case.make(), loss_fn=case.loss_fn, schedule=e["schedule"],
                                   num_microbatches=e["m"], stages_per_rank=e["v"],
                                   split_points=e["split"]))
        e.update(walls=[], compute=[], gaps=[], step_out=[], actions=0, sim=[])
    kw = dict(case.kwargs)
    if case.target is not None:
        kw["target"] = case.target
    for round_ in range(warmup + steps):
        for e, pipe in zip(entries, pipes):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(*case.args, **kw)
            dist.barrier()
            wall = time.perf_counter() - t0
            pipe.zero_grad()
            if round_ < warmup:
                continue
            rows = pipe.timelines()
            e["walls"].append(wall)
            e["compute"].append(sum(t1 - t0_ for row in rows for a, t0_, t1 in row
                                    if a.is_compute))
            e["gaps"].append(trace.action_overhead(rows))
            e["step_out"].append(trace.step_overhead(wall, rows))
            e["actions"] = sum(len(r) for r in rows)
            e["rows"] = rows
    for e, pipe in zip(entries, pipes):
        rows = e.pop("rows")
        # The schedule with this entry's own measured stage means, no runtime costs:
        # what the entry's compute alone and its dependencies give.
        e["sim_compute_only"] = trace.simulate_measured(
            pipe.schedule, rows, statistic="mean").makespan * 1e-3
    del pipes


# ------------------------------------------------------------------ report


def report(data: dict[str, Any], sheet_key: str = "sheet", label: str = "") -> dict[str, float]:
    from torch_mpmd.planning.sheet import CostSheet

    sheet = CostSheet.from_json(data[sheet_key])
    entries = data["entries"]
    pred = predict(sheet, entries)
    meas = [statistics.median(e["walls"]) for e in entries]
    rho = spearman(pred, meas)
    raw, scale, scaled = errors(pred, meas)
    print(f"\n{data['model']}{label}: action overhead {sheet.action_overhead * 1e6:.0f} us, "
          f"step overhead {sheet.step_overhead * 1e3:.2f} ms, link latency "
          f"{sheet.link_latency * 1e6:.0f} us")
    print(f"| entry | predicted ms | measured ms | predicted / measured | compute: sheet / "
          "measured | gaps us/action | outside ms |")
    print("|---|---|---|---|---|---|---|")
    for e, p, m in zip(entries, pred, meas):
        comp = sheet_compute(sheet, e["m"]) / statistics.median(e["compute"])
        print(f"| {e['name']} | {p * 1e3:.1f} | {m * 1e3:.1f} | {p / m:.2f} | {comp:.2f} | "
              f"{statistics.median(e['gaps']) * 1e6:.0f} | "
              f"{statistics.median(e['step_out']) * 1e3:.1f} |")
    print(f"Spearman {rho:.3f}; median |predicted/measured - 1|: raw {raw:.1%}, after the "
          f"launch's scale ({scale:.3f}) {scaled:.1%}")
    # The machine's drift apart: each entry predicted with the sheet's units
    # scaled to the compute its own steps measured (all ranks' F/B/I/W spans).
    fair = []
    for e in entries:
        f = statistics.median(e["compute"]) / sheet_compute(sheet, e["m"])
        units = [dataclasses.replace(u, **{k: getattr(u, k) * f for k in _TIMES})
                 for u in sheet.units]
        fair.append(predict(dataclasses.replace(sheet, units=units), [e])[0])
    rho_f = spearman(fair, meas)
    raw_f, scale_f, scaled_f = errors(fair, meas)
    print(f"with each entry's own measured compute: Spearman {rho_f:.3f}; median error raw "
          f"{raw_f:.1%}, scaled ({scale_f:.3f}) {scaled_f:.1%}; the measured steps' own spread "
          f"(median over entries of each entry's max/min - 1): "
          f"{statistics.median(max(e['walls']) / min(e['walls']) - 1 for e in entries):.0%}")
    return {"spearman": rho, "raw": raw, "scale": scale, "scaled": scaled,
            "spearman_own_compute": rho_f, "scaled_own_compute": scaled_f}


_TIMES = ("forward", "backward_input", "backward_weight", "forward_fixed",
          "backward_input_fixed", "backward_weight_fixed")


def before_sheet(case: Case, seen: dict[str, Any], fit: Any) -> Any:
    """The launch's sheet as the calibration fitted it before issue 31: the
    same 1F1B run (its split and microbatches), but every barrier around its
    timed steps a named one, which polls the store every 20 ms (NOTE
    [Calibration barriers] in planning/calibrate.py), fitted to the same
    measured units. Collective."""
    from torch_mpmd.parallel import lockstep
    from torch_mpmd.planning import calibrate
    from torch_mpmd.planning.sheet import CostSheet

    class Polled(lockstep.Collectives):
        def all_reduce(self, tensor: torch.Tensor, what: str, op: Any = dist.ReduceOp.SUM,
                       *, arrive: bool = True) -> torch.Tensor:
            return super().all_reduce(tensor, what, op, arrive=True)

    raw = CostSheet.from_json(seen["raw"])
    run = seen["runtime"]
    with Polled(dist.group.WORLD, 60.0, "the old calibration") as waits:
        costs = calibrate.measure_runtime(
            case.make(), case.args, case.kwargs, case.target, loss_fn=case.loss_fn,
            group=dist.group.WORLD, units=[raw.units[0].name, *run["split_points"]],
            num_microbatches=run["num_microbatches"], link=(0.0, raw.link_bandwidth),
            waits=waits)
    seen["runtime_before"] = dataclasses.asdict(costs)
    return fit(dataclasses.replace(raw, step_overhead=costs.step_overhead,
                                   link_latency=costs.transfer_latency,
                                   action_overhead=costs.action_overhead),
               costs, seen["batch"])


def markdown(data: dict[str, Any]) -> None:
    """One table of the saved run: each entry's prediction before (the old
    calibration, fitted in the same launch) and after, against its measured
    median; then the statistics of both."""
    from torch_mpmd.planning.sheet import CostSheet

    entries = data["entries"]
    meas = [statistics.median(e["walls"]) for e in entries]
    sheets = {"before": CostSheet.from_json(data["before"]),
              "after": CostSheet.from_json(data["sheet"])}
    pred = {k: predict(sh, entries) for k, sh in sheets.items()}
    print("| entry | measured ms | predicted before | ratio | predicted after | ratio |")
    print("|---|---|---|---|---|---|")
    for i, e in enumerate(entries):
        b, a = pred["before"][i], pred["after"][i]
        print(f"| {e['name']} | {meas[i] * 1e3:.1f} | {b * 1e3:.1f} | {b / meas[i]:.2f} | "
              f"{a * 1e3:.1f} | {a / meas[i]:.2f} |")
    for k, sh in sheets.items():
        raw, scale, scaled = errors(pred[k], meas)
        print(f"{k}: {sh.action_overhead * 1e6:.0f} us per action, {sh.step_overhead * 1e3:.1f} "
              f"ms per step; Spearman {spearman(pred[k], meas):.3f}, median |p/m - 1| raw "
              f"{raw:.1%}, scaled ({scale:.2f}) {scaled:.1%}")
    print(f"spread of the measured steps (median of max/min - 1): "
          f"{statistics.median(max(e['walls']) / min(e['walls']) - 1 for e in entries):.0%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="wide_head", choices=MODELS)
    ap.add_argument("--counts", type=lambda t: [int(v) for v in t.split(",")], default=[2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-before", dest="before", action="store_false",
                    help="skip the second calibration as it ran before issue 31 (its "
                    "barriers polling the store), fitted to the same sheet for comparison")
    ap.add_argument("--json", default=None, help="write everything measured here")
    ap.add_argument("--from-json", default=None, help="report a saved run (no launch)")
    ap.add_argument("--refit", action="store_true", help="with --from-json: fit the saved "
                    "sheet and calibration again with this checkout's calibrate.fit_sheet "
                    "(its first run only)")
    ap.add_argument("--markdown", action="store_true", help="with --from-json: one table, "
                    "before and after side by side")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        if args.refit:  # the sheet as this checkout's calibrate.fit_sheet fits the launch's run
            from torch_mpmd.planning import calibrate
            from torch_mpmd.planning.sheet import CostSheet

            # One run, as measure_runtime's default (a launch of the two-count
            # calibration saved its second run too: left out here).
            run = calibrate.RuntimeCosts(**{**data["runtime"], "split_points": tuple(
                data["runtime"]["split_points"]), "second_microbatches": 0})
            data["sheet"] = calibrate.fit_sheet(CostSheet.from_json(data["raw"]), run,
                                                data["batch"]).to_json()
        if args.markdown:
            markdown(data)
            return
        if data.get("before"):
            report(data, "before", " (before: the calibration's barriers polled the store)")
        report(data, label=" (after)")
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import torch_mpmd as mpmd
    import importlib

    from torch_mpmd.planning import calibrate

    profile_mod = importlib.import_module("torch_mpmd.planning.profile")

    # The sheet before the fit and the calibration's constants, kept for re-analysis.
    seen: dict[str, Any] = {}
    real_fit = calibrate.fit_sheet

    def keeping_fit(sheet: Any, runtime: Any, batch: int, *a: Any, **k: Any) -> Any:
        seen.update(raw=sheet.to_json(), runtime=dataclasses.asdict(runtime), batch=batch)
        return real_fit(sheet, runtime, batch, *a, **k)
    calibrate.fit_sheet = keeping_fit
    if hasattr(profile_mod, "fit_sheet"):
        profile_mod.fit_sheet = keeping_fit
    real_measure = profile_mod.measure_runtime

    def timed_measure(*a: Any, **k: Any) -> Any:  # the calibration's own time
        t0 = time.perf_counter()
        try:
            return real_measure(*a, **k)
        finally:
            seen["calibration_s"] = time.perf_counter() - t0
    profile_mod.measure_runtime = timed_measure
    case = case_of(args.model)
    t0 = time.perf_counter()
    sheet = mpmd.profile(case.make(), case.args, case.kwargs, loss_fn=case.loss_fn,
                         target=case.target, cache_dir=False)
    profiled = time.perf_counter() - t0
    before = None
    if args.before:
        box = [seen]  # rank 0 fitted the sheet; every rank runs the calibration
        dist.broadcast_object_list(box, src=0)
        seen = box[0]
        before = before_sheet(case, seen, real_fit).to_json()
    entries = grid(case, sheet, args.counts)
    t0 = time.perf_counter()
    measure(case, entries, args.steps, args.warmup)
    measured = time.perf_counter() - t0
    if rank == 0:
        data = {"model": args.model, "sheet": sheet.to_json(), **seen, "entries": entries,
                "profile_s": profiled, "measure_s": measured, "before": before}
        print(f"{args.model}: profile {profiled:.1f} s (its calibration "
              f"{seen.get('calibration_s', 0.0):.1f} s), {len(entries)} entries measured in "
              f"{measured:.1f} s ({args.steps} timed steps each, round-robin)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f)
        if before is not None:
            report(data, "before", " (before: the calibration's barriers polled the store)")
        report(data, label=" (after)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
