// A deterministic list scheduler for the zero-bubble family.
//
// NOTE [Greedy list scheduling]: instead of a closed form, the generator
// simulates every rank at unit costs (F=1, I=1, W=1, B=2, zero communication)
// and, whenever a rank is free, starts the ready action of highest priority:
//   1. W, if max_pending_w weight gradients are deferred;
//   2. a forward whose input has arrived, if the rank holds fewer than
//      activation_cap forwards without their backward;
//   3. a backward (I, or B without split) whose gradient has arrived;
//   4. a deferred W (oldest first).
// Forwards before backwards: the cap already bounds memory, and starting
// forwards as early as it allows keeps the last microbatches from starving
// at the tail (backward-first left ZB-V up to 9 steps longer at p=8 in the
// schedule sweep; forward-first reaches 6m + p - 1 there, and 3m + p - 1 for
// ZB-H1). A deferred-W limit below p made both schedules longer.
// Among stages of one rank, the higher stage index wins (it is closer to the
// loss for forwards and earlier in the backward chain). Each stage runs its
// microbatches in order. The emitted program is the order of the starts, so
// the real simulator finishes it no later than this pass did: every action
// started here only once its inputs were done, so it is also deadlock-free.
// The pass is O(makespan * stages) with flat per-(stage, mb) arrays.
#pragma once

#include <vector>

#include "../schedule.h"

namespace mpmd::schedules {

struct GreedyOptions {
  bool split_backward = true;       // I and W instead of B
  std::vector<int> activation_cap;  // per rank, >= 1
  std::vector<int> max_pending_w;   // per rank, >= 1: deferred W's at most
};

// Fills schedule.programs (which must be empty) for its placement and chain
// edges. Throws std::logic_error if the caps starve every rank (a bug in the
// caller's caps, never a user error).
void fillGreedy(Schedule& schedule, const GreedyOptions& options);

}  // namespace mpmd::schedules
