// Executor over the in-memory transport: every schedule, ranks as threads.
//
// The fake runner computes a toy "model" with integer values: stage s maps
// its inputs to a_s = (mb + 1) + (s + 1) * sum(inputs) and sends a_s to every
// consumer; backward sends g_s * (s + 1) to every producer, where g_s is the
// sum of the gradients from its consumers (1 on the last stage). The test
// compares every forward and gradient value with a sequential reference, so
// a value delivered to the wrong stage or microbatch, twice or never, fails.
//
// With `state_values` > 0 the runner also hands the executor a state per
// forward (NOTE [Runner state]): values naming (step, stage, microbatch),
// checked when B or I gets them back, and a one-value carry from I to W. State
// values count themselves, and the runner checks at every call that exactly
// the states a correct executor still holds are alive: a state freed late or
// never fails the test.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "core/lowering.h"
#include "core/schedules/registry.h"
#include "runtime/executor.h"
#include "runtime/memory_transport.h"
#include "test_util.h"

namespace mpmd::runtime {
namespace {

using namespace std::chrono_literals;

struct Int : Payload {
  explicit Int(int64_t v) : value(v) {}
  int64_t value;
};
Value num(int64_t v) { return std::make_shared<const Int>(v); }
int64_t valueOf(const Value& v) { return static_cast<const Int&>(*v).value; }

// A state value: counts the live ones of its runner.
struct Tracked : Int {
  Tracked(int64_t v, std::atomic<int>& live) : Int(v), live_(live) { ++live_; }
  ~Tracked() override { --live_; }
  std::atomic<int>& live_;
};

// Value k of the state of F(stage, mb) in `step`; k == kCarry: the carry of its I.
constexpr int kCarry = 7;
int64_t stateId(int step, int stage, int mb, int k) {
  return ((static_cast<int64_t>(step) * 100 + stage) * 1000 + mb) * 10 + k;
}

// Results of all ranks, keyed by (stage, microbatch).
struct Tables {
  std::mutex mu;
  std::map<std::pair<int, int>, int64_t> activation, gradient;
  std::map<std::pair<int, int>, int> weight_grads, input_only;
};

class FakeRunner : public StageRunner {
 public:
  FakeRunner(const Schedule& s, Tables& tables) : schedule_(s), tables_(tables) {}
  std::function<void(const char*, int, int)> before;  // fault injection hook
  int state_values = 0;     // values per forward state; 0: a runner without state
  bool states_kept = true;  // false: the program has no backward to keep them for
  int step = 0;             // names the states of this step
  bool stand_ins = false;   // an empty value (a drained peer's stand-in) counts as 0

  // State values alive now.
  int liveStates() const { return live_.load(); }
  // After a failed step: the executor dropped everything.
  void forgetStates() { expected_live_ = 0; }

  std::vector<Values> forward(int stage, int mb, std::vector<Values> inputs,
                              Values& state) override {
    EXPECT_TRUE(state.empty()) << "F" << stage << " mb " << mb << " got a state";
    expectLive("F", stage, mb);
    if (before) before("F", stage, mb);
    for (int k = 0; k < state_values; ++k) {
      state.push_back(std::make_shared<const Tracked>(stateId(step, stage, mb, k), live_));
    }
    if (states_kept) expected_live_ += state_values;
    int64_t sum = 0;
    for (const Values& from : inputs) {
      if (stand_ins && from.empty()) continue;
      EXPECT_EQ(from.size(), 1u);
      sum += valueOf(from.at(0));
    }
    const int64_t a = (mb + 1) + (stage + 1) * sum;
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.activation.emplace(std::pair{stage, mb}, a).second) << "F twice";
    const size_t consumers = schedule_.consumersOf()[stage].size();
    return std::vector<Values>(consumers, Values{num(a)});
  }

