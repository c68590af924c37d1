// Interleaved 1F1B (Megatron-LM's virtual pipeline): v stages per rank on a
// loop placement, run 1F1B-style over the depth-first grouped order (groups
// of at least p microbatches per chunk, see NOTE [Interleaved groups]).
//
// Warmup on rank r is (v-1)*G + 2*(p-1-r) forwards, G the first group's size:
// (v-1)*G brings the group to the rank's last chunk, and the extra 2*(p-1-r)
// (twice 1F1B's p-1-r) covers the round trip of the first backward through
// the later ranks, so that in the steady state each backward's gradient has
// already arrived. Any m works with groups of >= p: the simulator finds no
// deadlock for p <= 24, v <= 6, m <= 120 (the unit tests sweep p <= 8, v <= 4,
// m <= 32), and the bubble is below 1F1B's for every m >= 2 there.
#include <cstddef>

#include "common.h"
#include "table.h"

namespace mpmd {

Schedule makeInterleaved1F1B(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("interleaved_1f1b"), spec);
  const int p = spec.num_ranks, v = spec.stages_per_rank, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("interleaved_1f1b", p, m, loopPlacement(p, v));
  schedules::reservePrograms(s, 2 * static_cast<size_t>(v) * m);
  s.activation_bound.resize(static_cast<size_t>(p));
  const int group = schedules::microbatchGroups(p, m).front();
  for (int r = 0; r < p; ++r) {
    // With one chunk this is exactly 1F1B.
    const int warmup = v == 1 ? p - r - 1 : (v - 1) * group + 2 * (p - 1 - r);
    s.activation_bound[r] = schedules::appendOneFOneB(
        s, r, schedules::groupedOrder(spec, r, /*backward=*/false),
        schedules::groupedOrder(spec, r, /*backward=*/true), warmup);
  }
  return s;
}

}  // namespace mpmd
