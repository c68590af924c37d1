"""torch_mpmd.checkpoint is all or nothing and never changes what it does not load:
a load that fails (an item DCP refuses part-way, a check, a Stateful that
raises) leaves module, optimizer, step counter and user state exactly as
they were; save and a failed load never initialize the optimizer (training
after them matches a run without them, bit for bit); a crafted pickle of
shared references or a deep nesting is refused at once naming key and file;
a rank that stalls or dies in load makes the other raise CheckpointError
naming it within ``timeout=`` (two gloo ranks, tests/checkpoint_atomic_worker.py).
"""

import dataclasses
import io
import json
import os
import pickle
import signal
import zipfile
import zlib

import pytest
import torch

import torch_mpmd as mpmd
from dist_harness import run_ranks
from test_checkpoint import make, step
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch_mpmd.checkpoint import CheckpointError


def snapshot(pipe, opt, *stateful):
    """Everything a load may change, as exact copies."""
    return {"model": {k: v.clone() for k, v in pipe.state_dict().items()},
            "optim": torch.utils._pytree.tree_map(
                lambda v: v.clone() if isinstance(v, torch.Tensor) else v, opt.state_dict()),
            "step_count": pipe.step_count,
            "stateful": [json.dumps(s.state_dict(), default=str) for s in stateful]}


def assert_same(got, want):
    assert got["model"].keys() == want["model"].keys()
    changed = [k for k, v in got["model"].items() if not torch.equal(v, want["model"][k])]
    assert not changed, f"{len(changed)} of {len(want['model'])} entries changed: {changed}"
    torch.testing.assert_close(got["optim"], want["optim"], rtol=0, atol=0)
    assert got["step_count"] == want["step_count"]
    assert got["stateful"] == want["stateful"]


