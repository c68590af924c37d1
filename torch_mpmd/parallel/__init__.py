"""Ranks together: the library's collective calls checked and bounded
(lockstep, with its parts bounded, failures, job_store and named_waits),
replicated data parallel (data_parallel), sharded data parallel (sharding),
tied weights across ranks (tied), and meta-device models built rank by rank
(meta_init).

Depends on: torch_mpmd._runtime (lockstep's store watch) only.
"""
