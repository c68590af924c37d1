// Lowering passes, table-driven: compute-only programs in, full programs out.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "core/errors.h"
#include "core/lowering.h"
#include "core/schedules/registry.h"
#include "core/validate.h"
#include "test_util.h"

namespace mpmd {
namespace {

using testing::rowsOf;
using testing::scheduleFromRows;

struct LoweringCase {
  std::string name;
  std::vector<int> placement;
  int microbatches;
  std::vector<StageEdge> edges;  // empty = chain
  std::vector<std::string> compute;
  std::vector<std::string> lowered;  // expected lower() output
};

std::vector<LoweringCase> loweringCases() {
  return {
      {"two_ranks_one_microbatch",
       {0, 1},
       1,
       {},
       {"0F0 0B0", "1F0 1B0"},
       {"0F0 0SEND_F0 0RECV_B0 0B0 0REDUCE_GRAD", "1RECV_F0 1F0 1B0 1SEND_B0 1REDUCE_GRAD"}},
      {"split_backward_sends_after_input_grad",
       {0, 1},
       1,
       {},
       {"0F0 0I0 0W0", "1F0 1I0 1W0"},
       {"0F0 0SEND_F0 0RECV_B0 0I0 0W0 0REDUCE_GRAD", "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1REDUCE_GRAD"}},
      {"same_rank_stages_hand_off_locally",
       {0, 0},
       1,
       {},
       {"0F0 1F0 1B0 0B0"},
       {"0F0 1F0 1B0 1REDUCE_GRAD 0B0 0REDUCE_GRAD"}},
      {"v_placement_middle_stages_local",
       {0, 1, 1, 0},
       1,
       {},
       {"0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"},
       {"0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 3REDUCE_GRAD 0RECV_B0 0B0 0REDUCE_GRAD",
        "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 2REDUCE_GRAD 1B0 1SEND_B0 1REDUCE_GRAD"}},
      {"skip_connection_across_three_stages",
       {0, 1, 2, 3},
       1,
       {{0, 1}, {1, 2}, {2, 3}, {0, 3}},
       {"0F0 0B0", "1F0 1B0", "2F0 2B0", "3F0 3B0"},
       {"0F0 0SEND_F0 0SEND_F0->3 0RECV_B0 0RECV_B0<-3 0B0 0REDUCE_GRAD",
        "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0 1REDUCE_GRAD",
        "2RECV_F0 2F0 2SEND_F0 2RECV_B0 2B0 2SEND_B0 2REDUCE_GRAD",
        "3RECV_F0<-0 3RECV_F0 3F0 3B0 3SEND_B0->0 3SEND_B0 3REDUCE_GRAD"}},
      {"sends_wait_for_receive_order",
       // Rank 0 produces microbatch 1 first but rank 1 consumes 0 first: the
       // send of mb 1 is held back until mb 0's send is posted.
       {0, 1},
       2,
       {},
       {"0F1 0F0 0B0 0B1", "1F0 1F1 1B0 1B1"},
       {"0F1 0F0 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD",
        "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1REDUCE_GRAD"}},
  };
}

class LoweringTable : public ::testing::TestWithParam<LoweringCase> {};

TEST_P(LoweringTable, LowerProducesExpectedProgramsThatValidate) {
  const LoweringCase& c = GetParam();
  Schedule s = scheduleFromRows(c.placement, c.microbatches, c.compute, c.edges);
  Schedule lowered = lower(s);
  EXPECT_EQ(rowsOf(lowered), c.lowered);
  EXPECT_NO_THROW(validate(lowered));
  EXPECT_NO_THROW(validate(s));
}

INSTANTIATE_TEST_SUITE_P(Cases, LoweringTable, ::testing::ValuesIn(loweringCases()),
                         [](const auto& info) { return info.param.name; });

TEST(LoweringPasses, InsertTransfersAloneAddsNoGradReduce) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"});
  EXPECT_EQ(rowsOf(insertTransfers(s)),
            (std::vector<std::string>{"0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"}));
}

TEST(LoweringPasses, GradReduceCanBeTurnedOff) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"});
  LowerOptions options;
  options.grad_reduce = false;
  EXPECT_EQ(rowsOf(lower(s, options)),
            (std::vector<std::string>{"0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"}));
}

