"""Hugging Face models as users call them: what the pipeline does for them.

A user trains a Hugging Face causal LM with ``pipe.step(input_ids=ids,
labels=ids)``, maybe asking for outputs its hooks record
(``output_router_logits=True`` for an MoE's load-balancing loss). Two things
eager PyTorch takes in its stride need help under one captured graph:
:func:`install_output_recorders` (NOTE [Output recorders]) and
:func:`training_kwargs` (no KV cache in a training call). Nothing here
imports transformers: a model that is not one of its own is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["install_output_recorders", "recorders_install_while_tracing", "training_kwargs"]


def recorders_install_while_tracing() -> None:
    """Let Dynamo install a Hugging Face model's output recorders while it
    traces, instead of breaking the graph there.

    NOTE [Recorders while tracing]: a function compiled with
    ``torch.compile(backend="mpmd")`` is traced by Dynamo before the
    backend sees any model, so the recorders cannot be installed ahead as
    ``pipeline()`` installs them (NOTE [Output recorders]). Traced, the first
    forward that asks for them reaches transformers'
    ``maybe_install_capturing_hooks`` and its lock: a graph break, and the
    frames after it are not the user's function. Marked as a constant result
    (``torch._dynamo.assume_constant_result``), the install runs eagerly,
    once, while Dynamo traces (it returns None and is idempotent; the hooks
    it registers are then traced like any others), for every backend. The
    function object is marked in place; eager calls are unchanged. No-op
    without transformers (or a version without recorders). Called before
    transformers' recorders module is imported (torch_mpmd's backend imported
    first), it marks the function once that module is imported."""
    recording = sys.modules.get(_RECORDING)
    if recording is not None:
        _mark(recording)
    elif not any(isinstance(f, _MarkOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _MarkOnImport())


_RECORDING = "transformers.utils.output_capturing"


def _mark(recording: Any) -> None:
    install = getattr(recording, "maybe_install_capturing_hooks", None)
    if install is not None:
        torch._dynamo.assume_constant_result(install)


class _MarkOnImport(importlib.abc.MetaPathFinder):
    """Finds transformers' recorders module as the path finder does and
    marks its install function (:func:`recorders_install_while_tracing`)
    once the module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _RECORDING:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _MarkingLoader(spec.loader)
        return spec


class _MarkingLoader(importlib.abc.Loader):
    """The path finder's loader (its other methods too: ``get_source``, for
    tracebacks and Dynamo), marking the module once it has run."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _mark(module)


def install_output_recorders(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Install, eagerly, the hooks with which a Hugging Face model records
    outputs (``output_router_logits=True``, ``output_hidden_states=True``)
    where the call or the model's config asks for one.

    NOTE [Output recorders]: transformers installs them lazily inside the
    first forward that asks, under a ``threading.Lock``, which Dynamo cannot
    trace ("Unsupported context manager"); once installed, forward only
    checks a flag and the hooks trace like any others. Eager PyTorch gets the
    same hooks on its first such call."""
    recording = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(recording, "_CAN_RECORD_REGISTRY", None)
    install = getattr(recording, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return  # (transformers not imported, or a version without them)
    for sub in module.modules():
        flags = registry.get(sub)
        if not flags or getattr(sub, "_output_capturing_hooks_installed", False):
            continue
        config = getattr(sub, "config", None)
        if any(kwargs.get(f"output_{k}", getattr(config, f"output_{k}", False))
               for k in flags):
            install(sub)


def training_kwargs(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a training call (``step``, ``eval_step``) with
    ``use_cache=False`` added where the model's forward takes ``use_cache``,
    its config turns the cache on and the caller did not pass it: a training
    call has no use for the KV cache, which is an output no stage split can
    carry. Forward-only calls are left to the user."""
    if "use_cache" in kwargs or not getattr(getattr(module, "config", None), "use_cache", False):
        return dict(kwargs)
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    if "use_cache" not in parameters:
        return dict(kwargs)
    return {**kwargs, "use_cache": False}
