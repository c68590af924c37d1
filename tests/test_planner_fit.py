"""The calibration's timed steps (planning/calibrate.py, issue 31 item 2): one process, no group."""

from __future__ import annotations

import torch

from torch_mpmd.planning import calibrate


class _Waits:
    """A lockstep.Collectives stand-in that records how each barrier waits."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def barrier(self, what: str) -> None:
        self.calls.append((what, True))  # a named barrier: it polls the store

    def all_reduce(self, tensor: torch.Tensor, what: str, op: object = None, *,
                   arrive: bool = True) -> torch.Tensor:
        self.calls.append((what, arrive))
        return tensor


class _Pipe:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, *args: object, target: object = None) -> None:
        self.steps += 1

    def timelines(self) -> list:
        return [[]]


def test_timed_steps_wait_without_the_store_poll() -> None:
    # NOTE [Calibration barriers]: the barriers around each timed step are the
    # group's all-reduce alone; a store-polled (arrive) barrier there let the
    # ranks leave up to 20 ms apart, inside the step's wall. Only the one
    # barrier before the steps names a missing rank.
    waits, pipe = _Waits(), _Pipe()
    walls, rows = calibrate._timed_steps(pipe, waits, (), {}, None, steps=3)
    assert pipe.steps == 5 and len(walls) == 3 and len(rows) == 3
    polled = [what for what, arrive in waits.calls if arrive]
    assert polled == ["the barrier before the calibration's steps"], waits.calls
    assert len(waits.calls) == 1 + 2 * 5, waits.calls
