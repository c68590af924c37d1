// Simulator: timing of hand-written programs, deadlock reports, validation.
#include <map>
#include <random>
#include <tuple>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/lowering.h"
#include "core/schedules/registry.h"
#include "core/simulator.h"
#include "core/validate.h"
#include "test_util.h"

namespace mpmd {
namespace {

using testing::scheduleFromRows;
using testing::whatOf;

TEST(Simulator, TwoStageSingleMicrobatchIsTheCriticalPath) {
  // F0 F1 B1 B0 in sequence: 1 + 1 + 2 + 2.
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  SimulationResult r = simulate(s);
  EXPECT_DOUBLE_EQ(r.makespan, 6.0);
  EXPECT_EQ(r.busy, (std::vector<double>{3.0, 3.0}));
  EXPECT_DOUBLE_EQ(r.bubble_fraction[0], 0.5);
  EXPECT_EQ(r.messages, 2);
}

TEST(Simulator, CommunicationLatencyAndBandwidthDelayTheReceiver) {
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  CostModel model;
  model.comm_latency = 0.5;
  model.comm_bandwidth = 100.0;
  model.message_bytes = 50.0;  // 0.5 per message
  SimulationResult r = simulate(s, model);
  EXPECT_DOUBLE_EQ(r.makespan, 6.0 + 2 * 1.0);
  EXPECT_DOUBLE_EQ(r.comm_bytes, 100.0);
}

TEST(Simulator, ActionOverheadPrecedesEveryActionOnTheCriticalPath) {
  // NOTE [Action overhead]: rank 0 runs F0 SEND_F RECV_B B0 REDUCE_GRAD, rank 1
  // RECV_F F0 B0 SEND_B REDUCE_GRAD. The critical path is rank 0's F0 SEND_F,
  // rank 1's RECV_F F0 B0 SEND_B, rank 0's RECV_B B0 REDUCE_GRAD: nine
  // actions, each preceded by the overhead (a RECV's after its data arrived).
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  CostModel model;
  model.action_overhead = 0.25;
  SimulationResult r = simulate(s, model, /*record_timeline=*/true);
  EXPECT_DOUBLE_EQ(r.makespan, 6.0 + 9 * 0.25);
  EXPECT_EQ(r.busy, (std::vector<double>{3.0, 3.0}));  // compute only
  EXPECT_DOUBLE_EQ(r.timeline[0][0].start, 0.25);      // F0 begins after its overhead
}

TEST(Simulator, MicrobatchScaleMultipliesComputeAndBytesNotLatency) {
  // NOTE [Microbatch costs]: microbatch 0 costs half, microbatch 1 twice a
  // mean one. GPipe on two ranks: rank 0 F0 [0, 0.5], F1 [0.5, 2.5]; rank 1
  // F0 after 0.5 + its message (latency 0.1 + 0.5 * 1), F1 after 2.5 + 0.1 +
  // 2 * 1; busy per rank: 3 * (0.5 + 2).
  Schedule s = lower(scheduleFromRows({0, 1}, 2, {"0F0 0F1 0B1 0B0", "1F0 1F1 1B1 1B0"}));
  CostModel model;
  model.microbatch_scale = {0.5, 2.0};
  model.comm_latency = 0.1;
  model.comm_bandwidth = 10.0;
  model.message_bytes = 10.0;  // 1.0 per mean message
  SimulationResult r = simulate(s, model, /*record_timeline=*/true);
  EXPECT_EQ(r.busy, (std::vector<double>{7.5, 7.5}));
  EXPECT_DOUBLE_EQ(r.comm_bytes, 2 * 10.0 * (0.5 + 2.0));
  EXPECT_DOUBLE_EQ(r.timeline[1][1].start, 0.5 + 0.1 + 0.5);  // rank 1's F0 (after its RECV)
  EXPECT_DOUBLE_EQ(r.timeline[1][1].end, 0.5 + 0.1 + 0.5 + 0.5);
  CostModel uniform = model;
  uniform.microbatch_scale = {1.0, 1.0};
  CostModel none = model;
  none.microbatch_scale.clear();
  EXPECT_DOUBLE_EQ(simulate(s, uniform).makespan, simulate(s, none).makespan);
}

TEST(Simulator, PerStageCostsApply) {
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  CostModel model;
  model.stage_costs = {KindCosts{}, KindCosts{3.0, 6.0, 3.0, 3.0, 0.0}};
  EXPECT_DOUBLE_EQ(simulate(s, model).makespan, 1 + 3 + 6 + 2);
}

TEST(Simulator, TimelineRecordsEveryAction) {
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  SimulationResult r = simulate(s, {}, /*record_timeline=*/true);
  ASSERT_EQ(r.timeline.size(), 2u);
  ASSERT_EQ(r.timeline[1].size(), s.programs[1].size());
  // rank 1: RECV_F0 at t=1, F0 [1,2], B0 [2,4].
  EXPECT_DOUBLE_EQ(r.timeline[1][1].start, 1.0);
  EXPECT_DOUBLE_EQ(r.timeline[1][2].end, 4.0);
}

TEST(Simulator, HandWrittenDeadlockIsRejectedNamingBlockedActions) {
  // Each rank waits for the other's gradient before sending its activation.
  Schedule s = scheduleFromRows({0, 1}, 1,
                                {"0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  const std::string message = whatOf([&] { simulate(s); });
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 is blocked at #0 '0RECV_B0'"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 is blocked at #0 '1RECV_F0'"), std::string::npos) << message;
  EXPECT_THROW(simulate(s), DeadlockError);
}

TEST(Simulator, BackwardBeforeForwardIsRejectedBeforeSimulation) {
  Schedule s = scheduleFromRows({0, 1, 0}, 1, {"0F0 2F0 2B0 0B0", "1B0 1F0"});
  EXPECT_NE(whatOf([&] { validate(s); }).find("backward before its forward"), std::string::npos);
}

TEST(Simulator, ComputeOrderThatCannotCompleteIsADeadlock) {
  // Rank 1 wants microbatch 1 first; rank 0 produces it only after
  // microbatch 0's backward, which needs rank 1.
  Schedule s = scheduleFromRows({0, 1}, 2, {"0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"});
  const std::string message = whatOf([&] { validate(s); });
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 is blocked at #0 '1RECV_F1'"), std::string::npos) << message;
}

TEST(Simulator, ValidatedDeadlockThroughCommunicationOrder) {
  // Two ranks, two microbatches, rank 1 insists on the second microbatch
  // first while rank 0 sends it last: no rank can move.
  Schedule s = scheduleFromRows({0, 1}, 2,
                                {"0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1",
                                 "1RECV_F1 1RECV_F0 1F1 1F0 1B0 1SEND_B0 1B1 1SEND_B1"});
  const std::string message = whatOf([&] { validate(s); });
  EXPECT_NE(message.find("not matched by order"), std::string::npos) << message;
}

TEST(Simulator, RecvWithoutSendIsAScheduleError) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1RECV_F0 1F0 1B0"});
  EXPECT_THROW(simulate(s), ScheduleError);
}

TEST(Validate, NamesMissingAndDuplicateComputeActions) {
  EXPECT_NE(whatOf([] { validate(scheduleFromRows({0}, 2, {"0F0 0B0 0F1"})); }).find("stage 0 microbatch 1 has no backward"),
            std::string::npos);
  EXPECT_NE(whatOf([] { validate(scheduleFromRows({0}, 1, {"0F0 0F0 0B0"})); }).find("runs twice"), std::string::npos);
  EXPECT_NE(whatOf([] { validate(scheduleFromRows({0}, 1, {"0F0 0W0 0I0"})); }).find("0W0 before 0I0"),
            std::string::npos);
  EXPECT_NE(whatOf([] { validate(scheduleFromRows({0, 1}, 1, {"0F0 0B0 1F0 1B0", ""})); }).find("runs on rank 1"),
            std::string::npos);
}

TEST(Validate, SameRankDependencyOrderIsChecked) {
  const std::string message = whatOf([] { validate(scheduleFromRows({0, 0}, 1, {"1F0 0F0 1B0 0B0"})); });
  EXPECT_NE(message.find("1F0 runs before 0F0"), std::string::npos) << message;
}

TEST(Validate, ActivationBoundIsEnforced) {
  Schedule s = scheduleFromRows({0}, 3, {"0F0 0F1 0F2 0B0 0B1 0B2"});
  s.activation_bound = {2};
  const std::string message = whatOf([&] { validateStatic(s); });
  EXPECT_NE(message.find("holds 3 forwards"), std::string::npos) << message;
  s.activation_bound = {3};
  EXPECT_NO_THROW(validate(s));
  EXPECT_EQ(peakActivations(s), std::vector<int>{3});
}

TEST(Validate, LoweredProgramMissingATransferIsRejected) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  const std::string message = whatOf([&] { validate(s); });
  EXPECT_NE(message.find("never posts '0RECV_B0'"), std::string::npos) << message;
}

TEST(Validate, SendBeforeItsProducerIsRejected) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  const std::string message = whatOf([&] { validate(s); });
  EXPECT_NE(message.find("before the compute that produces it"), std::string::npos) << message;
}

TEST(Validate, BadEdgesAreNamed) {
  Schedule s = scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}, {{1, 0}});
  EXPECT_NE(whatOf([&] { validate(s); }).find("stage edge 1->0"), std::string::npos);
}

