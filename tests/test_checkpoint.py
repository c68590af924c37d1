"""torch_mpmd.checkpoint: the latest pointer and fresh directories, user state
(extra / extra_per_rank) across a resumed 2-rank run, a second save of a step
killed mid-write (what the survivor is told, and its directory removed by the
next save), strict keys and shapes, checksums, missing files."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from dist_harness import run_ranks
from torch_mpmd.checkpoint import CheckpointError


def make(depth=2, head=4):
    torch.manual_seed(0)
    model = models.MLP(d=8, depth=depth, markers=True)
    model.head = torch.nn.Linear(8, head)
    pipe = mpmd.pipeline(model, loss_fn=F.mse_loss, num_microbatches=2, schedule="gpipe",
                         stages_per_rank=depth)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    return pipe, opt


def step(pipe, opt, head=4):
    pipe.step(torch.ones(4, 8), target=torch.zeros(4, head))
    opt.step()
    opt.zero_grad()


def first_line(exc_info):
    return str(exc_info.value).splitlines()[0]


# ------------------------------------------------------------- one process

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
    assert fresh.step_count == 1
    assert fresh_opt.state_dict()["state"]  # AdamW moments came back


def test_missing_or_malformed_pointer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no completed checkpoint"):
        mpmd.checkpoint.latest(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        mpmd.checkpoint.latest(tmp_path)


def test_saving_an_existing_step_writes_a_new_directory_and_keep_last_prunes_old_ones(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    first = mpmd.checkpoint.save(pipe, opt, tmp_path)
    files = {f: (tmp_path / "step_1" / f).read_bytes() for f in os.listdir(first)}
    step(pipe, opt)
    pipe.step_count = 1   # a second run reaching the same step
    second = mpmd.checkpoint.save(pipe, opt, tmp_path)
    assert os.path.basename(first) == "step_1" and os.path.basename(second) == "step_1.1"
    assert mpmd.checkpoint.latest(tmp_path) == second
    assert {f: (tmp_path / "step_1" / f).read_bytes() for f in os.listdir(first)} == files
    (tmp_path / "step_0").mkdir()   # what a save that died leaves
    third = mpmd.checkpoint.save(pipe, opt, tmp_path, keep_last=2)
    assert os.path.basename(third) == "step_1.2"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1.1", "step_1.2"]
    with pytest.raises(ValueError, match="keep_last=0"):
        mpmd.checkpoint.save(pipe, opt, tmp_path, keep_last=0)


def test_extra_values_round_trip_and_unsaveable_values_are_errors(tmp_path):
    pipe, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step(pipe, opt)
    sched.step()
    value = {"pos": (3, [1, 2.5]), 7: b"\x00raw", "t": torch.arange(5.0), "none": None,
             "__tuple__": "not a tag"}
    mpmd.checkpoint.save(pipe, opt, tmp_path, extra={"step": 1, "data": value, "sched": sched},
                         extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    manifest = json.loads((tmp_path / "step_1" / "rank_0.json").read_text())
    assert manifest["extra"]["step"] == {"value": 1}   # text, not pickle
    want = torch.rand(3)   # what the restored RNG draws next
    fresh, fresh_opt = make()
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    got = mpmd.checkpoint.load(fresh, fresh_opt, tmp_path, extra={"sched": fresh_sched},
                               extra_per_rank={"rng": mpmd.checkpoint.RNGState()})
    assert torch.equal(torch.rand(3), want)
    assert fresh_sched.get_last_lr() == sched.get_last_lr() == [5e-3]
    assert got["step"] == 1 and got["directory"] == str(tmp_path / "step_1")
    assert got["extra_per_rank"] == {}
    data = got["extra"]["data"]
    assert got["extra"]["step"] == 1 and set(got["extra"]) == {"step", "data"}
    assert torch.equal(data.pop("t"), value["t"])
    assert data == {k: v for k, v in value.items() if k != "t"}
    assert isinstance(data["pos"], tuple)

    with pytest.raises(CheckpointError, match=r"extra\['data'\]\['fn'\]: a value of type function"):
        mpmd.checkpoint.save(pipe, opt, tmp_path, extra={"data": {"fn": make}})
    assert mpmd.checkpoint.latest(tmp_path) == str(tmp_path / "step_1")   # nothing written
    with pytest.raises(CheckpointError, match=r"extra\['ema'\]: the checkpoint holds no state"):
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path, extra={"ema": fresh_sched})


def test_model_with_other_layers_or_shapes_fails_strict_load_naming_the_keys(tmp_path):
    pipe, opt = make(depth=3)
    step(pipe, opt)
    mpmd.checkpoint.save(pipe, opt, tmp_path)

    fewer, fewer_opt = make(depth=2)
    before = {k: v.clone() for k, v in fewer.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(fewer, fewer_opt, tmp_path)
    line = first_line(e)
    assert "8 keys in the checkpoint but not in the module or optimizer" in line, line
    assert "model.blocks.2.0.weight, model.blocks.2.0.bias" in line, line
    assert all(torch.equal(v, before[k]) for k, v in fewer.state_dict().items())

    more, more_opt = make(depth=4)
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(more, more_opt, tmp_path)
    assert "missing from the checkpoint: model.blocks.3.0.weight" in first_line(e)

    other_head, other_opt = make(depth=3, head=5)
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(other_head, other_opt, tmp_path)
    assert "model.head.weight (checkpoint [4, 8], module [5, 8])" in first_line(e)

    got = mpmd.checkpoint.load(fewer, fewer_opt, tmp_path, strict=False)   # the common keys
    assert got["step"] == 1
    assert torch.equal(fewer.state_dict()["blocks.1.0.weight"], pipe.state_dict()["blocks.1.0.weight"])


def test_flipped_byte_in_a_shard_fails_load_naming_the_key_and_file(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    directory = mpmd.checkpoint.save(pipe, opt, tmp_path)
    shard = os.path.join(directory, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    at = data.find(pipe.state_dict()["blocks.1.0.weight"].numpy().tobytes())
    assert at > 0
    data[at + 13] ^= 0x40   # one bit of one float
    open(shard, "wb").write(data)
    fresh, fresh_opt = make()
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path)
    assert ("checksum mismatch for 'model.blocks.1.0.weight' in step_1/__0_0.distcp"
            in first_line(e)), str(e.value)
    with pytest.raises(CheckpointError, match="checksum mismatch"):   # not a key question
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path, strict=False)


def test_missing_shard_file_is_named_in_the_first_line(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    directory = mpmd.checkpoint.save(pipe, opt, tmp_path)
    os.remove(os.path.join(directory, "__0_0.distcp"))
    fresh, fresh_opt = make()
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path)
    assert "missing file step_1/__0_0.distcp (holds model.blocks.0.0.weight" in first_line(e)


# ------------------------------------------------------------- two ranks

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: train 2 steps, save with extra state, train 2 more (the reference).
    B: another run saves the same step; rank 1 dies part-way through writing.
    C: a fresh run (other weights and RNG) loads after capture and trains 2."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    first = run_ranks(2, "checkpoint_worker:train", directory, timeout=120).results
    second = run_ranks(2, "checkpoint_worker:second_run_dies_saving", directory, timeout=60,
                       pg_timeout=15, failure_grace=5, check=False)
    latest = mpmd.checkpoint.latest(directory)
    resumed = run_ranks(2, "checkpoint_worker:resume", directory, timeout=120, check=False)
    return {"first": first, "second": second, "latest": latest, "resumed": resumed}


def resumed(runs):
    """Each rank's result of run C (which only fails if a load does)."""
    run = runs["resumed"]
    assert not run.failed_ranks(), run.describe()
    return run.results


