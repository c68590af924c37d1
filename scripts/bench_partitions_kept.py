"""Stages built again from the export memo, as a planner's profile,
calibration and trials build them: F and B cut again at every hit, copies
of the kept ones, or the kept ones shared (NOTE [Partitions kept] in
torch_mpmd/programs/export_memo.py).

    python scripts/bench_partitions_kept.py cut|copies|shared [--rebuilds 15]

One process, tests/test_programs.py's tiny GPT (2 stages): traced once,
then captured, built and stepped ``--rebuilds`` times from the memo; the
median wall of one rebuild and step, and the memo's counts.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_programs as T  # noqa: E402  (the tests' model and one-process step)

from torch_mpmd.programs import export_memo, stage_programs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("cut", "copies", "shared"))
    parser.add_argument("--rebuilds", type=int, default=15)
    args = parser.parse_args()
    kept = export_memo.partitioned
    if args.mode == "cut":
        stage_programs.export_memo.partitioned = lambda joint, partition, **_: partition()
    elif args.mode == "copies":
        stage_programs.export_memo.partitioned = (
            lambda joint, partition, **_: kept(joint, partition, shared=False))
    model, x, y, loss_fn, kw = T._case("gpt")
    T.train_step(copy.deepcopy(model), x, y, loss_fn, split=True, **kw)  # the one trace
    walls = []
    for _ in range(args.rebuilds):
        fresh = copy.deepcopy(model)
        start = time.perf_counter()
        T.train_step(fresh, x, y, loss_fn, split=True, **kw)
        walls.append(time.perf_counter() - start)
    print(f"{args.mode}: median {statistics.median(walls) * 1e3:.1f} ms, "
          f"min {min(walls) * 1e3:.1f} ms per rebuild and step; memo {export_memo.stats()}")


if __name__ == "__main__":
    main()
