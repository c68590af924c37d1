"""Where the test suite's CPU goes: a sampling profile of every process.

Record the whole suite (pytest, its workers, every rank forked from the
test zygote, torchrun and its workers) with py-spy, then sum the samples by
what they were doing:

    pip install py-spy
    py-spy record -o /tmp/suite_raw.txt -f raw --subprocesses --rate 25 -- \\
        python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests
    python scripts/suite_profile.py /tmp/suite_raw.txt [--by-worker]

A sample goes to the first phase of PHASES found anywhere in its stack (an
import inside a capture counts as an import). py-spy's own sampling slows
the run (15 min against 12 here), so read shares, not seconds.
``--by-worker``: also the phases of each test worker module (the outermost
``*_worker.py`` or ``test_*.py`` frame).
"""

from __future__ import annotations

import argparse
import collections
import re

# (phase, substrings of a frame that mark it), in order of precedence.
PHASES = [
    ("import", ["_find_and_load"]),
    ("Inductor compile", ["compile_fx_inner", "fx_codegen_and_compile", "(torch/_inductor/"]),
    ("AOTAutograd joint trace", ["aot_export_joint_with_descriptors"]),
    ("F/B partition", ["default_partition"]),
    ("I/W split", ["_split (torch_mpmd/programs/stage_programs.py"]),
    ("export memo copies", ["_copy (torch_mpmd/programs/export_memo.py"]),
    ("Dynamo trace", ["(torch/_dynamo/convert_frame.py"]),
    ("capture, rest", ["capture (torch_mpmd/graph/capture.py"]),
    ("split, rest", ["split_model (torch_mpmd/graph/stage.py"]),
    ("programs, rest", ["build_stage_programs"]),
    ("calibration", ["measure_runtime (torch_mpmd/planning/calibrate.py"]),
    ("trials", ["run_trials (torch_mpmd/planning/trials.py"]),
    ("profile, rest", ["_profile (torch_mpmd/planning/profile.py"]),
    ("pipeline steps", ["step (torch_mpmd/session.py"]),
    ("test harness", ["dist_harness", "dist_workers"]),
    ("pytest", ["pytest"]),
]
_WORKER = re.compile(r"\((\w+_worker|test_\w+)\.py:")


def phase_of(stack: str) -> str:
    for name, marks in PHASES:
        if any(m in stack for m in marks):
            return name
    return "other"


def read(path: str, rate: float, by_worker: bool) -> None:
    totals: collections.Counter[str] = collections.Counter()
    workers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():  # a process's command line split over lines
                continue
            phase = phase_of(stack)
            totals[phase] += int(count)
            if by_worker:
                found = _WORKER.search(stack)
                workers[found.group(1) if found else "(no test frame)"][phase] += int(count)
    whole = sum(totals.values())
    print(f"{'seconds':>9} {'share':>6}  phase ({whole / rate:.0f} s sampled)")
    for name, n in totals.most_common():
        print(f"{n / rate:9.1f} {100 * n / whole:5.1f}%  {name}")
    if by_worker:
        print()
        for name, phases in sorted(workers.items(), key=lambda kv: -sum(kv[1].values()))[:25]:
            top = ", ".join(f"{p} {n / rate:.0f}" for p, n in phases.most_common(4))
            print(f"{sum(phases.values()) / rate:9.1f}  {name}: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy's output in its raw (collapsed stack) format")
    parser.add_argument("--rate", type=float, default=25.0, help="py-spy's --rate")
    parser.add_argument("--by-worker", action="store_true")
    args = parser.parse_args()
    read(args.raw, args.rate, args.by_worker)


if __name__ == "__main__":
    main()
