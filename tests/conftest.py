"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test captures from a clean Dynamo cache (captures must not leak between tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
