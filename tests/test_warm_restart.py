"""Warm restarts (issue 33): a relaunch of the same 2-rank job on the caches
the first launch filled (the capture store, NOTE [Capture store], and
Inductor's cache with its programs, NOTE [Programs in Inductor's cache])
loads instead of tracing and compiling, and its first step is the first
launch's, bit for bit. A relaunch after the model's source changed traces
and compiles again and trains as one process does. Real torchrun launches
(tests/warm_worker.py), on cache folders of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RTOL, ATOL = 1e-5, 1e-6  # fp32; Inductor's kernels against eager

MODEL = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = {activation}(layer(x))
        return x
'''


def _launch(tmp: Path, label: str, activation: str) -> dict[int, dict]:
    source = tmp / "warm_model.py"
    source.write_text(MODEL.format(activation=activation))
    # Dated as a file edited a while before its launch: the store does not
    # keep captures of files changed within its clock slack of the start.
    past = time.time() - 10
    os.utime(source, (past, past))
    out = tmp / label
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", WARM_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp), str(ROOT / "tests"), str(ROOT)]),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
               MPMD_CAPTURE_CACHE=str(tmp / "captures"))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(ROOT / "tests" / "warm_worker.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)}


def _trains_as_one_process(ranks: dict[int, dict]) -> None:
    for rank, got in ranks.items():
        assert abs(got["loss"] - got["want_loss"]) <= ATOL + RTOL * abs(got["want_loss"]), got
        assert got["grads"], f"rank {rank} holds no parameters"
        for name, g in got["grads"].items():
            assert g is not None, f"rank {rank}: {name} has no gradient"
            torch.testing.assert_close(g, got["want"][name], rtol=RTOL, atol=ATOL)


def test_a_relaunch_loads_its_programs_and_steps_as_the_first_launch_did(tmp_path):
    cold = _launch(tmp_path, "cold", "torch.tanh")
    warm = _launch(tmp_path, "warm", "torch.tanh")
    _trains_as_one_process(cold)
    for rank in (0, 1):
        c, w = cold[rank], warm[rank]
        assert w["loss"] == c["loss"], (rank, c["loss"], w["loss"])
        assert c["grads"].keys() == w["grads"].keys()
        for name in c["grads"]:
            assert torch.equal(c["grads"][name], w["grads"][name]), (rank, name)
        # The first launch compiled; the relaunch traced nothing and compiled nothing.
        assert c["inductor"].get("fxgraph_cache_miss", 0) > 0, c["inductor"]
        assert w["store"]["loaded"] == 1 and w["store"]["saved"] == 0, (c["store"], w["store"])
        assert w["inductor"].get("fxgraph_cache_miss", 0) == 0, w["inductor"]
        assert w["inductor"].get("fxgraph_cache_hit", 0) > 0, w["inductor"]
    # The model's source changed: nothing stale is loaded, and it trains exactly.
    changed = _launch(tmp_path, "changed", "torch.sigmoid")
    _trains_as_one_process(changed)
    # One rank traced the new source and stored it (the other loaded that);
    # the old entry was found stale.
    stores = [changed[rank]["store"] for rank in (0, 1)]
    assert sum(s["saved"] for s in stores) == 1 and sum(s["stale"] for s in stores) >= 1, stores
    for rank in (0, 1):
        ch = changed[rank]
        assert ch["inductor"].get("fxgraph_cache_miss", 0) > 0, ch["inductor"]
        assert ch["loss"] != cold[rank]["loss"]