  std::vector<Values> backward(int stage, int mb, std::vector<Values> grads, bool input_only,
                               Values& state) override {
    expectLive(input_only ? "I" : "B", stage, mb);
    if (before) before("B", stage, mb);
    EXPECT_EQ(state.size(), static_cast<size_t>(state_values)) << stage << "B" << mb;
    for (size_t k = 0; k < state.size(); ++k) {
      EXPECT_EQ(valueOf(state[k]), stateId(step, stage, mb, static_cast<int>(k)))
          << "B/I of stage " << stage << " mb " << mb << " got another forward's state";
    }
    if (state_values > 0) {
      expected_live_ -= state_values;
      if (input_only) {  // replace the state by the carry W needs
        state.clear();
        state.push_back(std::make_shared<const Tracked>(stateId(step, stage, mb, kCarry), live_));
        ++expected_live_;
      } else if (mb % 2 == 1) {  // consume it; on even microbatches the executor drops it
        state.clear();
      }
    }
    int64_t g = grads.empty() ? 1 : 0;
    for (const Values& from : grads) g += stand_ins && from.empty() ? 0 : valueOf(from.at(0));
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.activation.count({stage, mb})) << "backward before forward";
    EXPECT_TRUE(tables_.gradient.emplace(std::pair{stage, mb}, g).second) << "B twice";
    tables_.input_only[{stage, mb}] = input_only ? 1 : 0;
    const size_t producers = schedule_.producersOf()[stage].size();
    return std::vector<Values>(producers, Values{num(g * (stage + 1))});
  }

  void backwardWeight(int stage, int mb, Values state) override {
    expectLive("W", stage, mb);
    if (before) before("W", stage, mb);
    if (state_values > 0) {
      EXPECT_EQ(state.size(), 1u) << stage << "W" << mb;
      if (!state.empty()) {
        EXPECT_EQ(valueOf(state[0]), stateId(step, stage, mb, kCarry))
            << "W of stage " << stage << " mb " << mb << " got another I's carry";
      }
      --expected_live_;  // the last use: freed when this call returns
    } else {
      EXPECT_TRUE(state.empty());
    }
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.gradient.count({stage, mb})) << "W before I";
    ++tables_.weight_grads[{stage, mb}];
  }

  void reduceGrad(int stage) override { expectLive("REDUCE_GRAD", stage, -1); }

 private:
  void expectLive(const char* kind, int stage, int mb) const {
    EXPECT_EQ(live_.load(), expected_live_) << "state values alive at " << stage << kind << mb;
  }

  const Schedule& schedule_;
  Tables& tables_;
  std::atomic<int> live_ = 0;
  int expected_live_ = 0;
};

// The most state values a correct executor holds at once on `rank`: a state
// per forward from F to its B or I, a one-value carry from I to W.
int expectedPeakStateValues(const Schedule& s, int rank, int state_values) {
  int held = 0, peak = 0;
  for (const Action& a : s.programs[rank]) {
    switch (a.kind) {
      case ActionKind::Forward: held += state_values; break;
      case ActionKind::FullBackward: held -= state_values; break;
      case ActionKind::BackwardInput: held += 1 - state_values; break;
      case ActionKind::BackwardWeight: held -= 1; break;
      default: break;
    }
    peak = std::max(peak, held);
  }
  return peak;
}

// Sequential reference of the toy model.
void expectMatchesReference(const Schedule& s, Tables& t) {
  const auto producers = s.producersOf();
  const auto consumers = s.consumersOf();
  for (int mb = 0; mb < s.num_microbatches; ++mb) {
    std::vector<int64_t> a(s.num_stages), g(s.num_stages);
    for (int st = 0; st < s.num_stages; ++st) {
      int64_t sum = 0;
      for (int p : producers[st]) sum += a[p];
      a[st] = (mb + 1) + (st + 1) * sum;
      EXPECT_EQ((t.activation[{st, mb}]), a[st]) << "stage " << st << " mb " << mb;
    }
    for (int st = s.num_stages - 1; st >= 0; --st) {
      g[st] = consumers[st].empty() ? 1 : 0;
      for (int c : consumers[st]) g[st] += g[c] * (c + 1);
      EXPECT_EQ((t.gradient[{st, mb}]), g[st]) << "stage " << st << " mb " << mb;
      EXPECT_EQ((t.weight_grads[{st, mb}]), (t.input_only[{st, mb}]));  // W after each I
    }
  }
}

