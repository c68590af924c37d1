// Schedule generators by name.
//
// A generator is a pure function of ScheduleSpec: it checks its parameters
// against its row of the schedule table (checkSpec in table.h: ScheduleError
// naming the values, e.g. "num_microbatches=3 must be >= num_ranks=4 for
// zbv"), picks the placement and returns the compute-only
// programs and the activation bound it promises per rank.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "../schedule.h"

namespace mpmd {

struct ScheduleSpec {
  int num_ranks = 1;
  int stages_per_rank = 1;
  int num_microbatches = 1;
};

// The names of the schedule table (table.h), in its order: "gpipe", "1f1b",
// "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev".
std::vector<std::string> scheduleNames();

// Throws ScheduleError for an unknown name (listing the known ones) or
// parameters the schedule cannot take. Runs the static invariant check
// (validateStatic) before returning.
Schedule makeSchedule(std::string_view name, const ScheduleSpec& spec);

// Individual generators (no static check; makeSchedule adds it). A new one
// needs a row in the schedule table (table.cpp) and nothing else.
Schedule makeGPipe(const ScheduleSpec& spec);
Schedule make1F1B(const ScheduleSpec& spec);
Schedule makeInterleaved1F1B(const ScheduleSpec& spec);
Schedule makeLoopedBFS(const ScheduleSpec& spec);
Schedule makeZeroBubbleH1(const ScheduleSpec& spec);
Schedule makeZBV(const ScheduleSpec& spec);
Schedule makeDualPipeV(const ScheduleSpec& spec);

}  // namespace mpmd
