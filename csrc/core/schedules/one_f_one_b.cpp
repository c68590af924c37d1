// 1F1B (PipeDream-Flush): rank r runs p-r-1 warmup forwards, then alternates
// one forward and one backward, then drains the remaining backwards. It holds
// at most p-r forwards at once instead of GPipe's m, at the same makespan.
#include <algorithm>
#include <cstddef>

#include "common.h"
#include "table.h"

namespace mpmd {

Schedule make1F1B(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("1f1b"), spec);
  const int p = spec.num_ranks, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("1f1b", p, m, loopPlacement(p, 1));
  schedules::reservePrograms(s, 2 * static_cast<size_t>(m));
  s.activation_bound.resize(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const auto order = schedules::groupedOrder(spec, r, /*backward=*/false);
    // min(p - r, m): a rank cannot hold more microbatches than exist.
    s.activation_bound[r] = schedules::appendOneFOneB(s, r, order, order, p - r - 1);
  }
  return s;
}

}  // namespace mpmd