struct RunResult {
  std::vector<std::string> errors;  // per rank, "" when it succeeded
  std::vector<int> error_peers;
  std::vector<std::string> error_actions;
  std::vector<bool> error_drained;
  std::vector<ExecutorStats> stats;
};

// Runs every rank of `lowered` on its own thread for `steps` steps.
RunResult runAll(const Schedule& lowered, Tables& tables, ExecutorOptions options = {},
                 const std::function<void(MemoryNetwork&)>& faults = {},
                 const std::function<void(FakeRunner&, int)>& hook = {},
                 std::vector<int> ranks = {}) {
  auto net = std::make_shared<MemoryNetwork>(lowered.num_ranks);
  if (faults) faults(*net);
  if (ranks.empty()) {
    for (int r = 0; r < lowered.num_ranks; ++r) ranks.push_back(r);
  }
  RunResult result;
  result.errors.resize(lowered.num_ranks);
  result.error_peers.assign(lowered.num_ranks, -2);
  result.error_actions.resize(lowered.num_ranks);
  result.error_drained.assign(lowered.num_ranks, false);
  result.stats.resize(lowered.num_ranks);
  std::vector<std::thread> threads;
  for (int r : ranks) {
    threads.emplace_back([&, r] {
      FakeRunner runner(lowered, tables);
      if (hook) hook(runner, r);
      MemoryTransport transport(net, r);
      Executor exec(lowered, r, runner, transport, options);
      try {
        exec.run();
        result.stats[r] = exec.stats();
      } catch (const ExecutorError& e) {
        result.errors[r] = e.what();
        result.error_peers[r] = e.peer();
        result.error_actions[r] = e.action();
        result.error_drained[r] = e.drained();
      }
      // Done or failed, the executor holds no state of the step any more.
      EXPECT_EQ(runner.liveStates(), 0) << "rank " << r;
    });
  }
  for (auto& t : threads) t.join();
  if (std::all_of(result.errors.begin(), result.errors.end(), [](auto& e) { return e.empty(); })) {
    EXPECT_EQ(net->inFlight(), 0u);
  }
  return result;
}

int stagesPerRankFor(const std::string& name, int variant) {
  if (name == "zbv" || name == "dualpipev") return 2;
  if (name == "interleaved_1f1b" || name == "looped_bfs") return 2 + variant;
  if (name == "gpipe") return 1 + variant;
  return 1;
}

// Calls f(lowered, m) for every schedule, with 1, 2 and 4 ranks, 1 to 8
// microbatches, with and without a skip edge; returns the number of cases.
int forEachSweptSchedule(const std::function<void(const Schedule&, int)>& f) {
  int cases = 0;
  for (const std::string& name : scheduleNames()) {
    for (int p : {1, 2, 4}) {
      for (int variant : {0, 1}) {
        for (int m : {1, 2, 3, 4, 8}) {
          Schedule compute;
          try {
            compute = makeSchedule(name, {p, stagesPerRankFor(name, variant), m});
          } catch (const ScheduleError&) {
            continue;  // parameters this schedule does not take
          }
          // Variant 1 adds a skip edge from the first to the last stage.
          if (variant == 1 && compute.num_stages > 2) {
            compute.edges.push_back({0, compute.num_stages - 1});
          }
          SCOPED_TRACE(name + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
                       " variant=" + std::to_string(variant));
          f(lower(compute), m);
          ++cases;
        }
      }
    }
  }
  return cases;
}

TEST(Executor, EverySchedulePassesEveryValueToItsConsumer) {
  const int cases = forEachSweptSchedule([](const Schedule& lowered, int m) {
    Tables tables;
    RunResult r = runAll(lowered, tables, {.lookahead = 1 + m % 3});
    for (int rank = 0; rank < lowered.num_ranks; ++rank) {
      ASSERT_EQ(r.errors[rank], "") << "rank " << rank;
    }
    expectMatchesReference(lowered, tables);
    for (int rank = 0; rank < lowered.num_ranks && !lowered.activation_bound.empty(); ++rank) {
      EXPECT_LE(r.stats[rank].peak_live_forwards, lowered.activation_bound[rank]);
      EXPECT_EQ(r.stats[rank].peak_state_values, 0);  // a runner without state costs none
    }
  });
  EXPECT_GT(cases, 100);
}

