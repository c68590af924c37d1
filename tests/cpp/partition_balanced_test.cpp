// partitionBalanced: known optima on deliberately uneven costs, the
// parameter-byte cap, its errors, and an exhaustive check of optimality (and
// of the earliest-split tie-break) against every split of small sequences.
#include <gtest/gtest.h>

#include "test_util.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/graph_ir.h"
#include "core/partition.h"

namespace mpmd {
namespace {

// A chain of Compute nodes: x -> c0 -> c1 -> ... -> output, where node k has
// cost costs[k] and also reads the parameters listed in reads[k] (indices
// into param_bytes). Returns the graph; compute node k has id
// 1 + param_bytes.size() + k.
Graph chain(const std::vector<double>& costs, const std::vector<int64_t>& param_bytes = {},
            const std::vector<std::vector<int>>& reads = {}) {
  Graph g;
  auto add = [&](NodeKind kind, std::string name, std::vector<int32_t> in) {
    Node n;
    n.id = static_cast<int32_t>(g.nodes.size());
    n.kind = kind;
    n.name = std::move(name);
    n.inputs = std::move(in);
    g.nodes.push_back(n);
    return n.id;
  };
  int32_t prev = add(NodeKind::Input, "x", {});
  const int32_t first_param = static_cast<int32_t>(g.nodes.size());
  for (size_t p = 0; p < param_bytes.size(); ++p) {
    int32_t id = add(NodeKind::Parameter, "p" + std::to_string(p), {});
    g.nodes[id].fqn = "layers." + std::to_string(p) + ".weight";
    g.nodes[id].output_bytes = param_bytes[p];
  }
  for (size_t k = 0; k < costs.size(); ++k) {
    std::vector<int32_t> in{prev};
    if (k < reads.size())
      for (int p : reads[k]) in.push_back(first_param + p);
    prev = add(NodeKind::Compute, "c" + std::to_string(k), in);
    g.nodes[prev].cost = costs[k];
    g.nodes[prev].output_bytes = 4;
  }
  add(NodeKind::Output, "output", {prev});
  return g;
}

// Stage of each compute node, in order.
std::vector<int32_t> computeStages(const Graph& g, const PartitionPlan& plan) {
  std::vector<int32_t> out;
  for (const Node& n : g.nodes)
    if (n.kind == NodeKind::Compute) out.push_back(plan.node_stage[n.id]);
  return out;
}

double maxCost(const PartitionPlan& plan) {
  return *std::max_element(plan.stage_cost.begin(), plan.stage_cost.end());
}


TEST(PartitionBalanced, HeavyLayerGetsAStageOfItsOwnAtTheKnownOptimum) {
  Graph g = chain({1, 1, 1, 10, 1, 1, 1, 1, 1, 1});
  PartitionPlan plan = partitionBalanced(g, 3);
  EXPECT_EQ(plan.num_stages, 3);
  EXPECT_EQ(plan.stage_cost, (std::vector<double>{3, 10, 6}));
  EXPECT_EQ(computeStages(g, plan), (std::vector<int32_t>{0, 0, 0, 1, 2, 2, 2, 2, 2, 2}));
}

TEST(PartitionBalanced, UnevenTransformerLikeLayersReachTheOptimumFoundByHand) {
  // Embedding 2, eight blocks of 3 with one double-size block, head 4:
  // total 33, so 4 stages of integer cost cannot go below 9 (33/4 > 8), and
  // 9 is achievable: 2+3+3 | 3+6 | 3+3+3 | 3+4.
  Graph g = chain({2, 3, 3, 3, 6, 3, 3, 3, 3, 4});
  PartitionPlan plan = partitionBalanced(g, 4);
  EXPECT_EQ(maxCost(plan), 9.0);
  double total = 0;
  for (double c : plan.stage_cost) total += c;
  EXPECT_EQ(total, 33.0);
}

TEST(PartitionBalanced, TiesGoToTheEarliestSplits) {
  Graph g = chain({1, 1, 1, 1, 1});
  PartitionPlan plan = partitionBalanced(g, 2);
  EXPECT_EQ(computeStages(g, plan), (std::vector<int32_t>{0, 0, 1, 1, 1}));
  // More stages than the optimum needs: the extra stages are single nodes at
  // the front.
  Graph zeros = chain({0, 0, 0, 0, 5});
  PartitionPlan z = partitionBalanced(zeros, 3);
  EXPECT_EQ(computeStages(zeros, z), (std::vector<int32_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(maxCost(z), 5.0);
}

TEST(PartitionBalanced, OneStageTakesEverything) {
  Graph g = chain({1, 2, 3});
  PartitionPlan plan = partitionBalanced(g, 1);
  EXPECT_EQ(plan.stage_cost, std::vector<double>{6});
  EXPECT_TRUE(plan.cross_stage_values.empty());
}

TEST(PartitionBalanced, ParameterCapMovesTheSplitAwayFromTheCostOptimum) {
  // Unconstrained optimum splits 2|2 (cost 2), but nodes 0 and 1 together
  // read 400 bytes > 300.
  Graph g = chain({1, 1, 1, 1}, {200, 200, 10, 10}, {{0}, {1}, {2}, {3}});
  EXPECT_EQ(maxCost(partitionBalanced(g, 2)), 2.0);
  PartitionPlan capped = partitionBalanced(g, 2, 300);
  EXPECT_EQ(computeStages(g, capped), (std::vector<int32_t>{0, 1, 1, 1}));
  EXPECT_EQ(capped.stage_parameter_bytes, (std::vector<int64_t>{200, 220}));
  EXPECT_EQ(maxCost(capped), 3.0);
}

TEST(PartitionBalanced, SharedParameterCountsOncePerStageAndOnEveryStage) {
  // Every node reads the same 100-byte parameter: a cap of 100 holds on any
  // split, and each stage reports the 100 bytes.
  Graph g = chain({1, 1, 1, 1}, {100}, {{0}, {0}, {0}, {0}});
  PartitionPlan plan = partitionBalanced(g, 3, 100);
  EXPECT_EQ(plan.stage_parameter_bytes, (std::vector<int64_t>{100, 100, 100}));
  EXPECT_EQ(plan.parameters[0].stages, (std::vector<int32_t>{0, 1, 2}));
}

TEST(PartitionBalanced, ImpossibleCapIsAnErrorNamingTheCapAndTheNeed) {
  Graph g = chain({1, 1, 1}, {500, 60, 60}, {{}, {1}, {2}});
  g.nodes[4].inputs.push_back(1);  // c0 reads p0 (500 bytes)
  std::string msg = testing::errorOf([&] { partitionBalanced(g, 2, 100); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=100"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'c0' (id 4) alone reads 500"), std::string::npos) << msg;

  Graph h = chain({1, 1, 1}, {60, 60, 60}, {{0}, {1}, {2}});
  msg = testing::errorOf([&] { partitionBalanced(h, 2, 100); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=100 cannot be met with num_stages=2"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("at least 3 stages"), std::string::npos) << msg;
  EXPECT_NO_THROW(partitionBalanced(h, 3, 100));
}

TEST(PartitionBalanced, StageCountOutOfRangeIsAnErrorNamingBothNumbers) {
  Graph g = chain({1, 1, 1});
  std::string msg = testing::errorOf([&] { partitionBalanced(g, 4); });
  EXPECT_NE(msg.find("num_stages=4 exceeds the number of Compute nodes (3)"), std::string::npos)
      << msg;
  msg = testing::errorOf([&] { partitionBalanced(g, 0); });
  EXPECT_NE(msg.find("num_stages=0 must be at least 1"), std::string::npos) << msg;
  msg = testing::errorOf([&] { partitionBalanced(g, 2, -5); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=-5"), std::string::npos) << msg;
}

TEST(PartitionBalanced, NegativeOrNonFiniteCostIsAnErrorNamingTheNode) {
  Graph g = chain({1, -2, 1});
  std::string msg = testing::errorOf([&] { partitionBalanced(g, 2); });
  EXPECT_NE(msg.find("'c1' (id 2) has cost -2"), std::string::npos) << msg;
  g.nodes[2].cost = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(partitionBalanced(g, 2), std::invalid_argument);
}

// Every way of cutting n items into k non-empty contiguous runs, as the
// k-1 cut positions (a cut at p starts a stage at item p).
void forEachSplit(int n, int k, const std::function<void(const std::vector<int>&)>& f) {
  std::vector<int> cuts;
  std::function<void(int)> rec = [&](int from) {
    if (static_cast<int>(cuts.size()) == k - 1) {
      f(cuts);
      return;
    }
    for (int p = from; p <= n - (k - 1 - static_cast<int>(cuts.size())); ++p) {
      cuts.push_back(p);
      rec(p + 1);
      cuts.pop_back();
    }
  };
  rec(1);
}

TEST(PartitionBalanced, MatchesExhaustiveSearchOnRandomSmallSequences) {
  std::mt19937 rng(12345);
  int checked = 0, capped_cases = 0, infeasible_cases = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    const int k = 1 + static_cast<int>(rng() % std::min(4, n));
    const int num_params = static_cast<int>(rng() % 5);
    std::vector<double> costs(n);
    for (double& c : costs) c = static_cast<double>(rng() % 10);
    std::vector<int64_t> bytes(num_params);
    for (int64_t& b : bytes) b = 1 + static_cast<int64_t>(rng() % 100);
    std::vector<std::vector<int>> reads(n);
    for (auto& r : reads)
      for (int p = 0; p < num_params; ++p)
        if (rng() % 3 == 0) r.push_back(p);
    const int64_t cap = (num_params > 0 && rng() % 2) ? 1 + static_cast<int64_t>(rng() % 200) : 0;
    Graph g = chain(costs, bytes, reads);

    // Brute force: best max cost, and among optimal splits the one whose
    // cuts come earliest, comparing the last cut first.
    double best = -1;
    std::vector<int> best_cuts;
    forEachSplit(n, k, [&](const std::vector<int>& cuts) {
      double worst = 0;
      std::vector<int> bounds{0};
      bounds.insert(bounds.end(), cuts.begin(), cuts.end());
      bounds.push_back(n);
      for (int s = 0; s < k; ++s) {
        double sum = 0;
        std::vector<bool> used(num_params, false);
        int64_t b = 0;
        for (int i = bounds[s]; i < bounds[s + 1]; ++i) {
          sum += costs[i];
          for (int p : reads[i])
            if (!used[p]) used[p] = true, b += bytes[p];
        }
        if (cap != 0 && b > cap) return;
        worst = std::max(worst, sum);
      }
      const bool earlier = std::lexicographical_compare(cuts.rbegin(), cuts.rend(),
                                                        best_cuts.rbegin(), best_cuts.rend());
      if (best < 0 || worst < best || (worst == best && earlier)) {
        best = worst;
        best_cuts = cuts;
      }
    });

    SCOPED_TRACE(::testing::Message() << "trial " << trial << " n=" << n << " k=" << k
                                      << " cap=" << cap);
    if (best < 0) {
      EXPECT_THROW(partitionBalanced(g, k, cap), std::invalid_argument);
      ++infeasible_cases;
      continue;
    }
    PartitionPlan plan = partitionBalanced(g, k, cap);
    EXPECT_EQ(maxCost(plan), best);
    std::vector<int32_t> stages = computeStages(g, plan);
    std::vector<int> cuts;
    for (int i = 1; i < n; ++i)
      if (stages[i] != stages[i - 1]) cuts.push_back(i);
    EXPECT_EQ(cuts, best_cuts);
    if (cap != 0) {
      for (int64_t b : plan.stage_parameter_bytes) EXPECT_LE(b, cap);
    }
    capped_cases += cap != 0;
    ++checked;
  }
  // The random cases must actually exercise all three situations.
  EXPECT_GT(checked, 300);
  EXPECT_GT(capped_cases, 50);
  EXPECT_GT(infeasible_cases, 5);
}

}  // namespace
}  // namespace mpmd
