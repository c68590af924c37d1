"""Cost sheets: a model's per-unit times and bytes, link rates and memory facts, as data.

A sheet is what the planner (csrc/core/planner.h) plans from: written by hand,
computed from FLOPs (scripts/plan_on_paper.py) or, later, measured. Times are
seconds per microbatch at ``reference_microbatch`` samples and scale linearly
with the microbatch but for their fixed parts (NOTE [Microbatch scaling] in
csrc/core/planner.h); bytes
per microbatch (``saved_bytes``, ``saved_input_bytes``, ``output_bytes``,
``input_bytes``) scale the
same way, parameter bytes do not.

Contract: ``CostSheet(...)`` and ``CostSheet.from_json`` check every value and
raise ``ValueError`` naming the field and the value (``units[3].forward=-1.0
must be a finite number >= 0``, an unknown key, a duplicate unit name);
``CostSheet.from_json(sheet.to_json()) == sheet``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from torch_mpmd import _C

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["CostSheet", "Unit", "json_text", "read_json"]


def json_text(data: Mapping[str, Any], path: PathLike | None = None) -> str:
    """``data`` as indented JSON text; also written to ``path`` when given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def read_json(text_or_path: str | os.PathLike[str], what: str) -> Any:
    """The JSON value of text, or of the file at a path (text that does not
    start with ``{`` is a path); ValueError naming ``what`` when it is not
    valid JSON."""
    text = str(text_or_path)
    if isinstance(text_or_path, os.PathLike) or not text.lstrip().startswith("{"):
        with open(text_or_path) as f:
            text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what}={value!r} must be a number")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{what}={value!r} must be a finite number >= 0")
    return out


def _count(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{what}={value!r} must be an int >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class Unit:
    """One unit of a model (a block, the embedding, the head) on a cost sheet.

    ``forward``, ``backward_input`` (I) and ``backward_weight`` (W): seconds per
    microbatch (B = I + W). ``saved_bytes``: what its forward keeps for its
    backward, per microbatch, and ``saved_input_bytes`` what of its inputs it
    keeps (new bytes only where an earlier unit of its stage produces them).
    ``param_bytes``: its parameters.
    ``output_bytes``: what crosses a cut right after it, per microbatch.
    ``forward_fixed``, ``backward_input_fixed``, ``backward_weight_fixed``:
    the part of each time that does not scale with the microbatch's size
    (NOTE [Microbatch scaling] in csrc/core/planner.h; 0: linear).
    """

    name: str
    forward: float
    backward_input: float
    backward_weight: float
    saved_bytes: float = 0.0
    param_bytes: float = 0.0
    output_bytes: float = 0.0
    forward_fixed: float = 0.0
    backward_input_fixed: float = 0.0
    backward_weight_fixed: float = 0.0
    saved_input_bytes: float = 0.0

    def _checked(self, where: str) -> "Unit":
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}.name={self.name!r} must be a non-empty string")
        values = {f.name: _number(f"{where}.{f.name}", getattr(self, f.name))
                  for f in dataclasses.fields(self) if f.name != "name"}
        for kind in ("forward", "backward_input", "backward_weight"):
            if values[kind + "_fixed"] > values[kind]:
                raise ValueError(f"{where}.{kind}_fixed={values[kind + '_fixed']!r} must be at "
                                 f"most {where}.{kind}={values[kind]!r}, the time it is part of")
        return Unit(self.name, **values)

    @classmethod
    def _from_dict(cls, data: object, where: str) -> "Unit":
        if isinstance(data, Unit):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}={data!r} must be a Unit or a dict of its fields")
        known = {f.name for f in dataclasses.fields(cls)}
        values = dict(data)
        if "backward" in values and "backward_input" not in values and "backward_weight" not in values:
            # A sheet that knows only B: half of it each for I and W.
            b = _number(f"{where}.backward", values.pop("backward"))
            values["backward_input"] = values["backward_weight"] = b / 2
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in {where}; known: {', '.join(sorted(known))}")
        missing = [k for k in ("name", "forward", "backward_input", "backward_weight") if k not in values]
        if missing:
            raise ValueError(f"{where} has no {missing[0]!r}")
        return cls(**values)


