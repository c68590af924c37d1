"""PipelineConfig: one settings object behind pipeline()'s keywords, the mpmd
backend's options and the start-up comparison; and Pipeline.inspect(), the
public view of what a rank runs."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_mpmd as mpmd
from torch_mpmd.compile.backend import BACKEND_OPTIONS
from torch_mpmd.config import PipelineConfig
from torch_mpmd.schedules import Action, ActionKind


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def test_pipeline_keywords_and_backend_options_are_the_config_fields():
    fields = [f.name for f in dataclasses.fields(PipelineConfig)]
    params = inspect.signature(mpmd.pipeline).parameters
    assert list(params)[:2] == ["module", "config"]
    assert list(params)[2:] == fields
    # Required unless plan= gives it (a ValueError when the config is made).
    assert params["num_microbatches"].default is None
    assert set(BACKEND_OPTIONS) == (set(fields) - {"loss_fn"}) | {"reduction"}


def test_config_is_frozen_and_checks_each_value_when_made():
    config = PipelineConfig(num_microbatches=4, split_points=["2"])
    assert config.split_points == ("2",)  # a list is kept as a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_microbatches = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"num_microbatches=0 must be a positive int"):
        PipelineConfig(num_microbatches=0)
    with pytest.raises(ValueError, match=r"num_microbatches is required \(or plan="):
        PipelineConfig()
    with pytest.raises(ValueError, match=r"unknown schedule 'nope'"):
        PipelineConfig(num_microbatches=2, schedule="nope")
    with pytest.raises(ValueError, match=r"num_stages=3 disagrees with split_points=\['2'\]"):
        PipelineConfig(num_microbatches=2, split_points=["2"], num_stages=3)
    with pytest.raises(ValueError, match=r"timeout=-1 must be positive"):
        PipelineConfig(num_microbatches=2, timeout=-1)
    with pytest.raises(TypeError, match=r"unknown pipeline setting\(s\) 'microbatches'; known: "
                                        r"num_microbatches, loss_fn"):
        mpmd.pipeline(_mlp(), microbatches=2)
    with pytest.raises(ValueError, match=r"schedule 'zbv' places 2 stages per rank; got "
                                         r"stages_per_rank=1"):
        mpmd.pipeline(_mlp(), num_microbatches=2, schedule="zbv", stages_per_rank=1)


def test_a_config_and_keywords_that_change_it_make_the_pipeline():
    base = PipelineConfig(num_microbatches=2, loss_fn=F.mse_loss, schedule="gpipe")
    pipe = mpmd.pipeline(_mlp(), base, num_microbatches=4, split_points=["2"])
    assert pipe.config == dataclasses.replace(base, num_microbatches=4, split_points=("2",))
    assert pipe.num_microbatches == 4
    shared = pipe.config.shared_settings()
    assert shared["num_microbatches"] == "4" and shared["schedule"] == "gpipe"
    assert shared["loss_fn"].startswith("torch.nn.functional.mse_loss")
    assert "group" not in shared and "timeout" not in shared  # rank-local settings


def test_inspect_shows_the_rank_s_stages_typed_actions_and_programs():
    model = _mlp()
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, schedule="gpipe",
                         split_points=["2"])
    with pytest.raises(RuntimeError, match="has not captured the model yet"):
        pipe.inspect()
    pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
    view = pipe.inspect()
    assert view.local_stages == (0, 1) and set(view.stages) == {0, 1}
    assert all(isinstance(a, Action) for a in view.actions["step"])
    kinds = {a.kind for a in view.actions["step"]}
    assert {ActionKind.FORWARD, ActionKind.FULL_BACKWARD} <= kinds
    assert {a.kind for a in view.actions["forward"]} == {ActionKind.FORWARD}
    assert view.uses_programs and set(view.programs) == {0, 1}
    assert view.held_bytes == {0: 0, 1: 0}  # everything freed after the step
    assert view.captures == 1
    assert view.transfers == {"0->1": ((2, 16),), "1->0 grad": ((2, 16),)}
    pipe.step_count = 5
    assert pipe.step_count == 5
    with pytest.raises(ValueError, match=r"step_count=-1 must be an int >= 0"):
        pipe.step_count = -1
