"""Replicas surviving each other, measured (torch_mpmd/parallel/quorum.py).

Runs tests/quorum_worker.py's scenario: two torchrun jobs of a 2-rank
pipeline each in a Lighthouse of this process; a rank of replica 1 is
SIGKILLed (``--fault kill``) or hangs (``--fault stall``) once it joined
step 5's quorum. Prints, from the ranks' own clocks:

- the seconds from the fault to the survivor's failed step's end, and to its
  next committed step's end;
- the restart: from the fault to the restarted launch's start (after its
  imports), to its quorum being ready, and to its first committed step (the
  rejoin, healed from the survivor);
- the median step with two replicas and with one;
- a timeline of both replicas' steps (rank 0).

    python scripts/bench_quorum.py [--fault kill|stall] [--heartbeat-ms 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import quorum_worker as qw  # noqa: E402

COLUMN_S = 0.25


def _timeline(out: dict, t0: float, t1: float) -> str:
    """One row per replica launch (rank 0): '=' a step committed by two
    replicas, '-' by one, 'x' a step that did not commit; '!' the fault."""
    width = int((t1 - t0) / COLUMN_S) + 1
    fault = out["fault_at"]
    rows = []
    for (replica, rank, launch), data in sorted(out["ranks"].items()):
        if rank:
            continue
        row = [" "] * width
        start = int((data["started"] - t0) / COLUMN_S)
        for i in range(start, int((data["ready"] - t0) / COLUMN_S) + 1):
            row[i] = "."
        for rec in data["records"]:
            mark = ("=" if rec["participants"] > 1 else "-") if rec["committed"] else "x"
            for i in range(int((rec["started"] - t0) / COLUMN_S),
                           int((rec["ended"] - t0) / COLUMN_S) + 1):
                row[i] = mark
        row[int((fault - t0) / COLUMN_S)] = "!"
        rows.append(f"replica {replica} launch {launch} |{''.join(row).rstrip()}")
    axis = "".join(f"{int(i * COLUMN_S):<4d}" if i % 4 == 0 else "" for i in range(width))
    return "\n".join(rows + [f"{'seconds':>18} |{axis}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fault", choices=["kill", "stall"], default="kill")
    ap.add_argument("--heartbeat-ms", type=int, default=2000)
    ap.add_argument("--end", type=int, default=10)
    ap.add_argument("--out", help="keep the ranks' records and logs in this folder")
    args = ap.parse_args()
    env = {"QUORUM_KILL" if args.fault == "kill" else "QUORUM_STALL": "5:1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.out or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        ranks = qw.run_quorum(Path(tmp), env, tokens=False, end=args.end,
                              heartbeat_ms=args.heartbeat_ms)
        fault = float((Path(tmp) / "fault_at").read_text())
    survivor = ranks[(0, 0, 0)]["records"]
    failed = [r for r in survivor if not r["committed"] and r["started"] >= fault - 1]
    after = next(r for r in survivor if r["committed"] and r["ended"] > fault)
    back = ranks[(1, 0, 1)]
    rejoin = next(r for r in back["records"] if r["committed"])
    both = [r["ended"] - r["started"] for r in survivor if r["committed"] and r["participants"] > 1]
    alone = [r["ended"] - r["started"] for r in survivor if r["committed"] and r["participants"] == 1]
    print(f"fault: {args.fault} rank 1 of replica 1 at step 5 (Lighthouse heartbeat timeout "
          f"{args.heartbeat_ms} ms, quorum timeout 10 s)")
    if failed:
        print(f"  survivor's failed step ended      {failed[0]['ended'] - fault:6.2f} s after the fault")
    print(f"  survivor's next committed step     {after['ended'] - fault:6.2f} s after the fault "
          f"({after['participants']} replica)")
    print(f"  restarted launch started (imports) {back['started'] - fault:6.2f} s after the fault")
    print(f"  ... its pipeline and quorum ready  {back['ready'] - fault:6.2f} s")
    print(f"  ... rejoined (first commit, healed) {rejoin['ended'] - fault:5.2f} s "
          f"({rejoin['ended'] - back['started']:.2f} s after its start)")
    print(f"  median step: two replicas {statistics.median(both) * 1e3:.1f} ms, one "
          f"{statistics.median(alone) * 1e3:.1f} ms")
    t0 = min(d["started"] for d in ranks.values())
    t1 = max(d["records"][-1]["ended"] for d in ranks.values())
    print(_timeline({"ranks": ranks, "fault_at": fault}, t0, t1))


if __name__ == "__main__":
    main()
