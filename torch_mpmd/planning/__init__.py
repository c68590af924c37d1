"""Planning on paper: pick the pipeline plan with the least predicted step from a cost sheet.

    from torch_mpmd import planning
    sheet = planning.CostSheet.from_json("sheet.json")     # per-unit times and bytes, link rates
    plan = planning.plan_from_sheet(sheet, memory_limit=80 * 2**30)
    print(plan.describe())         # the plan, the top candidates, why; all simulated
    plan.to_json("plan.json")      # schedule, num_microbatches, stages_per_rank, split_points, recompute

The search runs in C++ (csrc/core/planner.h): every schedule the project
builds, 1, 2 or 4 stages per rank, the divisors of the batch as microbatch
counts, the exact min-max split (and a communication-aware one), recompute
per stage where the memory limit needs it; each candidate is simulated with
the sheet's per-stage costs, action overhead and link rates. Nothing here
imports torch.

Measured sheets and plans applied (these import torch, on first use):
``torch_mpmd.planning.profile`` (``mpmd.profile``: a model's per-unit costs
measured by running its stage programs, cached on disk) and
``torch_mpmd.planning.auto`` (``mpmd.plan``: profile and search, collective,
the same plan on every rank; ``pipeline(plan=...)``, ``plan="auto"`` and
``Pipeline.replan`` use it).
"""

from torch_mpmd.planning.plan import (
    Candidate,
    Plan,
    Rejected,
    SearchRecord,
    evaluate_plan,
    plan_from_sheet,
)
from torch_mpmd.planning.sheet import CostSheet, Unit

__all__ = [
    "Candidate",
    "CostSheet",
    "Plan",
    "Rejected",
    "SearchRecord",
    "Unit",
    "evaluate_plan",
    "plan_from_sheet",
]
