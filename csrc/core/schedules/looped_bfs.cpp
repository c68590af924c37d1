// Looped BFS (breadth-first): each local stage runs all microbatch forwards
// before the next local stage starts; backwards run local stages in reverse.
// Memory is GPipe's (every forward held); the point is fewer stage switches.
#include <cstddef>

#include "common.h"
#include "table.h"

namespace mpmd {

Schedule makeLoopedBFS(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("looped_bfs"), spec);
  const int p = spec.num_ranks, v = spec.stages_per_rank, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("looped_bfs", p, m, loopPlacement(p, v));
  schedules::reservePrograms(s, 2 * static_cast<size_t>(v) * m);
  for (int r = 0; r < p; ++r) {
    for (int chunk = 0; chunk < v; ++chunk) {
      for (int mb = 0; mb < m; ++mb) schedules::emit(s, r, chunk * p + r, ActionKind::Forward, mb);
    }
    for (int chunk = v - 1; chunk >= 0; --chunk) {
      for (int mb = 0; mb < m; ++mb) schedules::emit(s, r, chunk * p + r, ActionKind::FullBackward, mb);
    }
  }
  s.activation_bound.assign(static_cast<size_t>(p), v * m);
  return s;
}

}  // namespace mpmd
