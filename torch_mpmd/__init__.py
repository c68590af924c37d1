"""torch_mpmd: MPMD pipeline parallelism for PyTorch with a C++ core.

Importing the package does not import torch; ``torch_mpmd.schedules`` needs
only the compiled ``torch_mpmd._C`` extension. The torch-dependent names
(``pipeline``, ``Pipeline``, ``PipelineConfig``, ``PipelineError``,
``Replicate``, ``pipeline_of``, ``stage_boundary``, ``split_model``,
``SplitModel``, ``CaptureError``, ``pack``, ``document_mask``) and modules
(``checkpoint``, ``trace``, ``packing``) are imported on first access, and so is
``planning`` (plans from a cost sheet; it needs only ``_C``) and ``ordering``
(``microbatch_order``, ``microbatch_sizes``: an order of microbatches of
different sizes that shortens the step); ``bucket_microbatches`` pads them to
a few lengths; ``profile`` measures a model's per-unit costs as a cost sheet
and ``plan`` chooses a pipeline plan from them (``pipeline(plan=...)``).
"""

import atexit
import importlib
import sys
from typing import Any

from torch_mpmd import schedules

__version__ = "0.1.0"

# Public name -> module that defines it; imported lazily (they need torch).
_SUBMODULES = ("checkpoint", "trace", "packing", "planning", "ordering")  # imported on first access

_LAZY = {
    "stage_boundary": "torch_mpmd.graph.markers",
    "split_model": "torch_mpmd.graph.stage",
    "SplitModel": "torch_mpmd.graph.stage",
    "CaptureError": "torch_mpmd.graph.capture",
    "pipeline": "torch_mpmd.api",
    "Pipeline": "torch_mpmd.api",
    "PipelineConfig": "torch_mpmd.config",
    "PipelineError": "torch_mpmd.parallel.lockstep",
    "Replicate": "torch_mpmd.microbatch",
    "pipeline_of": "torch_mpmd.compile.door",
    "pack": "torch_mpmd.packing",
    "document_mask": "torch_mpmd.packing",
    "microbatch_order": "torch_mpmd.ordering",
    "bucket_microbatches": "torch_mpmd.microbatch",
    "over_microbatches": "torch_mpmd.compile.door",
    "microbatch_sizes": "torch_mpmd.ordering",
    "plan": "torch_mpmd.planning.auto",
    "profile": "torch_mpmd.planning.profile",
    "ReplicaQuorum": "torch_mpmd.parallel.quorum",
    "init_process_group": "torch_mpmd.parallel.launch",
    "QuorumStep": "torch_mpmd.parallel.quorum",
}

__all__ = ["__version__", "schedules", "checkpoint", "trace", "packing", "planning",
           "ordering", "pack", "document_mask", "microbatch_order", "microbatch_sizes",
           "bucket_microbatches", "over_microbatches", "plan", "profile", "pipeline",
           "Pipeline", "PipelineConfig", "PipelineError", "Replicate", "pipeline_of",
           "ReplicaQuorum", "QuorumStep", "init_process_group",
           "stage_boundary", "split_model", "SplitModel", "CaptureError"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"torch_mpmd.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_mpmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def _announce_exit() -> None:
    """NOTE [Ranks that left] in parallel/job_store.py: at exit, a process that runs
    torch.distributed tells the job's store it left (torch is not imported
    here for it: a process without it has nothing to tell)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        importlib.import_module("torch_mpmd.parallel.lockstep").announce_exit()


atexit.register(_announce_exit)
