"""What one rank runs: its RankRuntime (rank: schedule, runner, transport,
executor), the one function every call kind goes through (step.run_step), the
StageRunners the C++ executor calls (runner over FX stages, program_runner over
stage programs), and the executor's per-action timelines (trace).

Depends on: graph, programs, parallel, schedules, torch_mpmd._runtime.
"""