TEST(Executor, EveryScheduleHandsEachBackwardItsForwardsStateAndFreesIt) {
  // B and I get their own forward's state, W the carry of its I (checked by
  // the runner), each freed at its last use (checked at every call), and the
  // peak is exactly the program's.
  constexpr int kStateValues = 2;
  int zero_bubble_cases = 0;
  const int cases = forEachSweptSchedule([&](const Schedule& lowered, int m) {
    Tables tables;
    RunResult r = runAll(lowered, tables, {.lookahead = 1 + m % 3}, {},
                         [](FakeRunner& runner, int) { runner.state_values = kStateValues; });
    for (int rank = 0; rank < lowered.num_ranks; ++rank) {
      ASSERT_EQ(r.errors[rank], "") << "rank " << rank;
    }
    expectMatchesReference(lowered, tables);
    for (int rank = 0; rank < lowered.num_ranks; ++rank) {
      EXPECT_EQ(r.stats[rank].peak_state_values,
                expectedPeakStateValues(lowered, rank, kStateValues)) << "rank " << rank;
    }
    zero_bubble_cases += !tables.input_only.empty() &&
                         std::any_of(tables.input_only.begin(), tables.input_only.end(),
                                     [](const auto& kv) { return kv.second == 1; });
  });
  EXPECT_GT(cases, 100);
  EXPECT_GT(zero_bubble_cases, 10);  // schedules with I and W were among them
}

TEST(Executor, ForwardOnlyProgramDropsStatesAtOnce) {
  // Two stages on one rank, forwards only (an evaluation step): no B reads a
  // state, so none is held.
  const Schedule s = testing::scheduleFromRows({0, 0}, 2, {"0F0 1F0 0F1 1F1"});
  Tables tables;
  RunResult r = runAll(s, tables, {}, {}, [](FakeRunner& runner, int) {
    runner.state_values = 2;
    runner.states_kept = false;
  });
  ASSERT_EQ(r.errors[0], "");
  EXPECT_EQ(r.stats[0].peak_state_values, 0);
}

TEST(Executor, RunnerFailureLeavesNoStateForTheNextRun) {
  // One rank, two stages, I and W: the failure hits with forward states and
  // carries held; the executor must drop them and run the next step cleanly.
  const Schedule lowered = lower(makeSchedule("zbv", {1, 2, 4}));
  MemoryTransport transport(std::make_shared<MemoryNetwork>(1), 0);
  Tables tables;
  FakeRunner runner(lowered, tables);
  runner.state_values = 2;
  bool failed_with_state_held = false;
  runner.before = [&](const char* kind, int stage, int mb) {
    if (std::string(kind) == "W" && stage == 1 && mb == 2) {
      failed_with_state_held = runner.liveStates() > 1;  // more than this W's carry
      throw std::runtime_error("boom");
    }
  };
  Executor exec(lowered, 0, runner, transport);
  EXPECT_THROW(exec.run(), ExecutorError);
  EXPECT_TRUE(failed_with_state_held) << testing::rowOf(lowered, 0);
  EXPECT_EQ(runner.liveStates(), 0);

  runner.before = nullptr;
  runner.forgetStates();
  runner.step = 1;  // states of step 0 left over would name the wrong step
  tables.activation.clear();
  tables.gradient.clear();
  tables.weight_grads.clear();
  tables.input_only.clear();
  exec.run();
  expectMatchesReference(lowered, tables);
  EXPECT_EQ(runner.liveStates(), 0);
  EXPECT_EQ(exec.stats().peak_state_values, expectedPeakStateValues(lowered, 0, 2));
}

