"""Stage programs compiled by Inductor go through its FX graph cache (NOTE
[Programs in Inductor's cache] in torch_mpmd/programs/stage_programs.py):
the same program compiled again loads from it, and one compiled under
another CPU capability setting does not. In one process, on a cache folder
of the test's own; and processes that compile one program at once take
turns (NOTE [Compile claims] in torch_mpmd/programs/compile_claims.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from torch_mpmd.programs import compile_claims
from torch_mpmd.programs.stage_programs import _inductor


# No annotations: make_fx keeps them on the graph, and Inductor cannot key a
# graph holding typing objects (it bypasses the cache for it).
def _program(x, w):
    return ((torch.relu(x @ w) * 2).sum(1),)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    yield
    counters.clear()


def _compile_and_run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    compiled = _inductor(make_fx(_program)(x, w), [x, w])
    return compiled(x, w)[0]


def test_a_program_compiled_again_loads_from_the_cache_unless_the_cpu_setting_differs(
        own_cache, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)
    want = _program(x, w)[0]
    torch.testing.assert_close(_compile_and_run(x, w), want)
    assert counters["inductor"]["fxgraph_cache_miss"] == 1, dict(counters["inductor"])
    torch.testing.assert_close(_compile_and_run(x, w), want)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0, dict(counters["inductor"])
    # Another capability setting: compiled again, not loaded.
    other = "SSE41" if os.environ.get("DNNL_MAX_CPU_ISA") == "AVX2" else "AVX2"
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", other)
    torch.testing.assert_close(_compile_and_run(x, w), want)
    assert counters["inductor"]["fxgraph_cache_miss"] == 2, dict(counters["inductor"])


# Two processes compiling one program at once (NOTE [Compile claims] in
# torch_mpmd/programs/compile_claims.py): each waits for a file, then compiles.
TWO_AT_ONCE = """
import json, os, sys, time
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx
from torch_mpmd.programs.stage_programs import _inductor

def _program(x, w):
    return ((torch.relu(x @ w) * 2).sum(1),)

g = torch.Generator().manual_seed(0)
x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)
gm = make_fx(_program)(x, w)
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
out = _inductor(gm, [x, w])(x, w)[0]
print(json.dumps(dict(miss=counters["inductor"]["fxgraph_cache_miss"],
                      hit=counters["inductor"]["fxgraph_cache_hit"],
                      exact=bool(torch.allclose(out, _program(x, w)[0])))), flush=True)
"""


def test_processes_compiling_one_program_at_once_compile_it_once(tmp_path):
    """Started together on an empty cache, one process compiles the program
    and the other loads it from Inductor's cache (without the claim both
    looked it up before either stored it, and both compiled)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", TWO_AT_ONCE, str(go)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        go.touch()
        got = [json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1])
               for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(r["exact"] for r in got), got
    assert sorted((r["miss"], r["hit"]) for r in got) == [(0, 1), (1, 0)], got


def test_a_program_inductor_does_not_cache_is_marked_and_not_claimed_again(own_cache,
                                                                          monkeypatch):
    """A program Inductor bypasses its cache for (made to here: Inductor's
    own check refuses every graph) leaves a mark: later compiles of it take
    no claim, as nothing would come of waiting for it."""
    from torch._inductor.codecache import BypassFxGraphCache, FxGraphCache

    def refuse(*_args, **_kwargs):
        raise BypassFxGraphCache("refused by the test")

    monkeypatch.setattr(FxGraphCache, "_check_can_cache", staticmethod(refuse))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)
    before = compile_claims.stats()
    for _ in range(2):
        torch.testing.assert_close(_compile_and_run(x, w), _program(x, w)[0])
    after = compile_claims.stats()
    assert counters["inductor"]["fxgraph_cache_bypass"] == 2, dict(counters["inductor"])
    assert after["uncached"] - before["uncached"] == 1, (before, after)
    assert after["claimed"] - before["claimed"] == 1, (before, after)
    assert after["unclaimed"] - before["unclaimed"] == 1, (before, after)
