"""Timeline drawing with matplotlib (imported lazily; Agg canvas, no pyplot).

Contract: ``save_timeline(schedule, result, path)`` writes a PNG with one row
per rank (rank 0 on top) and one box per compute, REDUCE_GRAD, UNSHARD or
RESHARD action of non-zero duration from ``result.timeline`` (which must have
been recorded), coloured by kind and labelled with the microbatch and stage
(collectives: a letter and the stage; REDUCE_GRAD and UNSHARD are drawn over
their span on the collective stream, so they may overlap compute). Raises ``ImportError`` with an install
hint when matplotlib is missing, ``ValueError`` without a timeline.
"""

from __future__ import annotations

import os
from typing import Union

from torch_mpmd import _C
from torch_mpmd.schedules._schedule import Schedule
from torch_mpmd.schedules._simulation import SimulationResult

_K = _C.ActionKind
# The kinds drawn, one row each: (colour, legend label). The usual
# schedule-diagram palette: forward blue, backward green, input gradient light
# green, weight gradient orange. Kinds not here (SEND/RECV) are not drawn.
_DRAWN = {
    _K.FORWARD: ("#5b9bd5", "forward"),
    _K.FULL_BACKWARD: ("#70ad47", "backward"),
    _K.BACKWARD_INPUT: ("#a9d18e", "input grad"),
    _K.BACKWARD_WEIGHT: ("#f4b183", "weight grad"),
    _K.REDUCE_GRAD: ("#bfbfbf", "grad reduce"),
    _K.UNSHARD: ("#b4a7d6", "param gather"),
    _K.RESHARD: ("#d9d2e9", "param free"),
}
KIND_COLOURS = {kind: colour for kind, (colour, _) in _DRAWN.items()}
# Box label letters of the stage collectives (no microbatch).
_COLLECTIVE_LETTERS = {_K.REDUCE_GRAD: "R", _K.UNSHARD: "U", _K.RESHARD: "X"}


def import_matplotlib():  # type: ignore[no-untyped-def]
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            f"drawing a timeline needs matplotlib ({e}); install it with `pip install matplotlib`"
        ) from None
    return Figure, FigureCanvasAgg, Patch


def draw_timeline(ax, rows, makespan: float, points_per_unit: float) -> list:  # type: ignore[no-untyped-def]
    """Draw per-rank rows of ``(action, start, end)`` (typed actions) on
    ``ax`` (rank 0 on top); returns the kinds drawn, in first-seen order (for
    a legend)."""
    seen: list = []
    for rank, row in enumerate(rows):
        for action, start, end in row:
            kind = action.kind
            if kind not in KIND_COLOURS or end <= start:
                continue
            if kind not in seen:
                seen.append(kind)
            ax.barh(rank, end - start, left=start, height=0.8, color=KIND_COLOURS[kind],
                    edgecolor="black", linewidth=0.6)
            letter = _COLLECTIVE_LETTERS.get(kind)
            label = f"{letter}\ns{action.stage}" if letter else f"{action.microbatch}\ns{action.stage}"
            size = min(9.0, (end - start) * points_per_unit / 2.2)
            if size >= 4.0:
                ax.text((start + end) / 2, rank, label, ha="center", va="center",
                        fontsize=size, linespacing=0.9)
    ax.set_xlim(0, makespan)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    return seen


def add_legend(fig, ax, kinds) -> None:  # type: ignore[no-untyped-def]
    _, _, Patch = import_matplotlib()
    order = [k for k in KIND_COLOURS if k in kinds]
    ax.legend(
        handles=[Patch(facecolor=_DRAWN[k][0], edgecolor="black", label=_DRAWN[k][1])
                 for k in order],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
    )


def save_timeline(
    schedule: Schedule, result: SimulationResult, path: Union[str, "os.PathLike[str]"]
) -> None:
    """Draw ``result.timeline`` of ``schedule`` into the PNG file ``path``."""
    if result.timeline is None:
        raise ValueError("the result has no timeline; simulate with timeline=True")
    Figure, FigureCanvasAgg, _ = import_matplotlib()
    makespan = max(result.makespan, 1e-9)
    ranks = len(result.timeline)
    width_in = min(40.0, max(8.0, 0.35 * makespan + 1.5))
    fig = Figure(figsize=(width_in, 0.9 + 0.55 * ranks), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    seen = draw_timeline(ax, result.timeline, makespan, (width_in - 1.5) * 72 / makespan)
    ax.set_xlabel("time")
    mean_bubble = sum(result.bubble_fraction) / max(len(result.bubble_fraction), 1)
    ax.set_title(
        f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches; makespan {result.makespan:g}, "
        f"mean bubble {mean_bubble:.1%}"
    )
    add_legend(fig, ax, seen)
    fig.savefig(os.fspath(path), dpi=110)
