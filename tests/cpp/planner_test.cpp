// Planner: the min-max split, the search under a memory limit, its errors.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/planner.h"
#include "core/planner_steps.h"
#include "test_util.h"

namespace mpmd {
namespace {

// n transformer-like units: an embedding, n - 2 equal blocks, a heavy head.
CostSheet sheetOf(int blocks, int pp, int64_t batch) {
  CostSheet sheet;
  sheet.units.push_back({"embed", 0.1, 0.1, 0.0, 1e6, 4e6, 1e6});
  for (int i = 0; i < blocks; ++i) {
    sheet.units.push_back({"blocks." + std::to_string(i), 1.0, 1.0, 1.0, 8e6, 2e6, 1e6});
  }
  sheet.units.push_back({"head", 2.0, 2.0, 2.0, 16e6, 4e6, 0.0});
  sheet.global_batch = batch;
  sheet.input_bytes = 1e4;
  sheet.action_overhead = 0.01;
  sheet.link_latency = 0.005;
  sheet.link_bandwidth = 1e9;
  sheet.pp_size = pp;
  return sheet;
}

double maxOf(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// The message of the planner's refusal (an std::invalid_argument) by fn.
std::string refusalOf(const std::function<void()>& fn) {
  return testing::whatOf<std::invalid_argument>(fn);
}

TEST(Planner, MinMaxSplitFindsTheKnownOptimum) {
  // 1..9 into 3: [1..5]=15 [6 7]=13 [8 9]=17; no split has a max below 17.
  EXPECT_EQ(minMaxSplit({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3), (std::vector<int>{0, 5, 7}));
  // A heavy unit gets a stage of its own; ties go to the least sum of squares.
  EXPECT_EQ(minMaxSplit({1, 1, 1, 1, 10, 1, 1, 1, 1}, 3), (std::vector<int>{0, 4, 5}));
  EXPECT_EQ(minMaxSplit({2, 2, 2, 2}, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_NE(refusalOf([] { minMaxSplit({1, 2}, 3); }).find("cannot split 2 units into 3"), std::string::npos);
}

TEST(Planner, BestPlanIsTheFirstOfTheTopAndMatchesItsOwnEvaluation) {
  const CostSheet sheet = sheetOf(14, 4, 16);
  const PlanResult r = planPipeline(sheet);
  ASSERT_FALSE(r.top.empty());
  EXPECT_EQ(r.best.schedule, r.top.front().schedule);
  for (size_t i = 1; i < r.top.size(); ++i) EXPECT_LE(r.top[i - 1].step_seconds, r.top[i].step_seconds);
  EXPECT_GT(r.candidates, 0);
  EXPECT_GT(r.simulations, 0);
  SearchOptions unrefined;  // (the refinement's simulations come on top: NOTE [Split refinement])
  unrefined.refine_split = false;
  const PlanResult pruned = planPipeline(sheet, unrefined);
  EXPECT_LE(pruned.simulations, 2 * pruned.candidates);
  const Plan& b = r.best;
  EXPECT_EQ(b.stage_starts.size(), static_cast<size_t>(4 * b.stages_per_rank));
  EXPECT_EQ(b.peak_bytes.size(), 4u);
  const Plan again = evaluatePlan(sheet, b.schedule, b.stages_per_rank, b.num_microbatches, b.stage_starts,
                                  b.recompute);
  EXPECT_DOUBLE_EQ(again.step_seconds, b.step_seconds);
  EXPECT_EQ(again.peak_bytes, b.peak_bytes);
  // The winner is no slower than 1F1B on the same split at every m it tried.
  for (int m : {4, 8, 16}) {
    const Plan one = evaluatePlan(sheet, "1f1b", 1, m, minMaxSplit({0.2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 6}, 4));
    EXPECT_LE(b.step_seconds, one.step_seconds + 1e-12) << "m=" << m;
  }
}

TEST(Planner, RefinedSplitsAreNeverSlowerAndPredictWhatTheyClaim) {
  // Sheets of uneven units (a fixed pseudo-random mix), 2 and 4 ranks: each
  // finalist refined is at most its unrefined twin's step (same schedule, v
  // and m), its step is evaluatePlan's on its split, and some split moves.
  uint32_t seed = 7;
  auto draw = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return 0.2 + static_cast<double>((seed >> 8) % 1000) / 250.0;
  };
  int moved = 0;
  for (int trial = 0; trial < 12; ++trial) {
    CostSheet sheet = sheetOf(10, trial % 2 ? 4 : 2, 8);
    for (auto& u : sheet.units) {
      u.forward = draw();
      u.backward_input = u.forward * draw() / 2;
      u.backward_weight = u.forward;
    }
    SearchOptions off;
    off.refine_split = false;
    const PlanResult before = planPipeline(sheet, off), after = planPipeline(sheet);
    EXPECT_LE(after.best.step_seconds, before.best.step_seconds + 1e-12) << "trial " << trial;
    for (const Plan& q : after.top) {
      for (const Plan& o : before.top) {
        if (o.schedule == q.schedule && o.stages_per_rank == q.stages_per_rank &&
            o.num_microbatches == q.num_microbatches) {
          EXPECT_LE(q.step_seconds, o.step_seconds + 1e-12) << q.schedule << " m=" << q.num_microbatches;
          EXPECT_EQ(q.refined_split, q.stage_starts != o.stage_starts);
        }
      }
      const Plan again = evaluatePlan(sheet, q.schedule, q.stages_per_rank, q.num_microbatches, q.stage_starts,
                                      q.recompute);
      EXPECT_DOUBLE_EQ(again.step_seconds, q.step_seconds) << q.schedule;
      moved += q.refined_split ? 1 : 0;
    }
  }
  EXPECT_GT(moved, 0);
}

TEST(Planner, TheFirstStagesBackwardIsAllWeightGradient) {
  // The first stage's inputs carry no gradient: the runtime's I program for
  // it computes nothing and its W does the whole backward. How the sheet
  // splits its units' B into I and W must not change a plan's step.
  CostSheet sheet = sheetOf(6, 2, 8);
  for (auto& u : sheet.units) {
    u.backward_input = 1.5 * u.forward;
    u.backward_weight = 0.5 * u.forward;
  }
  CostSheet moved = sheet;
  for (int u = 0; u < 5; ++u) {  // stage 0's units (the heavier stage): I into W
    moved.units[u].backward_weight += moved.units[u].backward_input;
    moved.units[u].backward_input = 0.0;
  }
  for (const char* name : {"zero_bubble", "1f1b", "gpipe"}) {
    const Plan a = evaluatePlan(sheet, name, 1, 4, {0, 5});
    const Plan b = evaluatePlan(moved, name, 1, 4, {0, 5});
    EXPECT_DOUBLE_EQ(a.step_seconds, b.step_seconds) << name;
  }
  // Stage 1's split still matters where the schedule splits B.
  CostSheet later = sheet;
  for (int u = 5; u < 8; ++u) {
    later.units[u].backward_weight += later.units[u].backward_input;
    later.units[u].backward_input = 0.0;
  }
  EXPECT_NE(evaluatePlan(sheet, "zero_bubble", 1, 4, {0, 5}).step_seconds,
            evaluatePlan(later, "zero_bubble", 1, 4, {0, 5}).step_seconds);
}

TEST(Planner, TheStepOverheadAddsToEveryStepAndKeepsTheWinner) {
  CostSheet sheet = sheetOf(14, 4, 16);
  const PlanResult before = planPipeline(sheet);
  sheet.step_overhead = 0.25;
  const PlanResult after = planPipeline(sheet);
  EXPECT_EQ(after.best.schedule, before.best.schedule);
  EXPECT_EQ(after.best.stage_starts, before.best.stage_starts);
  EXPECT_NEAR(after.best.step_seconds, before.best.step_seconds + 0.25, 1e-12);
  sheet.step_overhead = -1;
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("step_overhead=-1"), std::string::npos);
}

TEST(Planner, FixedTimesDoNotScaleWithTheMicrobatch) {
  CostSheet sheet = sheetOf(2, 2, 8);
  const Plan linear = evaluatePlan(sheet, "1f1b", 1, 8, {0, 2});  // 1 sample, the reference
  const Plan linear_half = evaluatePlan(sheet, "1f1b", 1, 4, {0, 2});  // 2 samples
  EXPECT_NEAR(linear_half.stage_seconds[0], 2 * linear.stage_seconds[0], 1e-12);
  for (auto& u : sheet.units) {  // all fixed: a microbatch of any size costs the same
    u.forward_fixed = u.forward;
    u.backward_input_fixed = u.backward_input;
    u.backward_weight_fixed = u.backward_weight;
  }
  EXPECT_NEAR(evaluatePlan(sheet, "1f1b", 1, 4, {0, 2}).stage_seconds[0], linear.stage_seconds[0], 1e-12);
  sheet.units[1].forward_fixed = 2.0;  // above its forward, 1.0
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("units[1] ('blocks.0').forward_fixed=2 must be at most"),
            std::string::npos);
}

TEST(Planner, MemoryModelCountsStateActivationsAndBuffers) {
  // 2 ranks, 1F1B, one unit per stage, m = 2: rank 0 holds 2 forwards.
  CostSheet sheet;
  sheet.units = {{"a", 1, 1, 1, 100, 10, 7}, {"b", 1, 1, 1, 50, 20, 3}};
  sheet.global_batch = 2;
  sheet.pp_size = 2;
  const Plan plan = evaluatePlan(sheet, "1f1b", 1, 2, {0, 1});
  // rank 0: params 10 * (1 + 1 + 2) + 2 * 100 saved + 7 (gradient buffer).
  EXPECT_DOUBLE_EQ(plan.peak_bytes[0], 40 + 200 + 7);
  // rank 1: 20 * 4 + 1 * 50 + 7 (received activation).
  EXPECT_DOUBLE_EQ(plan.peak_bytes[1], 80 + 50 + 7);
  // Recompute on stage 0 keeps only its input (0 bytes) plus one rebuilt microbatch.
  const Plan rec = evaluatePlan(sheet, "1f1b", 1, 2, {0, 1}, {true, false});
  EXPECT_DOUBLE_EQ(rec.peak_bytes[0], 40 + 0 + 100 + 7);
  EXPECT_GT(rec.step_seconds, plan.step_seconds);  // one more forward per backward
}

TEST(Planner, InputsAUnitKeepsAreNewBytesOnlyInsideAStage) {
  // Three units, a keeping 30 bytes of its input, b 40 and c 60 of theirs.
  CostSheet sheet;
  sheet.units = {{"a", 1, 1, 1, 100, 10, 7}, {"b", 1, 1, 1, 50, 20, 3}, {"c", 1, 1, 1, 50, 20, 3}};
  sheet.units[0].saved_input_bytes = 30;
  sheet.units[1].saved_input_bytes = 40;
  sheet.units[2].saved_input_bytes = 60;
  sheet.global_batch = 1;
  sheet.pp_size = 2;
  // Stages [a] and [b, c]: b starts its stage (its input arrives: a transfer
  // buffer), c's input is b's output, made inside the stage: 60 more.
  const Plan joined = evaluatePlan(sheet, "1f1b", 1, 1, {0, 1});
  // Stages [a, b] and [c]: b's 40 on rank 0, c's input a received buffer.
  const Plan other = evaluatePlan(sheet, "1f1b", 1, 1, {0, 2});
  CostSheet none = sheet;
  for (UnitCost& u : none.units) u.saved_input_bytes = 0;
  EXPECT_DOUBLE_EQ(joined.peak_bytes[1] - evaluatePlan(none, "1f1b", 1, 1, {0, 1}).peak_bytes[1], 60);
  EXPECT_DOUBLE_EQ(joined.peak_bytes[0], evaluatePlan(none, "1f1b", 1, 1, {0, 1}).peak_bytes[0]);
  EXPECT_DOUBLE_EQ(other.peak_bytes[0] - evaluatePlan(none, "1f1b", 1, 1, {0, 2}).peak_bytes[0], 40);
  sheet.units[2].saved_input_bytes = -1;
  EXPECT_NE(refusalOf([&] { checkSheet(sheet); }).find("units[2] ('c').saved_input_bytes=-1"),
            std::string::npos);
}

// Two units, one per stage on 2 ranks, 1F1B at m = 2, with dp_size = 2:
// stage a 100 bytes of parameters, b 200 (g = 1, o = 2).
CostSheet dpSheet() {
  CostSheet sheet;
  sheet.units = {{"a", 1, 1, 1, 100, 100, 7}, {"b", 1, 1, 1, 50, 200, 3}};
  sheet.global_batch = 2;
  sheet.pp_size = 2;
  sheet.dp_size = 2;
  sheet.dp_latency = 0.25;
  sheet.dp_bandwidth = 100;
  return sheet;
}

TEST(Planner, ReplicatePricesTheAllReduceAndItsBuffer) {
  CostSheet one = dpSheet();
  one.dp_size = 1;
  const Plan base = evaluatePlan(one, "1f1b", 1, 2, {0, 1});
  const Plan rep = evaluatePlan(dpSheet(), "1f1b", 1, 2, {0, 1}, {}, "replicate");
  EXPECT_EQ(rep.data_parallel, "replicate");
  // Ring all-reduce after each rank's last backward: 2 (d-1) latency + 2 (d-1)/d bytes / bw.
  // Rank 0 ends last (its B1 follows rank 1's by one B = 2): 0.5 + 100/100 = 1.5 more;
  // rank 1's 0.5 + 200/100 = 2.5 starts 2 earlier.
  EXPECT_DOUBLE_EQ(rep.step_seconds, base.step_seconds + 1.5);
  // Rank 0: 100 * 4 + 7 + 2 forwards' 200 (its 100-byte reduce buffer comes after they are freed).
  EXPECT_DOUBLE_EQ(base.peak_bytes[0], 607);
  EXPECT_DOUBLE_EQ(rep.peak_bytes[0], 607);
  // Rank 1: 200 * 4 + 7 + 50 held, or at the step's end the 200-byte buffer of the all-reduce.
  EXPECT_DOUBLE_EQ(base.peak_bytes[1], 857);
  EXPECT_DOUBLE_EQ(rep.peak_bytes[1], 1007);
  // Unset dp rates are the link's.
  CostSheet link = dpSheet();
  link.dp_latency.reset();
  link.dp_bandwidth.reset();
  link.link_latency = 0.25;
  link.link_bandwidth = 100;
  CostSheet explicit_rates = link;
  explicit_rates.dp_latency = 0.25;
  explicit_rates.dp_bandwidth = 100;
  EXPECT_DOUBLE_EQ(evaluatePlan(link, "1f1b", 1, 2, {0, 1}).step_seconds,
                   evaluatePlan(explicit_rates, "1f1b", 1, 2, {0, 1}).step_seconds);
}

TEST(Planner, ShardPricesGathersReduceScattersAndTheGatheredBytes) {
  CostSheet one = dpSheet();
  one.dp_size = 1;
  const Plan base = evaluatePlan(one, "1f1b", 1, 2, {0, 1});
  const Plan shard = evaluatePlan(dpSheet(), "1f1b", 1, 2, {0, 1}, {}, "shard");
  EXPECT_EQ(shard.data_parallel, "shard");
  // Rank 0's first F waits for its all-gather, (d-1) latency + (d-1)/d bytes / bw =
  // 0.25 + 0.5: the pipeline starts 0.75 late; its reduce-scatter, 0.75, ends the step.
  EXPECT_DOUBLE_EQ(shard.step_seconds, base.step_seconds + 0.75 + 0.75);
  // Rank 0: shards 100/2 * 4 + 7; gather buffers 150 with the full 100 (250), then the
  // full parameters 100 + two forwards 200 + full gradients 100 = 400 at its first B.
  EXPECT_DOUBLE_EQ(shard.peak_bytes[0], 207 + 400);
  // Rank 1: 200/2 * 4 + 7; at its gather 300 + 200 = 500 (after it: 200 + 50 + 200 = 450).
  EXPECT_DOUBLE_EQ(shard.peak_bytes[1], 407 + 500);
  EXPECT_NE(refusalOf([] { evaluatePlan(dpSheet(), "1f1b", 1, 2, {0, 1}, {}, "zero3"); })
                .find("data_parallel='zero3' is not a mode"),
            std::string::npos);
}

TEST(Planner, TheMemoryLimitFlipsTheDataParallelMode) {
  CostSheet sheet = dpSheet();
  sheet.action_overhead = 0.01;  // shard runs two more actions per stage (UNSHARD, RESHARD)
  SearchOptions options;
  options.schedules = {"1f1b"};
  options.microbatch_counts = {2};
  const PlanResult free = planPipeline(sheet, options);
  EXPECT_EQ(free.best.data_parallel, "replicate");
  bool both = false;
  for (const Plan& p : free.top) both |= p.data_parallel == "shard";
  EXPECT_TRUE(both) << "the top candidates hold both modes";
  EXPECT_GT(maxOf(free.best.peak_bytes), 950);
  sheet.memory_limit = 950;  // replicate's 1007 on rank 1 does not fit (recompute cannot help)
  const PlanResult tight = planPipeline(sheet, options);
  EXPECT_EQ(tight.best.data_parallel, "shard");
  EXPECT_LE(maxOf(tight.best.peak_bytes), 950);
  EXPECT_GT(tight.best.step_seconds, free.best.step_seconds);
  bool named = false;
  for (const Rejection& r : tight.rejected) {
    named |= r.data_parallel == "replicate" && r.reason.find("over memory_limit") != std::string::npos;
  }
  EXPECT_TRUE(named) << "the faster replicate plan is among the rejected";
  // Restricted to replicate, nothing fits: the error names the mode.
  options.data_parallel = {"replicate"};
  EXPECT_NE(refusalOf([&] { planPipeline(sheet, options); }).find("data_parallel=replicate"), std::string::npos);
  options.data_parallel = {"shard"};
  EXPECT_EQ(planPipeline(sheet, options).best.data_parallel, "shard");
}

TEST(Planner, DpSizeOneSearchesAsBefore) {
  CostSheet sheet = sheetOf(6, 2, 8);
  const PlanResult a = planPipeline(sheet);
  sheet.dp_latency = 1.0;  // unused without replicas
  sheet.dp_bandwidth = 1.0;
  SearchOptions options;
  options.data_parallel = {"replicate"};
  const PlanResult b = planPipeline(sheet, options);
  EXPECT_EQ(a.candidates, b.candidates);
  ASSERT_EQ(a.top.size(), b.top.size());
  for (size_t i = 0; i < a.top.size(); ++i) {
    EXPECT_EQ(a.top[i].data_parallel, "replicate");
    EXPECT_EQ(a.top[i].schedule, b.top[i].schedule);
    EXPECT_EQ(a.top[i].step_seconds, b.top[i].step_seconds);
    EXPECT_EQ(a.top[i].peak_bytes, b.top[i].peak_bytes);
  }
  // Shard over one replica shards nothing: the same plans, named shard.
  options.data_parallel = {"shard"};
  const PlanResult c = planPipeline(sheet, options);
  ASSERT_EQ(a.top.size(), c.top.size());
  EXPECT_EQ(c.best.data_parallel, "shard");
  EXPECT_EQ(c.best.step_seconds, a.best.step_seconds);
  EXPECT_EQ(c.best.peak_bytes, a.best.peak_bytes);
  options.data_parallel = {"zero3"};
  EXPECT_NE(refusalOf([&] { planPipeline(sheet, options); }).find("data_parallel='zero3' is not a mode"),
            std::string::npos);
  sheet.dp_size = 0;
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("dp_size=0 must be >= 1"), std::string::npos);
}

TEST(Planner, AnInfeasibleLimitNamesTheSmallestPeakTheLimitAndThePlan) {
  CostSheet sheet = sheetOf(6, 2, 8);
  sheet.memory_limit = 1000;
  const std::string what = refusalOf([&] { planPipeline(sheet); });
  EXPECT_NE(what.find("no plan fits memory_limit="), std::string::npos) << what;
  EXPECT_NE(what.find("(1000 bytes)"), std::string::npos) << what;
  EXPECT_NE(what.find("smallest predicted peak is"), std::string::npos) << what;
  EXPECT_NE(what.find(" v="), std::string::npos) << what;
  EXPECT_NE(what.find(" m="), std::string::npos) << what;
  // The named peak is the smallest: with that limit a plan fits.
  const size_t at = what.find("(", what.find("smallest predicted peak is"));
  const double peak = std::stod(what.substr(at + 1));
  sheet.memory_limit = peak;
  EXPECT_NO_THROW(planPipeline(sheet));
}

TEST(Planner, ALimitBelowTheWinnersPeakForcesRecomputeOrAnotherPlan) {
  CostSheet sheet = sheetOf(14, 4, 16);
  const PlanResult free = planPipeline(sheet);
  sheet.memory_limit = maxOf(free.best.peak_bytes) * 0.9;
  const PlanResult tight = planPipeline(sheet);
  const Plan& b = tight.best;
  EXPECT_LE(maxOf(b.peak_bytes), sheet.memory_limit);
  for (const Plan& p : tight.top) EXPECT_LE(maxOf(p.peak_bytes), sheet.memory_limit);
  const bool recomputes = std::find(b.recompute.begin(), b.recompute.end(), true) != b.recompute.end();
  const bool other = b.schedule != free.best.schedule || b.num_microbatches != free.best.num_microbatches ||
                     b.stages_per_rank != free.best.stages_per_rank || b.stage_starts != free.best.stage_starts;
  EXPECT_TRUE(recomputes || other);  // other: another plan, or the same on a lighter split
  EXPECT_GE(b.step_seconds, free.best.step_seconds);
  // The unconstrained winner is among the rejected, over the limit, with its time.
  bool named = false;
  for (const Rejection& r : tight.rejected) {
    named |= r.schedule == free.best.schedule && r.num_microbatches == free.best.num_microbatches &&
             r.reason.find("over memory_limit") != std::string::npos;
  }
  EXPECT_TRUE(named);
}

TEST(Planner, ASplitBalancedOnTimeThatDoesNotFitGivesWayToALighterOne) {
  // Four units of equal time; the first two hold every parameter. The
  // time-balanced split puts both on rank 0; a limit under that peak is met
  // by the lighter split [0 | 1 2 3] (NOTE [Lighter split]).
  CostSheet sheet;
  sheet.units = {{"a", 1.0, 1.0, 1.0, 1e3, 100e6, 1e3},
                 {"b", 1.0, 1.0, 1.0, 1e3, 100e6, 1e3},
                 {"c", 1.0, 1.0, 1.0, 1e3, 0.0, 1e3},
                 {"d", 1.0, 1.0, 1.0, 1e3, 0.0, 0.0}};
  sheet.global_batch = 4;
  sheet.pp_size = 2;
  SearchOptions options;
  options.schedules = {"1f1b"};
  options.stages_per_rank = {1};
  options.microbatch_counts = {2};
  options.refine_split = false;
  const PlanResult free = planPipeline(sheet, options);
  EXPECT_EQ(free.best.stage_starts, (std::vector<int>{0, 2}));
  sheet.memory_limit = maxOf(free.best.peak_bytes) * 0.75;
  const PlanResult tight = planPipeline(sheet, options);
  EXPECT_EQ(tight.best.stage_starts, (std::vector<int>{0, 1}));
  EXPECT_LE(maxOf(tight.best.peak_bytes), sheet.memory_limit);
  // A limit no split meets names the smallest peak, the lighter split's (far
  // under the time-balanced split's), and a limit of that peak is met.
  sheet.memory_limit = maxOf(tight.best.peak_bytes) * 0.9;
  const std::string what = refusalOf([&] { planPipeline(sheet, options); });
  EXPECT_NE(what.find("no plan fits memory_limit="), std::string::npos) << what;
  const size_t at = what.find("(", what.find("smallest predicted peak is"));
  const double named = std::stod(what.substr(at + 1));
  EXPECT_LT(named, maxOf(free.best.peak_bytes) * 0.75) << what;
  sheet.memory_limit = named;
  EXPECT_EQ(planPipeline(sheet, options).best.stage_starts, (std::vector<int>{0, 1}));
}

TEST(Planner, ConstraintsRestrictTheSearch) {
  const CostSheet sheet = sheetOf(14, 4, 16);
  SearchOptions options;
  options.schedules = {"1f1b"};
  options.microbatch_counts = {8};
  const PlanResult r = planPipeline(sheet, options);
  EXPECT_EQ(r.best.schedule, "1f1b");
  EXPECT_EQ(r.best.num_microbatches, 8);
  EXPECT_EQ(r.best.stages_per_rank, 1);
  options.microbatch_counts = {3};
  EXPECT_NE(refusalOf([&] { planPipeline(sheet, options); }).find("num_microbatches=3 must divide global_batch=16"),
            std::string::npos);
  options = {};
  options.schedules = {"zbv"};
  options.microbatch_counts = {2};  // zbv needs m >= p
  EXPECT_NE(refusalOf([&] { planPipeline(sheet, options); }).find("num_microbatches=2 must be >= num_ranks=4 for zbv"),
            std::string::npos);
}

// A simulator that fails for one schedule: DeadlockError naming it.
planner::SimulateFn failingFor(const std::string& schedule) {
  return [schedule](const Schedule& lowered, const CostModel& model) {
    if (lowered.name == schedule) throw DeadlockError("test: " + schedule + " never finishes");
    return planner::simulatedStep(lowered, model);
  };
}

TEST(Planner, ACandidateWhoseSimulationFailsIsRejectedWithItsReason) {
  const CostSheet sheet = sheetOf(14, 4, 16);
  SearchOptions options;
  options.schedules = {"1f1b", "zbv"};
  const PlanResult r = planner::searchPlans(sheet, options, failingFor("zbv"));
  for (const Plan& p : r.top) EXPECT_NE(p.schedule, "zbv");
  bool named = false;
  for (const Rejection& q : r.rejected) {
    if (q.schedule != "zbv") continue;
    named |= q.reason.find("simulation at m=") != std::string::npos &&
             q.reason.find("test: zbv never finishes") != std::string::npos;
  }
  EXPECT_TRUE(named);
  // Nothing fits the simulation at all: the error says so, with the reasons.
  options.schedules = {"zbv"};
  const std::string what = refusalOf([&] { planner::searchPlans(sheet, options, failingFor("zbv")); });
  EXPECT_NE(what.find("no plan that fits could be simulated"), std::string::npos) << what;
  EXPECT_NE(what.find("test: zbv never finishes"), std::string::npos) << what;
}

// Over the limit, the winner is simulated without its recompute to show what
// the limit cost; that simulation failing is a rejection too, saying both.
TEST(Planner, AnOverLimitSimulationThatFailsIsRejectedWithItsReason) {
  CostSheet sheet = sheetOf(14, 4, 16);
  const PlanResult free = planPipeline(sheet);
  sheet.memory_limit = maxOf(free.best.peak_bytes) * 0.9;
  const PlanResult r = planner::searchPlans(sheet, {}, failingFor(free.best.schedule));
  bool named = false;
  for (const Rejection& q : r.rejected) {
    named |= q.schedule == free.best.schedule && q.reason.find("over memory_limit") != std::string::npos &&
             q.reason.find("never finishes") != std::string::npos;
  }
  EXPECT_TRUE(named);
  EXPECT_NE(r.best.schedule, free.best.schedule);
}

TEST(Planner, TheSearchSkipsWhatTheScheduleTableCallsAnotherScheduleAtOneStage) {
  planner::SearchSpace space;
  space.default_stages = true;
  EXPECT_FALSE(planner::triesTriple(space, "interleaved_1f1b", 1));
  EXPECT_FALSE(planner::triesTriple(space, "looped_bfs", 1));
  EXPECT_TRUE(planner::triesTriple(space, "interleaved_1f1b", 2));
  EXPECT_TRUE(planner::triesTriple(space, "1f1b", 1));
  space.default_stages = false;  // the caller asked for v = 1
  EXPECT_TRUE(planner::triesTriple(space, "interleaved_1f1b", 1));
}

TEST(Planner, BadSheetsNameTheValue) {
  CostSheet sheet = sheetOf(2, 2, 4);
  sheet.units[1].forward = -1;
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("units[1] ('blocks.0').forward=-1"), std::string::npos);
  sheet = sheetOf(2, 5, 4);
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("pp_size=5 is more than the sheet's 4 units"),
            std::string::npos);
  sheet = sheetOf(2, 2, 0);
  EXPECT_NE(refusalOf([&] { planPipeline(sheet); }).find("global_batch=0"), std::string::npos);
}