TEST(LoweringPasses, RefusesAlreadyLoweredInput) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0SEND_F0 0B0", "1F0 1B0"});
  try {
    insertTransfers(s);
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("0SEND_F0"), std::string::npos) << e.what();
  }
}

TEST(LoweringPasses, OrderChannelsLeavesMatchedChannelsAlone) {
  Schedule s = insertTransfers(scheduleFromRows({0, 1}, 2, {"0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"}));
  EXPECT_EQ(rowsOf(orderChannels(s)), rowsOf(s));
}


// --- insertUnshardReshard (NOTE [Unshard placement]) -------------------------

Schedule sharded(const std::string& name, int stages_per_rank, int prefetch, bool reshard_after_forward) {
  LowerOptions options;
  options.shard = true;
  options.shard_options = {prefetch, reshard_after_forward};
  return lower(makeSchedule(name, ScheduleSpec{2, stages_per_rank, 4}), options);
}

TEST(ShardLowering, OneFOneBGathersOnceAtTheStartAndFreesBeforeTheReduction) {
  const Schedule s = sharded("1f1b", 1, 1, false);
  EXPECT_EQ(rowsOf(s),
            (std::vector<std::string>{
                "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 "
                "0RECV_B2 0B2 0RECV_B3 0B3 0RESHARD 0REDUCE_GRAD",
                "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 "
                "1RECV_F3 1F3 1B3 1SEND_B3 1RESHARD 1REDUCE_GRAD"}));
  EXPECT_TRUE(s.isLowered());
  EXPECT_NO_THROW(validate(s));
}

TEST(ShardLowering, OneStagePerRankNeverSplitsAfterForward) {
  // 1F1B: each F of the stage is followed by its next compute (B or F) with
  // no other stage's compute between: nothing to free the memory for.
  for (int prefetch : {0, 1, 2}) {
    EXPECT_EQ(rowsOf(sharded("1f1b", 1, prefetch, true)), rowsOf(sharded("1f1b", 1, prefetch, false)));
    EXPECT_EQ(rowsOf(sharded("gpipe", 1, prefetch, true)), rowsOf(sharded("gpipe", 1, prefetch, false)));
  }
}

TEST(ShardLowering, InterleavedPrefetchesTheSecondStageOneComputeEarly) {
  const Schedule s = sharded("interleaved_1f1b", 2, 1, false);
  EXPECT_EQ(rowsOf(s),
            (std::vector<std::string>{
                "0UNSHARD 0F0 0SEND_F0 2UNSHARD 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 0F2 "
                "0SEND_F2 2RECV_B0 2B0 2SEND_B0 0F3 0SEND_F3 2RECV_B1 2B1 2SEND_B1 2RECV_F2 2F2 2SEND_F2 "
                "0RECV_B0 0B0 2RECV_F3 2F3 2SEND_F3 0RECV_B1 0B1 2RECV_B2 2B2 2SEND_B2 2RECV_B3 2B3 2SEND_B3 "
                "2RESHARD 2REDUCE_GRAD 0RECV_B2 0B2 0RECV_B3 0B3 0RESHARD 0REDUCE_GRAD",
                // 3UNSHARD goes above the RECV of the compute it precedes.
                "1UNSHARD 1RECV_F0 1F0 1SEND_F0 3UNSHARD 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 "
                "3RECV_F1 3F1 3B1 3SEND_B1 1RECV_F2 1F2 1SEND_F2 1RECV_B0 1B0 1SEND_B0 1RECV_F3 1F3 1SEND_F3 "
                "1RECV_B1 1B1 1SEND_B1 3RECV_F2 3F2 3B2 3SEND_B2 3RECV_F3 3F3 3B3 3SEND_B3 3RESHARD "
                "3REDUCE_GRAD 1RECV_B2 1B2 1SEND_B2 1RECV_B3 1B3 1SEND_B3 1RESHARD 1REDUCE_GRAD"}));
  EXPECT_NO_THROW(validate(s));
}

