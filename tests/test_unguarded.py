"""A capture's Dynamo guards are not built (NOTE [Guards never built] in
torch_mpmd/graph/unguarded.py); every other frame's are, and a dim the user
marked dynamic still fails loudly where the model specializes it."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.guards as dynamo_guards

from torch_mpmd.graph import capture as capturing
from torch_mpmd.graph.unguarded import guards_not_built


@pytest.fixture
def guards_built(monkeypatch):
    """Each guard build of this test, as (frame name, number of guards)."""
    monkeypatch.setenv("MPMD_CAPTURE_CACHE", "0")  # trace every time, no disk
    monkeypatch.setenv("MPMD_CAPTURE_MEMO", "0")
    built: list[tuple[str, int]] = []
    real = dynamo_guards.CheckFunctionManager.build_guards

    def counting(self, sorted_guards, existing, f_code, *args, **kwargs):
        built.append((f_code.co_name, len(sorted_guards)))
        return real(self, sorted_guards, existing, f_code, *args, **kwargs)

    monkeypatch.setattr(dynamo_guards.CheckFunctionManager, "build_guards", counting)
    return built


class _Specializing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 6:  # the batch dim becomes a constant
            return self.lin(x) * 2
        return self.lin(x)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.scale = 2.0  # a Python value the trace reads: a state guard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


def test_a_static_capture_builds_no_guards_and_keeps_its_state_guards(guards_built):
    model = _Scaled()
    captured = capturing.capture(model, (torch.randn(3, 4),), {})
    ours = [n for name, n in guards_built if name.startswith("mpmd_capture_")]
    assert ours and all(n == 0 for n in ours), guards_built
    targets = [str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert any("linear" in t for t in targets) and any("relu" in t for t in targets), targets
    # What a later call checks comes from Dynamo's guard list, not from built
    # guards: the Python value the trace read is still watched.
    assert capturing._guards_hold(captured, model)
    model.scale = 3.0
    assert not capturing._guards_hold(captured, model)


def test_other_frames_still_build_their_guards(guards_built):
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(lambda x: model(x).sum(), backend="eager")
    x = torch.randn(2, 4)
    with guards_not_built(capturing._fresh_entry(model).__code__):  # another code object
        compiled(x)
    assert [n for name, n in guards_built if name == "<lambda>"][0] > 0, guards_built
    torch._dynamo.reset()


def test_a_dim_marked_dynamic_that_the_model_specializes_is_still_an_error(guards_built):
    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(Exception, match="marked .* as dynamic but your code specialized it"):
        capturing.capture(_Specializing(), (x,), {})
    ours = [n for name, n in guards_built if name.startswith("mpmd_capture_")]
    assert ours and all(n > 0 for n in ours), guards_built  # built in full, and checked


def test_the_environment_can_ask_for_every_capture_s_guards(guards_built, monkeypatch):
    monkeypatch.setenv("MPMD_CAPTURE_GUARDS", "1")
    capturing.capture(_Scaled(), (torch.randn(3, 4),), {})
    ours = [n for name, n in guards_built if name.startswith("mpmd_capture_")]
    assert ours and all(n > 0 for n in ours), guards_built
