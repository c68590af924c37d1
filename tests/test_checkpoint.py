"""torch_mpmd.checkpoint in one process: the latest pointer, and a save that
fails part-way leaving the previous checkpoint whole and current."""

import os

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd


def make():
    torch.manual_seed(0)
    model = models.MLP(d=8, depth=2, markers=True)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, schedule="gpipe",
                         stages_per_rank=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    return pipe, opt


def step(pipe, opt):
    pipe.step(torch.ones(4, 8), target=torch.zeros(4, 4))
    opt.step()
    opt.zero_grad()


def test_interrupted_save_leaves_the_previous_checkpoint_current(tmp_path, monkeypatch):
    pipe, opt = make()
    step(pipe, opt)
    first = mpmd.checkpoint.save(pipe, opt, tmp_path)
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    step(pipe, opt)

    def crash(*args):
        raise OSError("simulated crash before the pointer update")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        mpmd.checkpoint.save(pipe, opt, tmp_path)
    monkeypatch.undo()
    assert mpmd.checkpoint.latest(tmp_path) == first
    fresh, fresh_opt = make()
    mpmd.checkpoint.load(fresh, fresh_opt, tmp_path)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert fresh._mpmd_step == 1
    assert fresh_opt.state_dict()["state"]  # AdamW moments came back


def test_missing_or_malformed_pointer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no completed checkpoint"):
        mpmd.checkpoint.latest(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        mpmd.checkpoint.latest(tmp_path)
