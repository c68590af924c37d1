"""Profiles: a model's measured per-unit costs as a :class:`CostSheet`.

    sheet = profile(model, (x,), loss_fn=F.cross_entropy, target=y)   # x, y: one step's batch
    plan = plan_from_sheet(sheet)

Units: by default the model's repeated blocks, cut at module FQNs as a user
would cut (``split_points``): the children of its largest ``nn.ModuleList``
(``layers.0`` .. ``layers.N-1``, ``blocks.i``), with a unit before them that
starts at the embedding and holds whatever runs before the first block, and
one after them that starts at the final norm (or the head) and holds
whatever runs after the last block (norm, head, loss): the parts of real
LLMs that weigh unlike a block (find_units, NOTE [Outer units]). A unit that
costs more than a balanced stage (F + B above the total over the pipeline
size), or one holding a balanced split's boundary where whole units cannot
balance (units.coarse), is cut one level down where its submodules start,
in call order (units.py, NOTE [Refined units]): a block at its attention
and MLP, the part after the blocks at its head. Or ``units=[fqn, ...]``, the FQNs where units start (the
first also holds what runs before it). A unit is named by its FQN, so a
plan's ``split_points`` (the units where stages 1.. start) are FQNs that
``pipeline(split_points=...)`` takes.

How it measures (one process, as the pipeline runs): the model is split with
``split_model`` at every unit boundary at a microbatch of the reference size,
and a ``ProgramRunner`` runs the stage programs the runtime would run (FX
graphs, or compiled with ``compile``): F, B, and B's halves I and W, each
stage on its own, ``repeats`` times after a warm-up; each cost is the
median. Rule for I and W: both are measured as the runtime runs them (I then
W, the programs ``_C.split_backward`` cuts B into), then scaled so that
I + W equals the measured B (the schedules without the split run B; the
ratio is kept). Saved bytes: what each stage program's forward saves for its
backward per microbatch (``StagePrograms.saved_bytes``: parameters, inputs
and views of them excluded; under the autograd fallback, what
saved_tensors_hooks saw), and apart the unit's received values it keeps
(``saved_input_bytes``: new bytes where an earlier unit of the same stage
produces them, as inside a refined block). Parameter bytes: the parameters each unit reads (a
weight tied across units counts in each). Output bytes: everything that
crosses the cut right after a unit (values produced at or before it and read
after it, skip connections included). Input bytes: the model inputs of one
microbatch.

Sizes: ``microbatch_sizes`` (samples; default the largest divisor of the
batch at most ``batch / (2 * pp_size)``, i.e. a microbatch of the m = 2p
plans) are the microbatches measured; with several, each cost is the
least-squares line through the origin over them (the planner scales costs
linearly, NOTE [Microbatch scaling] in csrc/core/planner.h), given at the
first size, the sheet's ``reference_microbatch``.

The runtime and the link: with a ``group`` of more than one rank, pipeline
ranks 0 and 1 measure the link by a ping-pong (median round trip of 4 bytes
/ 2; the time of 4 MiB one way less that latency), and then every rank runs
the model as a 1F1B pipeline for a few steps (calibrate.py): the sheet's
``step_overhead`` is the runtime's measured time per step outside its
actions, its ``link_latency`` what a transfer took beyond its bytes, and its
``action_overhead`` the price per action at which the planner predicts that
run's measured step (NOTE [Fitted action overhead]). On one process they
are :data:`DEFAULT_ACTION_OVERHEAD_S` (110 us: fitted the same way on two
CPU ranks with FX programs, a price that also covers the step's time
outside its actions), 0, :data:`DEFAULT_LINK_LATENCY_S` (150 us, gloo's
measured transfer latency between two CPU ranks) and
:data:`DEFAULT_LINK_BANDWIDTH` (1 GB/s).

Data parallel: with a ``dp_group`` of d > 1 ranks (``mpmd.plan`` on a mesh
with a "dp" dimension), the sheet's ``dp_size`` is d and its ``dp_latency``
and ``dp_bandwidth`` are fitted, right after the ping-pong, to the ring
all-reduce the replicate mode runs, 2 (d - 1) latency + 2 (d - 1) / d *
bytes / bandwidth, from the median of a 4-byte and of a 4 MiB all-reduce
over the real dp group (every rank times its own group; pipeline rank 0's
times go on the sheet). Like the link, they are measured at every launch.

Cache: a JSON file under ``cache_dir`` (default ``$MPMD_PROFILE_CACHE``, else
``~/.cache/torch_mpmd/profiles``) named by a hash of the model (every module
class's name and forward source, its parameter and buffer names, shapes and
dtypes), the batch's and target's shapes and dtypes, the units, the sizes,
the loss, the device type, the pipeline size (and the dp size above 1) and the
compile setting. A call with the same key loads its units
(``cache_dir=False``: no cache). ``measurements`` counts the profiles
measured in this process (tests check that a second call does not measure).

NOTE [Relative profiles]: what the cache keeps is the units as measured,
before any fit, and what it gives back is never used as seconds. A shared
machine changes speed by the hour (the same step measured 215 ms in one
launch and 330 ms in another an hour later), so seconds from another launch,
beside this launch's runtime constants, would price the runtime against
programs of another speed. Every launch therefore measures its own link
(the ping-pong), its dp group's all-reduce and its calibration run, and
fits the cached units to that run (calibrate.fit_sheet: the units scaled by
one factor to the compute the run measured, then the price per action):
the cache saves the units' measuring, the part that grows with the model,
and keeps only their ratios.

Collective with a ``group``: rank 0 of the group measures (the ping-pong
needs rank 1) and broadcasts the sheet's JSON, so every rank returns the
same sheet. With a ``dp_group`` also collective over it (every launch
times the all-reduce on every replica at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_mpmd.parallel import lockstep
from torch_mpmd.planning.calibrate import (RuntimeCosts, batch_size_of, fit_sheet,
                                           measure_runtime, model_state_kept)
from torch_mpmd.planning.profile_cache import cache_dir_of, profile_key, read_entry, write_entry
from torch_mpmd.planning.sheet import CostSheet, Unit
from torch_mpmd.planning.units import call_order, coarse, refine, too_big

__all__ = ["profile", "find_units", "profile_key", "measurements",
           "DEFAULT_ACTION_OVERHEAD_S", "DEFAULT_LINK_LATENCY_S", "DEFAULT_LINK_BANDWIDTH"]

DEFAULT_ACTION_OVERHEAD_S = 110e-6
DEFAULT_LINK_LATENCY_S = 150e-6
DEFAULT_LINK_BANDWIDTH = 1e9
# How long a rank waits at a profile's collective with no rank making
# progress (profile(timeout=)); the pipeline's own default timeout.
DEFAULT_TIMEOUT_S = 60.0
_PING_BYTES = 4
_PONG_BYTES = 4 << 20

# Profiles measured (not loaded from a cache) in this process.
measurements = 0


# ------------------------------------------------------------------ units


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_units(model: torch.nn.Module, order: Mapping[str, int] | None = None) -> list[str]:
    """Where the units start: the FQNs of the children of ``model``'s largest
    list of blocks (an ``nn.ModuleList``; where there is none, the
    ``nn.Sequential`` holding the most parameters, as timm's ViT holds its
    blocks) not inside another one's child (on a tie, the one holding more
    parameters, then the first found), led by
    the first module with parameters registered before the list on the way
    down to it (the embedding: a unit of what runs before the blocks) and
    followed by the first one registered after it (the final norm or the
    head: a unit of what runs after them). With ``order`` (units.call_order
    of one forward), "before" and "after" are the first calls with
    parameters before the first block's and after the last block's, outside
    the list and its ancestors (OPT registers its final norm before its
    layers and calls it after them). ValueError when the model has no
    list of two or more modules."""
    # An nn.Sequential only where no nn.ModuleList holds two modules: a
    # model with a list of blocks often builds small Sequentials too (an
    # MLP, a classifier head), longer than a short list of blocks.
    for kind in (torch.nn.ModuleList, torch.nn.Sequential):
        lists = {name: mod for name, mod in model.named_modules()
                 if isinstance(mod, kind) and len(mod) >= 2}
        if lists:
            break
    best: tuple[int, int, str] | None = None
    for name, mod in lists.items():
        # A list inside a child of another list is part of one block: a
        # mixture of experts' experts (an nn.ModuleList per block, as in
        # transformers 4's Mixtral and Qwen-MoE, and in MoEs users write),
        # often more of them than there are blocks; cutting there would
        # leave the other blocks whole in the units before and after it.
        if any(outer != name and (not outer or name.startswith(outer + "."))
               for outer in lists):
            continue
        size = (len(mod), sum(p.numel() for p in mod.parameters()))
        if kind is torch.nn.Sequential:  # the blocks outweigh a head's few layers
            size = size[::-1]
        if best is None or size > best[:2]:
            best = (*size, name)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of "
                         "blocks to cut at; "
                         "pass units=[module FQNs where units start]")
    path = best[2]
    mods = model.get_submodule(path) if path else model
    blocks = [f"{path}.{child}" if path else child for child, _ in mods.named_children()]
    if order is not None and all(b in order for b in blocks):
        return (_outer_called(model, path, blocks, order, "before") + blocks
                + _outer_called(model, path, blocks, order, "after"))
    return _outer(model, path, "before") + blocks + _outer(model, path, "after")


def _outer_called(model: torch.nn.Module, path: str, blocks: list[str],
                  order: Mapping[str, int], side: str) -> list[str]:
    """:func:`_outer` by call order: the first module with parameters called
    before the first block (``side`` "before") or after the last block
    starts ("after"), neither inside the list at ``path`` nor one of its
    ancestors (they are called around it); [] when none."""
    begin, end = min(order[b] for b in blocks), max(order[b] for b in blocks)
    modules = dict(model.named_modules())
    called = sorted(order, key=order.__getitem__)
    for name in called:
        at = order[name]
        if (at < begin) if side == "before" else (at > end):
            inside = path and name.startswith(path + ".")
            around = not path or path.startswith(name + ".") or path == name
            if not inside and not around and name in modules and \
                    _has_parameters(modules[name]):
                return [name]
    return []


def _outer(model: torch.nn.Module, path: str, side: str) -> list[str]:
    """The first module with parameters registered ``side`` ("before" or
    "after") the module at ``path`` among its siblings, walking from ``path``
    up to the root (HF's ``model.embed_tokens`` before ``model.layers``,
    ``model.norm`` after it; ``lm_head`` where the list's parent has none
    after it); [] when none.
    NOTE [Outer units]: registration order stands for call order where no
    forward was run (it does in most models, and a user reads the model the
    same way); the profile runs one and takes the call order
    (:func:`_outer_called`): OPT registers its final norm before its layers.
    A cut at a module called elsewhere is still a valid split, only a less
    balanced one."""
    parts = path.split(".") if path else []
    while parts:
        parent_path, child = ".".join(parts[:-1]), parts[-1]
        parent = model.get_submodule(parent_path) if parent_path else model
        names = list(parent._modules)
        at = names.index(child)
        # Before: the first registered (where the unit of what runs first starts).
        for name in (names[:at] if side == "before" else names[at + 1:]):
            sub = parent._modules[name]
            if sub is not None and _has_parameters(sub):
                return [f"{parent_path}.{name}" if parent_path else name]
        parts = parts[:-1]
    return []


def _check_units(model: torch.nn.Module, units: Sequence[str]) -> list[str]:
    if isinstance(units, str) or not isinstance(units, Sequence) or not units:
        raise ValueError(f"units={units!r} must be a non-empty list of module FQNs")
    out = list(units)
    known = dict(model.named_modules())
    for u in out:
        if not isinstance(u, str) or u not in known or not u:
            raise ValueError(f"units: {u!r} is not a submodule of {type(model).__name__}")
    if len(set(out)) != len(out):
        raise ValueError(f"units={out!r} repeat a name")
    return out


# ------------------------------------------------------------------ sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_microbatch(batch: int, pp_size: int) -> int:
    """The largest divisor of ``batch`` at most ``batch / (2 * pp_size)`` (at least 1)."""
    cap = max(1, batch // (2 * pp_size))
    return max(d for d in _divisors(batch) if d <= cap)


def _sizes(microbatch_sizes: Any, batch: int, pp_size: int) -> list[int]:
    if microbatch_sizes is None:  # the reference, and a second size for the fixed parts
        ref = default_microbatch(batch, pp_size)
        smaller = [d for d in _divisors(batch) if d < ref]
        second = smaller[-1:] or [d for d in _divisors(batch) if d > ref][:1]
        return [ref] + second
    sizes = [microbatch_sizes] if isinstance(microbatch_sizes, int) else list(microbatch_sizes)
    if not sizes:
        raise ValueError("microbatch_sizes=[] must name at least one size")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1 or batch % s:
            raise ValueError(f"microbatch_sizes: {s!r} must be a positive int dividing the "
                             f"batch of {batch}")
    return sizes


# ------------------------------------------------------------------ measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _measure_at(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, *,
                loss_fn: Any, units: Sequence[str], compile: Any, repeats: int
                ) -> dict[str, Any]:
    """One size: per unit F, B, I, W seconds (medians), saved, parameter and output bytes."""
    from torch_mpmd.graph.stage import split_model
    from torch_mpmd.programs.stage_programs import resolve_compiler
    from torch_mpmd.runtime.program_runner import ProgramRunner
    from torch_mpmd.runtime.rank import StagedModel
    from torch_mpmd.runtime.runner import EdgeLayout

    device = _device_of(model)
    with torch.enable_grad():
        sm = split_model(model, *args, split_points=list(units[1:]) or None, **kwargs)
    n = sm.num_stages
    if n != len(units):
        raise ValueError(f"splitting at units {list(units)} gave {n} stages")
    staged = StagedModel.from_split(sm)
    layout = EdgeLayout.build(staged.signatures, staged.example_values)
    producers: list[list[int]] = [[] for _ in range(n)]
    consumers: list[list[int]] = [[] for _ in range(n)]
    for p, c in layout.edges():
        producers[c].append(p)
        consumers[p].append(c)
    runner = ProgramRunner({s: staged.stages[s] for s in range(n)}, staged.signatures, layout,
                           producers, consumers, staged.rebuild_output, split_backward=True,
                           compiler=resolve_compiler(compile), device=device,
                           kinds={s: {"F", "B", "I", "W"} for s in range(n)})
    inputs = [sm.named_inputs(args, kwargs)]
    targets = [target]
    runner.prepare(inputs, targets, loss_fn)
    times: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in "FBIW"}
    saved = kept = [0] * n
    for rep in range(repeats + 1):  # the first is a warm-up
        lockstep.progress(f"timing {n} units, run {rep} of {repeats}")
        runner.begin_step(inputs, targets, loss_fn, 0, rep, training=True)
        try:
            for split in (False, True):
                values: dict[tuple[int, int], Any] = {}
                states: dict[int, Any] = {}
                for s in range(n):
                    (sends, states[s]), t = _timed(
                        lambda s=s: runner.forward(s, 0, [values[(p, s)] for p in producers[s]]),
                        device)
                    if rep and not split:
                        times["F"][s].append(t)
                    for c, v in zip(consumers[s], sends):
                        values[(s, c)] = v
                if rep == 0 and not split:
                    saved = [runner.peak_bytes[s] for s in range(n)]
                    # (the autograd fallback's hooks see no inputs apart: 0)
                    kept = [runner.programs[s].saved_input_bytes if runner.programs else 0
                            for s in range(n)]
                grads: dict[tuple[int, int], Any] = {}
                for s in reversed(range(n)):
                    out_grads = [grads[(s, c)] for c in consumers[s]]
                    if split:
                        (in_grads, carry), t_i = _timed(
                            lambda: runner.backward(s, 0, out_grads, True, states[s]), device)
                        _, t_w = _timed(lambda: runner.backward_weight(s, 0, carry), device)
                        if rep:
                            times["I"][s].append(t_i)
                            times["W"][s].append(t_w)
                    else:
                        (in_grads, _), t_b = _timed(
                            lambda: runner.backward(s, 0, out_grads, False, states[s]), device)
                        if rep:
                            times["B"][s].append(t_b)
                    for p, g in zip(producers[s], in_grads):
                        grads[(p, s)] = g
                    states.pop(s, None)
        finally:
            runner.end_step()
    med = {k: [statistics.median(v) for v in per] for k, per in times.items()}
    param_bytes = []
    for sig in sm.stage_signatures:
        param_bytes.append(sum(sm.captured.tensors[f].numel() * sm.captured.tensors[f].element_size()
                               for f in sig.parameters))
    out_bytes = [0] * n
    for v in sm.plan.cross_stage_values:
        last = max(v.consumer_stages)
        for cut in range(v.producer_stage, last):
            out_bytes[cut] += v.bytes
    first = sm.stage_signatures[0]
    input_bytes = sum(t.numel() * t.element_size() for name in first.user_inputs
                      for t in [inputs[0][name]] if isinstance(t, torch.Tensor))
    return {"F": med["F"], "B": med["B"], "I": med["I"], "W": med["W"], "saved": saved,
            "kept": kept,
            "params": param_bytes, "out": out_bytes, "input": input_bytes,
            "functional": runner.programs is not None}


def _fit(values: Sequence[float], sizes: Sequence[int], at: int) -> float:
    """The least-squares line through the origin over (size, value), at ``at``."""
    if len(sizes) == 1:
        return float(values[0])
    slope = sum(v * s for v, s in zip(values, sizes)) / sum(s * s for s in sizes)
    return max(0.0, slope * at)


def _affine(values: Sequence[float], sizes: Sequence[int], at: int) -> tuple[float, float]:
    """A time at ``at`` samples and its fixed part: the least-squares line
    ``fixed + slope * size`` over (size, value), the fixed part within [0,
    the time] (through the origin, no fixed part, from one size or where
    the line crosses below 0)."""
    if len(set(sizes)) < 2:
        return _fit(values, sizes, at), 0.0
    n = len(sizes)
    ms, mv = sum(sizes) / n, sum(values) / n
    slope = (sum((s - ms) * (v - mv) for s, v in zip(sizes, values))
             / sum((s - ms) ** 2 for s in sizes))
    fixed = mv - slope * ms
    if fixed < 0:
        return _fit(values, sizes, at), 0.0
    total = max(0.0, fixed + slope * at)
    return total, min(fixed, total)


def _ping_pong(group: Any, device: torch.device, waits: lockstep.Collectives
               ) -> tuple[float, float]:
    """(latency s, bandwidth B/s) between pipeline ranks 0 and 1 of ``group``
    (collective over the group: the others arrive and return zeros). Every
    message is bounded by ``waits`` (NOTE [Named waits] in named_waits.py)."""
    waits.arrive("the ping-pong between pipeline ranks 0 and 1")
    rank = dist.get_rank(group)
    if rank > 1:
        return 0.0, 0.0
    peer = dist.get_global_rank(group, 1 - rank)
    what = f"the ping-pong with rank {peer}"
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())

    def rounds(nbytes: int, count: int) -> float:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(count + 1):
            _sync(device)
            start = time.perf_counter()
            if rank == 0:
                waits.send(buf, peer, what)
                waits.recv(buf, peer, what)
            else:
                waits.recv(buf, peer, what)
                waits.send(buf, peer, what)
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    latency = rounds(_PING_BYTES, 20) / 2
    one_way = rounds(_PONG_BYTES, 5) / 2
    bandwidth = _PONG_BYTES / max(one_way - latency, 1e-9)
    return latency, bandwidth


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where a timing's buffers live: ``device``, or the current CUDA device
    when the group runs NCCL."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _all_reduce_rates(group: Any, device: torch.device, waits: lockstep.Collectives
                      ) -> tuple[float, float]:
    """(latency s per ring step, bandwidth B/s per link) of ``group``'s
    all-reduce: the ring model 2 (d - 1) latency + 2 (d - 1) / d * bytes /
    bandwidth through the median times of a 4-byte and a 4 MiB all-reduce
    (collective over ``group``; bounded by ``waits``, which is over it)."""
    d = dist.get_world_size(group)
    waits.arrive("the timing of the data-parallel all-reduce")
    device = _comm_device(group, device)

    def median_time(nbytes: int, count: int) -> float:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(count + 1):  # the first is a warm-up
            _sync(device)
            start = time.perf_counter()
            waits.all_reduce(buf, "an all-reduce of the timing", arrive=False)
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    steps = 2 * (d - 1)
    small = median_time(_PING_BYTES, 20)
    large = median_time(_PONG_BYTES, 5)
    return small / steps, steps / d * _PONG_BYTES / max(large - small, 1e-9)


def _measure(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, *,
             loss_fn: Any, units: list[str], sizes: list[int], compile: Any, repeats: int,
             batch: int, pp_size: int, global_batch: int, link: tuple[float, float],
             runtime: RuntimeCosts, memory_limit: float, order: dict[str, int] | None = None,
             dp: tuple[int, float | None, float | None] = (1, None, None)) -> CostSheet:
    """The sheet of ``units`` measured at ``sizes``; with ``order`` (the call
    order of the default units' forward; None for units the caller gave),
    units too coarse to balance are refined (NOTE [Refined units])."""
    from torch_mpmd.microbatch import first_microbatch, split_tree

    global measurements

    def measure_units(names: list[str]) -> list[dict[str, Any]]:
        per_size = []
        for size in sizes:
            lockstep.progress(f"measuring {len(names)} units at microbatch size {size}")
            m = batch // size
            a0, k0 = first_microbatch(args, kwargs, m)
            t0 = split_tree(target, m, "target", first_only=True)[0] if target is not None \
                else None
            per_size.append(_measure_at(model, a0, k0, t0, loss_fn=loss_fn, units=names,
                                        compile=compile, repeats=repeats))
        return per_size

    with model_state_kept(model):  # the profile leaves no trace in the model
        per_size = measure_units(units)
        # NOTE [Refined units]: a unit costing more than a balanced stage
        # (the total over p), or one holding a balanced split's boundary
        # where whole units split unevenly (units.coarse), is cut one level
        # down where its submodules start (units.py), and the finer units
        # are measured again.
        costs = [f + b for f, b in zip(per_size[0]["F"], per_size[0]["B"])]
        which = sorted(set(too_big(costs, pp_size)) | set(coarse(costs, pp_size))) \
            if order is not None else []
        if which:
            finer = refine(model, order, units, which)
            if finer != units:
                units, per_size = finer, measure_units(finer)
    measurements += 1
    ref = sizes[0]
    out_units = []
    for u, name in enumerate(units):
        col = {k: [r[k][u] for r in per_size]
               for k in ("F", "B", "I", "W", "saved", "kept", "out")}
        (f, f0), (b, b0) = _affine(col["F"], sizes, ref), _affine(col["B"], sizes, ref)
        (i, i0), (w, w0) = _affine(col["I"], sizes, ref), _affine(col["W"], sizes, ref)
        scale = b / (i + w) if i + w > 0 else 0.0  # I + W = B, their ratio kept
        out_units.append(Unit(name=name, forward=f, backward_input=i * scale,
                              backward_weight=w * scale if i + w > 0 else b,
                              forward_fixed=f0, backward_input_fixed=i0 * scale,
                              backward_weight_fixed=w0 * scale if i + w > 0 else b0,
                              saved_bytes=_affine(col["saved"], sizes, ref)[0],
                              saved_input_bytes=_affine(col["kept"], sizes, ref)[0],
                              param_bytes=float(per_size[0]["params"][u]),
                              output_bytes=(_affine(col["out"], sizes, ref)[0]
                                            if u < len(units) - 1 else 0.0)))
    return CostSheet(
        units=out_units, global_batch=global_batch, pp_size=pp_size, reference_microbatch=ref,
        input_bytes=_affine([r["input"] for r in per_size], sizes, ref)[0],
        action_overhead=runtime.action_overhead, step_overhead=runtime.step_overhead,
        link_latency=runtime.transfer_latency,
        link_bandwidth=link[1], memory_limit=memory_limit, dp_size=dp[0], dp_latency=dp[1],
        dp_bandwidth=dp[2])


def profile(model: torch.nn.Module, example_args: Any, example_kwargs: Mapping[str, Any] | None = None,
            *, loss_fn: Callable[..., Any] | None, target: Any = None,
            units: Sequence[str] | None = None, microbatch_sizes: int | Sequence[int] | None = None,
            compile: Any = False, cache_dir: Any = None, group: Any = None,
            pp_size: int | None = None, global_batch: int | None = None, repeats: int = 5,
            memory_limit: float = 0.0, dp_group: Any = None,
            timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S, calibrate: bool = True,
            info: dict[str, Any] | None = None) -> CostSheet:
    """The measured cost sheet of ``model`` on one step's batch (see the module docstring).

    ``example_args``/``example_kwargs``/``target``: a training step's batch
    (split along dim 0 like the pipeline splits it); ``loss_fn``: as
    ``pipeline(loss_fn=)`` takes it. ``group``: the pipeline group (default:
    the default group when one is initialized; collective over it).
    ``dp_group``: this rank's data-parallel group (a mesh's "dp"), whose
    size and all-reduce rates go on the sheet (collective over it too).
    ``pp_size`` (default: the group's size) and ``global_batch`` (default: the
    batch's size) go on the sheet; ``repeats``: timed runs per cost (medians).
    ``timeout`` (seconds or timedelta): how long a rank waits for the others
    at a collective, with no rank making progress (rank 0's measuring is
    progress); a rank that stalls or died raises PipelineError naming it
    (NOTE [Named waits] in named_waits.py). ``calibrate=False``: a cached
    profile is returned as cached, its times not fitted to this launch (for
    a caller that needs the units only). ``info`` (a dict, filled on
    rank 0): ``cache_path`` (the entry's Path, None without a cache) and
    ``measured`` (whether the units were measured, not loaded).
    """
    from torch_mpmd.config import as_timeout

    from torch_mpmd.config import pp_group

    timeout_s = as_timeout(timeout).total_seconds()
    with contextlib.ExitStack() as stack:
        waits = _waits(stack, pp_group(group), timeout_s, "profiling")
        dp_waits = (_waits(stack, dp_group, timeout_s, "profiling (data-parallel group)")
                    if dp_group is not None and dist.get_world_size(dp_group) > 1 else None)
        return _profile(model, example_args, example_kwargs, loss_fn=loss_fn, target=target,
                        units=units, microbatch_sizes=microbatch_sizes, compile=compile,
                        cache_dir=cache_dir, group=group, pp_size=pp_size,
                        global_batch=global_batch, repeats=repeats, memory_limit=memory_limit,
                        dp_group=dp_group, waits=waits, dp_waits=dp_waits,
                        calibrate=calibrate, info=info)


def _waits(stack: contextlib.ExitStack, group: Any, timeout_s: float, purpose: str
           ) -> lockstep.Collectives | None:
    """Bounded, named collectives over ``group`` (None for one process),
    active while ``stack`` is."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    return stack.enter_context(lockstep.Collectives(group, timeout_s, purpose))


def _profile(model: torch.nn.Module, example_args: Any, example_kwargs: Any, *,
             loss_fn: Any, target: Any, units: Any, microbatch_sizes: Any, compile: Any,
             cache_dir: Any, group: Any, pp_size: int | None, global_batch: int | None,
             repeats: int, memory_limit: float, dp_group: Any,
             waits: lockstep.Collectives | None, dp_waits: lockstep.Collectives | None,
             calibrate: bool, info: dict[str, Any] | None) -> CostSheet:
    """profile(), its waits made."""
    from torch_mpmd.config import pp_group

    if not isinstance(example_args, tuple):
        example_args = (example_args,) if not isinstance(example_args, list) else \
            tuple(example_args)
    kwargs = dict(example_kwargs or {})
    grp = pp_group(group)
    world = dist.get_world_size(grp) if grp is not None else 1
    rank = dist.get_rank(grp) if grp is not None else 0
    pp = world if pp_size is None else pp_size
    batch = batch_size_of(example_args, kwargs)
    gb = batch if global_batch is None else global_batch
    sizes = _sizes(microbatch_sizes, batch, pp)
    order: dict[str, int] | None = None
    if units is not None:
        unit_names = _check_units(model, units)
    else:  # the outer units by call order (NOTE [Outer units]): one forward, no grad
        from torch_mpmd.microbatch import first_microbatch

        with model_state_kept(model):
            order = call_order(model, *first_microbatch(example_args, kwargs, batch // sizes[0]))
        unit_names = find_units(model, order)
    device = _device_of(model)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    raw_text: str | None = None  # NOTE [Relative profiles]: the cached units, unfitted
    failure: tuple[str, str] | None = None
    raised: BaseException | None = None
    path: Path | None = None
    if rank == 0:
        key = profile_key(model, example_args, kwargs, target, loss_fn=loss_fn,
                          units=unit_names, sizes=sizes, compile=compile, pp_size=pp,
                          device=device.type, dp_size=dp_size)
        cache = cache_dir_of(cache_dir)
        path = cache / f"{key}.json" if cache is not None else None
        if info is not None:
            info["cache_path"] = path
        raw_text = read_entry(path)
    # Rank 0 tells the others whether it measures the units.
    if waits is not None:
        measure = bool(waits.broadcast_json(raw_text is None, "the broadcast of whether rank "
                                            "0 measures (no cached profile)"))
    else:
        measure = raw_text is None
    if info is not None:
        info["measured"] = measure
    if not calibrate and not measure:
        # A caller that only needs the units (a cached decision: auto.py).
        if waits is not None:
            raw_text = waits.broadcast_json(raw_text, "the broadcast of rank 0's cached "
                                            "profile")
        assert raw_text is not None
        return _with_batch(CostSheet.from_json(raw_text), gb, memory_limit)
    # This launch's own constants, measured whether or not the units were
    # cached: the link, the dp group's all-reduce and the runtime around the
    # programs (NOTE [Relative profiles]).
    link = ((DEFAULT_LINK_LATENCY_S, DEFAULT_LINK_BANDWIDTH) if grp is None or world < 2
            else _ping_pong(grp, device, waits))
    dp: tuple[int, float | None, float | None] = (1, None, None)
    if dp_waits is not None:
        dp = (dp_size, *_all_reduce_rates(dp_group, device, dp_waits))
    runtime = RuntimeCosts(DEFAULT_ACTION_OVERHEAD_S, 0.0, link[0])
    if grp is not None and world > 1 and len(unit_names) >= world:
        runtime = measure_runtime(model, example_args, kwargs, target, loss_fn=loss_fn,
                                  group=grp, units=unit_names,
                                  num_microbatches=batch // sizes[0], link=link,
                                  compile=compile, waits=waits)
    text: str | None = None
    if rank == 0:
        try:
            if measure:
                raw = _measure(model, example_args, kwargs, target, loss_fn=loss_fn,
                               units=unit_names, sizes=sizes, compile=compile,
                               repeats=repeats, batch=batch, pp_size=pp, global_batch=gb,
                               link=link, runtime=runtime, memory_limit=memory_limit,
                               order=order, dp=dp)
                write_entry(path, key, raw.to_json())
            else:
                assert raw_text is not None
                raw = dataclasses.replace(
                    CostSheet.from_json(raw_text), action_overhead=runtime.action_overhead,
                    step_overhead=runtime.step_overhead, link_latency=runtime.transfer_latency,
                    link_bandwidth=link[1], dp_size=dp[0], dp_latency=dp[1],
                    dp_bandwidth=dp[2])
            text = fit_sheet(raw, runtime, batch).to_json()
        except Exception as e:  # noqa: BLE001  (every rank raises it, below)
            failure, raised = (type(e).__name__, str(e)), e
    if waits is not None:
        text, failure = waits.broadcast_json([text, failure], "the broadcast of rank 0's "
                                             "profile (or its failure)")
    if raised is not None:
        raise raised
    if failure is not None:
        kind, message = failure
        error = ValueError if kind == "ValueError" else RuntimeError
        raise error(f"profiling {type(model).__name__} failed on pipeline rank 0: {message}")
    assert text is not None
    return _with_batch(CostSheet.from_json(text), gb, memory_limit)


def _with_batch(sheet: CostSheet, global_batch: int, memory_limit: float) -> CostSheet:
    if sheet.global_batch != global_batch or sheet.memory_limit != memory_limit:
        sheet = dataclasses.replace(sheet, global_batch=global_batch, memory_limit=memory_limit)
    return sheet
