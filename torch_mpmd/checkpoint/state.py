"""What a checkpoint holds of the module and optimizer, as DCP's state dict: read without changing the optimizer, loaded through empty templates, undone when a load fails.

Each rank's stages' parameters, buffers and optimizer state are stored under
the module's own FQNs, the optimizer's flattened per parameter
(``optim.state.<fqn>.<name>``, ``optim.param_groups.<fqn>.<option>``), so a
checkpoint saved with one pipeline size loads into another, or into the
unsplit module in one process.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

__all__ = ["SECTIONS", "OPTIM", "module_state", "no_optimizer_step",
           "drop_other_ranks_parameters", "compared", "section_order", "Undo",
           "optimizer_templates"]

SECTIONS = ("model", "optim", "pipeline")   # checked for unexpected keys (in this order)


def drop_other_ranks_parameters(module: torch.nn.Module, optimizer: Any) -> None:
    """An optimizer built before the pipeline's capture holds the whole module's
    parameters; those of other ranks' stages never get a gradient here and have
    no FQN in this rank's state dict: drop them (and their state, if any).
    Load does this to the optimizer it loads into; save never does
    (:func:`module_state`)."""
    if optimizer is None or not getattr(module, "is_captured", False):
        return
    local = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in local:
                optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if id(p) in local]


# The optimizer's state and param-group options keyed by parameter FQN
# (optim.param_groups.<fqn>.lr), not by group number: ranks holding different
# parameters then never write the same key with different values (DCP would
# keep one rank's), and any split of the module reads the keys of its own.
OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def no_optimizer_step() -> Iterator[None]:
    """DCP's get/set_optimizer_state_dict first "initialize" an optimizer that
    has no state yet by calling its step() with zero gradients: an AdamW so
    treated has step=1 and moments, and later training differs from a run
    that never saved. A checkpoint must never change the optimizer: this turns
    that step off for the calls inside (the state stays empty: saved as none;
    load makes the state the checkpoint holds, see optimizer_templates)."""
    real = dcp_state_dict._init_optim_state
    dcp_state_dict._init_optim_state = lambda optim: None
    try:
        yield
    finally:
        dcp_state_dict._init_optim_state = real


def _this_ranks_view(module: torch.nn.Module, optimizer: Any) -> Any:
    """``optimizer`` as DCP reads it for ``module``'s state dict: itself, or
    -- when ``module`` is a captured pipeline and ``optimizer`` also holds
    other ranks' parameters (one built before the first step) -- a shallow
    copy of it over this rank's parameters only: new param-group dicts (the
    same options) and a new state mapping (the same per-parameter entries).
    Nothing of ``optimizer`` changes: save never trims it."""
    if optimizer is None or not getattr(module, "is_captured", False):
        return optimizer
    local = {id(p) for p in module.parameters()}
    if all(id(p) in local for g in optimizer.param_groups for p in g["params"]):
        return optimizer
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)   # hooks, defaults: shared, never written
    view.state = defaultdict(dict, {p: s for p, s in optimizer.state.items() if id(p) in local})
    view.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in local]}
                         for g in optimizer.param_groups]
    return view


def module_state(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """What a checkpoint holds of ``module`` and ``optimizer`` (or None), as
    DCP's state dict: {"model", "optim" (flattened, keyed by FQN: OPTIM),
    "pipeline": {"step"}}. The tensors are the module's and the optimizer's
    own; neither is changed (no step: no_optimizer_step; no trimming:
    _this_ranks_view)."""
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        with no_optimizer_step():
            state["optim"] = get_optimizer_state_dict(
                module, _this_ranks_view(module, optimizer), options=OPTIM)
    state["pipeline"] = {"step": torch.tensor(getattr(module, "step_count", 0))}
    return state


def compared(key: str) -> bool:
    """Whether strict load compares ``key``: the model, the optimizer's state
    and the pipeline's, but not the optimizer's param-group options (lr,
    initial_lr, ...: those both have load, the rest keep their values)."""
    return key.split(".", 1)[0] in SECTIONS and not key.startswith("optim.param_groups.")


def section_order(key: str) -> int:
    head = key.split(".", 1)[0]
    return SECTIONS.index(head) if head in SECTIONS else len(SECTIONS)



class Undo:
    """What a load changes, kept to put back when the load fails, so that a
    failed load leaves everything exactly as it was: the optimizer's state
    and param groups (the objects: load gives the optimizer new ones and
    never writes into these), the step counter, the module's parameters,
    buffers and extra state (:meth:`keep_module`: a copy on the host, taken
    just before DCP reads into them: memory for one more copy of this rank's
    module state while load runs, never on the device) and each Stateful's
    ``state_dict()`` (:meth:`keep_stateful`: a deep copy, before the first
    is restored)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.module, self.optimizer = module, optimizer
        self.step_count = getattr(module, "step_count", None)
        self.model: dict[str, Any] | None = None
        self.stateful: list[tuple[Any, Any]] = []
        if optimizer is not None:
            self.optim_state = optimizer.state
            self.groups = optimizer.param_groups
            self.group_items = [dict(g) for g in self.groups]

    def keep_module(self) -> None:
        self.model = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                      else copy.deepcopy(v) for k, v in self.module.state_dict().items()}

    def keep_stateful(self, objs: list[Any]) -> None:
        self.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in objs]

    def restore(self) -> None:
        if self.optimizer is not None:
            self.optimizer.state = self.optim_state
            self.optimizer.param_groups = self.groups
            for group, items in zip(self.groups, self.group_items):
                group.clear()
                group.update(items)
        if self.step_count is not None:
            self.module.step_count = self.step_count
        # The module's and each Stateful's own load_state_dict put them back:
        # one that raises now does not keep the others from theirs.
        undo = [(self.module, self.model)] if self.model is not None else []
        for obj, saved in undo + self.stateful:
            try:
                obj.load_state_dict(saved)
            except Exception as e:  # noqa: BLE001  (the load's own error is the one raised)
                warnings.warn(f"checkpoint.load failed, and putting back the state of a "
                              f"{type(obj).__name__} failed too: {type(e).__name__}: {e}")