def test_resumed_run_with_extra_state_matches_the_uninterrupted_run(runs):
    for rank, (want, got) in enumerate(zip(runs["first"], resumed(runs))):
        assert got["losses"] == want["losses"] and len(want["losses"]) == 2  # bit-identical
        assert got["lrs"] == want["lrs"]
        assert got["lr"] == want["lr"] == 1e-2 * 0.5 ** 2   # the scheduler came back
        assert got["result"]["step"] == 2
        assert got["result"]["extra"] == {"step": 2, "data": {"epoch": 0, "pos": 2}}
        assert got["result"]["extra_per_rank"] == {"rank": rank}


def test_second_save_of_a_step_killed_mid_write_leaves_latest_loading_the_first(runs):
    first_dir = runs["first"][0]["saved_in"]
    died_in = runs["second"].results[1]["died_writing"]   # the failure was injected
    assert runs["second"].returncodes[1] == 1 and died_in != first_dir
    assert runs["latest"] == first_dir
    for want, got in zip(runs["first"], resumed(runs)):
        assert got["loaded"] == want["saved"]   # every rank's stage, from the first save


def test_missing_shard_of_one_rank_fails_load_on_every_rank_naming_the_file(runs):
    for got in resumed(runs):
        line = got["broken_error"].splitlines()[0]
        assert "missing file step_2/__0_0.distcp" in line, got["broken_error"]
        assert got["untouched"]


def test_survivor_of_a_save_killed_mid_write_says_so_and_the_next_save_removes_it(runs):
    died_in = runs["second"].results[1]["died_writing"]
    first_dir = runs["first"][0]["saved_in"]
    assert (f"CheckpointError: saving {died_in} failed on rank 0" in runs["second"].stderr[0]
            and f"the next save removes {died_in}" in runs["second"].stderr[0]), \
        runs["second"].describe([0])
    resumed(runs)   # run C has loaded; now a save under the same path
    assert os.path.isdir(died_in)
    pipe, opt = make()
    step(pipe, opt)
    mpmd.checkpoint.save(pipe, opt, os.path.dirname(first_dir))
    assert not os.path.exists(died_in) and os.path.isdir(first_dir)