TEST(Executor, BackwardThatFindsNoForwardStateIsAnInternalError) {
  struct Case {
    const char* row;
    const char* message;
  };
  for (const Case& c : {
           Case{"0F0 0I0 0W0 0W0", "0W0 finds no carry of its I (stage 0 mb 0: no forward ran"},
           Case{"0F0 0I0 0B0", "0B0 finds no state of its forward (stage 0 mb 0: no forward"},
           Case{"0F0 0F0 0B0", "0F0 runs while the state of an earlier forward"},
       }) {
    const Schedule s = testing::scheduleFromRows({0}, 1, {c.row});
    Tables tables;
    RunResult r = runAll(s, tables, {}, {},
                         [](FakeRunner& runner, int) { runner.state_values = 1; });
    EXPECT_NE(r.errors[0].find(std::string("internal error: ") + c.message), std::string::npos)
        << c.row << ": " << r.errors[0];
  }
}

TEST(Executor, BackwardOnlyProgramGivesEachBackwardAnEmptyState) {
  // The compile door runs a schedule's forward part and backward part as two
  // programs: a B/I/W whose producer is not in the program gets no state.
  for (const char* row : {"0B0 0B1", "0I0 0W0", "0W0"}) {
    const Schedule s = testing::scheduleFromRows({0}, 2, {row});
    Tables tables;
    tables.activation = {{{0, 0}, 1}, {{0, 1}, 1}};  // the forward program ran before
    if (std::string(row) == "0W0") tables.gradient[{0, 0}] = 1;  // and the I
    RunResult r = runAll(s, tables, {}, {}, [](FakeRunner&, int) {});
    EXPECT_TRUE(r.errors[0].empty()) << row << ": " << r.errors[0];
  }
}

