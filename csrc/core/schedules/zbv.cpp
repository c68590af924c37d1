// ZB-V (Qi et al.): two stages per rank on the V placement (rank r holds
// stages r and 2p-1-r, so rank 0 computes both the first stage and the loss),
// with the zero-bubble I/W split. Built by the greedy list scheduler (NOTE
// [Greedy list scheduling] in greedy.h) with an activation cap of 2p stage
// forwards per rank: each stage is half of a 1F1B stage, so this is 1F1B's
// rank-0 memory, on every rank. At unit costs it finishes in 6m + p - 1 over
// the test sweep, the lower bound (the last rank starts at p - 1). Like the
// ZB-V paper it asks for m >= p, enough microbatches to fill the V.
#include <algorithm>
#include <cstddef>

#include "common.h"
#include "table.h"
#include "greedy.h"

namespace mpmd {

Schedule makeZBV(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("zbv"), spec);
  const int p = spec.num_ranks, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("zbv", p, m, vPlacement(p));
  schedules::GreedyOptions options;
  options.activation_cap.assign(static_cast<size_t>(p), 2 * p);
  options.max_pending_w.assign(static_cast<size_t>(p), p);  // see NOTE [Greedy list scheduling]
  schedules::fillGreedy(s, options);
  s.activation_bound.assign(static_cast<size_t>(p), std::min(2 * p, 2 * m));
  return s;
}

}  // namespace mpmd
