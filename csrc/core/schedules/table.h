// The schedule table: every fact about a named schedule that code outside
// its generator asks, in one row per schedule.
//
// The generators (registry.h) take their parameter checks from their row
// (checkSpec), makeSchedule finds them by name here, the planner reads which
// triples are worth searching, and Python reads the same rows through the
// bindings (torch_mpmd.schedules.facts). Adding a schedule is its generator
// and one row of kScheduleTable (table.cpp); the GTest ScheduleTable and
// tests/test_schedules.py check that the two agree.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "../schedule.h"
#include "registry.h"

namespace mpmd {

// Where a schedule puts its stages (schedule.h): loopPlacement (stage s on
// rank s % p) or vPlacement (stage r and 2p-1-r on rank r).
enum class Placement { Loop, V };

struct ScheduleFacts {
  std::string_view name;
  Schedule (*make)(const ScheduleSpec&);  // the generator (registry.h)
  // Stages per rank it takes: min..max, max 0 for any number >= min.
  int min_stages_per_rank = 1;
  int max_stages_per_rank = 0;
  Placement placement = Placement::Loop;
  // It needs num_microbatches >= microbatches_per_rank * num_ranks (0: any
  // m >= 1): a V schedule fills its V only with enough microbatches.
  int microbatches_per_rank = 0;
  // Whether its programs hold I/W (the backward split into input and weight
  // gradients) rather than only B; it decides its family.
  bool splits_backward = false;
  // The schedule it is at one stage per rank ("interleaved_1f1b" is "1f1b"),
  // or empty: a search need not try both.
  std::string_view same_at_one_stage;
  // Said after a refused stages_per_rank, e.g. "use zbv for 2 stages per rank".
  std::string_view stages_hint;

  // The stages per rank it places when nothing else says: its minimum.
  int defaultStagesPerRank() const { return min_stages_per_rank; }
  // The fewest stages per rank that show what it is for: 2 for the V
  // schedules and for the ones that generalize a one-stage schedule
  // (what the examples, the CLI's table and the planner's default
  // contender take), else its default.
  int typicalStagesPerRank() const;
  // "split backward" or "whole backward".
  std::string_view family() const { return splits_backward ? "split backward" : "whole backward"; }
  int minMicrobatches(int num_ranks) const;
  bool takesStagesPerRank(int v) const {
    return v >= min_stages_per_rank && (max_stages_per_rank == 0 || v <= max_stages_per_rank);
  }
};

// Every row, in the order scheduleNames() lists them.
std::span<const ScheduleFacts> scheduleTable();

// The row of `name`; ScheduleError for an unknown name, listing the known ones.
const ScheduleFacts& scheduleFacts(std::string_view name);

// The checks every generator starts with, from its row: positive counts, the
// stages per rank it takes, its minimum microbatch count. ScheduleError
// naming the values and the schedule, e.g. "num_microbatches=3 must be >=
// num_ranks=4 for zbv".
void checkSpec(const ScheduleFacts& facts, const ScheduleSpec& spec);

// What a user gets without naming a schedule: pipeline()'s schedule, and the
// microbatch count of a call that does not split its batch (the compile door).
inline constexpr std::string_view kDefaultSchedule = "1f1b";
inline constexpr int kDefaultMicrobatches = 1;

// The default schedule at `stages_per_rank`: kDefaultSchedule where it takes
// that many, else the schedule that is kDefaultSchedule at one stage and
// takes them ("interleaved_1f1b" for 2). ScheduleError naming the count when
// none does.
std::string_view defaultSchedule(int stages_per_rank);

}  // namespace mpmd