TEST(Executor, RunsManyStepsAndTraces) {
  const Schedule lowered = lower(makeSchedule("1f1b", {2, 1, 4}));
  auto net = std::make_shared<MemoryNetwork>(2);
  std::vector<std::thread> threads;
  std::vector<ExecutorStats> stats(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Tables tables;  // per rank: each step refills it
      MemoryTransport transport(net, r);
      for (int step = 0; step < 3; ++step) {
        tables.activation.clear();
        tables.gradient.clear();
        FakeRunner runner(lowered, tables);
        Executor exec(lowered, r, runner, transport, {.trace = true});
        exec.run();
        stats[r] = exec.stats();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(stats[r].trace.size(), lowered.programs[r].size());
    for (size_t i = 0; i < stats[r].trace.size(); ++i) {
      EXPECT_EQ(stats[r].trace[i].action_index, static_cast<int32_t>(i));
      EXPECT_LE(stats[r].trace[i].begin_ns, stats[r].trace[i].end_ns);
    }
  }
  EXPECT_EQ(net->inFlight(), 0u);
}

TEST(Executor, RunnerFailureNamesRankActionAndMarksProgram) {
  const Schedule lowered = lower(makeSchedule("1f1b", {4, 1, 4}));
  Tables tables;
  RunResult r = runAll(lowered, tables, {.timeout = 10s}, {}, [](FakeRunner& runner, int rank) {
    if (rank != 2) return;
    runner.before = [](const char* kind, int stage, int mb) {
      if (std::string(kind) == "F" && stage == 2 && mb == 1) throw std::runtime_error("boom");
    };
  });
  EXPECT_NE(r.errors[2].find("rank 2: action 2F1"), std::string::npos) << r.errors[2];
  EXPECT_NE(r.errors[2].find("boom"), std::string::npos);
  EXPECT_NE(r.errors[2].find("2F1  <-- FAILED HERE"), std::string::npos) << r.errors[2];
  EXPECT_EQ(r.error_actions[2], "2F1");
  EXPECT_EQ(r.error_peers[2], -1);
  // Every other rank stops too (the abort reaches the neighbours, whose own
  // failure reaches theirs), each naming the peer it was waiting on.
  for (int rank : {0, 1, 3}) {
    EXPECT_NE(r.errors[rank], "") << "rank " << rank << " did not fail";
    EXPECT_NE(r.errors[rank].find("<-- FAILED HERE"), std::string::npos);
    EXPECT_NE(r.errors[rank].find("peer rank"), std::string::npos) << r.errors[rank];
  }
  EXPECT_EQ(r.error_peers[1], 2);
  EXPECT_EQ(r.error_peers[3], 2);
}

TEST(Executor, DrainedRunnerFailureLetsEveryPeerEndItsStepAndTheNextStepRuns) {
  // NOTE [Draining a failed step]: rank 2's runner raises at 2F1; it finishes
  // its transfers with stand-ins, so ranks 0, 1 and 3 end the step (on
  // stand-in values) instead of waiting for their timeout, and the channels
  // stay in step: the next step on the same network and executors is exact.
  const Schedule lowered = lower(makeSchedule("1f1b", {4, 1, 4}));
  auto net = std::make_shared<MemoryNetwork>(4);
  std::vector<std::string> errors(4);
  std::vector<std::string> actions(4);
  std::vector<bool> drained(4, false);
  Tables first, second;
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      FakeRunner runner(lowered, first);
      runner.stand_ins = true;
      if (r == 2) {
        runner.before = [](const char* kind, int stage, int mb) {
          if (std::string(kind) == "F" && stage == 2 && mb == 1) throw std::runtime_error("boom");
        };
      }
      MemoryTransport transport(net, r);
      // A silent peer would make the others fail at this timeout, not end.
      Executor exec(lowered, r, runner, transport, {.timeout = 10s, .drain = true});
      try {
        exec.run();
      } catch (const ExecutorError& e) {
        errors[r] = e.what();
        actions[r] = e.action();
        drained[r] = e.drained();
      }
      FakeRunner next(lowered, second);
      Executor again(lowered, r, next, transport, {.timeout = 10s, .drain = true});
      again.run();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[2].find("rank 2: action 2F1 (#"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("boom"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("stand-in"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("2F1  <-- FAILED HERE"), std::string::npos) << errors[2];
  EXPECT_EQ(actions[2], "2F1");
  EXPECT_TRUE(drained[2]);
  for (int r : {0, 1, 3}) EXPECT_EQ(errors[r], "") << "rank " << r;
  expectMatchesReference(lowered, second);
  EXPECT_EQ(net->inFlight(), 0u);
}

TEST(Executor, WithoutDrainARunnerFailureIsNotMarkedDrained) {
  const Schedule lowered = lower(makeSchedule("gpipe", {1, 2, 2}));
  Tables tables;
  RunResult r = runAll(lowered, tables, {}, {}, [](FakeRunner& runner, int) {
    runner.before = [](const char* kind, int, int) {
      if (std::string(kind) == "B") throw std::runtime_error("boom");
    };
  });
  EXPECT_NE(r.errors[0].find("boom"), std::string::npos);
  EXPECT_FALSE(r.error_drained[0]);
  EXPECT_EQ(r.errors[0].find("stand-in"), std::string::npos);
}

TEST(Executor, PeaksArePerRunNotSinceConstruction) {
  // gpipe holds every forward; a run of a forward-only program on the same
  // executor is impossible, so compare two runs where the second fails early.
  const Schedule lowered = lower(makeSchedule("gpipe", {1, 1, 4}));
  MemoryTransport transport(std::make_shared<MemoryNetwork>(1), 0);
  Tables tables;
  FakeRunner runner(lowered, tables);
  Executor exec(lowered, 0, runner, transport);
  exec.run();
  EXPECT_EQ(exec.stats().peak_live_forwards, 4);
  EXPECT_EQ(exec.stats().steps, 1);
  tables.activation.clear();
  tables.gradient.clear();
  runner.before = [](const char* kind, int, int mb) {
    if (std::string(kind) == "F" && mb == 1) throw std::runtime_error("stop");
  };
  EXPECT_THROW(exec.run(), ExecutorError);
  EXPECT_EQ(exec.stats().peak_live_forwards, 1);  // only F0 ran in this run
  EXPECT_EQ(exec.stats().steps, 1);               // runs completed
}

TEST(Executor, InjectedSendFailureNamesThePeer) {
  const Schedule lowered = lower(makeSchedule("gpipe", {2, 1, 2}));
  Tables tables;
  RunResult r = runAll(lowered, tables, {.timeout = 10s},
                       [](MemoryNetwork& net) { net.failSend(0, 1); });
  EXPECT_EQ(r.error_peers[0], 1);
  EXPECT_EQ(r.error_actions[0], "0SEND_F1");
  EXPECT_NE(r.errors[0].find("injected failure of send #1"), std::string::npos) << r.errors[0];
  EXPECT_EQ(r.error_peers[1], 0);
  EXPECT_NE(r.errors[1].find("peer rank 0 failed"), std::string::npos) << r.errors[1];
}

TEST(Executor, SilentPeerTimesOutNamingIt) {
  const Schedule lowered = lower(makeSchedule("1f1b", {2, 1, 2}));
  Tables tables;
  // Rank 1 never runs: rank 0 sends its forwards, then waits for gradients.
  RunResult r = runAll(lowered, tables, {.timeout = 50ms}, {}, {}, {0});
  EXPECT_EQ(r.error_peers[0], 1);
  EXPECT_EQ(r.error_actions[0], "0RECV_B0");
  EXPECT_NE(r.errors[0].find("timed out after 50 ms"), std::string::npos) << r.errors[0];
}

TEST(Executor, SendsOutOfReceiveOrderAreCaught) {
  // Rank 0 sends mb 1 before mb 0; rank 1 receives in mb order.
  const Schedule s = testing::scheduleFromRows(
      {0, 1}, 2,
      {"0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1",
       "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"});
  Tables tables;
  RunResult r = runAll(s, tables, {.timeout = 10s});
  EXPECT_NE(r.errors[1].find("channel order broken"), std::string::npos) << r.errors[1];
  EXPECT_EQ(r.error_actions[1], "1RECV_F0");
}

TEST(Executor, ReadingAValueNothingProducedFails) {
  const Schedule s = testing::scheduleFromRows(
      {0, 1}, 1, {"0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"});
  Tables tables;
  RunResult r = runAll(s, tables, {.timeout = 10s});
  EXPECT_NE(r.errors[0].find("0SEND_F0 needs activations 0->1 mb 0, which no earlier action"),
            std::string::npos)
      << r.errors[0];
}

TEST(Executor, RejectsProgramsThatDoNotFitTheSchedule) {
  Schedule s = lower(makeSchedule("1f1b", {2, 1, 2}));
  Tables tables;
  FakeRunner runner(s, tables);
  MemoryTransport transport(std::make_shared<MemoryNetwork>(2), 0);
  EXPECT_THROW(Executor(s, 2, runner, transport), ScheduleError);
  EXPECT_THROW(Executor(s, 0, runner, transport, {.lookahead = 0}), ScheduleError);
  s.programs[0].push_back(computeAction(1, ActionKind::Forward, 0));  // stage 1 is rank 1's
  std::string msg = testing::errorOf([&] { Executor(s, 0, runner, transport); });
  EXPECT_NE(msg.find("action 1F0"), std::string::npos) << msg;
}

// --- UNSHARD/RESHARD (sharded data parallel) ---------------------------------

// Logs every runner call as the action text it serves ("0F1", "2UNSHARD").
class RecordingRunner : public FakeRunner {
 public:
  using FakeRunner::FakeRunner;
  std::vector<std::string> log;
  bool unshard_throws = false;

  std::vector<Values> forward(int stage, int mb, std::vector<Values> inputs, Values& state) override {
    log.push_back(fmt::format("{}F{}", stage, mb));
    return FakeRunner::forward(stage, mb, std::move(inputs), state);
  }
  std::vector<Values> backward(int stage, int mb, std::vector<Values> grads, bool input_only,
                               Values& state) override {
    log.push_back(fmt::format("{}{}{}", stage, input_only ? "I" : "B", mb));
    return FakeRunner::backward(stage, mb, std::move(grads), input_only, state);
  }
  void backwardWeight(int stage, int mb, Values state) override {
    log.push_back(fmt::format("{}W{}", stage, mb));
    FakeRunner::backwardWeight(stage, mb, std::move(state));
  }
  void reduceGrad(int stage) override { log.push_back(fmt::format("{}REDUCE_GRAD", stage)); }
  void unshard(int stage) override {
    log.push_back(fmt::format("{}UNSHARD", stage));
    if (unshard_throws) throw std::runtime_error("gather failed too");
  }
  void reshard(int stage) override { log.push_back(fmt::format("{}RESHARD", stage)); }
};

Schedule shardedGPipeOneRank() {
  LowerOptions options;
  options.shard = true;
  options.shard_options = {1, true};
  return lower(makeSchedule("gpipe", {1, 2, 2}), options);
}

TEST(ExecutorShard, RunnerSeesUnshardAndReshardInProgramOrder) {
  const Schedule lowered = shardedGPipeOneRank();
  // Stage 0 is idle from 0F1 to 0B0 while stage 1 runs 1F1 and 1B0: two
  // windows.
  ASSERT_EQ(testing::rowOf(lowered, 0),
            "0UNSHARD 1UNSHARD 0F0 1F0 0F1 0RESHARD 1F1 0UNSHARD 1B0 0B0 1B1 1RESHARD 1REDUCE_GRAD 0B1 "
            "0RESHARD 0REDUCE_GRAD");
  Tables tables;
  RecordingRunner runner(lowered, tables);
  auto net = std::make_shared<MemoryNetwork>(1);
  MemoryTransport transport(net, 0);
  Executor exec(lowered, 0, runner, transport, {.trace = true});
  exec.run();
  std::vector<std::string> program;
  for (const Action& a : lowered.programs[0]) program.push_back(toString(a));
  EXPECT_EQ(runner.log, program);
  EXPECT_EQ(exec.stats().trace.size(), program.size());  // traced like every action
  expectMatchesReference(lowered, tables);
}

TEST(ExecutorShard, DrainedStepStillGathersAndFreesSwallowingTheirErrors) {
  const Schedule lowered = shardedGPipeOneRank();
  Tables tables;
  RecordingRunner runner(lowered, tables);
  runner.before = [&](const char* kind, int stage, int mb) {
    if (std::string(kind) == "B" && stage == 1 && mb == 0) {
      runner.unshard_throws = true;
      throw std::runtime_error("boom");
    }
  };
  auto net = std::make_shared<MemoryNetwork>(1);
  MemoryTransport transport(net, 0);
  Executor exec(lowered, 0, runner, transport, {.drain = true});
  try {
    exec.run();
    FAIL() << "expected ExecutorError";
  } catch (const ExecutorError& e) {
    EXPECT_TRUE(e.drained());
    EXPECT_EQ(e.action(), "1B0");
    EXPECT_NE(std::string(e.what()).find("boom"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("gather failed"), std::string::npos) << e.what();
  }
  runner.forgetStates();
  // Compute stops at the failing 1B0; the collectives after it still run.
  EXPECT_EQ(runner.log, (std::vector<std::string>{"0UNSHARD", "1UNSHARD", "0F0", "1F0", "0F1", "0RESHARD", "1F1",
                                                  "0UNSHARD", "1B0", "1RESHARD", "1REDUCE_GRAD", "0RESHARD",
                                                  "0REDUCE_GRAD"}));
}

TEST(ExecutorShard, EveryShardedScheduleRunsExactly) {
  LowerOptions options;
  options.shard = true;
  for (const std::string name : {"1f1b", "interleaved_1f1b", "zero_bubble", "gpipe"}) {
    for (bool raf : {false, true}) {
      options.shard_options = {1, raf};
      const int v = name == "interleaved_1f1b" || name == "gpipe" ? 2 : 1;
      const Schedule lowered = lower(makeSchedule(name, {2, v, 4}), options);
      Tables tables;
      RunResult r = runAll(lowered, tables);
      for (const std::string& e : r.errors) EXPECT_EQ(e, "") << name;
      expectMatchesReference(lowered, tables);
    }
  }
}

}  // namespace
}  // namespace mpmd::runtime
