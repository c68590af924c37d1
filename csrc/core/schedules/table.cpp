#include "table.h"

#include <algorithm>
#include <array>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../errors.h"

namespace mpmd {

namespace {

// One row per schedule (see ScheduleFacts for the columns):
//   name, generator, stages per rank min..max (0: any), placement,
//   microbatches per rank at least, splits backward, same at one stage, hint.
constexpr std::array<ScheduleFacts, 7> kScheduleTable = {{
    {"gpipe", makeGPipe, 1, 0, Placement::Loop, 0, false, "", ""},
    {"1f1b", make1F1B, 1, 1, Placement::Loop, 0, false, "",
     "use interleaved_1f1b for several stages per rank"},
    {"interleaved_1f1b", makeInterleaved1F1B, 1, 0, Placement::Loop, 0, false, "1f1b", ""},
    {"looped_bfs", makeLoopedBFS, 1, 0, Placement::Loop, 0, false, "gpipe", ""},
    {"zero_bubble", makeZeroBubbleH1, 1, 1, Placement::Loop, 0, true, "", "use zbv for 2 stages per rank"},
    {"zbv", makeZBV, 2, 2, Placement::V, 1, true, "", "its V placement puts 2 stages on each rank"},
    {"dualpipev", makeDualPipeV, 2, 2, Placement::V, 2, true, "", "its V placement puts 2 stages on each rank"},
}};

}  // namespace

int ScheduleFacts::typicalStagesPerRank() const {
  return min_stages_per_rank > 1 || !same_at_one_stage.empty() ? std::max(2, min_stages_per_rank)
                                                              : min_stages_per_rank;
}

int ScheduleFacts::minMicrobatches(int num_ranks) const {
  return std::max(1, microbatches_per_rank * num_ranks);
}

std::span<const ScheduleFacts> scheduleTable() { return kScheduleTable; }

const ScheduleFacts& scheduleFacts(std::string_view name) {
  for (const ScheduleFacts& row : kScheduleTable) {
    if (row.name == name) return row;
  }
  std::vector<std::string_view> known;
  for (const ScheduleFacts& row : kScheduleTable) known.push_back(row.name);
  throw ScheduleError(fmt::format("unknown schedule '{}'; known schedules: {}", name, fmt::join(known, ", ")));
}

void checkSpec(const ScheduleFacts& facts, const ScheduleSpec& spec) {
  const std::string_view name = facts.name;
  const int p = spec.num_ranks, v = spec.stages_per_rank, m = spec.num_microbatches;
  if (p < 1 || v < 1 || m < 1) {
    throw ScheduleError(fmt::format("num_ranks={}, stages_per_rank={} and num_microbatches={} must all be >= 1 for {}",
                                    p, v, m, name));
  }
  if (!facts.takesStagesPerRank(v)) {
    const int lo = facts.min_stages_per_rank, hi = facts.max_stages_per_rank;
    const std::string needs = lo == hi  ? fmt::format("exactly {}", lo)
                              : hi == 0 ? fmt::format("at least {}", lo)
                                        : fmt::format("{} to {}", lo, hi);
    std::string message = fmt::format("stages_per_rank={} is not supported by {}: it needs {}", v, name, needs);
    if (!facts.stages_hint.empty()) message += fmt::format(" ({})", facts.stages_hint);
    throw ScheduleError(message);
  }
  const int k = facts.microbatches_per_rank;
  if (m < facts.minMicrobatches(p)) {
    throw ScheduleError(k == 1 ? fmt::format("num_microbatches={} must be >= num_ranks={} for {}", m, p, name)
                               : fmt::format("num_microbatches={} must be >= {} * num_ranks={} (= {}) for {}", m, k,
                                             p, k * p, name));
  }
}

std::string_view defaultSchedule(int stages_per_rank) {
  const ScheduleFacts& base = scheduleFacts(kDefaultSchedule);
  if (base.takesStagesPerRank(stages_per_rank)) return base.name;
  for (const ScheduleFacts& row : kScheduleTable) {
    if (row.same_at_one_stage == kDefaultSchedule && row.takesStagesPerRank(stages_per_rank)) return row.name;
  }
  throw ScheduleError(fmt::format("stages_per_rank={} is taken by no default schedule ({} or one that is {} at one "
                                  "stage per rank)",
                                  stages_per_rank, kDefaultSchedule, kDefaultSchedule));
}

}  // namespace mpmd
