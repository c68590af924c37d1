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
#pragma once

#include "schedule.h"

namespace mpmd {

struct LowerOptions {
  bool grad_reduce = true;
};

// Input must be compute-only (ScheduleError otherwise).
Schedule insertTransfers(const Schedule& compute_only);
Schedule orderChannels(Schedule with_transfers);  // returned as is when already ordered
Schedule insertGradReduce(Schedule with_transfers);

// All passes in order.
Schedule lower(const Schedule& compute_only, const LowerOptions& options = {});

}  // namespace mpmd
