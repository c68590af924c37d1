"""Drive a ProgramRunner in one process, as the executor would, without one.

``train_step`` splits a model, builds a runner over all its stages and runs
every microbatch through F then B (or I then W) stage by stage, handing
values, gradients and the runner's state along as the C++ executor does
(NOTE [Runner state]). With ``functional=False`` the same runner takes the
autograd path: the reference the functional programs are tested against.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from torch_mpmd.runtime.program_runner import ProgramRunner
from torch_mpmd.runtime.runner import EdgeLayout
from torch_mpmd.runtime.rank import StagedModel
from torch_mpmd.graph.stage import split_model


def make_runner(model: torch.nn.Module, x: torch.Tensor, m: int, *, split: bool,
                compiler: Any = None, **split_kwargs: Any) -> tuple[ProgramRunner, Any]:
    sm = split_model(model, *x.chunk(m)[:1], **split_kwargs)
    staged = StagedModel.from_split(sm)
    layout = EdgeLayout.build(staged.signatures, staged.example_values)
    n = staged.num_stages
    producers: list[list[int]] = [[] for _ in range(n)]
    consumers: list[list[int]] = [[] for _ in range(n)]
    for p, c in layout.edges():
        producers[c].append(p)
        consumers[p].append(c)
    runner = ProgramRunner({s: staged.stages[s] for s in range(n)}, staged.signatures, layout,
                           producers, consumers, staged.rebuild_output, split_backward=split,
                           compiler=compiler)
    return runner, sm


def train_step(model: torch.nn.Module, x: torch.Tensor, y: Any, loss_fn: Callable, *,
               m: int = 2, split: bool = False, functional: bool = True, compiler: Any = None,
               runner: ProgramRunner | None = None, sm: Any = None, seed: int = 0, step: int = 0,
               **split_kwargs: Any) -> tuple[torch.Tensor, ProgramRunner, Any]:
    """One training step; returns (mean loss, runner, split model)."""
    if runner is None:
        runner, sm = make_runner(model, x, m, split=split, compiler=compiler, **split_kwargs)
    n = runner.num_stages
    inputs = sm.named_microbatches((x,), {}, m)
    targets = list(y.chunk(m))
    if functional:
        runner.prepare(inputs, targets, loss_fn)
    runner.begin_step(inputs, targets, loss_fn, seed, step, training=True)
    producers = {s: st.producers for s, st in runner.stages.items()}
    consumers = {s: st.consumers for s, st in runner.stages.items()}
    for mb in range(m):
        values: dict[tuple[int, int], Any] = {}
        states: dict[int, Any] = {}
        for s in range(n):
            sends, states[s] = runner.forward(s, mb, [values[(p, s)] for p in producers[s]])
            for c, t in zip(consumers[s], sends):
                values[(s, c)] = t
        grads: dict[tuple[int, int], Any] = {}
        for s in reversed(range(n)):
            out_grads = [grads[(s, c)] for c in consumers[s]]
            if split:
                in_grads, carry = runner.backward(s, mb, out_grads, True, states[s])
                runner.backward_weight(s, mb, carry)
            else:
                in_grads, _ = runner.backward(s, mb, out_grads, False, states[s])
            for p, t in zip(producers[s], in_grads):
                grads[(p, s)] = t
    runner.end_step()
    loss = torch.stack([runner.losses[k] for k in range(m)]).float().mean()
    return loss, runner, sm
