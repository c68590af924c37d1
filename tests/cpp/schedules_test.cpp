// Schedule generators: every spec of a sweep is valid or refused as
// documented, the known closed forms hold, errors name their values.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/lowering.h"
#include "core/schedules/registry.h"
#include "core/schedules/table.h"
#include "core/simulator.h"
#include "core/validate.h"

namespace mpmd {
namespace {

// Every schedule of the table: a new row joins the sweeps below.
const std::vector<std::string> kNames = scheduleNames();

// The parameter constraints of the schedule's row (schedule_table_test.cpp
// checks the rows against the generators' messages).
bool refuses(const std::string& name, const ScheduleSpec& spec) {
  const ScheduleFacts& f = scheduleFacts(name);
  return !f.takesStagesPerRank(spec.stages_per_rank) || spec.num_microbatches < f.minMicrobatches(spec.num_ranks);
}

SimulationResult run(const std::string& name, const ScheduleSpec& spec) {
  return simulate(lower(makeSchedule(name, spec)));
}

double mean(const std::vector<double>& values) {
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

std::string specText(const ScheduleSpec& s) {
  return "p=" + std::to_string(s.num_ranks) + " v=" + std::to_string(s.stages_per_rank) +
         " m=" + std::to_string(s.num_microbatches);
}

TEST(ScheduleRegistry, UnknownNameListsKnownSchedules) {
  try {
    makeSchedule("pipedream", {2, 1, 4});
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'pipedream'"), std::string::npos) << what;
    for (const auto& name : kNames) EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

class ScheduleSweep : public ::testing::TestWithParam<std::string> {};

// p in 1..8, v in 1..4, m in 1..32: refused exactly where documented, and
// otherwise valid (validate lowers and simulates: no deadlock), complete under
// simulation, compute-only, with the stated activation bound respected.
TEST_P(ScheduleSweep, EveryScheduleIsValidOrRefusedAsDocumented) {
  const std::string& name = GetParam();
  const bool splits = scheduleFacts(name).splits_backward;
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = 1; m <= 32; ++m) {
        const ScheduleSpec spec{p, v, m};
        SCOPED_TRACE(name + " " + specText(spec));
        if (refuses(name, spec)) {
          ASSERT_THROW(makeSchedule(name, spec), ScheduleError);
          continue;
        }
        const Schedule s = makeSchedule(name, spec);
        ASSERT_EQ(s.name, name);
        ASSERT_EQ(s.num_stages, p * v);
        ASSERT_FALSE(s.isLowered());
        ASSERT_EQ(s.splitsBackward(), splits);
        ASSERT_NO_THROW(validate(s));
        const SimulationResult result = simulate(lower(s));
        ASSERT_GT(result.makespan, 0.0);
        // The bound is what the design promises; except for ZB-V (whose cap
        // is only reached once m >= 2p) every program reaches it exactly.
        const std::vector<int> peaks = peakActivations(s);
        ASSERT_EQ(s.activation_bound.size(), static_cast<size_t>(p));
        for (int r = 0; r < p; ++r) {
          if (name == "zbv" && m < 2 * p) {
            ASSERT_LE(peaks[r], s.activation_bound[r]) << "rank " << r;
          } else {
            ASSERT_EQ(peaks[r], s.activation_bound[r]) << "rank " << r;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, ScheduleSweep, ::testing::ValuesIn(kNames),
                         [](const auto& info) { return std::string(info.param); });

TEST(ScheduleSpecs, GeneratorsArePureFunctionsOfTheSpec) {
  for (const auto& name : kNames) {
    const ScheduleSpec spec{4, 2, 9};
    if (refuses(name, spec)) continue;
    EXPECT_EQ(makeSchedule(name, spec).programs, makeSchedule(name, spec).programs) << name;
  }
  EXPECT_EQ(makeSchedule("zero_bubble", {5, 1, 13}).programs,
            makeSchedule("zero_bubble", {5, 1, 13}).programs);
}

TEST(ScheduleSpecs, InterleavedWithOneStagePerRankIs1F1B) {
  for (int p = 1; p <= 6; ++p) {
    for (int m = 1; m <= 12; ++m) {
      EXPECT_EQ(makeSchedule("interleaved_1f1b", {p, 1, m}).programs,
                makeSchedule("1f1b", {p, 1, m}).programs)
          << "p=" << p << " m=" << m;
    }
  }
}

TEST(ScheduleClosedForm, GPipeAnd1F1BMakespanIsThreeTimesMPlusPMinusOne) {
  for (const std::string name : {"gpipe", "1f1b"}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 32; ++m) {
        const SimulationResult r = run(name, {p, 1, m});
        ASSERT_DOUBLE_EQ(r.makespan, 3.0 * (m + p - 1)) << name << " p=" << p << " m=" << m;
        for (int rank = 0; rank < p; ++rank) {
          ASSERT_NEAR(r.bubble_fraction[rank], double(p - 1) / (m + p - 1), 1e-12)
              << name << " p=" << p << " m=" << m << " rank " << rank;
        }
      }
    }
  }
}

TEST(ScheduleClosedForm, GPipeHoldsEveryForwardUntilTheBackwardPhase) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m : {1, 5, 16}) {
        const SimulationResult r = run("gpipe", {p, v, m});
        EXPECT_EQ(r.peak_activations[0], v * m) << specText({p, v, m});
      }
    }
  }
}

TEST(ScheduleClosedForm, OneFOneBHoldsAtMostPMinusRankForwards) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      const SimulationResult r = run("1f1b", {p, 1, m});
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_LE(r.peak_activations[rank], p);
        EXPECT_EQ(r.peak_activations[rank], std::min(p - rank, m)) << "p=" << p << " m=" << m;
      }
    }
  }
}

