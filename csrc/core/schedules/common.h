// Helpers shared by the schedule generators (not part of the public API).
#pragma once

#include <string_view>
#include <vector>

#include "../action.h"
#include "../schedule.h"
#include "registry.h"

namespace mpmd::schedules {

// Parameter checks: checkSpec (table.h), from the schedule's row.

// Reserves room for `actions_per_rank` actions in every program.
inline void reservePrograms(Schedule& s, size_t actions_per_rank) {
  for (auto& program : s.programs) program.reserve(actions_per_rank);
}

// Appends one compute action to rank `rank`'s program.
inline void emit(Schedule& s, int rank, int stage, ActionKind kind, int mb) {
  s.programs[rank].push_back(computeAction(stage, kind, mb));
}

struct StageMb {
  int stage = 0;
  int mb = 0;
};

// Microbatch groups of the interleaved order: max(1, m / p) groups whose
// sizes differ by at most one, larger first (m=10, p=4: 5 5; m=11, p=4: 6 5).
// NOTE [Interleaved groups]: every group has at least p microbatches when
// m >= p. A trailing group shorter than p (Megatron's 4 4 2 for m=10) can
// deadlock interleaved 1F1B (p=4, v=3, m=5: rank 0 waits for microbatch 4
// from rank 3, which waits for a gradient rank 0 only sends afterwards).
std::vector<int> microbatchGroups(int num_ranks, int num_microbatches);

// The depth-first order of interleaved schedules on a loop placement: within
// each group of microbatchGroups, local chunk 0 runs every microbatch of the
// group, then chunk 1, and so on. With `backward` the chunks run in reverse
// (the backward pass enters a rank through its last chunk). Size v*m.
std::vector<StageMb> groupedOrder(const ScheduleSpec& spec, int rank, bool backward);

// Appends the 1F1B pattern to `rank`'s program: the first `warmup` forwards,
// then one forward and one backward (B) alternating, then the remaining
// backwards. `forwards` and `backwards` have the same size. Returns the peak
// number of forwards held before their backward, which is the rank's bound.
int appendOneFOneB(Schedule& s, int rank, const std::vector<StageMb>& forwards,
                   const std::vector<StageMb>& backwards, int warmup);

}  // namespace mpmd::schedules