@dataclass(frozen=True)
class CostSheet:
    """Per-unit costs, link rates and memory facts; see the module docstring.

    ``global_batch``: samples per step of one pipeline. ``pp_size``: pipeline
    ranks. ``link_bandwidth`` bytes/s (0: infinite) and ``link_latency`` s
    per transfer; with ``ranks_per_node`` > 0, transfers between nodes run at
    ``inter_node_bandwidth`` (0: ``link_bandwidth``). ``action_overhead``: the
    runtime's seconds per action; ``step_overhead``: its seconds per step
    outside the actions (added to every plan's predicted step). Per rank its parameters cost
    ``param_bytes * (1 + grad_bytes_per_param_byte +
    optimizer_bytes_per_param_byte)`` (AdamW: 2 states, so 2.0).
    ``memory_limit``: bytes per rank, 0 for none. ``dp_size``: data-parallel
    replicas of every pipeline rank (a mesh's "dp" dimension); their
    collectives run at ``dp_latency`` s per ring step and ``dp_bandwidth``
    bytes/s per link (0: infinite), ``None``: the link's (NOTE [Data-parallel
    modes] in csrc/core/planner.h). A sheet's JSON without them has
    ``dp_size`` 1.
    """

    units: tuple[Unit, ...]
    global_batch: int
    pp_size: int
    reference_microbatch: int = 1
    input_bytes: float = 0.0
    action_overhead: float = 0.0
    step_overhead: float = 0.0
    link_latency: float = 0.0
    link_bandwidth: float = 0.0
    ranks_per_node: int = 0
    inter_node_bandwidth: float = 0.0
    grad_bytes_per_param_byte: float = 1.0
    optimizer_bytes_per_param_byte: float = 2.0
    memory_limit: float = 0.0
    dp_size: int = 1
    dp_latency: Optional[float] = None
    dp_bandwidth: Optional[float] = None
    _names: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.units, (str, bytes, Mapping)) or not hasattr(self.units, "__iter__"):
            raise ValueError(f"units={self.units!r} must be a list of Unit or dicts")
        units = tuple(Unit._from_dict(u, f"units[{i}]")._checked(f"units[{i}]")
                      for i, u in enumerate(self.units))
        if not units:
            raise ValueError("units=[] must hold at least one unit")
        names: dict[str, int] = {}
        for i, u in enumerate(units):
            if u.name in names:
                raise ValueError(f"units[{i}].name={u.name!r} repeats units[{names[u.name]}]'s; "
                                 "unit names must be unique")
            names[u.name] = i
        set_ = object.__setattr__
        set_(self, "units", units)
        set_(self, "_names", names)
        set_(self, "global_batch", _count("global_batch", self.global_batch, 1))
        set_(self, "pp_size", _count("pp_size", self.pp_size, 1))
        set_(self, "reference_microbatch", _count("reference_microbatch", self.reference_microbatch, 1))
        set_(self, "ranks_per_node", _count("ranks_per_node", self.ranks_per_node, 0))
        set_(self, "dp_size", _count("dp_size", self.dp_size, 1))
        for name in ("dp_latency", "dp_bandwidth"):
            if getattr(self, name) is not None:
                set_(self, name, _number(name, getattr(self, name)))
        for name in ("input_bytes", "action_overhead", "step_overhead", "link_latency",
                     "link_bandwidth", "inter_node_bandwidth", "grad_bytes_per_param_byte",
                     "optimizer_bytes_per_param_byte", "memory_limit"):
            set_(self, name, _number(name, getattr(self, name)))
        if self.pp_size > len(units):
            raise ValueError(f"pp_size={self.pp_size} is more than the sheet's {len(units)} units: "
                             "every rank needs at least one unit")

    # -- names ------------------------------------------------------------
    def index_of(self, name: str) -> int:
        """The position of the unit called ``name``; ValueError naming the known ones."""
        try:
            return self._names[name]
        except (KeyError, TypeError):
            shown = ", ".join(list(self._names)[:8]) + (", ..." if len(self._names) > 8 else "")
            raise ValueError(f"no unit named {name!r} on the sheet (units: {shown})") from None

    # -- JSON -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name)
                               for f in dataclasses.fields(self) if f.init and f.name != "units"}
        out["units"] = [dataclasses.asdict(u) for u in self.units]
        return out

    def to_json(self, path: PathLike | None = None) -> str:
        """The sheet as JSON text; also written to ``path`` when given."""
        return json_text(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostSheet":
        if not isinstance(data, Mapping):
            raise ValueError(f"a cost sheet is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in the cost sheet; known: {', '.join(sorted(known))}")
        for key in ("units", "global_batch", "pp_size"):
            if key not in data:
                raise ValueError(f"the cost sheet has no {key!r}")
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> "CostSheet":
        """A sheet from JSON text, or from the file at a path."""
        return cls.from_dict(read_json(text_or_path, "the cost sheet"))

    # -- the core's form --------------------------------------------------
    def to_cpp(self, memory_limit: float | None = None) -> _C.CostSheet:
        """The ``_C.CostSheet`` the planner reads; ``memory_limit`` overrides the sheet's."""
        out = _C.CostSheet()
        units = []
        for u in self.units:
            c = _C.UnitCost()
            for f in dataclasses.fields(u):
                setattr(c, f.name, getattr(u, f.name))
            units.append(c)
        out.units = units
        for f in dataclasses.fields(self):
            if f.init and f.name != "units":
                setattr(out, f.name, getattr(self, f.name))
        if memory_limit is not None:
            out.memory_limit = _number("memory_limit", memory_limit)
        return out
