"""Functional stage programs (torch_mpmd/programs/stage_programs.py) in one process.

The ProgramRunner is driven as the executor would drive it
(tests/program_driver.py) and compared with the same runner on its autograd
path: losses, every gradient and buffers equal. The I/W split is checked op
by op: I and W together compute exactly what B computes. The multi-process
runs of every schedule, with and without Inductor, are in test_pipeline.py.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import models
from program_driver import make_runner, train_step
from torch_mpmd.programs.stage_programs import program_ops


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _case(name):
    """(model, x, y, loss_fn, split kwargs) with weights fixed by a seed."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt":  # tied embedding and unembedding on the first and last stage
        return (models.CharGPT(vocab=32, d=32, n_layer=2, n_head=4, block_size=16),
                torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g),
                gpt_loss, dict(split_points=["blocks.1"]))
    if name == "bn_cnn":  # BatchNorm running stats are buffers written by every forward
        return (models.ResCNN(), torch.randn(4, 3, 8, 8, generator=g),
                torch.randint(0, 5, (4,), generator=g), F.cross_entropy,
                dict(split_points=["layers.1"]))
    if name == "skip":  # a value crossing several stages
        return (models.SkipChain(), torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g),
                F.mse_loss, dict(split_points=["layers.2", "layers.5"]))
    if name == "checkpointed":  # torch.utils.checkpoint around every layer
        return (models.CheckpointedLayers(), torch.randn(4, 8, generator=g),
                torch.randn(4, 8, generator=g), F.mse_loss, dict(split_points=["layers.2"]))
    if name == "inplace":  # a received value written in place
        return (models.ViewOfValueBeforeWrite(), torch.randn(4, 4, generator=g),
                torch.randn(4, 4, generator=g), F.mse_loss, {})
    if name == "skipnet":  # markers, tuple output, a skip over three boundaries
        return (models.SkipNet(d=16), torch.randn(4, 16, generator=g),
                torch.randn(4, 16, generator=g),
                lambda out, t: F.mse_loss(out[0], t) + out[1].square().mean(), {})
    raise ValueError(name)


MODELS = ["gpt", "bn_cnn", "skip", "checkpointed", "inplace", "skipnet"]


