"""The loss contract: what a microbatch's loss is, on the last stage.

``pipeline(loss_fn=...)``: on the last stage, for each microbatch ``k``,
``loss_fn(output_k, target_k)`` is called with the model's output of that
microbatch and its chunk of ``target`` and must return a one-element tensor.
With ``loss_fn=None`` the model's output carries the loss itself: a
one-element tensor, or a mapping, dataclass or named tuple with a field
``loss`` (a Hugging Face ``ModelOutput`` called with ``labels=``). A step
returns the mean of the microbatches' losses and accumulates the gradient of
that mean: for a mean-reduced loss and equal microbatches, the full batch's
loss and gradient. ``loss_fn`` may instead return a pair ``(sum of token
losses, token count)``: the step's loss is then the sum over every
microbatch (and data-parallel replica) divided by the total count, and so are
its gradients (NOTE [Token-weighted losses] in training.py). Both runners (FX
stages and functional programs) call :func:`microbatch_loss`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["microbatch_loss", "loss_from_output", "callable_name", "unwrap_partial", "describe",
           "loss_label", "needs_target", "check_token_count"]


def _loss_field(output: Any) -> Any:
    """The ``loss`` entry of a mapping, dataclass or named tuple; None when absent."""
    if isinstance(output, Mapping):  # a dict, or a Hugging Face ModelOutput
        return output.get("loss")
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return getattr(output, "loss", None)
    if isinstance(output, tuple) and "loss" in getattr(output, "_fields", ()):
        return output.loss
    return None


def describe(value: Any) -> str:
    """A value as error messages name it: a tensor by its shape, else by its type."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a value of type {type(value).__name__}"


def loss_from_output(output: Any) -> torch.Tensor:
    """The loss a model returned itself (``loss_fn=None``): the output when it is
    a one-element tensor, else its field ``loss``. ValueError otherwise."""
    loss = output if isinstance(output, torch.Tensor) else _loss_field(output)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        found = (f"; its field 'loss' is {describe(loss)}"
                 if loss is not None and loss is not output else "")
        raise ValueError(
            "pipeline(loss_fn=None) needs the model to return its loss as a scalar tensor, or "
            "a dict, dataclass or Hugging Face ModelOutput with a field 'loss' (e.g. called "
            f"with labels=); it returned {describe(output)}{found}; pass loss_fn=")
    return loss if loss.dim() == 0 else loss.reshape(())


def unwrap_partial(fn: Any) -> Any:
    """The function a (nested) functools.partial calls; ``fn`` otherwise."""
    while callable(getattr(fn, "func", None)):
        fn = fn.func
    return fn


def callable_name(fn: Any) -> str:
    """A loss function (or any callable) as messages name it: its qualified
    name, a module instance's type, a partial's function."""
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    inner = unwrap_partial(fn)
    if inner is not fn:
        return f"functools.partial({callable_name(inner)}, ...)"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or ''}.{qualname}".lstrip(".")


def microbatch_loss(loss_fn: Callable[..., torch.Tensor] | None, output: Any,
                    target: Any, *, needs_grad: bool = False) -> torch.Tensor:
    """One microbatch's loss on the last stage, a 0-dim tensor (the loss
    contract in the module docstring), or for a token-weighted loss (``loss_fn``
    returns ``(sum, count)``) the float32 tensor ``[sum, count]``. ``needs_grad`` (a training step, under
    grad mode): a loss that does not require grad is a ValueError naming
    ``loss_fn`` and what it returned, where eager ``backward()`` would raise
    too (a detached loss would train on zero gradients)."""
    if loss_fn is None:
        loss = loss_from_output(output)
        what = "the model's output (loss_fn=None)"
    else:
        what = f"loss_fn {callable_name(loss_fn)}"
        try:
            loss = loss_fn(output, target)
        except (TypeError, AttributeError, ValueError) as e:
            # Say what the loss was given when it is not what a loss expects:
            # no target, or an output that is not a tensor (not only what
            # broke inside the user's loss).
            if target is None:
                raise type(e)(f"target is missing: {what} raised with target=None (pass "
                              f"step(..., target=y)): {e}") from e
            if not isinstance(output, torch.Tensor):
                raise type(e)(f"{what} failed on the last stage's output, which is "
                              f"{describe(output)}: {e}") from e
            raise
        count = None
        if isinstance(loss, (tuple, list)) and len(loss) == 2:
            loss, count = loss
            count = _token_count(count, what)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError(f"loss_fn must return a one-element tensor or a pair (sum of "
                             f"token losses, token count), it returned {describe(loss)}")
        if count is not None:
            _check_grad(loss, output, what, needs_grad)
            # NOTE [Token-weighted losses]: the pair travels as one 2-element
            # tensor [sum, count]; backward seeds it with [1, 0].
            return torch.stack([loss.reshape(()).float(),
                                count.to(device=loss.device, dtype=torch.float32)])
    _check_grad(loss, output, what, needs_grad)
    return loss if loss.dim() == 0 else loss.reshape(())


