// Schedule generators against programs written out by hand.
//
// Each expected row was derived on paper from the generator's rule (1F1B
// warmup p-r-1, Megatron warmup (v-1)*G + 2(p-1-r), DualPipeV's eight
// phases, the greedy scheduler's unit-time simulation) before comparing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/schedules/registry.h"
#include "core/validate.h"
#include "test_util.h"

namespace mpmd {
namespace {

using testing::rowsOf;

struct GoldenCase {
  std::string schedule;
  ScheduleSpec spec;
  std::vector<std::string> rows;
};

std::string caseName(const ::testing::TestParamInfo<GoldenCase>& info) {
  return info.param.schedule + "_p" + std::to_string(info.param.spec.num_ranks) + "_v" +
         std::to_string(info.param.spec.stages_per_rank) + "_m" +
         std::to_string(info.param.spec.num_microbatches);
}

class ScheduleGolden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(ScheduleGolden, ProgramsMatchHandDerivedRows) {
  const GoldenCase& c = GetParam();
  const Schedule s = makeSchedule(c.schedule, c.spec);
  EXPECT_EQ(rowsOf(s), c.rows);
  EXPECT_NO_THROW(validate(s));
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, ScheduleGolden,
    ::testing::Values(
        // 1F1B: rank 0 warms up with p-r-1 = 1 forward; rank 1 (last) with none.
        GoldenCase{"1f1b", {2, 1, 3},
                   {"0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"}},
        GoldenCase{"gpipe", {2, 1, 2}, {"0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"}},
        // Two groups of 2 microbatches, chunk 0 then chunk 1 within a group;
        // backwards mirror the chunks.
        GoldenCase{"gpipe", {2, 2, 4},
                   {"0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3 2B0 2B1 0B0 0B1 2B2 2B3 0B2 0B3",
                    "1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3 3B0 3B1 1B0 1B1 3B2 3B3 1B2 1B3"}},
        // Warmup (v-1)*2 + 2*(p-1-r): 4 (all forwards) on rank 0, 2 on rank 1.
        GoldenCase{"interleaved_1f1b", {2, 2, 2},
                   {"0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"}},
        GoldenCase{"looped_bfs", {2, 2, 2},
                   {"0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"}},
        // Greedy, caps 2 and 1 forwards: rank 1 alternates F and I, rank 0
        // fills its wait for 0I1 with 0W0; makespan 7 against 1F1B's 9.
        GoldenCase{"zero_bubble", {2, 1, 2},
                   {"0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"}},
        // One rank holding both stages: cap 2 forwards, at most 1 deferred W.
        GoldenCase{"zbv", {1, 2, 2}, {"0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1"}},
        GoldenCase{"dualpipev", {1, 2, 2}, {"0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1"}},
        GoldenCase{"dualpipev", {2, 2, 4},
                   {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
                    "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"}}),
    caseName);

}  // namespace
}  // namespace mpmd
