"""What a step did, for users: the public face over :mod:`torch_mpmd.runtime.trace`.

``pipe.timelines()`` gives rows of ``(action, start s, end s)`` per rank; the
functions here turn them into metrics (:func:`bubble_fractions`,
:func:`step_metrics`, :func:`transfer_latencies`), exports
(:func:`chrome_trace`, :func:`write_chrome_trace`), the runtime's time per
action (:func:`action_overhead`) and per step outside the actions
(:func:`step_overhead`), and a measured-against-simulated picture
(:func:`simulate_measured`, :func:`save_measured_timeline`).
"""

from torch_mpmd.runtime.trace import (StepRecord, action_kind, action_overhead, bubble_fractions,
                                      chrome_trace, gather_timelines, rank_timeline,
                                      save_measured_timeline, simulate_measured, stage_times,
                                      step_metrics, step_overhead, transfer_latencies,
                                      write_chrome_trace)

__all__ = ["action_kind", "action_overhead", "step_overhead", "rank_timeline", "step_metrics",
           "bubble_fractions", "transfer_latencies", "StepRecord", "stage_times",
           "gather_timelines", "chrome_trace", "write_chrome_trace", "simulate_measured",
           "save_measured_timeline"]
