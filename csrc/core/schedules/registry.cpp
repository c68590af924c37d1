#include "registry.h"

#include "../validate.h"
#include "table.h"

namespace mpmd {

std::vector<std::string> scheduleNames() {
  std::vector<std::string> names;
  for (const ScheduleFacts& row : scheduleTable()) names.emplace_back(row.name);
  return names;
}

Schedule makeSchedule(std::string_view name, const ScheduleSpec& spec) {
  Schedule schedule = scheduleFacts(name).make(spec);  // ScheduleError for an unknown name
  validateStatic(schedule);
  return schedule;
}

}  // namespace mpmd