// --- collectives: UNSHARD/REDUCE_GRAD on the collective stream, RESHARD blocking

Schedule shardedTwoStagesOneRank(int prefetch) {
  LowerOptions options;
  options.shard = true;
  options.shard_options = {prefetch, false};
  return lower(scheduleFromRows({0, 0}, 1, {"0F0 1F0 1B0 0B0"}), options);
}

TEST(SimulatorCollectives, UnshardDelaysTheStagesFirstCompute) {
  Schedule s = scheduleFromRows({0}, 1, {"0UNSHARD 0F0 0B0 0RESHARD"});
  CostModel model;
  model.costs.unshard = 3.0;
  SimulationResult r = simulate(s, model, /*record_timeline=*/true);
  EXPECT_DOUBLE_EQ(r.makespan, 3.0 + 1.0 + 2.0);
  EXPECT_EQ(r.busy, (std::vector<double>{3.0}));  // compute only
  EXPECT_DOUBLE_EQ(r.timeline[0][0].start, 0.0);  // the gather on the stream
  EXPECT_DOUBLE_EQ(r.timeline[0][0].end, 3.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][1].start, 3.0);  // 0F0 waited for it
  EXPECT_DOUBLE_EQ(r.timeline[0][1].end, 4.0);
}

TEST(SimulatorCollectives, PrefetchOverlapsTheGatherWithEarlierWork) {
  CostModel model;
  model.costs.unshard = 3.0;
  // Prefetch 0: 0UNSHARD 0F0 1UNSHARD 1F0 1B0 1RESHARD 1REDUCE_GRAD 0B0 ...
  // gather 0 [0,3], 0F0 [3,4], gather 1 [4,7], 1F0 [7,8], 1B0 [8,10], 0B0 [10,12].
  const Schedule none = shardedTwoStagesOneRank(0);
  EXPECT_EQ(testing::rowOf(none, 0),
            "0UNSHARD 0F0 1UNSHARD 1F0 1B0 1RESHARD 1REDUCE_GRAD 0B0 0RESHARD 0REDUCE_GRAD");
  EXPECT_DOUBLE_EQ(simulate(none, model).makespan, 12.0);
  // Prefetch 1: both gathers first, one after the other on the stream:
  // gather 0 [0,3], gather 1 [3,6]; 0F0 [3,4], 1F0 [6,7], 1B0 [7,9], 0B0 [9,11].
  const Schedule one = shardedTwoStagesOneRank(1);
  EXPECT_EQ(testing::rowOf(one, 0),
            "0UNSHARD 1UNSHARD 0F0 1F0 1B0 1RESHARD 1REDUCE_GRAD 0B0 0RESHARD 0REDUCE_GRAD");
  SimulationResult r = simulate(one, model, /*record_timeline=*/true);
  EXPECT_DOUBLE_EQ(r.makespan, 11.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][1].start, 3.0);  // 1UNSHARD waits for the stream
  EXPECT_DOUBLE_EQ(r.timeline[0][1].end, 6.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][3].start, 6.0);  // 1F0
}

