"""Compare torch_mpmd's pipeline schedules on the simulator.

Run it (from the repository root, on a fresh machine):

    bash scripts/run_example.sh

or, once set up:

    python examples/show_schedules.py --ranks 4 --microbatches 8 --png schedules.png

For each built-in schedule it generates the per-rank programs in C++, lowers
them (adds the SEND/RECV and gradient-reduce actions), proves them
deadlock-free, simulates them under the default cost model (F=1, B=2, I=1,
W=1) and prints makespan, bubble and peak in-flight activations side by side,
then the full lowered program of one schedule. Until the executor lands this
is the main job; later it trains a GPT under torchrun.
"""

import argparse

from torch_mpmd import schedules

# stages_per_rank each schedule is shown with: the fewest that show what it
# is for (the schedule table's; V schedules need exactly 2).
STAGES_PER_RANK = {name: schedules.facts(name).typical_stages_per_rank
                   for name in schedules.schedule_names()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--show", default="1f1b", help="schedule whose lowered program is printed")
    parser.add_argument("--png", help="also draw the --show schedule's simulated timeline here")
    args = parser.parse_args()

    print(f"ranks={args.ranks} microbatches={args.microbatches}, costs F=1 B=2 I=1 W=1\n")
    print(f"{'schedule':<18}{'stages/rank':>12}{'makespan':>10}{'mean bubble':>13}{'peak act (per rank)':>24}")
    for name in schedules.names():
        spr = STAGES_PER_RANK.get(name, 1)
        try:
            sched = schedules.get_schedule(
                name, num_ranks=args.ranks, num_microbatches=args.microbatches, stages_per_rank=spr
            )
        except ValueError as err:
            print(f"{name:<18}{spr:>12}  not available here: {err}")
            continue
        result = sched.lower().simulate()
        bubble = sum(result.bubble_fraction) / len(result.bubble_fraction)
        print(f"{name:<18}{spr:>12}{result.makespan:>10.0f}{bubble:>13.3f}{str(result.peak_activations):>24}")

    shown = schedules.get_schedule(
        args.show,
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        stages_per_rank=STAGES_PER_RANK.get(args.show, 1),
    ).lower()
    print(f"\nlowered program of {args.show}:")
    print(shown.table())
    if args.png:
        from torch_mpmd.schedules import plot

        plot.save_timeline(shown, shown.simulate(timeline=True), args.png)
        print(f"timeline written to {args.png}")


if __name__ == "__main__":
    main()
