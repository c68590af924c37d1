"""README's main job, shortened: examples/train_gpt.py under torchrun on 2 ranks
trains (its own check: the loss falls) and writes its trace and timeline.

The first test launches as a user does, every process a fresh interpreter;
the others' interpreters are forked from the tests' zygote (NOTE [Forked
interpreters] in tests/forked_python.py): the same torchrun and script,
without importing torch in each of their 14 processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dist_harness as H

ROOT = Path(__file__).resolve().parent.parent


def test_train_gpt_on_two_ranks_trains_and_writes_trace(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / "train_gpt.py"), "--steps", "12", "--sample-chars", "0",
           "--schedule", "zbv", "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loss: first" in run.stdout and "bubble" in run.stdout
    trace = json.loads((tmp_path / "train_gpt_trace.json").read_text())
    ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1}
    assert (tmp_path / "train_gpt_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_train_gpt_3d_on_eight_ranks_trains_checkpoints_and_resumes_on_two(tmp_path):
    """Issue 14's command: pp2 x dp2 (sharded) x tp2 on 8 ranks trains, its
    trace holds the UNSHARD/RESHARD/REDUCE_GRAD actions of every rank, and its
    checkpoint resumes on a plain 2-rank pipeline (resharded by DCP)."""
    python, prefix, env = H.launcher()
    script = str(ROOT / "examples" / "train_gpt.py")
    ckpt = str(tmp_path / "ckpt")
    cmd = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "8", *prefix, script, "--dp", "2", "--tp", "2", "--shard", "--steps", "8", "--eval-every", "0",
           "--sample-chars", "0", "--out-dir", str(tmp_path), "--checkpoint-dir", ckpt]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dp=2, tp=2" in run.stdout and "parameter all-gathers" in run.stdout
    trace = json.loads((tmp_path / "train_gpt_trace.json").read_text())
    kinds = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"UNSHARD", "RESHARD", "REDUCE_GRAD", "F", "B"} <= kinds, kinds
    resume = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", *prefix, script, "--resume", "--checkpoint-dir", ckpt, "--steps", "4",
              "--eval-every", "0", "--sample-chars", "0", "--out-dir", str(tmp_path)]
    run = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "resumed from" in run.stdout and "at step 8" in run.stdout


def test_train_gpt_packed_documents_on_two_ranks_trains(tmp_path):
    """--packed: the corpus's sentences packed into rows (mpmd.pack), attention
    within each document, a token-weighted loss; the script checks the loss falls."""
    python, prefix, env = H.launcher()
    cmd = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *prefix, str(ROOT / "examples" / "train_gpt.py"), "--packed", "--steps", "10",
           "--sample-chars", "0", "--eval-every", "0", "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loss: first" in run.stdout
