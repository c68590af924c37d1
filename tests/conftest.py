"""Shared pytest fixtures, and the environment every test's ranks inherit."""

import getpass
import os
import tempfile

import pytest
import torch

import dist_harness

# Inductor's on-disk caches do not key their artifacts by ATen's CPU
# capability: kernels compiled under one ATEN_CPU_CAPABILITY (MKL's and
# oneDNN's ISA caps alike) and loaded under another crashed a rank (a
# segfault in the dynamic-shape Inductor tests, a nan loss in the dynamic
# door, after running the suite both ways on one AVX-512 machine). A cache
# directory per setting; ranks inherit it through the environment.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_cpu_"
    f"{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"))
# Inductor compiles in the process itself: its default (as many compile workers
# as cores) starts a pool of subprocesses that import torch again, in every
# rank that compiles, which on a 2-core machine running 2 ranks buys nothing
# and cost 3x the compile (a cold stage program: 30 s with the pool, 9.5 s
# without; a warm one 6 s and 2.3 s, under load). The kernels are the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The capture store (NOTE [Capture store]): one folder for this run, shared by
# pytest and every rank it starts, so a model is traced once per run and
# every later capture of it (another rank, another case) loads it. Not the
# user's default folder: each run starts empty, as on a fresh machine.
_CAPTURES = tempfile.TemporaryDirectory(prefix="mpmd_captures_")
os.environ.setdefault("MPMD_CAPTURE_CACHE", _CAPTURES.name)

# plan="auto"'s trials time at least 5 steps of each finalist, more while
# they fill 4 s (planning/trials.py). The tests check what the trials decide
# and that training stays exact, never the timings' spread: 1 s of timed
# steps is enough, and every planning case on two ranks spent 4-8 s of both
# cores in them (BENCHMARKS.md, "Alike stages traced once, shorter trials in
# tests").
os.environ.setdefault("MPMD_TRIAL_SECONDS", "1")


dist_harness.collect_less_often()  # NOTE [Collections in tests]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test captures from a clean Dynamo cache (captures must not leak between tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The test files that take longest, longest first (seconds of one run, alone,
# on two cores: BENCHMARKS.md, "The test command in two processes"). With
# the suite in two pytest processes (scripts/test.sh: pytest-xdist, whole
# files, in collection order), starting them first keeps the last minutes
# from running one file on one process while the other has nothing left.
# Any file may be missing here: the rest follow in their own order. Not
# strictly by length: the replica and example files (mostly waiting) go
# early, beside the heaviest grids; ordered by this session's times, with
# the planner's Hugging Face grid and the warm restarts beside the heaviest,
# the run took 18:03 against 16:25 (BENCHMARKS.md, "torchrun's processes
# forked from the test zygote").
_LONGEST_FIRST = ("test_compile_door", "test_plan_auto", "test_tensor_parallel", "test_quorum",
                  "test_example", "test_3d_checkpoint", "test_pipeline", "test_plan_hf",
                  "test_sharded_dp", "test_pipeline_failures", "test_bounded_collectives",
                  "test_warm_restart", "test_plan_trials", "test_lockstep_bounds",
                  "test_microbatches")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: order kept within


def pytest_sessionfinish(session, exitstatus):
    """The worker groups of tests/dist_harness.py end with the session."""
    dist_harness.close_worker_groups()
