"""Ranks of tests/test_dynamic_shapes.py: a pipeline with symbolic sizes
(``dynamic=True`` or inputs marked with ``torch._dynamo.mark_dynamic``)
trained over several sequence lengths (and batch sizes) in turn. Per step:
loss and every local gradient against one eager process on the same batch;
per run: how many captures and how many program compilations happened."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

import pipeline_worker
import torch_mpmd as mpmd
from torch_mpmd.schedules import facts
from pipeline_worker import _compare_grads, _diff, _error_text, _rank_world

M = 2
TOL = {False: (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}
SPLITS = {2: ["blocks.1"], 4: ["blocks.0.mlp", "blocks.1", "blocks.1.mlp"]}


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _Counter:
    """Counts Inductor compilations (compile_fx_inner calls) while installed."""

    def __init__(self) -> None:
        import torch._inductor.compile_fx as cfx

        self.module, self.original, self.calls = cfx, cfx.compile_fx_inner, 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        cfx.compile_fx_inner = counting

    def close(self) -> None:
        self.module.compile_fx_inner = self.original


def _model(name: str, stages: int) -> tuple[torch.nn.Module, list[str], int]:
    """(model, split points, vocabulary) by name."""
    if name == "gpt":
        return pipeline_worker.build_model("gpt"), SPLITS[stages], 32
    import models_worker  # a Hugging Face LM returning its logits

    model, _, _, _, splits = models_worker.build(name)
    return model, splits[stages], 64


def run_case(case: dict[str, Any], group: Any, timeout: float) -> dict[str, Any]:
    rank, world = _rank_world()
    res: dict[str, Any] = dict(id=case["id"], rank=rank, error=None, steps={})
    counter = _Counter()
    try:
        stages = world * (facts(case["schedule"]).fixed_stages_per_rank
                          if facts(case["schedule"]).v_placement else 1)
        model, splits, vocab = _model(case.get("model", "gpt"), stages)
        ref = copy.deepcopy(model)
        pipe = mpmd.pipeline(model, loss_fn=lm_loss, schedule=case["schedule"],
                             num_microbatches=M, split_points=splits, group=group,
                             timeout=timeout, compile=case["compile"],
                             dynamic=not case.get("mark"))
        tol = TOL[case["compile"]]
        g = torch.Generator().manual_seed(3)
        for batch, t in case["sizes"]:
            x = torch.randint(0, vocab, (batch, t), generator=g)
            y = torch.randint(0, vocab, (batch, t), generator=g)
            if case.get("mark"):
                torch._dynamo.mark_dynamic(x, 1)
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            want = sum(lm_loss(ref(xs), ys) for xs, ys in zip(x.chunk(M), y.chunk(M))) / M
            want.backward()
            loss = pipe.step(x, target=y)
            step = dict(loss=_diff(loss.reshape(()), want.detach(), *tol),
                        functional=pipe.inspect().fallback_reason)
            step.update(_compare_grads(pipe.named_parameters(), model, ref, tol))
            res["steps"][f"{batch}x{t}"] = step
        res["captures"] = pipe.inspect().captures
        res["compilations"] = counter.calls
        res["local_stages"] = list(pipe.local_stages)
    except Exception:
        res["error"] = _error_text()
    finally:
        counter.close()
    return res


def grid(cases: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
    return pipeline_worker.grid(cases, timeout, task="dynamic", run=run_case)
