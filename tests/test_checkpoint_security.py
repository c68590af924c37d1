"""torch_mpmd.checkpoint never runs code on load: a ``.metadata`` or a
non-tensor item rewritten to carry a pickle payload is refused (whether or not
the writer also rewrote every checksum) and the payload never runs; an edited
``extra`` / ``extra_per_rank`` in a manifest is detected; a save refuses
values that load could not read back; a checkpoint without manifests
(``strict=False``) loads unverified but still runs no code; a save removes the
directories of saves that died part-way.

The two-rank cases: one 2-rank run saves, this process tampers with copies of
the checkpoint (as a writer with access to the files would, recomputing what
it can), and a second 2-rank run loads each copy.
"""

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import zlib

import pytest
import torch

import torch_mpmd as mpmd
from dist_harness import run_ranks
from test_checkpoint import make, step
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch_mpmd.checkpoint import CheckpointError


class Payload:
    """Pickles as a call of ``eval(code)``: what a hostile file carries."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


def marking(marker, then):
    """Code that creates ``marker`` and evaluates to ``then`` (an expression)."""
    return f"(open({marker!r}, 'w').write('ran'), {then})[1]"


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def rehash_metadata(directory):
    """What a writer that recomputes checksums does after rewriting .metadata:
    record its sha256 in rank 0's manifest."""
    manifest = os.path.join(directory, "rank_0.json")
    m = read_json(manifest)
    digest = hashlib.sha256(open(os.path.join(directory, ".metadata"), "rb").read()).hexdigest()
    m.setdefault("sha256", {})[".metadata"] = digest
    write_json(manifest, m)


def metadata_payload(directory, marker, rehash):
    """Replace .metadata by a pickle that runs code and returns the real metadata."""
    path = os.path.join(directory, ".metadata")
    real = open(path, "rb").read()
    code = marking(marker, f"__import__('pickle').loads({real!r})")
    with open(path, "wb") as f:
        pickle.dump(Payload(code), f)
    if rehash:
        rehash_metadata(directory)


