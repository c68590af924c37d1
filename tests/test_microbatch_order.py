"""Microbatches of different sizes in the simulator (``simulate(microbatch_costs=)``,
NOTE [Microbatch costs] in csrc/core/simulator.h) and the order that shortens
the step (torch_mpmd.ordering): no processes, the C++ simulator only."""

from __future__ import annotations

import random

import pytest

import torch_mpmd as mpmd
from torch_mpmd.schedules import facts, get_schedule, schedule_names

# Every schedule of the table, at the fewest stages per rank that show what it is for.
SCHEDULES = [(s, facts(s).typical_stages_per_rank) for s in schedule_names()]


@pytest.mark.parametrize("name,spr", SCHEDULES)
def test_microbatch_costs_scale_each_microbatch_and_equal_sizes_change_nothing(name, spr):
    s = get_schedule(name, num_ranks=2, num_microbatches=4, stages_per_rank=spr)
    plain = s.simulate()
    same = s.simulate(microbatch_costs=[7, 7, 7, 7])
    assert same.makespan == pytest.approx(plain.makespan)
    sizes = [1, 2, 3, 6]  # mean 3: scales 1/3, 2/3, 1, 2
    varied = s.simulate(microbatch_costs=sizes)
    # Every rank computes each microbatch once per local stage: its busy time
    # is unchanged by scales that average 1; the step is never shorter.
    assert varied.busy == pytest.approx(plain.busy)
    assert varied.makespan >= plain.makespan - 1e-9


def test_microbatch_costs_errors_name_the_values():
    s = get_schedule("1f1b", num_ranks=2, num_microbatches=4)
    with pytest.raises(ValueError, match="microbatch_costs has 3 entries, the schedule 4"):
        s.simulate(microbatch_costs=[1, 2, 3])
    with pytest.raises(ValueError, match=r"microbatch_costs\[1\]"):
        s.simulate(microbatch_costs=[1, -2, 3, 4])
    with pytest.raises(ValueError, match="all 0"):
        s.simulate(microbatch_costs=[0, 0, 0, 0])


@pytest.mark.parametrize("name,spr", SCHEDULES)
def test_the_chosen_order_is_never_predicted_slower_and_permutes(name, spr):
    rng = random.Random(7)
    sizes = [min(2048.0, rng.lognormvariate(5.4, 0.9)) for _ in range(8)]
    order = mpmd.microbatch_order(sizes, schedule=name, pp_size=2, stages_per_rank=spr)
    assert sorted(order.order) == list(range(8))
    assert order.predicted["chosen"] <= min(v for k, v in order.predicted.items()
                                            if k != "chosen") + 1e-9
    s = get_schedule(name, num_ranks=2, num_microbatches=8, stages_per_rank=spr)
    assert s.simulate(microbatch_costs=order.apply(sizes)).makespan == pytest.approx(
        order.predicted["chosen"])
    assert order.speedup >= 1.0
    again = mpmd.microbatch_order(sizes, schedule=name, pp_size=2, stages_per_rank=spr)
    assert again.order == order.order  # every rank computes the same order


def test_order_shortens_long_tailed_mixes_under_1f1b():
    # Fine-tuning-like lengths (lognormal, mean ~300, at most 2048): over 20
    # mixes the chosen order is predicted >= 10% faster on average.
    rng = random.Random(0)
    speedups = []
    for _ in range(20):
        sizes = [min(2048.0, rng.lognormvariate(5.4, 0.9)) for _ in range(8)]
        speedups.append(mpmd.microbatch_order(sizes, schedule="1f1b", pp_size=4).speedup)
    assert sum(speedups) / len(speedups) > 1.10, speedups


def test_sizes_of_microbatches_and_apply_errors():
    import torch

    mbs = [((torch.zeros(2, n, dtype=torch.long),), {}) for n in (3, 5)]
    assert mpmd.microbatch_sizes(mbs) == [6, 10]
    with pytest.raises(ValueError, match="microbatch 0 has no tensor argument"):
        mpmd.microbatch_sizes([((), {"n": 3})])
    order = mpmd.microbatch_order([1, 2], pp_size=2)
    with pytest.raises(ValueError, match="for 2 microbatches, got 3"):
        order.apply([1, 2, 3])