TEST(ShardLowering, PrefetchDistanceMovesTheGather) {
  // Prefetch 0: right before the window's first compute, above its RECV.
  const auto none = rowsOf(sharded("interleaved_1f1b", 2, 0, false));
  EXPECT_EQ(none[0].substr(0, 57), "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 2UNSHARD 2RECV_F0 2F0 ");
  EXPECT_EQ(none[1].substr(0, 54), "1UNSHARD 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3");
  EXPECT_NE(none[1].find("1SEND_F1 3UNSHARD 3RECV_F0 3F0"), std::string::npos) << none[1];
  // Prefetch 2 reaches past the program start: both gathers open it, in
  // the order of their windows.
  const auto two = rowsOf(sharded("interleaved_1f1b", 2, 2, false));
  EXPECT_EQ(two[0].substr(0, 21), "0UNSHARD 2UNSHARD 0F0");
  EXPECT_EQ(two[1].substr(0, 26), "1UNSHARD 3UNSHARD 1RECV_F0");
  for (int prefetch : {0, 1, 2, 7}) EXPECT_NO_THROW(validate(sharded("interleaved_1f1b", 2, prefetch, false)));
}

TEST(ShardLowering, ZeroBubbleWindowsEndAfterTheLastWeightGradient) {
  const Schedule s = sharded("zero_bubble", 1, 1, false);
  EXPECT_EQ(rowsOf(s),
            (std::vector<std::string>{
                "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0F2 0SEND_F2 0RECV_B1 0I1 0W0 0F3 0SEND_F3 "
                "0RECV_B2 0I2 0W1 0W2 0RECV_B3 0I3 0W3 0RESHARD 0REDUCE_GRAD",
                "1UNSHARD 1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1RECV_F2 1F2 1I2 1SEND_B2 "
                "1W1 1RECV_F3 1F3 1I3 1SEND_B3 1W2 1W3 1RESHARD 1REDUCE_GRAD"}));
  EXPECT_NO_THROW(validate(s));
}

TEST(ShardLowering, GPipeReshardsAfterForwardWhereOtherStagesComputeBetween) {
  // Rank 0 computes 0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3 2B0 2B1 0B0 0B1 2B2 2B3
  // 0B2 0B3: stage 0 is idle from 0F3 to 0B0 (four computes of stage 2), so
  // its window splits; stage 2's last F is followed by its own B: no split.
  const Schedule s = sharded("gpipe", 2, 1, true);
  EXPECT_EQ(rowsOf(s),
            (std::vector<std::string>{
                "0UNSHARD 0F0 0SEND_F0 2UNSHARD 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 0F2 "
                "0SEND_F2 0F3 0SEND_F3 0RESHARD 2RECV_F2 2F2 2SEND_F2 2RECV_F3 2F3 2SEND_F3 2RECV_B0 2B0 "
                "2SEND_B0 0UNSHARD 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1 2RECV_B2 2B2 2SEND_B2 "
                "2RECV_B3 2B3 2SEND_B3 2RESHARD 2REDUCE_GRAD 0RECV_B2 0B2 0RECV_B3 0B3 0RESHARD 0REDUCE_GRAD",
                "1UNSHARD 1RECV_F0 1F0 1SEND_F0 3UNSHARD 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3F1 "
                "1RECV_F2 1F2 1SEND_F2 1RECV_F3 1F3 1SEND_F3 1RESHARD 3RECV_F2 3F2 3RECV_F3 3F3 3B0 3SEND_B0 "
                "1UNSHARD 3B1 3SEND_B1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 3B2 3SEND_B2 3B3 3SEND_B3 "
                "3RESHARD 3REDUCE_GRAD 1RECV_B2 1B2 1SEND_B2 1RECV_B3 1B3 1SEND_B3 1RESHARD 1REDUCE_GRAD"}));
  EXPECT_NO_THROW(validate(s));
  // Without it, one window per stage.
  for (const std::string& row : rowsOf(sharded("gpipe", 2, 1, false))) {
    size_t unshards = 0;
    for (size_t at = row.find("UNSHARD"); at != std::string::npos; at = row.find("UNSHARD", at + 1)) ++unshards;
    EXPECT_EQ(unshards, 2u) << row;
  }
}

