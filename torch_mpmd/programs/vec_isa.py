"""Inductor's CPU vector ISA, probed once per machine rather than once per process.

NOTE [A probe per machine]: before Inductor generates CPU code it checks
every vector ISA the CPU claims (avx2, avx512, ...): it builds a small
program (kept in its cache) and loads it in a new Python process, one per
ISA, in every process that compiles. That is about 1.1 s of each rank of a
warm relaunch on two cores (BENCHMARKS.md, "Warm restarts"), though the
answer depends on the machine, the compiler and torch, not on the process.

So the first process to compile stage programs on a machine runs Inductor's
own probes and records which ISAs passed, beside Inductor's cache. Where
every ISA the CPU claims passed, stage programs are compiled with
Inductor's ``vec_isa_ok=True`` (among its ``cpp`` options): it then takes
the claimed ISAs as valid without their base probes, the same list the
probes gave. (The extra checks Inductor makes for some instructions, AVX-512
VNNI and BF16 and AMX, where the CPU claims them, still probe as before.) The setting is used in
every process, the one that probed included, because Inductor's cache keys
programs by its config: a relaunch must look its programs up under the key
the first launch stored them with. Nothing changes where some ISA failed its
probe, off x86, or where the user set ``vec_isa_ok``
(``TORCHINDUCTOR_VEC_ISA_OK``) themselves.

The record is keyed by what decides the probes: torch's version, build and
install (its folder, and libtorch_cpu's size and modification time), the
Python that loads the probe, the CPU's claimed ISAs, and the compiler (its
path, size, modification time and its own version line). Only a record of
every claimed ISA passing, probed by this process's Inductor, is written: a
failure (or a probe timed out on a loaded machine) is probed again by the
next process rather than kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile

import torch

__all__ = ["vec_isa_ok"]

_UNKNOWN = object()
_answer: object = _UNKNOWN  # this process's answer, once known


def _claimed() -> list[str]:
    """The vector ISAs Inductor would probe here: those whose CPU flags are set."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return "?"


def _record_path(claimed: list[str]) -> str:
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    compiler = get_cpp_compiler()
    where = shutil.which(compiler) or compiler
    torch_dir = os.path.dirname(torch.__file__)
    libtorch = os.path.join(torch_dir, "lib", "libtorch_cpu.so")
    key = json.dumps([torch.__version__, torch.version.git_version, torch_dir, _stamp(libtorch),
                      sys.executable, platform.machine(), claimed, where, _stamp(where),
                      get_compiler_version_info(compiler)])
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "torch_mpmd_vec_isa", f"{name}.json")


def _write(path: str, valid: list[str]) -> None:
    """Atomically (ranks of one machine may write it at once); a failure to
    write only costs the next process its probes."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"valid": valid}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def vec_isa_ok() -> bool | None:
    """The value of Inductor's ``vec_isa_ok`` (its ``cpp`` options) to compile stage
    programs with (NOTE [A probe per machine]): True where every ISA the CPU
    claims is known to build and load here (recorded by an earlier process,
    or probed now and recorded), else the user's setting (None: Inductor
    probes as usual)."""
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.config import cpp as cpp_options

    global _answer
    if cpp_options.vec_isa_ok is not None:
        return cpp_options.vec_isa_ok
    if _answer is not _UNKNOWN:
        return _answer  # type: ignore[return-value]
    if platform.machine() not in ("x86_64", "AMD64") or config.is_fbcode():
        _answer = None
        return None
    claimed = _claimed()
    path = _record_path(claimed)
    try:
        with open(path) as f:
            valid = json.load(f)["valid"]
    except (OSError, ValueError, KeyError, TypeError):
        # Inductor's probes, unless this process listed the ISAs already
        # (perhaps under a setting of its own): that list is used, not kept.
        probing = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
        valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        if probing and valid == claimed:
            _write(path, valid)
    _answer = True if claimed and valid == claimed else None
    return _answer  # type: ignore[return-value]
