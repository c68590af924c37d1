"""``checkpoint.load``: every rank checks the checkpoint against its module and optimizer before reading anything, then DCP reads it in; all or nothing.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from torch_mpmd.checkpoint.extra import decode, is_stateful, walk_tensors
from torch_mpmd.checkpoint.layout import latest
from torch_mpmd.checkpoint.manifest import NoManifest, read_manifests, verify
from torch_mpmd.checkpoint.plain import (PlainLoadPlanner, VerifiedReader, read_metadata,
                                         read_plain_items)
from torch_mpmd.checkpoint.state import (OPTIM, Undo, compared, drop_other_ranks_parameters,
                                         module_state, no_optimizer_step,
                                         optimizer_templates, section_order)
from torch_mpmd.checkpoint.sync import (CheckpointError, DCPFailed, Sync, dcp_error,
                                        dcp_failed_error, named, quiet_dcp, raise_agreed,
                                        this_rank, timeout_seconds)

__all__ = ["load"]


def _raise_key_issues(reports: list[dict[str, Any]], metadata: Metadata | None,
                      strict: bool, what: str) -> None:
    """Raise on every rank, from every rank's report, for keys the checkpoint
    lacks, keys in it that no rank's module or optimizer has (``strict``), and
    shapes that differ: all named in the first line."""
    def union(lists: Any) -> list[str]:
        return sorted(dict.fromkeys(k for keys in lists for k in keys), key=section_order)

    missing = union(r["missing"] for r in reports)
    mismatched = union(r["mismatched"] for r in reports)
    unexpected: list[str] = []
    if strict and metadata is not None and all(r["keys"] is not None for r in reports):
        wanted = {k for r in reports for k in r["keys"]}
        sections = {k.split(".", 1)[0] for k in wanted}
        unexpected = union([[k for k in metadata.state_dict_metadata
                             if compared(k) and k.split(".", 1)[0] in sections
                             and k not in wanted]])
    issues = []
    if missing:
        issues.append(f"{len(missing)} key{'s' * (len(missing) > 1)} missing from the "
                      f"checkpoint: {named(missing)}")
    if unexpected:
        issues.append(f"{len(unexpected)} key{'s' * (len(unexpected) > 1)} in the checkpoint "
                      f"but not in the module or optimizer: {named(unexpected)}")
    if mismatched:
        issues.append(f"{len(mismatched)} shape mismatch{'es' * (len(mismatched) > 1)}: "
                      f"{named(mismatched)}")
    if issues:
        hint = "\nload(..., strict=False) loads the keys both have" if missing or unexpected else ""
        raise CheckpointError(f"{what}: " + "; ".join(issues) + hint)



def load(module: torch.nn.Module, optimizer: Any, path: str | os.PathLike, *,
         extra: Mapping[str, Any] | None = None,
         extra_per_rank: Mapping[str, Any] | None = None,
         strict: bool = True,
         timeout: float | datetime.timedelta | None = None) -> dict[str, Any]:
    """Load the latest checkpoint under ``path`` into ``module`` (a Pipeline of
    any size, or the unsplit module), ``optimizer`` (or None) and the Stateful
    objects of ``extra`` / ``extra_per_rank`` (restored in place through
    ``load_state_dict``; names the checkpoint lacks are errors). Collective.

    Returns ``{"directory": the checkpoint loaded, "step": the pipeline's step
    at save, "extra": {name: value} for every plain (non-Stateful) value of
    the saved ``extra``, "extra_per_rank": the same for this rank's}``.

    All or nothing: a load that fails, at any point (a check below, an item
    DCP refuses, a peer that dies, a Stateful's ``load_state_dict`` that
    raises), leaves the module's parameters, buffers and extra state, the
    optimizer's state and param groups, the step counter and every Stateful
    exactly as they were. The optimizer's state becomes the checkpoint's (a
    parameter it holds no state for has none, as an optimizer before its
    first step), made without calling the optimizer's step().

    Raises CheckpointError on every rank, before anything is loaded, when a
    file is missing, an item's bytes do not match the CRC32 recorded at save
    (naming the key and the file), ``.metadata`` or an extra entry does not
    match its sha256, ``.metadata`` or a non-tensor item refers to anything a
    checkpoint never holds (refused unread: loading runs no code) or is not
    a plain value (nested too deep or too large once expanded), or with
    ``strict`` (the default) when the checkpoint's model/optimizer keys or
    shapes differ from the module's and optimizer's over all ranks.
    ``strict=False`` loads the keys both have (checksums are still verified
    where recorded; a checkpoint without manifests, e.g. one saved by DCP
    alone, loads unverified, but its pickles are still read as above).
    ``timeout`` (seconds or timedelta; default: the Pipeline's ``timeout``)
    bounds every wait for the other ranks: a rank that stalls or dies makes
    the others raise CheckpointError naming it (NOTE [Checkpoint waits] in
    checkpoint/sync.py).
    """
    target = latest(path)
    what = f"loading checkpoint {target}"
    with Sync(timeout_seconds(module, timeout), what) as sync:
        undo = Undo(module, optimizer)
        try:
            return _load(sync, undo, module, optimizer, target, extra, extra_per_rank, strict)
        except BaseException:
            undo.restore()
            raise


def _load(sync: Sync, undo: Undo, module: torch.nn.Module, optimizer: Any, target: str,
          extra: Mapping[str, Any] | None, extra_per_rank: Mapping[str, Any] | None,
          strict: bool) -> dict[str, Any]:
    rank = this_rank()
    what = f"loading checkpoint {target}"
    state: dict[str, Any] = {}
    # What this rank tells the others before anything is read: a problem (a
    # missing manifest, file or key, a bad checksum), its keys (for the keys
    # no rank wants), and its missing and shape-mismatched keys.
    report: dict[str, Any] = {"problem": None, "keys": None, "missing": [], "mismatched": []}
    metadata: Metadata | None = None
    extra_tensors: dict[str, torch.Tensor] = {}
    restore: list[tuple[Any, Any]] = []   # (Stateful, its encoded state_dict)
    plain: dict[str, dict[str, Any]] = {"extra": {}, "extra_per_rank": {}}
    has_optim = False
    try:
        manifests: dict[int, dict[str, Any]] | None = None
        try:
            manifests = read_manifests(target)
        except NoManifest:
            if strict or extra or extra_per_rank:
                raise
        metadata = read_metadata(target, manifests)
        has_optim = optimizer is not None and any(
            k.startswith("optim.") for k in metadata.state_dict_metadata)
        if optimizer is not None and strict and not has_optim:
            raise ValueError("the checkpoint holds no optimizer state (saved with "
                             "optimizer=None): pass optimizer=None to load the rest, or "
                             "strict=False to keep the optimizer as it is")
        drop_other_ranks_parameters(module, optimizer)
        if has_optim:
            optimizer_templates(module, optimizer, metadata)
        state = module_state(module, optimizer if has_optim else None)
        manifest_of = {"extra": os.path.join(os.path.basename(target), "rank_0.json"),
                       "extra_per_rank": os.path.join(os.path.basename(target),
                                                      f"rank_{rank}.json")}
        for kind, asked, saved in (
                ("extra", extra, (manifests or {}).get(0, {}).get("extra", {})),
                ("extra_per_rank", extra_per_rank,
                 (manifests or {}).get(rank, {}).get("extra_per_rank", {}))):
            for name, obj in (asked or {}).items():
                if not is_stateful(obj):
                    raise TypeError(f"load(..., {kind}=) takes objects with load_state_dict() "
                                    f"to restore; {name!r} is a {type(obj).__name__} (plain "
                                    f"values come back in load's result)")
                if "state_dict" not in saved.get(name, {}):
                    held = sorted(n for n, v in saved.items() if "state_dict" in v)
                    whose = "" if kind == "extra" else f" of rank {rank}"
                    raise KeyError(f"{kind}[{name!r}]: the checkpoint holds no state{whose} "
                                   f"under that name (it holds {held})")
                walk_tensors(saved[name]["state_dict"], f"{kind}[{name!r}] of {manifest_of[kind]}",
                              extra_tensors)
                restore.append((obj, saved[name]["state_dict"]))
            for name, entry in saved.items():
                if "value" in entry:
                    walk_tensors(entry["value"], f"{kind}[{name!r}] of {manifest_of[kind]}",
                                  extra_tensors)
                    plain[kind][name] = entry["value"]
        state.update(extra_tensors)
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata)   # DCP's flattening: its keys
        flat = planner.state_dict
        saved_md = metadata.state_dict_metadata
        if strict:
            report["missing"] = [k for k in flat if k not in saved_md and compared(k)]
        for k, v in flat.items():
            md = saved_md.get(k)
            if md is None:
                continue
            if isinstance(v, torch.Tensor) != isinstance(md, TensorStorageMetadata):
                report["mismatched"].append(f"{k} (a tensor in only one of them)")
            elif isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(md.size):
                report["mismatched"].append(
                    f"{k} (checkpoint {list(md.size)}, module {list(v.shape)})")
        report["keys"] = [k for k in flat if compared(k)]
        if not report["missing"] and not report["mismatched"]:
            issues = verify(target, flat, metadata, manifests, strict)
            issues = issues or read_plain_items(target, flat, metadata)
            if issues:
                report["problem"] = "\n".join(issues)
    except (ValueError, KeyError, TypeError) as e:   # ours: the message says it
        report["problem"] = e.args[0] if isinstance(e, KeyError) else str(e)
    except Exception as e:  # reported, not raised: the other ranks must hear of it
        report["problem"] = f"{type(e).__name__}: {e}"
    reports = sync.gather(report, "the checks of every rank's part of the checkpoint")
    _raise_key_issues(reports, metadata, strict, what)
    raise_agreed([r["problem"] for r in reports], what)
    assert metadata is not None
    undo.keep_module()
    try:
        with quiet_dcp():
            # Partial: the checks above decided which differences are errors.
            sync.run_dcp(lambda group: dcp.load(
                state, checkpoint_id=target, storage_reader=VerifiedReader(target, metadata),
                planner=PlainLoadPlanner(allow_partial_load=True), process_group=group,
                no_dist=group is None), "DCP's load")
    except CheckpointException as e:
        raise dcp_error("loading", target, e) from e
    except DCPFailed as e:
        raise dcp_failed_error(e, f"loading {target}", rank, "the module, optimizer and "
                               "extra state are as they were") from e.__cause__
    if has_optim:
        with no_optimizer_step():
            set_optimizer_state_dict(module, optimizer, state["optim"], options=OPTIM)
    undo.keep_stateful([obj for obj, _ in restore])
    for obj, encoded in restore:
        obj.load_state_dict(decode(encoded, extra_tensors))
    module.load_state_dict(state["model"])
    if hasattr(module, "step_count"):
        module.step_count = int(state["pipeline"]["step"])
    return {"directory": target, "step": int(state["pipeline"]["step"]),
            "extra": {n: decode(v, extra_tensors) for n, v in plain["extra"].items()},
            "extra_per_rank": {n: decode(v, extra_tensors)
                               for n, v in plain["extra_per_rank"].items()}}
