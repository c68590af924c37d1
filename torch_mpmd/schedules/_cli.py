"""Command line: print (and optionally draw) a schedule and its metrics.

    python -m torch_mpmd.schedules show 1f1b --ranks 4 --microbatches 8
    python -m torch_mpmd.schedules show zbv --ranks 4 --microbatches 8 --png zbv.png
    python -m torch_mpmd.schedules show --file sched.csv --lowered
    python -m torch_mpmd.schedules list

Contract: ``main(argv)`` returns 0 on success. Any usage or input error prints
one line ``error: ...`` to stderr and returns 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from torch_mpmd.schedules import (V_SCHEDULES, Schedule, SimulationResult, default_stages_per_rank,
                                  get_schedule, names)
from torch_mpmd.schedules._simulation import COST_KEYS

PROG = "python -m torch_mpmd.schedules"


class UsageError(Exception):
    """A command-line mistake; reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


def _parse_costs(text: str) -> dict[str, float]:
    costs: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--costs item {item!r} is not KEY=VALUE (e.g. F=1,B=2)")
        if key not in COST_KEYS:
            raise UsageError(f"--costs key {key!r} is not one of {', '.join(COST_KEYS)}")
        try:
            costs[key] = float(value)
        except ValueError:
            raise UsageError(f"--costs value {value!r} for {key} is not a number") from None
    return costs


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect torch_mpmd pipeline schedules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="print the schedule names")
    show = sub.add_parser(
        "show",
        help="print a schedule's per-rank table and simulated metrics",
        description="Print a named or loaded schedule, simulate it, optionally draw it.",
    )
    show.add_argument("name", nargs="?", help=f"schedule name: {', '.join(names())}")
    show.add_argument("--file", type=Path, help="load a .csv (torch format) or text schedule")
    show.add_argument("--ranks", type=int, help="number of pipeline ranks")
    show.add_argument("--microbatches", type=int, help="number of microbatches")
    show.add_argument("--stages-per-rank", type=int, default=None,
                      help="default: the schedule's own (2 for the V schedules: "
                           f"{', '.join(V_SCHEDULES)}), else 1")
    show.add_argument("--lowered", action="store_true", help="print the lowered program")
    show.add_argument("--shard", action="store_true",
                      help="lower for sharded data parallel (UNSHARD/RESHARD around each stage's "
                           "compute) before simulating; implies --lowered")
    show.add_argument("--costs", type=_parse_costs, default=None,
                      help="e.g. F=1,B=2,I=1,W=1,REDUCE_GRAD=0,UNSHARD=0,RESHARD=0 (UNSHARD/RESHARD "
                           "apply with --shard or to a --file schedule that holds them)")
    show.add_argument("--comm-latency", type=float, default=0.0, help="time per message")
    show.add_argument("--png", type=Path, help="draw the simulated timeline to this PNG")
    return parser


def _load(args: argparse.Namespace) -> Schedule:
    if args.file is not None:
        if args.name is not None:
            raise UsageError("give a schedule name or --file, not both")
        given = [f for f in ("ranks", "microbatches", "stages_per_rank") if getattr(args, f) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{flag} applies to a named schedule, not to --file")
        if args.file.suffix.lower() == ".csv":
            return Schedule.from_csv(args.file)
        return Schedule.from_text(args.file.read_text(encoding="utf-8"))
    if args.name is None:
        raise UsageError("give a schedule name or --file")
    if args.ranks is None or args.microbatches is None:
        raise UsageError(f"schedule {args.name!r} needs --ranks and --microbatches")
    return get_schedule(
        args.name,
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        stages_per_rank=default_stages_per_rank(args.name) if args.stages_per_rank is None
        else args.stages_per_rank,
    )


def _metrics(result: SimulationResult) -> str:
    mean = sum(result.bubble_fraction) / max(len(result.bubble_fraction), 1)
    lines = [
        f"makespan: {result.makespan:g}",
        "bubble fraction per rank: "
        + " ".join(f"{b:.3f}" for b in result.bubble_fraction)
        + f" (mean {mean:.3f})",
        "peak activations per rank: " + " ".join(str(a) for a in result.peak_activations),
        f"messages: {result.messages}",
    ]
    if result.comm_bytes:
        lines.append(f"comm bytes: {result.comm_bytes:g}")
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> None:
    if args.png is not None:
        from torch_mpmd.schedules.plot import import_matplotlib

        import_matplotlib()  # fail before printing anything when it is missing
    schedule = _load(args)
    if args.shard:
        if schedule.is_lowered:
            raise UsageError("--shard lowers the schedule, which is lowered already")
        schedule = schedule.lower(shard=True)
    shown = schedule.lower() if args.lowered and not schedule.is_lowered else schedule
    result = schedule.simulate(
        args.costs, comm_latency=args.comm_latency, timeline=args.png is not None
    )
    print(shown.table())
    print()
    print(_metrics(result))
    if args.png is not None:
        from torch_mpmd.schedules.plot import save_timeline

        save_timeline(schedule, result, args.png)
        print(f"wrote {args.png}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 error)."""
    try:
        args = _build_parser().parse_args(argv)
        if args.command == "list":
            print("\n".join(names()))
        else:
            _show(args)
    except (UsageError, ValueError, RuntimeError, OSError, ImportError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    return 0
