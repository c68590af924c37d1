"""Workers of tests/test_bounded_collectives.py (run by dist_harness): two gloo
ranks of one pipeline, rank 1 killed (SIGKILL, or os._exit inside DCP) in one
phase -- a checkpoint save, replan(), meta-device materialization, the
groups of a mesh -- while
rank 0 goes on with a short ``timeout=``; rank 0 returns what it raised. The
save launch first checks that ``checkpoint.save`` leaves the optimizer as it
was, before and after the first step, on both ranks.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import torch_mpmd as mpmd
from dist_harness import partial_result


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _make(timeout: float) -> tuple[Any, Any]:
    """A 2-stage pipeline and an AdamW built before its first step (it holds
    every parameter of the module, both ranks' stages)."""
    torch.manual_seed(0)
    pipe = mpmd.pipeline(models.MLP(d=8, depth=2, markers=True), loss_fn=F.mse_loss,
                         num_microbatches=2, schedule="1f1b", timeout=timeout)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def _step(pipe: Any, opt: Any, value: float) -> float:
    loss = pipe.step(torch.full((4, 8), value), target=torch.ones(4, 4))
    opt.step()
    opt.zero_grad()
    return float(loss)


def _differences(a: Any, b: Any, at: str = "") -> list[str]:
    """Where two optimizer state dicts differ (tensors by value, exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [at]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{at} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{at}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return [f"{at} {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at} {a!r} != {b!r}"]


def _copy(state: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


def _optimizer_untouched_by_save(directory: str, timeout: float) -> dict[str, Any]:
    """Save before the first step and after it: the optimizer's state_dict
    unchanged each time, and the next step equal to that of a pipeline never
    saved (built and fed the same)."""
    ref_pipe, ref_opt = _make(timeout)
    pipe, opt = _make(timeout)
    out: dict[str, Any] = {}
    for when, value in (("before the first step", 0.5), ("after the first step", 0.25)):
        before = _copy(opt.state_dict())
        mpmd.checkpoint.save(pipe, opt, os.path.join(directory, when.replace(" ", "_")))
        out[when] = _differences(opt.state_dict(), before, "state_dict")
        out[f"loss {when}"] = [_step(pipe, opt, value), _step(ref_pipe, ref_opt, value)]
    out["params differ"] = [k for k, v in pipe.state_dict().items()
                            if not torch.equal(v, ref_pipe.state_dict()[k])]
    out["optimizer differs"] = _differences(opt.state_dict(), ref_opt.state_dict())
    out["groups"] = [len(g["params"]) for g in opt.param_groups]
    out["params"] = len(list(models.MLP(d=8, depth=2, markers=True).parameters()))
    return out


def _raised(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test checks the type and the text)
        return {"type": type(e).__name__, "message": str(e)[:3000],
                "raised_after": time.monotonic() - start, "peer": getattr(e, "peer", None)}
    return {"type": None, "message": "returned although rank 1 was killed"}


def peer_dies(phase: str, directory: str, timeout: float) -> dict[str, Any]:
    """Rank 1 dies in ``phase``; rank 0 returns what its call raised.

    - "save": both ranks first check the optimizer (partial result on rank 1),
      then rank 1 is SIGKILLed before the save;
    - "save_in_dcp": rank 1 exits while DCP writes its data;
    - "replan": rank 1 is SIGKILLed after a step, before ``replan()``;
    - "meta_init": a meta-device model whose init_fn SIGKILLs rank 1, so rank 0
      waits at the broadcast of the tied parameters;
    - "mesh_groups": rank 1 is SIGKILLed before ``pipeline()`` makes the
      groups of a mesh (new_group waits out the default group's timeout).
    """
    rank = dist.get_rank()
    if phase == "mesh_groups":
        # A mesh without "pp" (each rank a one-rank pipeline) makes one group
        # per replica: new_group, collective over the world.
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        if rank == 1:
            _die()
        return _raised(lambda: mpmd.pipeline(models.MLP(d=8, depth=2), loss_fn=F.mse_loss,
                                             num_microbatches=2, mesh=mesh, timeout=timeout))
    if phase == "meta_init":
        def init_fn(module: torch.nn.Module) -> None:
            if rank == 1:
                _die()

        pipe, ids = models.meta_gpt_pipeline(init_fn, timeout)
        return _raised(lambda: pipe.step(ids, target=ids))

    out: dict[str, Any] = {}
    if phase == "save":
        out["optimizer"] = _optimizer_untouched_by_save(directory, timeout)
        partial_result(out)
    pipe, opt = _make(timeout)
    _step(pipe, opt, 0.5)
    if rank == 1:
        if phase == "save_in_dcp":
            from torch.distributed.checkpoint import FileSystemWriter

            def die(*args: Any, **kwargs: Any) -> Any:
                os._exit(1)

            FileSystemWriter.write_data = die  # type: ignore[method-assign]
        else:
            _die()
    if phase in ("save", "save_in_dcp"):
        out.update(_raised(lambda: mpmd.checkpoint.save(pipe, opt, os.path.join(
            directory, "killed"), timeout=timeout)))
        out["latest written"] = os.path.exists(os.path.join(directory, "killed", "latest"))
    elif phase == "replan":
        out.update(_raised(pipe.replan))
    else:
        raise ValueError(f"unknown phase {phase!r}")
    return out