TEST(SimulatorCollectives, PerStageCollectiveCostsApply) {
  CostModel model;
  model.stage_costs = {KindCosts{}, KindCosts{}};
  model.stage_costs[1].unshard = 5.0;  // stage 0 gathers for free
  // gather 1 [0,5]; 0F0 [0,1]; 1F0 [5,6], 1B0 [6,8], 0B0 [8,10].
  EXPECT_DOUBLE_EQ(simulate(shardedTwoStagesOneRank(1), model).makespan, 10.0);
}

TEST(SimulatorCollectives, ReshardBlocksTheRank) {
  Schedule s = scheduleFromRows({0}, 1, {"0UNSHARD 0F0 0RESHARD 0UNSHARD 0B0 0RESHARD"});
  CostModel model;
  model.costs.reshard = 2.0;
  model.costs.unshard = 1.0;
  // gather [0,1], 0F0 [1,2], free [2,4], gather [4,5], 0B0 [5,7], free [7,9].
  EXPECT_DOUBLE_EQ(simulate(s, model).makespan, 9.0);
}

TEST(SimulatorCollectives, ReduceGradIsAsynchronousAndEndsTheStep) {
  // 0F0 1F0 1B0 1REDUCE_GRAD 0B0 0REDUCE_GRAD: 1B0 ends at 4; its reduction
  // runs [4,9] while 0B0 computes [4,6]; 0's reduction queues behind: [9,14].
  Schedule s = lower(scheduleFromRows({0, 0}, 1, {"0F0 1F0 1B0 0B0"}));
  CostModel model;
  model.costs.reduce_grad = 5.0;
  SimulationResult r = simulate(s, model, /*record_timeline=*/true);
  EXPECT_DOUBLE_EQ(r.makespan, 14.0);
  EXPECT_EQ(r.busy, (std::vector<double>{6.0}));
  ASSERT_EQ(testing::rowOf(s, 0), "0F0 1F0 1B0 1REDUCE_GRAD 0B0 0REDUCE_GRAD");
  EXPECT_DOUBLE_EQ(r.timeline[0][3].start, 4.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][3].end, 9.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][4].start, 4.0);  // 0B0 did not wait for it
  EXPECT_DOUBLE_EQ(r.timeline[0][5].start, 9.0);
  EXPECT_DOUBLE_EQ(r.timeline[0][5].end, 14.0);
}

