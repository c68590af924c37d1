// partitionBalanced: known optima on deliberately uneven costs (compute only,
// bytes_cost=0), the parameter-byte cap, its errors, the price of bytes
// crossing boundaries and the module-boundary tie-break, and exhaustive
// checks of optimality and of the tie-breaks against every split of small
// sequences.
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

using testing::errorOf;

// "c7": built by appending, since g++ 12 warns (-Wrestrict, a false
// positive) on `numbered("c", k)`.
std::string numbered(const char* prefix, size_t k) {
  std::string s = prefix;
  s += std::to_string(k);
  return s;
}

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
    int32_t id = add(NodeKind::Parameter, numbered("p", p), {});
    g.nodes[id].fqn = numbered("layers.", p) + ".weight";
    g.nodes[id].output_bytes = param_bytes[p];
  }
  for (size_t k = 0; k < costs.size(); ++k) {
    std::vector<int32_t> in{prev};
    if (k < reads.size())
      for (int p : reads[k]) in.push_back(first_param + p);
    prev = add(NodeKind::Compute, numbered("c", k), in);
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
  PartitionPlan plan = partitionBalanced(g, 3, 0, 0.0);
  EXPECT_EQ(plan.num_stages, 3);
  EXPECT_EQ(plan.stage_cost, (std::vector<double>{3, 10, 6}));
  EXPECT_EQ(computeStages(g, plan), (std::vector<int32_t>{0, 0, 0, 1, 2, 2, 2, 2, 2, 2}));
}

TEST(PartitionBalanced, UnevenTransformerLikeLayersReachTheOptimumFoundByHand) {
  // Embedding 2, eight blocks of 3 with one double-size block, head 4:
  // total 33, so 4 stages of integer cost cannot go below 9 (33/4 > 8), and
  // 9 is achievable: 2+3+3 | 3+6 | 3+3+3 | 3+4.
  Graph g = chain({2, 3, 3, 3, 6, 3, 3, 3, 3, 4});
  PartitionPlan plan = partitionBalanced(g, 4, 0, 0.0);
  EXPECT_EQ(maxCost(plan), 9.0);
  double total = 0;
  for (double c : plan.stage_cost) total += c;
  EXPECT_EQ(total, 33.0);
}