// ZB-H1 reaches 3m + p - 1, the lower bound (the last rank starts at p - 1
// and computes 3m), against 1F1B's 3(m + p - 1), with no more activations.
TEST(ScheduleClosedForm, ZeroBubbleIsShorterThan1F1BAtTheSameMemory) {
  for (int p = 2; p <= 8; ++p) {
    for (int m = p; m <= 32; ++m) {
      const SimulationResult zb = run("zero_bubble", {p, 1, m});
      const SimulationResult base = run("1f1b", {p, 1, m});
      ASSERT_LT(zb.makespan, base.makespan) << "p=" << p << " m=" << m;
      ASSERT_DOUBLE_EQ(zb.makespan, 3.0 * m + p - 1) << "p=" << p << " m=" << m;
      for (int rank = 0; rank < p; ++rank) {
        ASSERT_LE(zb.peak_activations[rank], base.peak_activations[rank])
            << "p=" << p << " m=" << m << " rank " << rank;
      }
    }
  }
}

TEST(ScheduleClosedForm, InterleavedBubbleIsBelow1F1B) {
  for (int p = 2; p <= 8; ++p) {
    for (int v = 2; v <= 4; ++v) {
      for (int m = 2; m <= 32; ++m) {
        const double one_f_one_b = double(p - 1) / (m + p - 1);
        const SimulationResult r = run("interleaved_1f1b", {p, v, m});
        ASSERT_LT(mean(r.bubble_fraction), one_f_one_b) << specText({p, v, m});
      }
    }
  }
}

// Both V schedules finish in 6m + p - 1 at unit costs, the lower bound: the
// last rank starts at p - 1 and computes 2 stages x m x (F + I + W).
TEST(ScheduleClosedForm, VSchedulesReachTheLowerBoundMakespan) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = p; m <= 32; ++m) {
      const SimulationResult zbv = run("zbv", {p, 2, m});
      EXPECT_DOUBLE_EQ(zbv.makespan, 6.0 * m + p - 1) << "zbv p=" << p << " m=" << m;
      for (int peak : zbv.peak_activations) EXPECT_LE(peak, 2 * p);
      if (m < 2 * p) continue;
      const SimulationResult dual = run("dualpipev", {p, 2, m});
      EXPECT_DOUBLE_EQ(dual.makespan, 6.0 * m + p - 1) << "dualpipev p=" << p << " m=" << m;
      for (int peak : dual.peak_activations) EXPECT_EQ(peak, 2 * p + 1);
    }
  }
}

void expectErrorMentions(const std::string& name, const ScheduleSpec& spec,
                         const std::vector<std::string>& parts) {
  try {
    makeSchedule(name, spec);
    ADD_FAILURE() << name << " " << specText(spec) << ": expected ScheduleError";
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

TEST(ScheduleErrors, MessagesNameTheOffendingValues) {
  expectErrorMentions("zbv", {4, 2, 3}, {"num_microbatches=3 must be >= num_ranks=4 for zbv"});
  expectErrorMentions("zbv", {4, 3, 8}, {"stages_per_rank=3", "zbv", "exactly 2"});
  expectErrorMentions("1f1b", {4, 2, 8}, {"stages_per_rank=2", "1f1b", "interleaved_1f1b"});
  expectErrorMentions("zero_bubble", {4, 2, 8}, {"stages_per_rank=2", "zero_bubble"});
  expectErrorMentions("dualpipev", {4, 2, 7}, {"num_microbatches=7", "num_ranks=4", "dualpipev"});
  expectErrorMentions("dualpipev", {4, 1, 8}, {"stages_per_rank=1", "dualpipev"});
  expectErrorMentions("gpipe", {0, 1, 4}, {"num_ranks=0", "gpipe"});
  expectErrorMentions("looped_bfs", {2, 0, 4}, {"stages_per_rank=0"});
  expectErrorMentions("interleaved_1f1b", {2, 2, -1}, {"num_microbatches=-1"});
}

// Every generator at the benchmark's scale (p=64, m=1024) produces a
// complete program that passes the static invariants. Speed is measured by
// scripts/bench_schedules.sh, never by a test.
TEST(ScheduleScale, LargeSpecsAreCompleteAndValid) {
  struct Case {
    Schedule (*make)(const ScheduleSpec&);
    int v;
  };
  for (const Case c : {Case{makeGPipe, 4}, Case{make1F1B, 1}, Case{makeInterleaved1F1B, 4},
                       Case{makeLoopedBFS, 4}, Case{makeZeroBubbleH1, 1}, Case{makeZBV, 2},
                       Case{makeDualPipeV, 2}}) {
    const Schedule s = c.make({64, c.v, 1024});
    EXPECT_EQ(s.num_stages, 64 * c.v) << s.name;
    EXPECT_GE(s.numActions(), 2u * 64 * c.v * 1024) << s.name;
    EXPECT_NO_THROW(validateStatic(s)) << s.name;
  }
}

}  // namespace
}  // namespace mpmd
