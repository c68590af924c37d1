"""Shared pytest fixtures, and the environment every test's ranks inherit."""

import getpass
import os
import tempfile

import pytest
import torch

# Inductor's on-disk caches do not key their artifacts by ATen's CPU
# capability: kernels compiled under one ATEN_CPU_CAPABILITY (MKL's and
# oneDNN's ISA caps alike) and loaded under another crashed a rank (a
# segfault in the dynamic-shape Inductor tests, a nan loss in the dynamic
# door, after running the suite both ways on one AVX-512 machine). A cache
# directory per setting; ranks inherit it through the environment.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_cpu_"
    f"{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test captures from a clean Dynamo cache (captures must not leak between tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
