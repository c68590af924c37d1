// The schedule table (core/schedules/table.h): every row has a generator and
// every generator a row, and each row's facts are what its generator does.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/schedules/registry.h"
#include "core/schedules/table.h"

namespace mpmd {
namespace {

std::string refusal(const std::string& name, const ScheduleSpec& spec) {
  try {
    makeSchedule(name, spec);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "";
}

TEST(ScheduleTable, NamesAreTheRowsInOrderAndUnique) {
  std::vector<std::string> rows;
  for (const ScheduleFacts& f : scheduleTable()) rows.emplace_back(f.name);
  EXPECT_EQ(scheduleNames(), rows);
  EXPECT_EQ(std::set<std::string>(rows.begin(), rows.end()).size(), rows.size());
  EXPECT_GE(rows.size(), 7u);
}

// Each row at a spec it takes: its generator makes a schedule of that name
// with the placement, the stage count and the I/W use the row states.
TEST(ScheduleTable, EveryRowsGeneratorDoesWhatTheRowSays) {
  for (const ScheduleFacts& f : scheduleTable()) {
    ASSERT_NE(f.make, nullptr) << f.name;
    for (int p : {1, 2, 4}) {
      const int v = f.typicalStagesPerRank();
      const ScheduleSpec spec{p, v, f.minMicrobatches(p) + 1};
      SCOPED_TRACE(std::string(f.name) + " p=" + std::to_string(p));
      const Schedule s = makeSchedule(f.name, spec);
      EXPECT_EQ(s.name, f.name);
      EXPECT_EQ(s.stagesPerRank(), v);
      EXPECT_EQ(s.stage_to_rank, f.placement == Placement::V ? vPlacement(p) : loopPlacement(p, v));
      EXPECT_EQ(s.splitsBackward(), f.splits_backward);
      EXPECT_EQ(f.family(), f.splits_backward ? "split backward" : "whole backward");
      EXPECT_TRUE(f.takesStagesPerRank(f.defaultStagesPerRank()));
      EXPECT_TRUE(f.takesStagesPerRank(v));
    }
  }
}

// Where a row says no, its generator says no, naming the value and the
// schedule; where it says yes, the generator takes it (p <= 6, v <= 4).
TEST(ScheduleTable, RowsRefuseExactlyWhatTheirGeneratorsRefuse) {
  for (const ScheduleFacts& f : scheduleTable()) {
    const std::string name(f.name);
    for (int p = 1; p <= 6; ++p) {
      for (int v = 1; v <= 4; ++v) {
        const int least = f.minMicrobatches(p);
        for (int m : {least - 1, least}) {
          if (m < 1) continue;
          SCOPED_TRACE(name + " p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m));
          const std::string why = refusal(name, {p, v, m});
          if (!f.takesStagesPerRank(v)) {
            EXPECT_NE(why.find("stages_per_rank=" + std::to_string(v)), std::string::npos) << why;
            EXPECT_NE(why.find(name), std::string::npos) << why;
          } else if (m < least) {
            EXPECT_NE(why.find("num_microbatches=" + std::to_string(m)), std::string::npos) << why;
            EXPECT_NE(why.find("num_ranks=" + std::to_string(p)), std::string::npos) << why;
            EXPECT_NE(why.find(name), std::string::npos) << why;
          } else {
            EXPECT_EQ(why, "");
          }
        }
      }
    }
  }
}

TEST(ScheduleTable, TheMessagesNameTheValues) {
  EXPECT_EQ(refusal("zbv", {4, 2, 3}), "num_microbatches=3 must be >= num_ranks=4 for zbv");
  EXPECT_EQ(refusal("dualpipev", {4, 2, 7}), "num_microbatches=7 must be >= 2 * num_ranks=4 (= 8) for dualpipev");
  EXPECT_EQ(refusal("1f1b", {4, 2, 8}),
            "stages_per_rank=2 is not supported by 1f1b: it needs exactly 1 (use interleaved_1f1b for several "
            "stages per rank)");
  EXPECT_EQ(refusal("gpipe", {0, 1, 8}), "num_ranks=0, stages_per_rank=1 and num_microbatches=8 must all be >= 1 "
                                         "for gpipe");
}

// A schedule that is another at one stage per rank runs its programs there.
TEST(ScheduleTable, SameAtOneStageRunsTheSamePrograms) {
  int aliases = 0;
  for (const ScheduleFacts& f : scheduleTable()) {
    if (f.same_at_one_stage.empty()) continue;
    ++aliases;
    const ScheduleFacts& other = scheduleFacts(f.same_at_one_stage);
    for (int p = 1; p <= 4; ++p) {
      for (int m = std::max(f.minMicrobatches(p), other.minMicrobatches(p)); m <= 9; ++m) {
        EXPECT_EQ(makeSchedule(f.name, {p, 1, m}).programs, makeSchedule(other.name, {p, 1, m}).programs)
            << f.name << " p=" << p << " m=" << m;
      }
    }
  }
  EXPECT_GE(aliases, 1);
}

TEST(ScheduleTable, TheDefaultIsARowAndTakesSeveralStagesThroughItsGeneralization) {
  EXPECT_EQ(defaultSchedule(1), kDefaultSchedule);
  const ScheduleFacts& several = scheduleFacts(defaultSchedule(2));
  EXPECT_TRUE(several.takesStagesPerRank(2));
  EXPECT_EQ(several.same_at_one_stage, kDefaultSchedule);
  EXPECT_GE(kDefaultMicrobatches, scheduleFacts(kDefaultSchedule).minMicrobatches(1));
}

TEST(ScheduleTable, AnUnknownNameListsTheKnownOnes) {
  try {
    scheduleFacts("pipedream");
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'pipedream'"), std::string::npos) << what;
    for (const auto& name : scheduleNames()) EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace mpmd
