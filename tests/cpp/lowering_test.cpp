// Lowering passes, table-driven: compute-only programs in, full programs out.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/lowering.h"
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

}  // namespace
}  // namespace mpmd