def item_payload(directory, marker):
    """Point one non-tensor item of rank 1's file (an optimizer option) at a
    torch.save of a payload appended to that file, and recompute every
    checksum: the item's CRC32 in rank 1's manifest and .metadata's sha256.
    Returns the item's key and file."""
    md_path = os.path.join(directory, ".metadata")
    with open(md_path, "rb") as f:
        metadata = pickle.load(f)   # our own test's file: trusted
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if s.relative_path == "__1_0.distcp"
                       and isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
                       and i.fqn.endswith(".lr"))
    buf = io.BytesIO()
    torch.save(Payload(marking(marker, "0.01")), buf)
    blob = buf.getvalue()
    data_path = os.path.join(directory, info.relative_path)
    offset = os.path.getsize(data_path)
    with open(data_path, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    with open(md_path, "wb") as f:
        pickle.dump(metadata, f)
    manifest = os.path.join(directory, "rank_1.json")
    m = read_json(manifest)
    for e in m["items"]:
        if e["key"] == index.fqn:
            e.update(offset=offset, length=len(blob), crc32=zlib.crc32(blob))
    write_json(manifest, m)
    rehash_metadata(directory)
    return index.fqn, info.relative_path


def edit(directory, manifest, kind, name, value):
    path = os.path.join(directory, manifest)
    m = read_json(path)
    m[kind][name] = {"value": value}
    write_json(path, m)


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    """Each case's checkpoint root, its marker files, and every rank's load result."""
    base = tmp_path_factory.mktemp("tamper")
    saved = run_ranks(2, "checkpoint_worker:save_for_tampering", str(base / "saved"),
                      timeout=120).results[0]["saved_in"]
    cases, facts = {}, {}
    for case in ("intact", "metadata", "metadata_rehashed", "item", "extra", "extra_per_rank"):
        root = base / case
        shutil.copytree(base / "saved", root)
        cases[case] = str(root)
        target = str(root / os.path.basename(saved))
        marker = str(base / f"{case}.ran")
        facts[case] = {"marker": marker}
        if case.startswith("metadata"):
            metadata_payload(target, marker, rehash=case.endswith("rehashed"))
        elif case == "item":
            facts[case]["key"], facts[case]["file"] = item_payload(target, marker)
        elif case == "extra":
            edit(target, "rank_0.json", "extra", "step", 999)
        elif case == "extra_per_rank":
            edit(target, "rank_1.json", "extra_per_rank", "rank", 7)
    run = run_ranks(2, "checkpoint_worker:load_each", list(cases.values()), timeout=180)
    return {case: {**facts[case], "got": [r[root] for r in run.results]}
            for case, root in cases.items()}


def refused(case):
    """Every rank's error (the same first line on each), checked to be a
    CheckpointError that left the parameters as they were."""
    errors = [g["error"] for g in case["got"]]
    assert all(e is not None for e in errors), case["got"]
    assert all(e.startswith("CheckpointError: ") for e in errors), errors
    assert len({e.splitlines()[0] for e in errors}) == 1, errors
    assert all(g["untouched"] for g in case["got"]), case["got"]
    return errors[0].splitlines()[0]


def test_intact_checkpoint_loads_with_its_extra_state(tampered):
    for rank, got in enumerate(tampered["intact"]["got"]):
        assert got["error"] is None, got["error"]
        assert got["extra"] == {"step": 5} and got["extra_per_rank"] == {"rank": rank}


def test_metadata_with_a_pickle_payload_is_refused_by_its_checksum_and_never_runs(tampered):
    case = tampered["metadata"]
    line = refused(case)
    assert ".metadata does not match the sha256 recorded in rank_0.json" in line, line
    assert not os.path.exists(case["marker"])


def test_metadata_with_a_payload_and_a_recomputed_checksum_is_refused_unread(tampered):
    case = tampered["metadata_rehashed"]
    line = refused(case)
    assert ".metadata" in line and "builtins.eval" in line, line
    assert "refused" in line, line
    assert not os.path.exists(case["marker"])


def test_non_tensor_item_with_a_payload_is_refused_on_every_rank_and_never_runs(tampered):
    case = tampered["item"]
    line = refused(case)
    assert f"{case['key']!r} in step_1/{case['file']}" in line, line
    assert "eval" in line and "refused" in line, line
    assert not os.path.exists(case["marker"])


def test_edited_extra_is_detected_naming_the_entry_and_manifest(tampered):
    line = refused(tampered["extra"])
    assert "rank_0.json" in line and "extra['step'] was changed" in line, line


def test_edited_extra_per_rank_is_detected_naming_the_entry_and_manifest(tampered):
    line = refused(tampered["extra_per_rank"])
    assert "rank_1.json" in line and "extra_per_rank['rank'] was changed" in line, line


# ------------------------------------------------------------- one process

class Opaque:
    """A value a checkpoint cannot carry (loading it would need its class)."""


def test_save_refuses_a_non_tensor_value_load_could_not_read_back(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    opt.param_groups[0]["schedule"] = Opaque()
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.save(pipe, opt, tmp_path)
    line = str(e.value).splitlines()[0]
    assert "optim.param_groups.blocks.0.0.weight.schedule" in line, line
    assert "Opaque" in line, line
    assert not os.path.exists(tmp_path / "latest")
    assert [n for n in os.listdir(tmp_path) if n.startswith("step_")] == []


def test_plain_non_tensor_values_round_trip(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    # One item (DCP pickles a tuple whole) holding every kind of plain value.
    value = ("warmup", b"\x00\xff", {1, 2}, (1.5, None), 1 + 2j, [{"k": frozenset({"a"})}])
    for group in opt.param_groups:
        group["tags"] = value
    mpmd.checkpoint.save(pipe, opt, tmp_path)
    fresh, fresh_opt = make()
    for group in fresh_opt.param_groups:
        group["tags"] = None   # load fills the optimizer's own keys
    mpmd.checkpoint.load(fresh, fresh_opt, tmp_path)
    assert fresh_opt.param_groups[0]["tags"] == value


def test_save_removes_directories_of_saves_that_died(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    first = mpmd.checkpoint.save(pipe, opt, tmp_path)
    dead = tmp_path / "step_0"               # data, no manifest: died in DCP's write
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"half")
    half = tmp_path / "step_1.7"             # rank 0's manifest only, of 2 ranks
    shutil.copytree(first, half)
    m = read_json(half / "rank_0.json")
    m["world_size"] = 2
    write_json(half / "rank_0.json", m)
    step(pipe, opt)
    second = mpmd.checkpoint.save(pipe, opt, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1", "step_2"]
    assert mpmd.checkpoint.latest(tmp_path) == second


def test_checkpoint_without_manifests_loads_unverified_but_never_runs_code(tmp_path):
    pipe, opt = make()
    step(pipe, opt)
    directory = mpmd.checkpoint.save(pipe, opt, tmp_path)
    os.remove(os.path.join(directory, "rank_0.json"))   # as DCP alone writes it
    fresh, fresh_opt = make()
    with pytest.raises(CheckpointError, match="rank_0.json is missing"):
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path)
    assert mpmd.checkpoint.load(fresh, fresh_opt, tmp_path, strict=False)["step"] == 1
    marker = str(tmp_path / "ran")
    metadata_payload(directory, marker, rehash=False)
    with pytest.raises(CheckpointError) as e:
        mpmd.checkpoint.load(fresh, fresh_opt, tmp_path, strict=False)
    assert ".metadata refers to builtins.eval" in str(e.value).splitlines()[0]
    assert not os.path.exists(marker)