TEST(SimulatorCollectives, CrossRankReduceStartsWhenEveryMemberPostedIt) {
  // Tied stages 0 and 1 on ranks 0 and 1: rank 1 posts at its REDUCE_GRAD
  // (after 1B0, t=4), rank 0 after 0B0 (t=6); the sum takes 3: both end at 9.
  Schedule s = lower(scheduleFromRows({0, 1}, 1, {"0F0 0B0", "1F0 1B0"}));
  CostModel model;
  model.cross_rank_reduces = {CrossRankReduce{{0, 1}, 3.0}};
  EXPECT_DOUBLE_EQ(simulate(s).makespan, 6.0);
  EXPECT_DOUBLE_EQ(simulate(s, model).makespan, 9.0);
  // Behind the stage's own reduction on the collective stream (2 on rank 0).
  model.costs.reduce_grad = 2.0;
  EXPECT_DOUBLE_EQ(simulate(s, model).makespan, 11.0);
  // A stage on no rank's REDUCE_GRAD list is an error naming it.
  model.cross_rank_reduces = {CrossRankReduce{{0, 7}, 1.0}};
  EXPECT_NE(whatOf([&] { simulate(s, model); }).find("names stage 7"), std::string::npos);
}

TEST(SimulatorCollectives, CrossRankReduceIsPostedAtTheLastLocalStage) {
  // Stages 0 and 1 both on rank 0 (and stage 2 on rank 1): rank 0 posts the
  // sum of stages {0, 2} at 0REDUCE_GRAD, its last of the group, not at 1's.
  Schedule s = lower(scheduleFromRows({0, 0, 1}, 1, {"0F0 1F0 1B0 0B0", "2F0 2B0"}));
  CostModel model;
  model.cross_rank_reduces = {CrossRankReduce{{0, 2}, 1.0}};
  const double plain = simulate(s).makespan;
  EXPECT_DOUBLE_EQ(simulate(s, model).makespan, plain + 1.0);
}

