"""Stage programs compiled by Inductor go through its FX graph cache (NOTE
[Programs in Inductor's cache] in torch_mpmd/programs/stage_programs.py):
the same program compiled again loads from it, and one compiled under
another CPU capability setting does not. In one process, on a cache folder
of the test's own."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

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
