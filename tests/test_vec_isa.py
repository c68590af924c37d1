"""Inductor's vector-ISA probes run once per machine (torch_mpmd/programs/vec_isa.py,
NOTE [A probe per machine]): the first process probes and records, a later
one takes the record without starting a probe, and both compile for the same
ISA under the same Inductor config. A record with a failed ISA, and the
user's own setting, leave Inductor to decide as before."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_mpmd.programs.vec_isa as vec_isa

# One process as a rank compiling stage programs sees it: the answer, then
# Inductor picking its ISA under the setting the programs compile with; every
# probe process Inductor starts is counted.
SCRIPT = """
import json, torch
from torch._inductor import config, cpu_vec_isa
from torch_mpmd.programs.vec_isa import vec_isa_ok, _claimed
probes = []
load = cpu_vec_isa.VecISA._probe_load
def counted(self, path):
    probes.append(str(self))
    return load(self, path)
cpu_vec_isa.VecISA._probe_load = counted
ok = vec_isa_ok()
with config.patch({"cpp.vec_isa_ok": True} if ok else {}):
    isa = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps(dict(ok=ok, probes=probes, isa=isa, claimed=_claimed())))
"""
X86 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not torch.cpu._is_avx2_supported(),
    reason="the probes are of x86 vector ISAs; this CPU claims none")


def _process(cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@X86
def test_the_first_process_probes_and_records_a_later_one_takes_the_record(tmp_path):
    first = _process(tmp_path)
    assert first["probes"], first  # Inductor's own probes, one process per check
    records = list((tmp_path / "torch_mpmd_vec_isa").glob("*.json"))
    second = _process(tmp_path)
    assert second["isa"] == first["isa"], (first, second)
    if first["ok"]:  # every claimed ISA builds and loads (the usual case): recorded
        assert len(records) == 1, records
        assert json.loads(records[0].read_text())["valid"] == first["claimed"]
        # One base probe per claimed ISA is skipped; the instruction checks
        # (AVX-512 VNNI, BF16, AMX, where claimed) remain.
        assert second["ok"] is True, second
        assert len(first["probes"]) - len(second["probes"]) == len(first["claimed"]), \
            (first, second)
    else:  # one failed: nothing recorded, and Inductor probes in every process
        assert not records and second["ok"] is None, (records, second)
        assert len(second["probes"]) == len(first["probes"]), (first, second)


@X86
def test_a_failed_isa_or_the_users_setting_leaves_inductor_to_probe(tmp_path, monkeypatch):
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)  # not set by the user here
    monkeypatch.setattr(vec_isa, "_claimed", lambda: ["avx2", "avx512"])
    path = Path(vec_isa._record_path(["avx2", "avx512"]))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"valid": ["avx2"]}))  # avx512 failed its probe here
    monkeypatch.setattr(vec_isa, "_answer", vec_isa._UNKNOWN)
    assert vec_isa.vec_isa_ok() is None
    path.write_text(json.dumps({"valid": ["avx2", "avx512"]}))
    monkeypatch.setattr(vec_isa, "_answer", vec_isa._UNKNOWN)
    assert vec_isa.vec_isa_ok() is True
    monkeypatch.setattr(vec_isa, "_answer", vec_isa._UNKNOWN)
    with config.patch({"cpp.vec_isa_ok": False}):
        assert vec_isa.vec_isa_ok() is False