TEST(PartitionBalanced, TiesGoToTheEarliestSplits) {
  Graph g = chain({1, 1, 1, 1, 1});
  PartitionPlan plan = partitionBalanced(g, 2, 0, 0.0);
  EXPECT_EQ(computeStages(g, plan), (std::vector<int32_t>{0, 0, 1, 1, 1}));
  // More stages than the optimum needs: the extra stages are single nodes at
  // the front.
  Graph zeros = chain({0, 0, 0, 0, 5});
  PartitionPlan z = partitionBalanced(zeros, 3, 0, 0.0);
  EXPECT_EQ(computeStages(zeros, z), (std::vector<int32_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(maxCost(z), 5.0);
}

TEST(PartitionBalanced, OneStageTakesEverything) {
  Graph g = chain({1, 2, 3});
  PartitionPlan plan = partitionBalanced(g, 1, 0, 0.0);
  EXPECT_EQ(plan.stage_cost, std::vector<double>{6});
  EXPECT_TRUE(plan.cross_stage_values.empty());
}

TEST(PartitionBalanced, ParameterCapMovesTheSplitAwayFromTheCostOptimum) {
  // Unconstrained optimum splits 2|2 (cost 2), but nodes 0 and 1 together
  // read 400 bytes > 300.
  Graph g = chain({1, 1, 1, 1}, {200, 200, 10, 10}, {{0}, {1}, {2}, {3}});
  EXPECT_EQ(maxCost(partitionBalanced(g, 2, 0, 0.0)), 2.0);
  PartitionPlan capped = partitionBalanced(g, 2, 300, 0.0);
  EXPECT_EQ(computeStages(g, capped), (std::vector<int32_t>{0, 1, 1, 1}));
  EXPECT_EQ(capped.stage_parameter_bytes, (std::vector<int64_t>{200, 220}));
  EXPECT_EQ(maxCost(capped), 3.0);
}

TEST(PartitionBalanced, SharedParameterCountsOncePerStageAndOnEveryStage) {
  // Every node reads the same 100-byte parameter: a cap of 100 holds on any
  // split, and each stage reports the 100 bytes.
  Graph g = chain({1, 1, 1, 1}, {100}, {{0}, {0}, {0}, {0}});
  PartitionPlan plan = partitionBalanced(g, 3, 100, 0.0);
  EXPECT_EQ(plan.stage_parameter_bytes, (std::vector<int64_t>{100, 100, 100}));
  EXPECT_EQ(plan.parameters[0].stages, (std::vector<int32_t>{0, 1, 2}));
}

TEST(PartitionBalanced, ImpossibleCapIsAnErrorNamingTheCapAndTheNeed) {
  Graph g = chain({1, 1, 1}, {500, 60, 60}, {{}, {1}, {2}});
  g.nodes[4].inputs.push_back(1);  // c0 reads p0 (500 bytes)
  std::string msg = errorOf([&] { partitionBalanced(g, 2, 100, 0.0); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=100"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'c0' (id 4) alone reads 500"), std::string::npos) << msg;

  Graph h = chain({1, 1, 1}, {60, 60, 60}, {{0}, {1}, {2}});
  msg = errorOf([&] { partitionBalanced(h, 2, 100, 0.0); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=100 cannot be met with num_stages=2"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("at least 3 stages"), std::string::npos) << msg;
  EXPECT_NO_THROW(partitionBalanced(h, 3, 100, 0.0));
}

TEST(PartitionBalanced, StageCountOutOfRangeIsAnErrorNamingBothNumbers) {
  Graph g = chain({1, 1, 1});
  std::string msg = errorOf([&] { partitionBalanced(g, 4, 0, 0.0); });
  EXPECT_NE(msg.find("num_stages=4 exceeds the number of Compute nodes (3)"), std::string::npos)
      << msg;
  msg = errorOf([&] { partitionBalanced(g, 0, 0, 0.0); });
  EXPECT_NE(msg.find("num_stages=0 must be at least 1"), std::string::npos) << msg;
  msg = errorOf([&] { partitionBalanced(g, 2, -5, 0.0); });
  EXPECT_NE(msg.find("max_stage_parameter_bytes=-5"), std::string::npos) << msg;
}

TEST(PartitionBalanced, NegativeOrNonFiniteCostIsAnErrorNamingTheNode) {
  Graph g = chain({1, -2, 1});
  std::string msg = errorOf([&] { partitionBalanced(g, 2, 0, 0.0); });
  EXPECT_NE(msg.find("'c1' (id 2) has cost -2"), std::string::npos) << msg;
  g.nodes[2].cost = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(partitionBalanced(g, 2, 0, 0.0), std::invalid_argument);
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

TEST(PartitionBalanced, MatchesExhaustiveSearchOnRandomSmallSequencesUnderACap) {
  // Chains (every inner cut crosses one 4-byte value), priced or not.
  std::mt19937 rng(12345);
  const std::vector<double> prices = {0.0, 0.0, 0.25, 1.0};
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
    const double w = prices[rng() % prices.size()];
    Graph g = chain(costs, bytes, reads);
    auto traffic = [&](int lo, int hi) { return w * (4.0 * (lo > 0) + 4.0 * (hi < n)); };

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
        worst = std::max(worst, sum + traffic(bounds[s], bounds[s + 1]));
      }
      const bool earlier = std::lexicographical_compare(cuts.rbegin(), cuts.rend(),
                                                        best_cuts.rbegin(), best_cuts.rend());
      if (best < 0 || worst < best || (worst == best && earlier)) {
        best = worst;
        best_cuts = cuts;
      }
    });

    SCOPED_TRACE(::testing::Message() << "trial " << trial << " n=" << n << " k=" << k
                                      << " cap=" << cap << " w=" << w);
    if (best < 0) {
      EXPECT_THROW(partitionBalanced(g, k, cap, w), std::invalid_argument);
      ++infeasible_cases;
      continue;
    }
    PartitionPlan plan = partitionBalanced(g, k, cap, w);
    std::vector<int32_t> stages = computeStages(g, plan);
    std::vector<int> cuts;
    for (int i = 1; i < n; ++i)
      if (stages[i] != stages[i - 1]) cuts.push_back(i);
    EXPECT_EQ(cuts, best_cuts);
    std::vector<int> bounds{0};
    bounds.insert(bounds.end(), cuts.begin(), cuts.end());
    bounds.push_back(n);
    double worst = 0;
    for (int s = 0; s + 1 < static_cast<int>(bounds.size()); ++s)
      worst = std::max(worst, plan.stage_cost[s] + traffic(bounds[s], bounds[s + 1]));
    EXPECT_EQ(worst, best);
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


// A sequence of Compute items with explicit reads: item k reads the items in
// reads[k] (earlier ones; none means it reads only the input x), has cost
// costs[k], output bytes bytes[k] and module path modules[k] ("" if absent);
// the Output reads `outputs` (the last item when empty). Item k has id 1 + k.
struct Items {
  std::vector<double> costs;
  std::vector<int64_t> bytes;
  std::vector<std::vector<int>> reads;
  std::vector<std::string> modules;
  std::vector<int> outputs;

  Graph graph() const {
    Graph g;
    auto add = [&](NodeKind kind, std::string name, std::vector<int32_t> in) -> Node& {
      Node n;
      n.id = static_cast<int32_t>(g.nodes.size());
      n.kind = kind;
      n.name = std::move(name);
      n.inputs = std::move(in);
      g.nodes.push_back(n);
      return g.nodes.back();
    };
    add(NodeKind::Input, "x", {});
    for (size_t k = 0; k < costs.size(); ++k) {
      std::vector<int32_t> in;
      for (int r : reads[k]) in.push_back(1 + r);
      if (in.empty()) in.push_back(0);
      Node& n = add(NodeKind::Compute, numbered("c", k), in);
      n.cost = costs[k];
      n.output_bytes = bytes[k];
      if (k < modules.size()) n.module_fqn = modules[k];
    }
    std::vector<int32_t> out;
    for (int o : outputs) out.push_back(1 + o);
    if (out.empty()) out.push_back(static_cast<int32_t>(costs.size()));
    add(NodeKind::Output, "output", out);
    return g;
  }

  // Bytes crossing cut c (0 < c < m), and how many values cross it.
  std::pair<int64_t, int> crossing(int c) const {
    const int m = static_cast<int>(costs.size());
    int64_t b = 0;
    int count = 0;
    for (int p = 0; p < c; ++p) {
      bool later = false;
      for (int k = c; k < m; ++k)
        for (int r : reads[k]) later = later || r == p;
      const bool by_output = outputs.empty() ? p == m - 1
                                             : std::find(outputs.begin(), outputs.end(), p) !=
                                                   outputs.end();
      if (later || by_output) b += bytes[p], ++count;
    }
    return {b, count};
  }
};

// Items 0..n-1 chained (each reads the previous), `bytes` each.
Items chainItems(const std::vector<double>& costs, int64_t bytes = 4) {
  Items it;
  it.costs = costs;
  it.bytes.assign(costs.size(), bytes);
  it.reads.resize(costs.size());
  for (size_t k = 1; k < costs.size(); ++k) it.reads[k] = {static_cast<int>(k) - 1};
  return it;
}

std::vector<int> cutsOf(const Graph& g, const PartitionPlan& plan) {
  std::vector<int32_t> stages = computeStages(g, plan);
  std::vector<int> cuts;
  for (size_t i = 1; i < stages.size(); ++i)
    if (stages[i] != stages[i - 1]) cuts.push_back(static_cast<int>(i));
  return cuts;
}

int64_t crossBytes(const PartitionPlan& plan) {
  int64_t b = 0;
  for (const auto& v : plan.cross_stage_values) b += v.bytes;
  return b;
}

// A decoder-like layer: in_proj (item 0) feeds q, k, v (items 1-3, module
// layers.0.attn), which attention (item 4, layers.0) reads; items 5-7 are
// layer 1. Cuts 3 and 4, inside the layer, cross three 1000-byte values
// (items 0-2, then q, k, v); cut 5, the layer boundary, only item 4's.
TEST(PartitionBalanced, BytesCostPicksTheCutThatMovesFewerBytesOverASlightlyBetterBalance) {
  Items it;
  it.costs = {1, 3, 3, 3, 1, 2, 2, 3};  // total 18
  it.bytes.assign(8, 1000);
  it.reads = {{}, {0}, {0}, {0}, {1, 2, 3}, {4}, {5}, {6}};
  it.modules = {"layers.0", "layers.0.attn", "layers.0.attn", "layers.0.attn", "layers.0",
                "layers.1", "layers.1", "layers.1"};
  const Graph g = it.graph();
  // Compute only: cut 4 gives 10 | 8 (q, k, v cross: 3000 bytes); the layer
  // boundary, cut 5, 11 | 7.
  PartitionPlan compute_only = partitionBalanced(g, 2, 0, 0.0);
  EXPECT_EQ(cutsOf(g, compute_only), std::vector<int>{4});
  EXPECT_EQ(compute_only.stage_cost, (std::vector<double>{10, 8}));
  EXPECT_EQ(crossBytes(compute_only), 3000);
  // Priced: cut 4 costs 10 + 3000 w, cut 5 11 + 1000 w; they meet at
  // w = 1/2000. At w = 0.01: 40 against 21.
  PartitionPlan priced = partitionBalanced(g, 2, 0, 0.01);
  EXPECT_EQ(cutsOf(g, priced), std::vector<int>{5});
  EXPECT_EQ(priced.stage_cost, (std::vector<double>{11, 7}));
  EXPECT_EQ(crossBytes(priced), 1000);
  // Below the break-even price the better balance still wins: 10.3 < 11.1.
  EXPECT_EQ(cutsOf(g, partitionBalanced(g, 2, 0, 0.0001)), std::vector<int>{4});
}

TEST(PartitionBalanced, TrafficOutweighsASmallImbalanceButNotALargeOne) {
  // Chain of 6 items where item 2 fans out: items 3 and 5 both read it, so
  // cuts 3, 4 and 5 carry item 2's 900 bytes on top of the chain's 100.
  Items it = chainItems({2, 2, 2, 2, 2, 2}, 100);
  it.bytes[2] = 900;
  it.reads[5] = {4, 2};
  const Graph g = it.graph();
  // Compute only: 6 | 6 at cut 3 (crossing: item 2, 900 bytes).
  PartitionPlan flat = partitionBalanced(g, 2, 0, 0.0);
  EXPECT_EQ(cutsOf(g, flat), std::vector<int>{3});
  EXPECT_EQ(crossBytes(flat), 900);
  // w = 0.01: cut 3 costs 6 + 9 = 15; cut 2 costs 8 + 1 = 9 (item 1, 100 bytes).
  PartitionPlan priced = partitionBalanced(g, 2, 0, 0.01);
  EXPECT_EQ(cutsOf(g, priced), std::vector<int>{2});
  EXPECT_EQ(crossBytes(priced), 100);
  // w = 0.001: cut 3 costs 6.9, cut 2 8.1: balance wins again.
  EXPECT_EQ(cutsOf(g, partitionBalanced(g, 2, 0, 0.001)), std::vector<int>{3});
}

TEST(PartitionBalanced, AtEqualCostTheCutGoesToTheShallowerModuleBoundary) {
  // Costs 1, 0, 0, 1, 0, 1 in a chain: every cut gives a largest stage of 2
  // and crosses 8 bytes. Cut 1 is inside layers.0.mlp (depth 3), cut 2
  // between layers.0.mlp and layers.0 (the residual add, depth 2), cut 3
  // between layers.0 and layers.1.norm (depth 1): the shallowest boundary,
  // chosen although later; cuts 4 and 5 are inside layers.1 (depth 2).
  Items it = chainItems({1, 0, 0, 1, 0, 1}, 8);
  it.modules = {"layers.0.mlp", "layers.0.mlp", "layers.0", "layers.1.norm", "layers.1",
                "layers.1"};
  const Graph g = it.graph();
  PartitionPlan plan = partitionBalanced(g, 2, 0, 0.0);
  EXPECT_EQ(cutsOf(g, plan), std::vector<int>{3});
  // Same with a bytes cost (every cut crosses 8 bytes) and with traffic.
  EXPECT_EQ(cutsOf(g, partitionBalanced(g, 2, 0, 0.5)), std::vector<int>{3});
  // Without module paths the earliest of the equal cuts wins.
  Items plain = chainItems({1, 0, 0, 1, 0, 1}, 8);
  const Graph h = plain.graph();
  EXPECT_EQ(cutsOf(h, partitionBalanced(h, 2, 0, 0.0)), std::vector<int>{1});
  // The tie-break never trades cost: with costs 2, 0, 0, 1, 0, 1 cuts 1-3
  // give 2 | 2 and cuts 4-5 3 | 1; cut 5 is the only boundary between
  // top-level modules (depth 0) but costs more, so the earliest of cuts 1-3
  // (all depth 1) is taken.
  Items costly = chainItems({2, 0, 0, 1, 0, 1}, 8);
  costly.modules = {"a.x", "a.y", "a.z", "a.x", "a.y", "b"};
  const Graph d = costly.graph();
  EXPECT_EQ(cutsOf(d, partitionBalanced(d, 2, 0, 0.0)), std::vector<int>{1});
}

TEST(PartitionBalanced, ABoundaryNoValueCrossesIsNeverChosen) {
  // c0 (cost 5) is read by nobody; c1 reads only the input; so nothing
  // crosses cut 1, the compute optimum (5 | 2). Cut 2 (6 | 1) is taken.
  Items it;
  it.costs = {5, 1, 1};
  it.bytes = {4, 4, 4};
  it.reads = {{}, {}, {1}};
  const Graph g = it.graph();
  PartitionPlan plan = partitionBalanced(g, 2, 0, 0.0);
  EXPECT_EQ(cutsOf(g, plan), std::vector<int>{2});
  // When every split needs such a boundary, the error says so.
  Items split;
  split.costs = {1, 1};
  split.bytes = {4, 4};
  split.reads = {{}, {}};
  const Graph h = split.graph();
  const std::string msg = errorOf([&] { partitionBalanced(h, 2); });
  EXPECT_NE(msg.find("cannot split into num_stages=2 stages: every such split has a boundary "
                     "that no value crosses"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("only 0 of the 1 positions"), std::string::npos) << msg;
}

TEST(PartitionBalanced, BytesCostMustBeFiniteAndNonNegative) {
  const Graph g = chainItems({1, 1, 1}).graph();
  std::string msg = errorOf([&] { partitionBalanced(g, 2, 0, -1.0); });
  EXPECT_NE(msg.find("bytes_cost=-1 must be finite and >= 0"), std::string::npos) << msg;
  EXPECT_THROW(partitionBalanced(g, 2, 0, std::numeric_limits<double>::infinity()),
               std::invalid_argument);
  EXPECT_THROW(partitionBalanced(g, 2, 0, std::numeric_limits<double>::quiet_NaN()),
               std::invalid_argument);
  // The default is kDefaultBytesCost.
  EXPECT_EQ(partitionBalanced(g, 2).hash, partitionBalanced(g, 2, 0, kDefaultBytesCost).hash);
}

TEST(PartitionBalanced, MatchesExhaustiveSearchWithSkipReadsTrafficAndModules) {
  // Random items with skip reads, dead values (boundaries no value crosses),
  // extra outputs, module paths and traffic prices; the brute force scores every split with the
  // documented objective and tie-breaks.
  std::mt19937 rng(2024);
  const std::vector<std::string> module_pool = {"", "a", "a.b", "a.b.c", "a.d", "e", "e.f"};
  const std::vector<double> prices = {0.0, 0.5, 1.0, 3.0};
  int checked = 0, infeasible = 0, priced = 0, ties_by_module = 0;
  for (int trial = 0; trial < 800; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 11);
    const int k = 1 + static_cast<int>(rng() % std::min(4, n));
    Items it;
    for (int i = 0; i < n; ++i) {
      it.costs.push_back(static_cast<double>(rng() % 6));
      it.bytes.push_back(static_cast<int64_t>(rng() % 20));
      std::vector<int> reads;
      if (i > 0 && rng() % 6 != 0) reads.push_back(i - 1);
      if (i > 1 && rng() % 3 == 0) reads.push_back(static_cast<int>(rng() % (i - 1)));
      it.reads.push_back(reads);
      it.modules.push_back(module_pool[rng() % module_pool.size()]);
    }
    if (rng() % 3 == 0) it.outputs = {n - 1, static_cast<int>(rng() % n)};
    const double w = prices[rng() % prices.size()];
    const Graph g = it.graph();

    std::vector<int64_t> x(n + 1, 0);
    std::vector<bool> allowed(n + 1, true);
    std::vector<int> depth(n + 1, 0);
    auto shared = [](const std::string& a, const std::string& b) {
      if (a.empty() || b.empty()) return 0;
      auto parts = [](const std::string& s) {
        std::vector<std::string> out{""};
        for (char c : s) c == '.' ? out.push_back("") : void(out.back() += c);
        return out;
      };
      const auto pa = parts(a), pb = parts(b);
      int d = 0;
      while (d < static_cast<int>(std::min(pa.size(), pb.size())) && pa[d] == pb[d]) ++d;
      return d;
    };
    for (int c = 1; c < n; ++c) {
      const auto [b, count] = it.crossing(c);
      x[c] = b;
      allowed[c] = count > 0;
      depth[c] = shared(it.modules[c - 1], it.modules[c]);
    }
    double best = -1;
    std::vector<int> best_cuts, earliest_cuts;
    auto better_ties = [&](const std::vector<int>& a, const std::vector<int>& b) {
      for (int i = static_cast<int>(a.size()) - 1; i >= 0; --i) {
        if (depth[a[i]] != depth[b[i]]) return depth[a[i]] < depth[b[i]];
        if (a[i] != b[i]) return a[i] < b[i];
      }
      return false;
    };
    forEachSplit(n, k, [&](const std::vector<int>& cuts) {
      std::vector<int> bounds{0};
      bounds.insert(bounds.end(), cuts.begin(), cuts.end());
      bounds.push_back(n);
      double worst = 0;
      for (int s = 0; s < k; ++s) {
        if (!allowed[bounds[s]] || !allowed[bounds[s + 1]]) return;
        double sum = 0;
        for (int i = bounds[s]; i < bounds[s + 1]; ++i) sum += it.costs[i];
        worst = std::max(worst, sum + w * static_cast<double>(x[bounds[s]] + x[bounds[s + 1]]));
      }
      if (best < 0 || worst < best) {
        best = worst, best_cuts = earliest_cuts = cuts;
      } else if (worst == best) {
        if (better_ties(cuts, best_cuts)) best_cuts = cuts;
        if (std::lexicographical_compare(cuts.rbegin(), cuts.rend(), earliest_cuts.rbegin(),
                                         earliest_cuts.rend()))
          earliest_cuts = cuts;
      }
    });

    SCOPED_TRACE(::testing::Message() << "trial " << trial << " n=" << n << " k=" << k
                                      << " w=" << w);
    if (best < 0) {
      const std::string msg = errorOf([&] { partitionBalanced(g, k, 0, w); });
      EXPECT_NE(msg.find("no value crosses"), std::string::npos) << msg;
      ++infeasible;
      continue;
    }
    PartitionPlan plan = partitionBalanced(g, k, 0, w);
    const std::vector<int> cuts = cutsOf(g, plan);
    ASSERT_EQ(cuts.size(), static_cast<size_t>(k - 1));
    std::vector<int> bounds{0};
    bounds.insert(bounds.end(), cuts.begin(), cuts.end());
    bounds.push_back(n);
    double worst = 0;
    for (int s = 0; s < k; ++s)
      worst = std::max(worst, plan.stage_cost[s] +
                                  w * static_cast<double>(x[bounds[s]] + x[bounds[s + 1]]));
    EXPECT_EQ(worst, best);
    EXPECT_EQ(cuts, best_cuts);
    priced += w > 0;
    ties_by_module += best_cuts != earliest_cuts;  // the module depth decided
    ++checked;
  }
  EXPECT_GT(checked, 400);
  EXPECT_GT(infeasible, 10);
  EXPECT_GT(priced, 200);
  EXPECT_GT(ties_by_module, 20);
}

}  // namespace
}  // namespace mpmd
