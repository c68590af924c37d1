// GPipe: every forward, then every backward.
//
// With several stages per rank the forwards run depth-first in groups of about
// num_ranks microbatches (see groupedOrder), so chunk 1 of rank 0 starts soon
// after microbatch 0 leaves the last rank instead of after all m microbatches
// of chunk 0. The backwards mirror that order.
#include <cstddef>

#include "common.h"
#include "table.h"

namespace mpmd {

Schedule makeGPipe(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("gpipe"), spec);
  const int p = spec.num_ranks, v = spec.stages_per_rank, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("gpipe", p, m, loopPlacement(p, v));
  schedules::reservePrograms(s, 2 * static_cast<size_t>(v) * m);
  for (int r = 0; r < p; ++r) {
    for (const auto& [stage, mb] : schedules::groupedOrder(spec, r, /*backward=*/false)) {
      schedules::emit(s, r, stage, ActionKind::Forward, mb);
    }
    for (const auto& [stage, mb] : schedules::groupedOrder(spec, r, /*backward=*/true)) {
      schedules::emit(s, r, stage, ActionKind::FullBackward, mb);
    }
  }
  // Every forward of the rank is held until the backward phase starts.
  s.activation_bound.assign(static_cast<size_t>(p), v * m);
  return s;
}

}  // namespace mpmd
