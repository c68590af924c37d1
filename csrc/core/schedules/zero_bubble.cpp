// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the
// backward split into I (input gradient, on the critical path between ranks)
// and W (weight gradient, local). I runs as soon as its gradient arrives; W's
// are deferred into the bubbles 1F1B would leave idle. Activation memory is
// 1F1B's: rank r holds at most p - r forwards before their I.
#include <algorithm>
#include <cstddef>

#include "common.h"
#include "table.h"
#include "greedy.h"

namespace mpmd {

Schedule makeZeroBubbleH1(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("zero_bubble"), spec);
  const int p = spec.num_ranks, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("zero_bubble", p, m, loopPlacement(p, 1));
  schedules::GreedyOptions options;
  for (int r = 0; r < p; ++r) {
    options.activation_cap.push_back(p - r);
    // p deferred W's are enough to fill the bubbles (makespan 3m + p - 1 at
    // unit costs); without a cap every W would drift to the end.
    options.max_pending_w.push_back(p);
  }
  schedules::fillGreedy(s, options);
  for (int r = 0; r < p; ++r) s.activation_bound.push_back(std::min(p - r, m));
  return s;
}

}  // namespace mpmd
