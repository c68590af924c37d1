"""The calibration's timed steps (planning/calibrate.py, issue 31 item 2): one process, no group."""

from __future__ import annotations

import dataclasses

import pytest
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


def _sheet():
    from torch_mpmd.planning import CostSheet, Unit

    units = [Unit(f"blocks.{i}", 1e-3, 1e-3, 1e-3, forward_fixed=1e-4) for i in range(4)]
    return CostSheet(units=units, global_batch=16, pp_size=2, reference_microbatch=4,
                     action_overhead=0.0, step_overhead=0.0, link_latency=1e-4)


def _step(sheet, m: int, action_s: float, step_s: float) -> float:
    from torch_mpmd.planning import evaluate_plan

    return evaluate_plan(dataclasses.replace(sheet, action_overhead=action_s,
                                             step_overhead=step_s),
                         "1f1b", num_microbatches=m, split_points=["blocks.2"]).predicted_step_s


def test_two_microbatch_counts_recover_the_price_per_action_and_per_step() -> None:
    # NOTE [Two microbatch counts]: runs at m=4 and m=8 that took what 200 us
    # per action and 5 ms per step predict: the fit finds both. From the m=4
    # run alone the fit prices the 5 ms per step as actions (the timelines
    # read 1 ms per step outside them), and so over-predicts m=16.
    from torch_mpmd.planning.calibrate import RuntimeCosts, fit_sheet

    sheet = _sheet()
    costs = RuntimeCosts(action_overhead=5e-5, step_overhead=1e-3, transfer_latency=1e-4,
                         split_points=("blocks.2",), num_microbatches=4,
                         step_wall=_step(sheet, 4, 2e-4, 5e-3),
                         second_microbatches=8, second_wall=_step(sheet, 8, 2e-4, 5e-3))
    two = fit_sheet(dataclasses.replace(sheet, step_overhead=1e-3), costs, batch=16)
    assert two.action_overhead == pytest.approx(2e-4, rel=1e-5)
    assert two.step_overhead == pytest.approx(5e-3, rel=1e-5)
    assert two.units == sheet.units
    assert _step(two, 16, two.action_overhead, two.step_overhead) == \
        pytest.approx(_step(sheet, 16, 2e-4, 5e-3), rel=1e-5)
    one = fit_sheet(dataclasses.replace(sheet, step_overhead=1e-3),
                    dataclasses.replace(costs, second_microbatches=0), batch=16)
    assert one.action_overhead > 3e-4  # the step's 4 ms more, priced per action
    assert _step(one, 16, one.action_overhead, one.step_overhead) > \
        1.1 * _step(sheet, 16, 2e-4, 5e-3)


def test_two_microbatch_counts_keep_the_timelines_floor() -> None:
    # A second run faster than the actions the timelines measured allow
    # (noise): the price stays at least the timelines' reading, the step
    # overhead at least theirs (0 here).
    from torch_mpmd.planning.calibrate import RuntimeCosts, fit_sheet

    sheet = _sheet()
    wall = _step(sheet, 4, 1e-4, 2e-3)
    costs = RuntimeCosts(action_overhead=1e-4, step_overhead=0.0, transfer_latency=1e-4,
                         split_points=("blocks.2",), num_microbatches=4, step_wall=wall,
                         second_microbatches=8, second_wall=wall - 5e-3)
    fitted = fit_sheet(sheet, costs, batch=16)
    assert fitted.action_overhead >= 1e-4
    assert fitted.step_overhead == 0.0


def test_a_step_overhead_below_the_timelines_reading_is_noise() -> None:
    # Walls of 200 us per action and no step overhead, but the timelines
    # read 3 ms per step outside the actions: the difference of the walls
    # would give 0 per step; the step overhead stays at 3 ms and the price
    # per action is what each run asks on top of it (less than 200 us).
    from torch_mpmd.planning.calibrate import RuntimeCosts, fit_sheet

    sheet = _sheet()
    costs = RuntimeCosts(action_overhead=5e-5, step_overhead=3e-3, transfer_latency=1e-4,
                         split_points=("blocks.2",), num_microbatches=4,
                         step_wall=_step(sheet, 4, 2e-4, 0.0),
                         second_microbatches=8, second_wall=_step(sheet, 8, 2e-4, 0.0))
    fitted = fit_sheet(sheet, costs, batch=16)
    assert fitted.step_overhead == pytest.approx(3e-3)
    assert 5e-5 <= fitted.action_overhead < 2e-4
