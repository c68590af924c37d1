"""Hugging Face MoE models trained with their load-balancing loss
(``output_router_logits=True``, recorded by transformers' output hooks:
NOTE [Output recorders] in torch_mpmd/graph/hf.py) and without
``use_cache=False`` train like eager PyTorch on 2 gloo ranks, through
``pipeline()`` and the compile door (tests/hf_calls_worker.py)."""

from __future__ import annotations

import pytest

from dist_harness import GridRun

CASES = [dict(id=f"{model}-{schedule}", kind="moe_aux_loss", model=model, schedule=schedule)
         for model in ("Mixtral", "Qwen2Moe") for schedule in ("1f1b",)]
CASES += [dict(id="Mixtral-zero_bubble", kind="moe_aux_loss", model="Mixtral",
               schedule="zero_bubble")]
CASES += [dict(id=f"{model}-door", kind="moe_aux_loss_door", model=model, schedule="1f1b")
          for model in ("Mixtral", "Qwen2Moe")]
_GRID = GridRun(2, "hf_calls_worker:grid", CASES, task="hf_calls", timeout=600)


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_an_moe_trained_with_its_router_loss_and_default_cache_matches_eager(case):
    held = set()
    for rank, r in enumerate(_GRID.results(case)):
        assert r["aux"] > 0, r  # the router's loss is part of the loss compared
        assert r["loss"] <= 1, (rank, r["loss"])
        bad = {n: d for n, d in r["grads"].items() if d > 1}
        assert not bad, f"rank {rank}: gradients off (inf: missing): {bad}"
        held |= set(r["grads"])
    assert any("experts" in n or "gate" in n for n in held), sorted(held)


def test_the_backend_imported_before_transformers_still_marks_the_recorders_install():
    # NOTE [Recorders while tracing]: torch_mpmd's backend imported first (as
    # `from torch_mpmd import over_microbatches` before `import transformers`
    # does) still marks transformers' install once its module is imported.
    # (The MoE door cases above run in ranks forked from a zygote that imports
    # the backend first; unmarked, Dynamo broke the graph there and the
    # capture failed.) A fresh interpreter: the order is the point.
    import subprocess
    import sys

    code = ("import sys\n"
            "import torch_mpmd.compile.backend\n"
            "assert 'transformers.utils.output_capturing' not in sys.modules\n"
            "import transformers\n"
            "from transformers import MixtralForCausalLM\n"
            "from transformers.utils import output_capturing as oc\n"
            "print(getattr(oc.maybe_install_capturing_hooks, '_dynamo_marked_constant', False))\n"
            "import inspect; assert inspect.getsource(oc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("True"), run.stdout