def _token_count(count: Any, what: str) -> torch.Tensor:
    """The count of a token-weighted loss as a detached 0-dim tensor; a
    ValueError naming ``what`` unless it is a finite number >= 0."""
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        # Its value is checked where it is real (check_token_count): a stage
        # program traces this with fake tensors.
        return count.detach().reshape(())
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        check_token_count(float(count), what)
        return torch.tensor(float(count))
    raise ValueError(f"{what} returned a pair whose count is {describe(count)}; a "
                     "token-weighted loss is (sum of token losses, token count), the count "
                     "a number or a one-element tensor")


def check_token_count(count: float, what: str = "loss_fn") -> None:
    """A ValueError naming ``what`` unless ``count`` is a finite number >= 0."""
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"{what} returned the token count {count!r}; it must be a finite "
                         "number >= 0")


def _check_grad(loss: torch.Tensor, output: Any, what: str, needs_grad: bool) -> None:
    if needs_grad and not loss.requires_grad:
        raise ValueError(
            f"{what} returned a loss that does not require grad ({describe(loss)}, "
            f"dtype {str(loss.dtype).replace('torch.', '')}, requires_grad=False), so the step "
            "would train on zero gradients; return a loss computed from the model's output "
            "without .detach(), .item(), torch.tensor(...) or torch.no_grad()"
            + ("" if _requires_grad_anywhere(output) else
               "; the model's output does not require grad either (is every parameter "
               "frozen?)"))


def _requires_grad_anywhere(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in pytree.tree_leaves(value))


def loss_label(loss_fn: Callable[..., Any] | None) -> str:
    """The loss function as the start-up handshake compares it across ranks:
    its qualified name and a digest of its code (two lambdas, or a function
    edited on one rank only, differ), never an address."""
    if loss_fn is None:
        return "None (the model's output)"
    fn = unwrap_partial(loss_fn)
    if isinstance(fn, torch.nn.Module):
        fn = type(fn).forward
    code = getattr(fn, "__code__", None)
    if code is None:  # a builtin or C function: its name says it all
        return callable_name(loss_fn)
    return f"{callable_name(loss_fn)} (code {_code_digest(code)})"


def _code_digest(code: Any) -> str:
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:  # nested functions by their code, not their repr's address
        h.update((_code_digest(const) if hasattr(const, "co_code") else repr(const)).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:12]


def needs_target(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` is known to read its target before it runs: one of
    torch's losses (a ``torch.nn`` loss module, a ``torch.nn.functional``
    function, or a partial of either; every one of them takes a target).
    Another callable may ignore it: without a target it is called with None,
    and an error it raises then says the target is missing
    (:func:`microbatch_loss`)."""
    fn = unwrap_partial(loss_fn)
    if isinstance(fn, torch.nn.Module):
        return isinstance(fn, torch.nn.modules.loss._Loss)
    return getattr(fn, "__module__", None) == "torch.nn.functional" and \
        getattr(fn, "__name__", "").endswith(("_loss", "cross_entropy", "nll_loss"))