def _compare(model, ref, loss, ref_loss, rtol=1e-5, atol=1e-6):
    assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        assert (p.grad is None) == (want is None), name
        if want is not None:
            assert_close(p.grad, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert_close(b, ref_buffers[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("name", MODELS)
def test_programs_match_the_autograd_runner(name, split):
    model, x, y, loss_fn, kw = _case(name)
    ref = copy.deepcopy(model)
    for _ in range(2):  # two steps: gradients accumulate, buffers move on
        ref_loss, _, _ = train_step(ref, x, y, loss_fn, split=split, functional=False, **kw)
        loss, runner, _ = train_step(model, x, y, loss_fn, split=split, **kw)
        assert runner.fallback_reason is None, runner.fallback_reason
        _compare(model, ref, loss, ref_loss)


def test_a_tied_parameter_accumulates_the_sum_of_its_stages_gradients():
    model, x, y, loss_fn, kw = _case("gpt")
    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).backward()
    _, runner, _ = train_step(model, x, y, loss_fn, m=1, **kw)
    assert runner.fallback_reason is None
    assert len([s for s, p in runner.programs.items()
                if any(t is model.wte.weight for t, _ in p.param_grads)]) == 2
    assert_close(model.wte.weight.grad, ref.wte.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt", "bn_cnn", "checkpointed", "skip"])
def test_input_and_weight_programs_compute_exactly_the_backward_ops(name):
    model, x, y, loss_fn, kw = _case(name)
    runner, sm = make_runner(model, x, 2, split=True, **kw)
    inputs = sm.named_microbatches((x,), {}, 2)
    runner.prepare(inputs, list(y.chunk(2)), loss_fn)
    assert runner.fallback_reason is None
    for s, prog in runner.programs.items():
        b = collections.Counter(program_ops(prog.graphs["B"]))
        i = collections.Counter(program_ops(prog.graphs["I"]))
        w = collections.Counter(program_ops(prog.graphs["W"]))
        assert i + w == b, f"stage {s}: I+W - B = {(i + w) - b}, B - (I+W) = {b - (i + w)}"
        assert sum(w.values()) > 0, f"stage {s}: W computes nothing"
        if s > 0:  # a stage with received values computes their gradients in I
            assert sum(i.values()) > 0
        # I never computes a parameter gradient's last op when only W needs it:
        # every W output is computed in W or carried, and I hands over no more
        # than W reads.
        carry = [n for n in prog.graphs["W"].graph.nodes if n.op == "placeholder"]
        i_out = prog.graphs["I"].graph.output_node().args[0]
        assert len(i_out) == len(prog.i_input_slots) + len(carry)


class CheckpointedMLP(nn.Module):
    """Blocks of Linear-GELU-Linear, each under torch.utils.checkpoint: GELU's
    backward needs the first Linear's output, which is recomputed, not saved."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                  nn.Linear(2 * d, d)) for _ in range(n))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpointed_blocks_recompute_their_forward_once_in_the_backward():
    torch.manual_seed(0)
    model = CheckpointedMLP()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    runner, sm = make_runner(model, x, 2, split=True, split_points=["blocks.2"])
    runner.prepare(sm.named_microbatches((x,), {}, 2), list(y.chunk(2)), F.mse_loss)
    assert runner.fallback_reason is None
    for s, prog in runner.programs.items():
        ops = {k: collections.Counter(program_ops(prog.graphs[k])) for k in "FBIW"}
        assert ops["F"]["aten.gelu.default"] == 2  # two blocks per stage
        # Both GELUs are recomputed in the backward (not saved) ...
        assert ops["B"]["aten.gelu.default"] == 2
        # ... once, by I or by W, where each result is first needed.
        assert ops["I"] + ops["W"] == ops["B"]
        if s == 0:  # no received values: no input gradient, W does all
            assert not ops["I"] and ops["W"] == ops["B"]
        else:
            # The last block's GELU feeds the output the loss's gradient needs
            # (I); the first block's is read only by its second Linear's weight
            # gradient (W).
            assert ops["I"]["aten.gelu.default"] == 1 and ops["W"]["aten.gelu.default"] == 1
    ref_loss, _, _ = train_step(ref, x, y, F.mse_loss, split=True, functional=False,
                                split_points=["blocks.2"])
    loss, _, _ = train_step(model, x, y, F.mse_loss, split=True, runner=runner, sm=sm)
    _compare(model, ref, loss, ref_loss)


def test_saved_values_only_i_reads_are_not_carried_to_w():
    torch.manual_seed(0)
    model = models.MLP(d=16, depth=2, markers=True)
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    runner, sm = make_runner(model, x, 2, split=True)
    runner.prepare(sm.named_microbatches((x,), {}, 2), list(y.chunk(2)), F.cross_entropy)
    prog = runner.programs[1]
    saved = [n.name for n in prog.graphs["I"].graph.nodes if n.op == "placeholder"]
    carried = [n.name for n in prog.graphs["W"].graph.nodes if n.op == "placeholder"]
    assert set(carried) < set(saved) | {n.name for n in prog.graphs["I"].graph.nodes}
    # The weight of the head is read by I (for the input gradient) and not by W.
    assert len([c for c in carried if c in saved]) < len(saved)


def test_a_users_compiler_gets_every_program_and_its_result_runs():
    model, x, y, loss_fn, kw = _case("skip")
    ref = copy.deepcopy(model)
    seen = []

    def my_compiler(gm, example_inputs):
        seen.append((type(gm).__name__, len(example_inputs)))
        return gm.forward

    ref_loss, _, _ = train_step(ref, x, y, loss_fn, split=True, functional=False, **kw)
    loss, runner, _ = train_step(model, x, y, loss_fn, split=True, compiler=my_compiler, **kw)
    assert runner.fallback_reason is None
    assert len(seen) == 3 * 3  # F, I and W of three stages (B is never run when split)
    _compare(model, ref, loss, ref_loss)


def test_inductor_programs_match_the_autograd_runner():
    from torch_mpmd.programs.stage_programs import resolve_compiler

    model, x, y, loss_fn, kw = _case("bn_cnn")
    ref = copy.deepcopy(model)
    ref_loss, _, _ = train_step(ref, x, y, loss_fn, split=True, functional=False, **kw)
    loss, runner, _ = train_step(model, x, y, loss_fn, split=True,
                                 compiler=resolve_compiler("inductor"), **kw)
    assert runner.fallback_reason is None
    prog = runner.programs[0]
    assert prog.forward != prog.graphs["F"].forward  # Inductor's code, not the FX graph
    _compare(model, ref, loss, ref_loss, rtol=1e-4, atol=1e-5)


def test_a_parameter_with_a_hook_keeps_the_rank_on_the_autograd_path():
    model, x, y, loss_fn, kw = _case("skip")
    calls = []
    model.layers[0].weight.register_hook(lambda g: calls.append(1))
    _, runner, _ = train_step(model, x, y, loss_fn, **kw)
    assert runner.fallback_reason is not None and "hook" in runner.fallback_reason
    assert calls  # the hook ran: the engine did the backward


def test_dropout_programs_are_deterministic_per_stage_and_microbatch():
    torch.manual_seed(0)
    model = models.DropoutMLP(d=16)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    results = []
    for split in (False, True, False):
        m = copy.deepcopy(model)
        loss, runner, _ = train_step(m, x, y, F.mse_loss, split=split, seed=7)
        assert runner.fallback_reason is None
        results.append((loss, [p.grad.clone() for p in m.parameters()]))
    other_seed, _, _ = train_step(copy.deepcopy(model), x, y, F.mse_loss, seed=8)
    for loss, grads in results[1:]:
        assert_close(loss, results[0][0])
        for g, want in zip(grads, results[0][1]):
            assert_close(g, want)
    assert not torch.equal(other_seed, results[0][0])


def test_inductor_dropout_is_the_same_under_b_and_under_i_and_w():
    # Compiled random ops draw from the generator seeded per (step, stage,
    # microbatch) before each F: the same masks whatever the backward split.
    from torch_mpmd.programs.stage_programs import resolve_compiler

    torch.manual_seed(0)
    model = models.DropoutMLP(d=16)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    runs = []
    for split in (False, True):
        m = copy.deepcopy(model)
        loss, runner, _ = train_step(m, x, y, F.mse_loss, split=split, seed=3,
                                     compiler=resolve_compiler("inductor"))
        assert runner.fallback_reason is None and all(p.draws_rng
                                                      for p in runner.programs.values())
        runs.append((loss, [p.grad for p in m.parameters()]))
    assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for g, want in zip(runs[1][1], runs[0][1]):
        assert_close(g, want, rtol=1e-4, atol=1e-5)
    eval_model = copy.deepcopy(model).eval()
    assert abs(float(F.mse_loss(eval_model(x), y)) - float(runs[0][0])) > 1e-4  # dropout active


def test_pipelining_a_torch_compiled_module_compiles_its_stage_programs():
    # pipeline(torch.compile(model)) used to run the module eagerly: it pipelines
    # the original module and compiles each stage's programs with Inductor.
    import torch_mpmd as mpmd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = mpmd.pipeline(torch.compile(model), loss_fn=F.mse_loss, schedule="interleaved_1f1b",
                         num_microbatches=2, split_points=["2"])
    loss = pipe.step(x, target=y)
    view = pipe.inspect()
    assert view.uses_programs
    assert pipe.config.compile == "inductor"
    for prog in view.programs.values():  # compiled callables, not the FX graphs' forward
        assert prog.forward is not prog.graphs["F"].forward
    want = sum(F.mse_loss(ref(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))) / 2
    want.backward()
    assert_close(loss, want.detach(), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_saved_bytes_count_what_the_forward_computes_not_views_of_parameters():
    """A linear's backward reads its weight transposed; F hands that view on
    in `saved`, but it owns no memory (NOTE [Resharding frees the storage] in
    sharding.py relies on the same fact): saved_bytes counts the activations
    alone, well under one weight's bytes here."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    runner, sm = make_runner(model, x, 2, split=False)
    runner.prepare(sm.named_microbatches((x,), {}, 2), list(y.chunk(2)), F.mse_loss)
    prog = runner.programs[0]
    weight_bytes = 64 * 64 * 4
    views = [n for n in prog.graphs["F"].graph.nodes if "t" == getattr(n.target, "__name__", "")
             .split(".")[0]]
    assert views, "the forward saves no transposed weight: the test no longer covers a view"
    # The ReLU's output and the linear outputs of 2 rows: a few KiB at most.
    assert 0 < prog.saved_bytes < weight_bytes, prog.saved_bytes


@pytest.mark.parametrize("name", ["gpt", "checkpointed", "skipnet"])
def test_a_stage_traced_again_comes_from_the_export_memo_and_trains_the_same(name):
    # NOTE [Export memo]: a copy of the model, split the same way, reuses the
    # joint graphs AOTAutograd traced for the first; its loss and gradients
    # are the autograd path's all the same.
    from torch_mpmd.programs import export_memo

    export_memo.clear()
    model, x, y, loss_fn, kw = _case(name)
    first, again, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    before = export_memo.stats()
    train_step(first, x, y, loss_fn, split=True, **kw)
    traced = export_memo.stats()
    assert traced["hits"] == before["hits"] and traced["misses"] > before["misses"]
    loss, runner, _ = train_step(again, x, y, loss_fn, split=True, **kw)
    assert runner.fallback_reason is None, runner.fallback_reason
    assert export_memo.stats()["hits"] - traced["hits"] == runner.num_stages
    # NOTE [Partitions kept]: F and B of each stage too, not cut again.
    kept = export_memo.stats()["partitions_kept"] - traced["partitions_kept"]
    assert kept == runner.num_stages, kept
    ref_loss, _, _ = train_step(ref, x, y, loss_fn, split=True, functional=False, **kw)
    _compare(again, ref, loss, ref_loss)


class _EqualBlocks(nn.Module):
    """Equal residual blocks between two unequal ends; each block's own
    weights, and BatchNorm buffers that every training forward writes."""

    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.Tanh())
                                    for _ in range(n))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def test_stages_alike_but_for_their_names_share_one_trace_and_train_exactly():
    # NOTE [Stages alike]: one stage per block; the blocks' stages differ
    # only in their parameters' and buffers' names, so the first is traced
    # and the other three come from the memo, renamed: each still reads and
    # updates its own weights and running statistics.
    from torch_mpmd.programs import export_memo

    export_memo.clear()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = _EqualBlocks()
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    ref = copy.deepcopy(model)
    before = export_memo.stats()
    loss, runner, _ = train_step(model, x, y, F.mse_loss, split=True,
                                 split_points=[f"blocks.{i}" for i in range(4)] + ["out"])
    assert runner.fallback_reason is None, runner.fallback_reason
    assert runner.num_stages == 6
    after = export_memo.stats()
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (3, 3), after
    assert after["partitions_kept"] - before["partitions_kept"] == 3, after
    ref_loss, _, _ = train_step(ref, x, y, F.mse_loss, split=True, functional=False,
                                split_points=[f"blocks.{i}" for i in range(4)] + ["out"])
    _compare(model, ref, loss, ref_loss)


def test_what_a_kept_joint_graph_does_not_describe_is_traced_again():
    # A loss closing over another constant: the last stage is traced again
    # (the others come from the memo), and the loss follows the change.
    from torch_mpmd.programs import export_memo

    export_memo.clear()
    model, x, y, _, kw = _case("skip")

    def scaled(k):
        return lambda out, t: F.mse_loss(out, t) * k

    def check(make_loss, expect_hits=None, freeze=False):
        changed, ref = copy.deepcopy(model), copy.deepcopy(model)
        if freeze:
            for m in (changed, ref):
                m.layers[0].weight.requires_grad_(False)
        before = export_memo.stats()
        loss, runner, _ = train_step(changed, x, y, make_loss(), **kw)
        assert runner.fallback_reason is None, runner.fallback_reason
        if expect_hits is not None:
            assert export_memo.stats()["hits"] - before["hits"] == expect_hits(runner)
        ref_loss, _, _ = train_step(ref, x, y, make_loss(), functional=False, **kw)
        _compare(changed, ref, loss, ref_loss)
        return changed

    check(lambda: scaled(1.0))
    check(lambda: scaled(3.0), expect_hits=lambda r: r.num_stages - 1)
    # A parameter frozen since (a capture and stages of their own).
    assert check(lambda: scaled(3.0), freeze=True).layers[0].weight.grad is None
    # A loss with no name across calls (closing over a module instance) is
    # not kept: the last stage is traced every time.
    before = export_memo.stats()
    mse = nn.MSELoss()
    check(lambda: (lambda out, t: mse(out, t)))
    assert export_memo.stats()["not_keyed"] == before["not_keyed"] + 1
    # A global the loss reads, changed since: traced again, and the loss
    # follows it (NOTE [Loss state] is part of the key).
    global LOSS_SCALE
    check(lambda: scaled_by_global)
    LOSS_SCALE = 5.0
    try:
        check(lambda: scaled_by_global, expect_hits=lambda r: r.num_stages - 1)
    finally:
        LOSS_SCALE = 2.0
    # Back to the first value: the kept trace is right again.
    check(lambda: scaled_by_global, expect_hits=lambda r: r.num_stages)
    # A loss that changes what it reads when called is never kept: its
    # runner runs it under autograd at every microbatch, as eager does.
    stored = export_memo.stats()["kept"]
    changed = copy.deepcopy(model)
    loss, runner, _ = train_step(changed, x, y, counting_loss, **kw)
    assert runner.fallback_reason is not None and "changes Python state" in \
        runner.fallback_reason, runner.fallback_reason
    assert export_memo.stats()["kept"] == stored, "a stateful loss's trace was kept"


LOSS_SCALE = 2.0
CALLS = []


def scaled_by_global(out, t):
    return F.mse_loss(out, t) * LOSS_SCALE


def counting_loss(out, t):
    CALLS.append(1)
    return F.mse_loss(out, t) * len(CALLS)