TEST(SimulatorCollectives, ShardedScheduleWithFreeCollectivesKeepsItsMakespan) {
  LowerOptions options;
  options.shard = true;
  for (const std::string name : {"1f1b", "zero_bubble"}) {
    const Schedule compute = makeSchedule(name, ScheduleSpec{4, 1, 8});
    EXPECT_DOUBLE_EQ(simulate(lower(compute, options)).makespan, simulate(lower(compute)).makespan) << name;
  }
}

}  // namespace
}  // namespace mpmd

namespace mpmd {
namespace {

// Channel order by brute force: per directed rank pair, the transfers in
// send order and in receive order, as (sender stage, receiver stage, kind, mb).
bool channelsMatchByOrder(const Schedule& s) {
  std::map<std::pair<int, int>, std::vector<std::tuple<int, int, bool, int>>> sent, received;
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.programs[r]) {
      const int peer = s.stage_to_rank[a.peer_stage < 0 ? 0 : a.peer_stage];
      const bool backward = a.kind == ActionKind::SendB || a.kind == ActionKind::RecvB;
      if (isSend(a.kind)) sent[{r, peer}].emplace_back(a.stage, a.peer_stage, backward, a.microbatch);
      if (isRecv(a.kind)) received[{peer, r}].emplace_back(a.peer_stage, a.stage, backward, a.microbatch);
    }
  }
  return sent == received;
}

// Mutations of valid lowered programs (adjacent swaps, drops, duplicates):
// whatever validateStatic accepts must match channels by order and simulate
// without a ScheduleError. Guards the single-pass fast path of validation.
TEST(Validate, MutatedLoweredProgramsAreAcceptedOnlyWhenSound) {
  std::mt19937 rng(1234);
  int accepted = 0, rejected = 0;
  for (const char* name : {"1f1b", "interleaved_1f1b", "zero_bubble", "zbv"}) {
    const int v = std::string(name) == "zbv" || std::string(name) == "interleaved_1f1b" ? 2 : 1;
    const Schedule base = lower(makeSchedule(name, {3, v, 4}));
    for (int trial = 0; trial < 400; ++trial) {
      Schedule s = base;
      auto& program = s.programs[rng() % s.num_ranks];
      const size_t i = rng() % program.size();
      switch (trial % 3) {
        case 0: if (i + 1 < program.size()) std::swap(program[i], program[i + 1]); break;
        case 1: program.erase(program.begin() + static_cast<long>(i)); break;
        default: program.insert(program.begin() + static_cast<long>(i), program[i]); break;
      }
      try {
        validateStatic(s);
      } catch (const ScheduleError&) {
        ++rejected;
        continue;
      }
      ++accepted;
      EXPECT_TRUE(channelsMatchByOrder(s)) << name << " trial " << trial << ":\n" << testing::rowOf(s, 0);
      try {
        simulate(s);
      } catch (const DeadlockError&) {
        // A reordering may deadlock; that is simulate's verdict to give.
      }
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace mpmd
