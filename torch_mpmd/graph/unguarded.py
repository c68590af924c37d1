"""Captures whose Dynamo guards are never built.

NOTE [Guards never built]: a capture (capture.py) compiles a fresh code
object, runs it once and drops its cache entry: Dynamo's guards for it are
never evaluated (what a later call must check, the capture keeps itself:
NOTE [State guards], from the guard *list* its backend reads while the
trace holds it). Yet after every trace Dynamo builds them anyway: each
guard turned into a guard-manager node (``Guard.create``), the whole
checked once on the frame's locals, and its latency profiled after a cache
flush, for a log line. On a 4-layer Hugging Face Llama that is a fifth of a
static capture (1.04 s against 0.85 s without: scripts/bench_unguarded.py),
and in the sampled profiles of the test suite's largest grids 18.5% of
Dynamo's samples (BENCHMARKS.md, "A capture's guards never built").

:func:`guards_not_built` marks a code object for the span of its trace:
Dynamo's guard builder then sees its output graph with no guards and
``skip_guards_check`` set (a manager that checks only the global state, as
an empty one does). Every other frame, the user's own ``torch.compile``
included, gets its guards as ever. Where this torch builds guards some
other way (the hook's names missing) or the reduced build raises, the full
build runs: the capture only ever loses the saving, never its trace.

Only static captures take it: where a user marked a dim dynamic
(``torch._dynamo.mark_dynamic``), it is the guards' shape part that finds a
dim the trace specialized and raises Dynamo's ConstraintViolationError.
``MPMD_CAPTURE_GUARDS=1`` builds every capture's guards, as Dynamo does
(to compare, or to rule this out).
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from typing import Any, Iterator

__all__ = ["guards_not_built"]

_log = logging.getLogger(__name__)
_UNGUARDED: set[types.CodeType] = set()  # the code objects being traced now
_hooked: bool | None = None  # None: not tried yet


class _WithoutGuards:
    """An output graph as the guard builder should see it for a frame whose
    guards are never evaluated: its guards dropped, the check after the
    build skipped; everything else the graph's own."""

    guards: tuple = ()
    aotautograd_guards: tuple = ()
    skip_guards_check = True

    def __init__(self, output_graph: Any) -> None:
        self.__dict__["_graph"] = output_graph

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_graph"], name)


def _hook() -> bool:
    """Route Dynamo's guard builder (``convert_frame.CheckFunctionManager``)
    through a wrapper that reduces it for the marked code objects (once);
    False where this torch has no such builder to route."""
    global _hooked
    if _hooked is None:
        try:
            from torch._dynamo import convert_frame

            build = convert_frame.CheckFunctionManager
        except (ImportError, AttributeError):
            _hooked = False
            return False

        def check_function_manager(f_code: Any, output_graph: Any, *args: Any,
                                   **kwargs: Any) -> Any:
            if f_code in _UNGUARDED and output_graph is not None:
                try:
                    return build(f_code, _WithoutGuards(output_graph), *args, **kwargs)
                except Exception as e:  # (a builder this module does not know)
                    _log.debug("guards of %s built in full: %s", f_code.co_name, e)
            return build(f_code, output_graph, *args, **kwargs)

        convert_frame.CheckFunctionManager = check_function_manager
        _hooked = True
    return _hooked


@contextlib.contextmanager
def guards_not_built(code: types.CodeType) -> Iterator[None]:
    """Within the block, Dynamo builds no guards for frames of ``code`` (a
    code object compiled once and dropped: see the NOTE above)."""
    if os.environ.get("MPMD_CAPTURE_GUARDS") == "1" or not _hook():
        yield
        return
    _UNGUARDED.add(code)
    try:
        yield
    finally:
        _UNGUARDED.discard(code)
