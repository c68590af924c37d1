"""The Python ``Schedule``: an immutable wrapper around ``_C.Schedule``.

Every way to obtain a ``Schedule`` checks it: ``get_schedule`` and
``with_edges`` run the full ``validate`` (static invariants, then lowering and
simulation, so a deadlock raises ``DeadlockError``); ``from_text``,
``from_csv`` and ``from_actions`` run the static invariants only, so a loaded
program that deadlocks still loads and reports its deadlock from
``validate()`` or ``simulate()``. Malformed input raises ``ValueError``
(``ParseError``/``ScheduleError``) naming the token or the values.

Programs are read as typed ``_C.Action`` values (``actions``); their text
rows (``action_text``) are formatted by the core, never parsed here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

from torch_mpmd import _C
from torch_mpmd.schedules._simulation import CostDict, SimulationResult, cost_model

PathLike = Union[str, "os.PathLike[str]"]
_TABLE_WIDTH = 120


class Schedule:
    """Per-rank action programs of one pipeline step; see the module docstring.

    Construct through ``get_schedule`` or the ``from_*`` classmethods; the
    constructor wraps an already-checked ``_C.Schedule`` and is internal.
    """

    __slots__ = ("_cpp", "_programs")
    _cpp: _C.Schedule
    _programs: tuple[tuple[_C.Action, ...], ...]

    def __init__(self, cpp: _C.Schedule) -> None:
        if not isinstance(cpp, _C.Schedule):
            raise TypeError(f"Schedule wraps a torch_mpmd._C.Schedule, got {type(cpp).__name__}")
        object.__setattr__(self, "_cpp", cpp)
        # The one place actions cross from the core: converted once, kept immutable.
        object.__setattr__(self, "_programs", tuple(tuple(row) for row in cpp.programs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Schedule is immutable; with_edges() and lower() return new ones")

    # -- properties -------------------------------------------------------
    @property
    def name(self) -> str:
        return self._cpp.name

    @property
    def num_ranks(self) -> int:
        return self._cpp.num_ranks

    @property
    def num_stages(self) -> int:
        return self._cpp.num_stages

    @property
    def num_microbatches(self) -> int:
        return self._cpp.num_microbatches

    @property
    def stages_per_rank(self) -> int:
        return self._cpp.stages_per_rank

    @property
    def stage_to_rank(self) -> list[int]:
        return list(self._cpp.stage_to_rank)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Stage data dependencies ``(producer, consumer)``; the chain by default."""
        return list(self._cpp.edges)

    @property
    def actions(self) -> list[list[_C.Action]]:
        """Each rank's program as typed actions (``a.stage``, ``a.kind``,
        ``a.microbatch``, ``a.peer_stage``); ``str(a)`` is the text form."""
        return [list(program) for program in self._programs]

    @property
    def action_text(self) -> list[list[str]]:
        """Each rank's program as action tokens (``"2F0"``, ``"1RECV_B3"``)."""
        return [[str(a) for a in program] for program in self._programs]

    def part(self, kinds: Iterable[_C.ActionKind], *, name: str) -> "Schedule":
        """The schedule named ``name`` whose programs keep only the actions of
        ``kinds``, in order; placement, edges and microbatches unchanged.

        Not validated: a part of a schedule (its forwards) is not a whole
        step. Of a lowered schedule, the forward kinds (F, SEND_F, RECV_F)
        or the backward ones keep a valid program: a subsequence keeps every
        channel's order (NOTE [Channel order]) and forwards depend only on
        forwards.
        """
        keep = set(kinds)
        out = copy.copy(self._cpp)
        out.name = name
        out.programs = [[a for a in program if a.kind in keep] for program in self._programs]
        return Schedule(out)

    @property
    def activation_bound(self) -> list[int]:
        """Per-rank bound on in-flight forwards the schedule promises; [] if none."""
        return list(self._cpp.activation_bound)

    @property
    def splits_backward(self) -> bool:
        """True when the programs split backwards into I and W (zero bubble)."""
        return self._cpp.splits_backward

    @property
    def is_lowered(self) -> bool:
        """True when the programs hold any action besides F/B/I/W: SEND/RECV,
        REDUCE_GRAD, UNSHARD or RESHARD."""
        return self._cpp.is_lowered

    # -- transformations ----------------------------------------------------
    def lower(
        self,
        *,
        grad_reduce: bool = True,
        shard: bool = False,
        unshard_prefetch: int = 1,
        reshard_after_forward: bool = False,
    ) -> "Schedule":
        """Add transfers (and REDUCE_GRAD unless ``grad_reduce=False``).

        With ``shard=True`` (ZeRO-3/FSDP-style sharded data parallel) each
        rank also gathers each local stage's parameters (``UNSHARD``) before
        its compute and frees them (``RESHARD``) after; NOTE [Unshard
        placement] in csrc/core/lowering.h. ``unshard_prefetch`` (>= 0) is how
        many compute actions ahead of the stage's first compute the gather is
        posted; ``reshard_after_forward`` also frees the parameters between a
        stage's forwards and backwards when more than ``unshard_prefetch``
        compute actions of other stages run in between.

        Raises ``ValueError`` when the schedule is already lowered or
        ``unshard_prefetch`` is negative.
        """
        if self.is_lowered:
            raise ValueError(f"schedule '{self.name}' is already lowered")
        if isinstance(unshard_prefetch, bool) or not isinstance(unshard_prefetch, int):
            raise ValueError(f"unshard_prefetch={unshard_prefetch!r} must be an int >= 0")
        if unshard_prefetch < 0:
            raise ValueError(f"unshard_prefetch={unshard_prefetch} must be >= 0")
        return Schedule(
            _C.lower(
                self._cpp,
                grad_reduce=grad_reduce,
                shard=bool(shard),
                unshard_prefetch=unshard_prefetch,
                reshard_after_forward=bool(reshard_after_forward),
            )
        )

    def with_edges(self, edges: Iterable[Sequence[int]]) -> "Schedule":
        """A validated copy whose stage edges are exactly ``edges``.

        The list replaces the current one, so keep the chain when adding a skip
        connection: ``s.with_edges(s.edges + [(0, 3)])``. Compute-only
        schedules only (transfers depend on the edges).
        """
        if self.is_lowered:
            raise ValueError(
                f"with_edges needs a compute-only schedule; '{self.name}' is lowered "
                "(call with_edges before lower())"
            )
        pairs = []
        for edge in edges:
            pair = tuple(edge)
            if len(pair) != 2 or not all(isinstance(x, int) for x in pair):
                raise ValueError(f"edge {edge!r} must be a (producer, consumer) pair of ints")
            pairs.append(pair)
        out = _C.with_edges(self._cpp, pairs)
        _C.validate(out)
        return Schedule(out)

    # -- checks and simulation ------------------------------------------------
    def validate(self) -> None:
        """Static invariants, then lower (if needed) and simulate with unit costs.

        Raises ``ScheduleError`` (a ``ValueError``) or ``DeadlockError``.
        """
        _C.validate(self._cpp)

    def simulate(
        self,
        costs: Optional[CostDict] = None,
        *,
        stage_costs: Optional[Union[Sequence[CostDict], Mapping[int, CostDict]]] = None,
        comm_latency: float = 0.0,
        comm_bandwidth: float = 0.0,
        message_bytes: float = 0.0,
        timeline: bool = False,
        cross_rank_reduces: Sequence[tuple[Sequence[int], float]] = (),
        action_overhead: float = 0.0,
        microbatch_costs: Optional[Sequence[float]] = None,
        step_overhead: float = 0.0,
    ) -> SimulationResult:
        """Simulate all ranks; a compute-only schedule is lowered first.

        ``costs`` maps ``"F" "B" "I" "W" "REDUCE_GRAD" "UNSHARD" "RESHARD"``
        to times (defaults 1, 2, 1, 1, 0, 0, 0); ``stage_costs`` overlays
        per-stage dicts on it. REDUCE_GRAD and UNSHARD are asynchronous: they
        run one after another on the rank's collective stream, a stage's
        compute waits for its UNSHARD, and the makespan includes every
        collective's end; RESHARD blocks the rank (csrc/core/simulator.h).
        To simulate sharding, lower with ``shard=True`` first.
        ``cross_rank_reduces``: ``(stages, cost)`` per sum of tied weights'
        gradients over the ranks of ``stages``, posted by each rank's last
        REDUCE_GRAD of those stages; it ends ``cost`` after the last rank
        posted it, and so do those ranks' steps.
        ``action_overhead``: the runtime's own time per action, spent by the
        rank before each one it runs (dispatch, posting a transfer; measured
        steps show it as the gaps between actions: ``trace.simulate_measured``).
        ``microbatch_costs``: one relative size per microbatch (its tokens, say)
        for microbatches of different sizes: each one's compute and transfer
        bytes scale by its size over the mean, so ``costs`` stay a mean
        microbatch's (NOTE [Microbatch costs] in csrc/core/simulator.h).
        ``step_overhead``: the runtime's fixed time per step outside every
        action (the begin and end exchanges, the Python around the
        executor), added to the makespan once (``trace.step_overhead``
        measures it).
        ``comm_bandwidth=0`` means infinite bandwidth. Raises ``ValueError``
        naming a bad key or value and ``DeadlockError`` naming blocked actions.
        """
        model = cost_model(
            costs, stage_costs, self.num_stages, comm_latency, comm_bandwidth, message_bytes,
            cross_rank_reduces, action_overhead, microbatch_costs, self.num_microbatches,
            step_overhead,
        )
        lowered = self if self.is_lowered else self.lower()
        raw = _C.simulate(lowered._cpp, model, bool(timeline))
        return SimulationResult._from_cpp(raw, lowered.actions if timeline else None)

    # -- text forms -------------------------------------------------------------
    def to_text(self) -> str:
        """The text form (name, skip edges and one line per rank); see from_text."""
        return _C.to_text(self._cpp)

    def to_csv(self, path: Optional[PathLike] = None) -> str:
        """torch.distributed.pipelining's CSV form; also written to ``path`` if given.

        Raises ``ValueError`` for a schedule with skip edges (CSV assumes the chain).
        """
        if sorted(self.edges) != sorted(_C.chain_edges(self.num_stages)):
            raise ValueError(
                f"schedule '{self.name}' has non-chain edges {self.edges}, which CSV cannot "
                "express; use to_text()"
            )
        text = _C.to_csv(self._cpp)
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        return text

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse the text form and check the static invariants."""
        return cls._checked(_C.schedule_from_text(text))

    @classmethod
    def from_csv(cls, path: PathLike) -> "Schedule":
        """Load a CSV file in torch's format (empty cells are idle slots)."""
        with open(path, encoding="utf-8", newline="") as f:
            return cls._checked(_C.schedule_from_csv(f.read()))

    @classmethod
    def from_actions(
        cls,
        actions: Sequence[Sequence[Union[_C.Action, str]]],
        name: str = "custom",
        *,
        edges: Optional[Iterable[Sequence[int]]] = None,
    ) -> "Schedule":
        """Build from one list per rank (rank = list index) of ``Action``
        values or action tokens (``"2F0"``, parsed by the core)."""
        programs = []
        for rank, row in enumerate(actions):
            if isinstance(row, str):
                raise TypeError(f"rank {rank}: expected a list of actions, got a str")
            program = []
            for i, token in enumerate(row):
                if isinstance(token, _C.Action):
                    program.append(token)
                    continue
                try:
                    program.append(_C.parse_action(str(token)))
                except _C.ParseError as e:
                    raise _C.ParseError(f"rank {rank}, action {i}: {e}") from None
            programs.append(program)
        pairs = [tuple(e) for e in edges] if edges is not None else []
        return cls._checked(_C.schedule_from_programs(programs, name, pairs))

    @classmethod
    def _checked(cls, cpp: _C.Schedule) -> "Schedule":
        _C.validate_static(cpp)
        return cls(cpp)

    # -- display ----------------------------------------------------------------
    def table(self) -> str:
        """A per-rank table of the programs, wrapped into blocks of steps."""
        kind = "lowered" if self.is_lowered else "compute-only"
        lines = [
            f"schedule {self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches ({kind})"
        ]
        rows = self.action_text
        steps = max((len(r) for r in rows), default=0)
        width = max([len(t) for r in rows for t in r] + [len(str(max(steps - 1, 0)))])
        label = max(len("step"), len(f"rank {self.num_ranks - 1}"))
        per_block = max(1, (_TABLE_WIDTH - label - 3) // (width + 1))
        for first in range(0, max(steps, 1), per_block):
            cols = range(first, min(first + per_block, steps))
            lines.append("")
            lines.append(f"{'step':>{label}} | " + " ".join(f"{c:<{width}}" for c in cols).rstrip())
            lines.append("-" * (label + 1) + "+" + "-" * (len(cols) * (width + 1)))
            for r, row in enumerate(rows):
                cells = " ".join(f"{row[c] if c < len(row) else '':<{width}}" for c in cols)
                lines.append((f"{f'rank {r}':>{label}} | " + cells).rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Schedule(name={self.name!r}, num_ranks={self.num_ranks}, "
            f"num_stages={self.num_stages}, num_microbatches={self.num_microbatches}, "
            f"is_lowered={self.is_lowered})"
        )

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.stage_to_rank, self.edges, self.num_microbatches, self._programs)

    def __eq__(self, other: object) -> bool:
        """Equal name, placement, edges, microbatches and programs."""
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.to_text())
