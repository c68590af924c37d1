"""The executor calls a Python runner's unshard/reshard at UNSHARD/RESHARD
actions, and runs runners without those methods as before (csrc/python/runtime)."""

import pytest
import torch

from torch_mpmd import _runtime
from torch_mpmd.schedules import ActionKind, Schedule

# Two stages on one rank, reshard after forward: stage 0 is freed while stage 1 runs.
SHARDED = Schedule.from_actions([["0F0", "1F0", "1B0", "0B0"]]).lower(
    shard=True, unshard_prefetch=0, reshard_after_forward=True)


class Replicated:
    """A runner without unshard/reshard (stage 0 feeds stage 1)."""

    def __init__(self):
        self.log = []

    def forward(self, stage, mb, inputs):
        self.log.append(f"{stage}F{mb}")
        return [[torch.zeros(1)]] if stage == 0 else []

    def backward(self, stage, mb, grads, input_only):
        self.log.append(f"{stage}B{mb}")
        return [[torch.zeros(1)]] if stage == 1 else []

    def backward_weight(self, stage, mb):
        self.log.append(f"{stage}W{mb}")

    def reduce_grad(self, stage):
        self.log.append(f"{stage}REDUCE_GRAD")


class Sharded(Replicated):
    def unshard(self, stage):
        self.log.append(f"{stage}UNSHARD")

    def reshard(self, stage):
        self.log.append(f"{stage}RESHARD")


def test_sharded_runner_sees_every_action_in_program_order():
    assert SHARDED.action_text[0] == ["0UNSHARD", "0F0", "0RESHARD", "1UNSHARD", "1F0", "1B0",
                                  "1RESHARD", "1REDUCE_GRAD", "0UNSHARD", "0B0", "0RESHARD",
                                  "0REDUCE_GRAD"]
    runner = Sharded()
    _runtime.Executor(SHARDED.to_text(), 0, runner, None).run()
    assert runner.log == SHARDED.action_text[0]


def test_runner_without_unshard_or_reshard_skips_them():
    runner = Replicated()
    _runtime.Executor(SHARDED.to_text(), 0, runner, None).run()
    assert runner.log == [str(a) for a in SHARDED.actions[0]
                          if a.kind not in (ActionKind.UNSHARD, ActionKind.RESHARD)]


def test_failing_unshard_is_reported_with_its_action():
    class Failing(Sharded):
        def unshard(self, stage):
            raise KeyError("gather failed")

    runner = Failing()
    with pytest.raises(_runtime.ExecutorError, match=r"action 0UNSHARD \(#0\) failed: .*gather failed"):
        _runtime.Executor(SHARDED.to_text(), 0, runner, None).run()
    assert isinstance(runner.error, KeyError)