TEST(ShardLowering, NoSplitWhenThePrefetchWouldGatherAgainAtOnce) {
  // Interleaved rank 0: stage 2's last F (2F3) and its next compute (2B2)
  // have one compute between (0B1). Prefetch 1 would put the second gather
  // right behind the RESHARD, so the window stays whole; prefetch 0 splits.
  const auto one = rowsOf(sharded("interleaved_1f1b", 2, 1, true));
  EXPECT_NE(one[0].find("2F3 2SEND_F3 0RECV_B1"), std::string::npos) << one[0];
  EXPECT_NE(one[0].find("0F3 0SEND_F3 0RESHARD 2RECV_B1"), std::string::npos) << one[0];  // stage 0 splits
  EXPECT_NE(one[0].find("2SEND_B1 0UNSHARD 2RECV_F2 2F2"), std::string::npos) << one[0];
  const auto zero = rowsOf(sharded("interleaved_1f1b", 2, 0, true));
  EXPECT_NE(zero[0].find("2F3 2SEND_F3 2RESHARD 0RECV_B1 0B1 2UNSHARD 2RECV_B2 2B2"), std::string::npos)
      << zero[0];
}

// Every generated schedule, every option: the placement validates and keeps
// its windows per stage: one, or two with reshard_after_forward.
TEST(ShardLowering, EveryScheduleLowersToValidWindows) {
  for (const std::string& name : scheduleNames()) {
    for (int p : {1, 2, 4}) {
      for (int v : {1, 2}) {
        for (int m : {1, 4, 8}) {
          Schedule compute;
          try {
            compute = makeSchedule(name, ScheduleSpec{p, v, m});
          } catch (const ScheduleError&) {
            continue;  // a spec this schedule refuses (schedules_test covers which)
          }
          for (int prefetch : {0, 1, 3}) {
            for (bool raf : {false, true}) {
              LowerOptions options;
              options.shard = true;
              options.shard_options = {prefetch, raf};
              const Schedule s = lower(compute, options);
              SCOPED_TRACE(fmt::format("{} p={} v={} m={} prefetch={} raf={}", name, p, v, m, prefetch, raf));
              EXPECT_NO_THROW(validate(s));
              for (int r = 0; r < s.num_ranks; ++r) {
                std::vector<int> windows(s.num_stages, 0);
                for (const Action& a : s.programs[r]) windows[a.stage] += a.kind == ActionKind::Unshard;
                for (int st = 0; st < s.num_stages; ++st) {
                  if (s.stage_to_rank[st] != r) continue;
                  EXPECT_GE(windows[st], 1);
                  EXPECT_LE(windows[st], raf ? 2 : 1);
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(ShardLowering, RefusesShardedInputAndNegativePrefetch) {
  const Schedule s = sharded("1f1b", 1, 1, false);
  try {
    insertUnshardReshard(s);
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("0UNSHARD"), std::string::npos) << e.what();
  }
  // Lowering again is the "already lowered" error of insertTransfers.
  EXPECT_THROW(lower(s), ScheduleError);
  try {
    insertUnshardReshard(makeSchedule("1f1b", ScheduleSpec{2, 1, 4}), ShardOptions{-1, false});
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("unshard_prefetch=-1"), std::string::npos) << e.what();
  }
}

TEST(ShardLowering, WorksOnComputeOnlySchedulesToo) {
  Schedule s = scheduleFromRows({0, 0}, 1, {"0F0 1F0 1B0 0B0"});
  EXPECT_EQ(rowsOf(insertUnshardReshard(s, ShardOptions{0, true})),
            (std::vector<std::string>{"0UNSHARD 0F0 0RESHARD 1UNSHARD 1F0 1B0 1RESHARD 0UNSHARD 0B0 0RESHARD"}));
  EXPECT_EQ(rowsOf(insertUnshardReshard(s, ShardOptions{1, false})),
            (std::vector<std::string>{"0UNSHARD 1UNSHARD 0F0 1F0 1B0 1RESHARD 0B0 0RESHARD"}));
}

// --- validation of UNSHARD/RESHARD windows -------------------------------------

std::string shardError(const std::string& row) {
  try {
    validateStatic(scheduleFromRows({0}, 1, {row}));
  } catch (const ScheduleError& e) {
    return e.what();
  }
  ADD_FAILURE() << "'" << row << "' validated";
  return "";
}

TEST(ShardValidation, NamesRankStageAndPositionOfEachBrokenWindow) {
  EXPECT_NO_THROW(validateStatic(scheduleFromRows({0}, 1, {"0UNSHARD 0F0 0B0 0RESHARD 0REDUCE_GRAD"})));
  EXPECT_NO_THROW(validateStatic(scheduleFromRows({0}, 1, {"0UNSHARD 0F0 0RESHARD 0UNSHARD 0B0 0RESHARD"})));

  std::string e = shardError("0F0 0UNSHARD 0B0 0RESHARD");
  EXPECT_NE(e.find("rank 0, action #0 '0F0'"), std::string::npos) << e;
  EXPECT_NE(e.find("stage 0's parameters are not gathered"), std::string::npos) << e;

  e = shardError("0UNSHARD 0F0 0RESHARD 0B0");
  EXPECT_NE(e.find("rank 0, action #3 '0B0'"), std::string::npos) << e;

  e = shardError("0UNSHARD 0F0 0UNSHARD 0B0 0RESHARD");
  EXPECT_NE(e.find("rank 0, action #2 '0UNSHARD'"), std::string::npos) << e;
  EXPECT_NE(e.find("UNSHARD at #0 has no RESHARD"), std::string::npos) << e;

  e = shardError("0UNSHARD 0F0 0B0 0RESHARD 0RESHARD");
  EXPECT_NE(e.find("rank 0, action #4 '0RESHARD'"), std::string::npos) << e;
  EXPECT_NE(e.find("no UNSHARD of stage 0 is open"), std::string::npos) << e;

  e = shardError("0UNSHARD 0F0 0B0");
  EXPECT_NE(e.find("rank 0, action #0 '0UNSHARD'"), std::string::npos) << e;
  EXPECT_NE(e.find("still gathered at the end"), std::string::npos) << e;
}

TEST(ShardValidation, EachRankAndStageIsCheckedOnItsOwn) {
  // Rank 1 has no UNSHARD/RESHARD: it runs replicated and is not checked.
  Schedule s = scheduleFromRows({0, 1}, 1,
                                {"0UNSHARD 0F0 0SEND_F0 0RECV_B0 0B0 0RESHARD", "1RECV_F0 1F0 1B0 1SEND_B0"});
  EXPECT_NO_THROW(validate(s));
  // Stage 2 of rank 0 has no window although stage 0 has.
  Schedule two = scheduleFromRows({0, 0, 0}, 1, {"0UNSHARD 0F0 1F0 2F0 2B0 1B0 0B0 0RESHARD"});
  try {
    validateStatic(two);
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0, action #2 '1F0': stage 1's"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mpmd