TEST(Planner, TheSearchIsDeterministic) {
  CostSheet sheet = sheetOf(30, 4, 32);
  sheet.memory_limit = 1.2e9;
  const PlanResult a = planPipeline(sheet), b = planPipeline(sheet);
  ASSERT_EQ(a.top.size(), b.top.size());
  for (size_t i = 0; i < a.top.size(); ++i) {
    EXPECT_EQ(a.top[i].schedule, b.top[i].schedule);
    EXPECT_EQ(a.top[i].num_microbatches, b.top[i].num_microbatches);
    EXPECT_EQ(a.top[i].stage_starts, b.top[i].stage_starts);
    EXPECT_EQ(a.top[i].recompute, b.top[i].recompute);
    EXPECT_EQ(a.top[i].step_seconds, b.top[i].step_seconds);
    EXPECT_EQ(a.top[i].peak_bytes, b.top[i].peak_bytes);
  }
  EXPECT_EQ(a.candidates, b.candidates);
  EXPECT_EQ(a.simulations, b.simulations);
}

TEST(Planner, SearchTimeFor64UnitsOnEightRanksIsPrinted) {
  // Printed, never asserted: timing never decides a test.
  CostSheet sheet = sheetOf(62, 8, 64);
  sheet.ranks_per_node = 4;
  sheet.inter_node_bandwidth = 1e8;
  const auto t0 = std::chrono::steady_clock::now();
  const PlanResult r = planPipeline(sheet);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[planner] 64 units x p=8, batch 64: %.3f s, %lld candidates (%lld simulated), %.0f candidates/s; "
              "best %s v=%d m=%d step %.3f\n",
              s, static_cast<long long>(r.candidates), static_cast<long long>(r.simulations), r.candidates / s,
              r.best.schedule.c_str(), r.best.stages_per_rank, r.best.num_microbatches, r.best.step_seconds);
  EXPECT_EQ(r.best.stage_starts.size(), static_cast<size_t>(8 * r.best.stages_per_rank));
}

}  // namespace
}  // namespace mpmd
