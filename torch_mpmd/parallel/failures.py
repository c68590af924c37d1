"""How a failure of the ranks is told: PipelineError, the first line a rank
sends of its failure, and which exceptions are settled.

An exception is *settled* when every rank raises together (the ranks found
it in the same exchange and stay in step), when the other ranks were told of
it, or when the groups were marked unusable because of it: a pipeline call
that ends with it has nothing more to tell its peers (NOTE [Lockstep] in
lockstep.py; :func:`settle`, :func:`is_settled`).
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["PipelineError", "first_line", "describe_failure", "settle", "is_settled",
           "add_note", "UNUSABLE"]


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank: a peer died or timed out, a transfer
    failed, or a stage raised. ``rank``, ``action`` (text form, e.g.
    ``"1RECV_F3"``) and ``peer`` (-1 when none) say where; the message also
    lists this rank's program with the failing step marked. When another
    rank's own code failed, ``peer`` is that rank (global rank) and the message
    names it with the first line of its exception."""

    def __init__(self, message: str, rank: int = -1, action: str = "", peer: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.peer = peer


# What a message adds when the pipeline's groups cannot be used any more.
UNUSABLE = ("; the pipeline's process groups cannot be used after this: restart the job "
            "(e.g. torchrun --max-restarts=N restarts every rank; resume from the last "
            "checkpoint)")


def first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut to ``limit`` characters ("..." marks a cut)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def describe_failure(exc: BaseException) -> str:
    """The first line of what a rank sends about its failure: the exception's
    type and first line (a stage's own exception for a PipelineError that
    wraps one, with the action it ran)."""
    cause = exc.__cause__ if isinstance(exc, PipelineError) and exc.__cause__ else exc
    text = f"{type(cause).__name__}: {first_line(str(cause))}"
    action = getattr(exc, "action", "")
    return f"{text} (in action {action})" if action and cause is not exc else text


_E = TypeVar("_E", bound=BaseException)


def settle(err: _E) -> _E:
    """Mark ``err`` settled (see the module docstring): the pipeline call it
    ends tells the other ranks nothing more. Returns ``err``."""
    err._mpmd_settled = True
    return err


def is_settled(err: BaseException) -> bool:
    """Whether :func:`settle` marked ``err``."""
    return getattr(err, "_mpmd_settled", False)


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` where Python has it (3.11+)."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