def replace_item(directory, pick, blob):
    """Point the item ``pick(fqn, metadata entry)`` chooses (the last in its
    file) at ``blob`` appended to its file, recomputing every checksum as a
    writer with access to the files would. Returns the key and the file."""
    md_path = os.path.join(directory, ".metadata")
    with open(md_path, "rb") as f:
        metadata = pickle.load(f)   # our own test's file: trusted
    index, info = max(((i, s) for i, s in metadata.storage_data.items()
                       if pick(i.fqn, metadata.state_dict_metadata[i.fqn])),
                      key=lambda kv: kv[1].offset)
    data_path = os.path.join(directory, info.relative_path)
    offset = os.path.getsize(data_path)
    with open(data_path, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    with open(md_path, "wb") as f:
        pickle.dump(metadata, f)
    manifest = os.path.join(directory, "rank_0.json")
    m = json.load(open(manifest))
    for e in m["items"]:
        if e["key"] == index.fqn:
            e.update(offset=offset, length=len(blob), crc32=zlib.crc32(blob))
    import hashlib
    m["sha256"][".metadata"] = hashlib.sha256(open(md_path, "rb").read()).hexdigest()
    json.dump(m, open(manifest, "w"))
    return index.fqn, info.relative_path


class Refused:
    """What torch.load(weights_only=True) refuses (nothing here runs)."""

    def __reduce__(self):
        return (print, ("never printed",))


def torch_save_of_pickle(data):
    """An item as DCP writes a non-tensor value (torch.save's zip), holding ``data``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def trained(steps):
    """The one-process pipeline after ``steps`` training steps (other data than
    the checkpoint's, so every entry differs from it)."""
    pipe, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        pipe.step(torch.full((4, 8), 0.5), target=torch.ones(4, 4))
        opt.step()
        opt.zero_grad()
        sched.step()
    return pipe, opt, sched


@pytest.fixture
def saved(tmp_path):
    pipe, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    step(pipe, opt)
    sched.step()
    return mpmd.checkpoint.save(pipe, opt, tmp_path, extra={"sched": sched}), tmp_path


# ------------------------------------------------------------- all or nothing

def test_a_tensor_item_refused_inside_dcps_load_leaves_everything_as_it_was(saved):
    directory, root = saved
    buf = io.BytesIO()
    torch.save(Refused(), buf)
    key, _ = replace_item(directory, lambda k, md: isinstance(md, TensorStorageMetadata),
                          buf.getvalue())
    pipe, opt, sched = trained(2)
    before = snapshot(pipe, opt, sched)
    with pytest.raises(CheckpointError, match="failed on rank 0: .*Weights only load failed"):
        mpmd.checkpoint.load(pipe, opt, root, extra={"sched": sched})
    assert_same(snapshot(pipe, opt, sched), before)


def test_a_stateful_that_raises_in_load_leaves_module_and_optimizer_as_they_were(saved):
    _, root = saved
    pipe, opt, sched = trained(2)

    real, calls = sched.load_state_dict, []

    def refuse_once(state):   # part-way, then fails; load's undo then restores through it
        calls.append(state)
        if len(calls) == 1:
            sched.last_epoch = -7
            raise RuntimeError("the scheduler refuses")
        real(state)

    before = snapshot(pipe, opt, sched)
    sched.load_state_dict = refuse_once
    with pytest.raises(RuntimeError, match="the scheduler refuses"):
        mpmd.checkpoint.load(pipe, opt, root, extra={"sched": sched})
    del sched.load_state_dict
    assert_same(snapshot(pipe, opt, sched), before)


# ------------------------------------------------- the optimizer left alone

def train_3(pipe, opt):
    for i in range(3):
        pipe.step(torch.full((4, 8), 0.1 * i), target=torch.ones(4, 4))
        opt.step()
        opt.zero_grad()
    return snapshot(pipe, opt)


def test_save_before_the_first_step_and_a_failed_load_change_no_later_step(tmp_path):
    want = train_3(*make())                       # never saved nor loaded

    pipe, opt = make()
    mpmd.checkpoint.save(pipe, opt, tmp_path / "a")
    assert opt.state_dict()["state"] == {}
    assert_same(train_3(pipe, opt), want)

    pipe, opt = make()
    mpmd.checkpoint.save(pipe, opt, tmp_path / "b")
    os.remove(os.path.join(mpmd.checkpoint.latest(tmp_path / "b"), "__0_0.distcp"))
    with pytest.raises(CheckpointError, match="missing file"):
        mpmd.checkpoint.load(pipe, opt, tmp_path / "b")
    assert opt.state_dict()["state"] == {}
    assert_same(train_3(pipe, opt), want)

    pipe, opt = make()   # the checkpoint saved before any step loads as one
    mpmd.checkpoint.load(pipe, opt, tmp_path / "a")
    assert_same(train_3(pipe, opt), want)


def test_a_checkpoint_loads_its_optimizer_state_into_a_fresh_optimizer(saved):
    """Resume: the moments and counter come back (no step() made them)."""
    _, root = saved
    pipe, opt = make()   # what the fixture saved, trained on
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    step(pipe, opt)
    sched.step()
    want = train_3(pipe, opt)
    fresh, fresh_opt = make()
    torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.9)   # initial_lr, as resumed
    mpmd.checkpoint.load(fresh, fresh_opt, root)
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 1
    assert_same(train_3(fresh, fresh_opt), want)


# ------------------------------------------------------ crafted plain values

@pytest.fixture
def deadline():
    """A hang on the code before the fix fails the test instead (the fixed
    load answers in milliseconds: the limit never decides it)."""
    def expired(*_):
        raise TimeoutError("load did not return within 60 s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def shared_nesting(levels):
    x = []
    for _ in range(levels):
        x = [x, x]
    return pickle.dumps(x, protocol=2)


def deep_nesting(levels):
    """A list nested ``levels`` deep, written op by op (pickle.dumps would
    recurse): the lists, outermost first, then one APPEND per level."""
    return b"\x80\x02" + b"]" * (levels + 1) + b"a" * levels + b"."


@pytest.mark.parametrize("data, problem", [
    (shared_nesting(40), "entries once its shared references are expanded"),
    (deep_nesting(100_000), "nested more than 100 levels deep")],
    ids=["shared_references_2^40", "100000_deep"])
def test_a_crafted_plain_item_is_refused_at_once_naming_key_and_file(saved, deadline,
                                                                     data, problem):
    directory, root = saved
    key, file = replace_item(directory, lambda k, md: isinstance(md, BytesStorageMetadata)
                             and k.endswith(".lr"), torch_save_of_pickle(data))
    pipe, opt, sched = trained(1)
    before = snapshot(pipe, opt, sched)
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(pipe, opt, root)
    text = str(e.value)
    assert f"{key!r} in step_1/{file} holds a value" in text and problem in text, text
    assert_same(snapshot(pipe, opt, sched), before)


def test_save_refuses_a_deep_value_naming_its_key(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    x = []
    for _ in range(5000):   # past the recursion limit
        x = [x]
    opt.param_groups[0]["schedule"] = x
    with pytest.raises(CheckpointError, match=r"optim.param_groups.blocks.0.0.weight.schedule"
                                              r"[.0-9]*\.\.\. \(a value nested more than 100 "
                                              r"levels deep\)"):
        mpmd.checkpoint.save(pipe, opt, tmp_path)


# ------------------------------------------------------------- two ranks

@pytest.mark.parametrize("how", ["stall", "die_in_dcp"])
def test_a_rank_that_stalls_or_dies_in_load_is_named_by_the_other(tmp_path, how):
    run = run_ranks(2, "checkpoint_atomic_worker:peer_fails_in_load", str(tmp_path), how,
                    timeout=120, pg_timeout=600, failure_grace=30, check=False)
    got = run.results[0]
    assert got and got.get("error"), run.describe([0, 1])
    assert got["error"].startswith("CheckpointError: "), got["error"]
    assert got["untouched"], got
    line = got["error"].splitlines()[0]
    if how == "stall":
        assert "rank 1 never arrived" in line or "rank 1 has not arrived" in line, got["error"]
    else:
        assert "rank 1 closed its connection" in line or "rank 1 died" in line, got["error"]