def _state_template(param: torch.Tensor, md: TensorStorageMetadata) -> torch.Tensor:
    """An empty tensor for one saved optimizer entry of ``param``: laid out
    as the parameter where it has the parameter's (global) shape, so a
    moment of a DTensor parameter (tensor parallel, sharded data parallel) is
    a DTensor of its placements, as the optimizer's own step would make it;
    a plain tensor of the saved shape otherwise (a step counter)."""
    size = tuple(md.size)
    if tuple(param.shape) == size and size != ():
        return torch.empty_like(param.detach(), dtype=md.properties.dtype)
    return torch.empty(size, dtype=md.properties.dtype)


def optimizer_templates(module: torch.nn.Module, optimizer: Any, metadata: Metadata) -> None:
    """Give ``optimizer`` a new state that holds, for each of its parameters
    whose state the checkpoint holds, empty tensors of the saved shapes and
    dtypes (None for a non-tensor entry) under the saved names, for DCP to
    read into; the others get no state, as ``optimizer.load_state_dict`` of
    the saved state leaves them. (DCP would instead make state by calling
    the optimizer's step(): no_optimizer_step.) The state replaced is the
    Undo's, untouched."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = {next(iter(dcp_state_dict._get_fqns(module, name))): p
              for name, p in module.named_parameters() if id(p) in held}
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("optim.state."):
            continue
        path = key[len("optim.state."):].split(".")   # fqn, then the entry's (nested) name
        for cut in range(len(path) - 1, 0, -1):
            p = params.get(".".join(path[:cut]))
            if p is not None:
                entry = state[p]
                for part in path[cut:-1]:
                    entry = entry.setdefault(part, {})
                entry[path[-1]] = (_state_template(p, md)
                                   if isinstance(md, TensorStorageMetadata) else None)
                break
    optimizer.state = state
