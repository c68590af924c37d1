// Lowering: compute-only schedule -> full per-rank programs.
//
// A chain of small passes, each Schedule -> Schedule and usable alone:
//   insertTransfers   SEND right after the compute that produces a value for
//                     a stage on another rank (F for activations, B or I for
//                     input gradients), RECV right before the compute that
//                     needs it; stages on the same rank hand off locally (no
//                     action: the executor reads the producer's buffer).
//   orderChannels     NOTE [Channel order]: NCCL p2p has no tags, so on each
//                     directed rank channel a->b the k-th SEND posted by a
//                     must be the k-th RECV posted by b. This pass moves
//                     SENDs later (never earlier than their producer) until
//                     every channel's send order equals its receive order.
//   insertGradReduce  REDUCE_GRAD for each stage right after its last
//                     backward (B or W) and the sends that follow it.
//   insertUnshardReshard  (sharded data parallel, LowerOptions::shard) the
//                     all-gather (UNSHARD) and free (RESHARD) of each stage's
//                     parameters around its compute (NOTE [Unshard placement]).
//
// NOTE [Unshard placement]: with ZeRO-3/FSDP-style sharding a stage's
// parameters exist in full only between an UNSHARD of the stage (which posts
// their all-gather; the runner waits for it before the stage's next compute)
// and the following RESHARD (which frees them). The rule, per rank, checked by
// validateStatic: every compute action of a local stage lies inside exactly
// one UNSHARD(s)..RESHARD(s) window; a stage's windows neither nest nor
// overlap; every window is closed by the end of the program. Placement:
//   - windows: one per local stage s, from its first compute action of the
//     step to its last. With reshard_after_forward the window is split after
//     s's last F when s computes again later and more than unshard_prefetch
//     compute actions of other stages run in between (NOTE [When to reshard
//     after forward]);
//   - RESHARD(s) right after the window's last compute action and the SENDs
//     directly behind it (freeing never delays a value a peer waits for);
//   - UNSHARD(s) is prefetched: it goes before the compute action that is
//     unshard_prefetch compute actions (of any stage on the rank) before the
//     window's first one (the program start if there are fewer), moved up
//     past the RECVs directly before that compute so the gather also overlaps
//     the receive's wait; never before s's previous RESHARD. With
//     unshard_prefetch = 0 it goes right before the window's first compute
//     (again above its RECVs).
//   - where several land in one place, RESHARDs come first (memory is freed
//     before more is gathered), then UNSHARDs in the order of their windows.
//
// NOTE [When to reshard after forward]: splitting frees s's parameters while
// other stages compute, at the price of a second all-gather. The second
// window's UNSHARD is prefetched unshard_prefetch compute actions early, so
// with k other compute actions between s's last F and its next compute the
// parameters are freed during k - unshard_prefetch of them. With k <=
// unshard_prefetch they would be gathered again at once (RESHARD directly
// followed by UNSHARD): no memory is saved and a gather is added, so the
// window stays whole. With unshard_prefetch = 0 the rule is "another stage
// computes in between". A rank with one stage never splits (its F and B
// follow each other with no other compute between).
#pragma once

#include "schedule.h"

namespace mpmd {

struct ShardOptions {
  int unshard_prefetch = 1;            // compute actions of look-ahead; >= 0
  bool reshard_after_forward = false;  // split windows after the last F
};

struct LowerOptions {
  bool grad_reduce = true;
  bool shard = false;  // run insertUnshardReshard last, with shard_options
  ShardOptions shard_options = {};
};

// Input must be compute-only (ScheduleError otherwise).
Schedule insertTransfers(const Schedule& compute_only);
Schedule orderChannels(Schedule with_transfers);  // returned as is when already ordered
Schedule insertGradReduce(Schedule with_transfers);
// Any schedule without UNSHARD/RESHARD (compute-only or lowered); ScheduleError
// for one that has them or for unshard_prefetch < 0. NOTE [Unshard placement].
Schedule insertUnshardReshard(Schedule lowered, const ShardOptions& options = {});

// All passes in order.
Schedule lower(const Schedule& compute_only, const LowerOptions& options = {});

}  // namespace mpmd
