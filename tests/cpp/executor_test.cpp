// Executor over the in-memory transport: every schedule, ranks as threads.
//
// The fake runner computes a toy "model" with integer values: stage s maps
// its inputs to a_s = (mb + 1) + (s + 1) * sum(inputs) and sends a_s to every
// consumer; backward sends g_s * (s + 1) to every producer, where g_s is the
// sum of the gradients from its consumers (1 on the last stage). The test
// compares every forward and gradient value with a sequential reference, so
// a value delivered to the wrong stage or microbatch, twice or never, fails.
#include <gtest/gtest.h>

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

  std::vector<Values> forward(int stage, int mb, std::vector<Values> inputs) override {
    if (before) before("F", stage, mb);
    int64_t sum = 0;
    for (const Values& from : inputs) {
      EXPECT_EQ(from.size(), 1u);
      sum += valueOf(from.at(0));
    }
    const int64_t a = (mb + 1) + (stage + 1) * sum;
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.activation.emplace(std::pair{stage, mb}, a).second) << "F twice";
    const size_t consumers = schedule_.consumersOf()[stage].size();
    return std::vector<Values>(consumers, Values{num(a)});
  }

  std::vector<Values> backward(int stage, int mb, std::vector<Values> grads, bool input_only) override {
    if (before) before("B", stage, mb);
    int64_t g = grads.empty() ? 1 : 0;
    for (const Values& from : grads) g += valueOf(from.at(0));
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.activation.count({stage, mb})) << "backward before forward";
    EXPECT_TRUE(tables_.gradient.emplace(std::pair{stage, mb}, g).second) << "B twice";
    tables_.input_only[{stage, mb}] = input_only ? 1 : 0;
    const size_t producers = schedule_.producersOf()[stage].size();
    return std::vector<Values>(producers, Values{num(g * (stage + 1))});
  }

  void backwardWeight(int stage, int mb) override {
    std::lock_guard lock(tables_.mu);
    EXPECT_TRUE(tables_.gradient.count({stage, mb})) << "W before I";
    ++tables_.weight_grads[{stage, mb}];
  }

  void reduceGrad(int) override {}

 private:
  const Schedule& schedule_;
  Tables& tables_;
};

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
      }
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

TEST(Executor, EverySchedulePassesEveryValueToItsConsumer) {
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
          const Schedule lowered = lower(compute);
          Tables tables;
          RunResult r = runAll(lowered, tables, {.lookahead = 1 + m % 3});
          for (int rank = 0; rank < p; ++rank) {
            ASSERT_EQ(r.errors[rank], "") << name << " p=" << p << " m=" << m;
          }
          SCOPED_TRACE(name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
          expectMatchesReference(lowered, tables);
          for (int rank = 0; rank < p && !lowered.activation_bound.empty(); ++rank) {
            EXPECT_LE(r.stats[rank].peak_live_forwards, lowered.activation_bound[rank]);
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 100);
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

}  // namespace
}  // namespace mpmd::runtime
