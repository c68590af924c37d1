#include "registry.h"

#include <array>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../errors.h"
#include "../validate.h"

namespace mpmd {

namespace {

struct Entry {
  std::string_view name;
  Schedule (*make)(const ScheduleSpec&);
};

constexpr std::array<Entry, 7> kSchedules = {{
    {"gpipe", makeGPipe},
    {"1f1b", make1F1B},
    {"interleaved_1f1b", makeInterleaved1F1B},
    {"looped_bfs", makeLoopedBFS},
    {"zero_bubble", makeZeroBubbleH1},
    {"zbv", makeZBV},
    {"dualpipev", makeDualPipeV},
}};

}  // namespace

std::vector<std::string> scheduleNames() {
  std::vector<std::string> names;
  for (const Entry& e : kSchedules) names.emplace_back(e.name);
  return names;
}

Schedule makeSchedule(std::string_view name, const ScheduleSpec& spec) {
  for (const Entry& e : kSchedules) {
    if (e.name != name) continue;
    Schedule schedule = e.make(spec);
    validateStatic(schedule);
    return schedule;
  }
  throw ScheduleError(fmt::format("unknown schedule '{}'; known schedules: {}", name,
                                  fmt::join(scheduleNames(), ", ")));
}

}  // namespace mpmd
