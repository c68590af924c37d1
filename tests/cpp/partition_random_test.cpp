// Property tests of the partitioner on random DAGs with random markers,
// against a naive reference written independently of the implementation:
// every node's stage, cross-stage values complete and minimal (exactly the
// reads across stages), parameter and constant placement exactly the reading
// stages, the documented errors exactly when the reference predicts them,
// and a deterministic hash shared by markers and the equivalent split points.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/graph_ir.h"
#include "core/partition.h"

namespace mpmd {
namespace {

struct RandomGraph {
  Graph g;
  std::vector<int32_t> stage_starts;  // first Compute node after each marker (if any)
};

RandomGraph randomGraph(std::mt19937& rng, int max_compute, double marker_rate) {
  RandomGraph out;
  Graph& g = out.g;
  auto add = [&](NodeKind kind, std::vector<int32_t> in) {
    Node n;
    n.id = static_cast<int32_t>(g.nodes.size());
    n.kind = kind;
    n.name = fmt::format("n{}", n.id);
    n.inputs = std::move(in);
    n.cost = static_cast<double>(rng() % 8);
    n.output_bytes = 1 + static_cast<int64_t>(rng() % 64);
    if (kind == NodeKind::Parameter || kind == NodeKind::Buffer) n.fqn = fmt::format("mod.{}", n.name);
    g.nodes.push_back(n);
    return n.id;
  };
  auto pick = [&](const std::vector<int32_t>& from) { return from[rng() % from.size()]; };
  std::vector<int32_t> placeholders, constants, computes, markers;
  const int inputs = 1 + static_cast<int>(rng() % 3);
  for (int i = 0; i < inputs; ++i) placeholders.push_back(add(NodeKind::Input, {}));
  const int params = static_cast<int>(rng() % 5);
  for (int i = 0; i < params; ++i)
    placeholders.push_back(add(rng() % 4 ? NodeKind::Parameter : NodeKind::Buffer, {}));
  auto addConstant = [&] {
    std::vector<int32_t> in;
    if (!constants.empty() && rng() % 2) in.push_back(pick(constants));
    if (!constants.empty() && rng() % 3 == 0) in.push_back(pick(constants));
    constants.push_back(add(NodeKind::Constant, in));
  };
  for (int i = static_cast<int>(rng() % 3); i > 0; --i) addConstant();
  const int num_compute = 1 + static_cast<int>(rng() % max_compute);
  bool pending_start = false;
  for (int k = 0; k < num_compute; ++k) {
    if (rng() % 8 == 0) addConstant();  // FX order may put constants anywhere
    std::vector<int32_t> in;
    if (!computes.empty() && rng() % 5 != 0) in.push_back(computes.back());
    const int extra = static_cast<int>(rng() % 4);
    for (int e = 0; e < extra; ++e) {
      switch (rng() % 4) {
        case 0: in.push_back(pick(placeholders)); break;
        case 1: if (!constants.empty()) in.push_back(pick(constants)); break;
        case 2: if (!computes.empty()) in.push_back(pick(computes)); break;
        case 3: if (!markers.empty()) in.push_back(pick(markers)); break;
      }
    }
    computes.push_back(add(NodeKind::Compute, in));
    if (pending_start) out.stage_starts.push_back(computes.back());
    pending_start = false;
    // Markers anywhere, including adjacent or at the ends (errors expected).
    while (std::uniform_real_distribution<double>(0, 1)(rng) < marker_rate) {
      std::vector<int32_t> min;
      if (rng() % 4 == 0) min.push_back(computes.back());  // identity-style marker
      markers.push_back(add(NodeKind::Marker, min));
      pending_start = true;
    }
  }
  std::vector<int32_t> outs{computes.back()};
  for (int e = static_cast<int>(rng() % 3); e > 0; --e) {
    switch (rng() % 3) {
      case 0: outs.push_back(pick(computes)); break;
      case 1: outs.push_back(pick(placeholders)); break;
      case 2: if (!constants.empty()) outs.push_back(pick(constants)); break;
    }
  }
  add(NodeKind::Output, outs);
  return out;
}

// The naive reference, given the stage of each Compute node.
struct Reference {
  std::vector<int32_t> stage;                    // Compute and Output nodes; -1 elsewhere
  std::vector<std::set<int32_t>> reader_stages;  // per node: stages whose nodes need it
  std::map<int32_t, std::set<int32_t>> crossing; // producer -> later consumer stages
};

// Non-marker nodes that node j reads, looking through markers recursively.
void resolvedReads(const Graph& g, int32_t j, std::vector<int32_t>& out) {
  for (int32_t i : g.nodes[j].inputs) {
    if (g.nodes[i].kind == NodeKind::Marker) {
      resolvedReads(g, i, out);
    } else {
      out.push_back(i);
    }
  }
}

Reference reference(const Graph& g, const std::vector<int32_t>& compute_stage, int num_stages) {
  const int n = static_cast<int>(g.nodes.size());
  Reference r;
  r.stage = compute_stage;
  r.stage[n - 1] = num_stages - 1;
  r.reader_stages.resize(n);
  // Direct reads by Compute and Output nodes.
  for (int j = 0; j < n; ++j) {
    if (g.nodes[j].kind != NodeKind::Compute && g.nodes[j].kind != NodeKind::Output) continue;
    std::vector<int32_t> reads;
    resolvedReads(g, j, reads);
    for (int32_t i : reads) r.reader_stages[i].insert(r.stage[j]);
  }
  // Constants pass their needs on to the constants they read, to a fixed point.
  for (bool changed = true; changed;) {
    changed = false;
    for (int j = 0; j < n; ++j) {
      if (g.nodes[j].kind != NodeKind::Constant) continue;
      std::vector<int32_t> reads;
      resolvedReads(g, j, reads);
      for (int32_t i : reads)
        for (int32_t s : r.reader_stages[j]) changed |= r.reader_stages[i].insert(s).second;
    }
  }
  for (int i = 0; i < n; ++i) {
    if (g.nodes[i].kind != NodeKind::Compute) continue;
    for (int32_t s : r.reader_stages[i])
      if (s > r.stage[i]) r.crossing[i].insert(s);
  }
  return r;
}

// Checks every documented property of `plan` against the reference built
// from the plan's own Compute stages.
void expectPlanMatchesReference(const Graph& g, const PartitionPlan& plan) {
  const int n = static_cast<int>(g.nodes.size());
  const int S = plan.num_stages;
  ASSERT_EQ(static_cast<int>(plan.node_stage.size()), n);
  std::vector<int32_t> compute_stage(n, -1);
  std::vector<int> per_stage(S, 0);
  int32_t prev = 0;
  for (int i = 0; i < n; ++i) {
    if (g.nodes[i].kind != NodeKind::Compute) continue;
    const int32_t s = plan.node_stage[i];
    ASSERT_GE(s, 0) << "node " << i;
    ASSERT_LT(s, S) << "node " << i;
    EXPECT_GE(s, prev) << "stages must be contiguous runs in id order, node " << i;
    prev = s;
    compute_stage[i] = s;
    ++per_stage[s];
  }
  for (int s = 0; s < S; ++s) EXPECT_GT(per_stage[s], 0) << "stage " << s;
  Reference ref = reference(g, compute_stage, S);

  // Every consumer stage >= producer stage.
  for (int i = 0; i < n; ++i) {
    if (g.nodes[i].kind != NodeKind::Compute) continue;
    for (int32_t s : ref.reader_stages[i]) EXPECT_GE(s, compute_stage[i]);
  }

  // Cross-stage values: exactly the reads across stages.
  std::map<int32_t, std::set<int32_t>> got;
  int32_t last_node = -1;
  for (const auto& v : plan.cross_stage_values) {
    EXPECT_GT(v.node, last_node) << "ordered by producing node id";
    last_node = v.node;
    EXPECT_EQ(v.producer_stage, compute_stage[v.node]);
    EXPECT_TRUE(std::is_sorted(v.consumer_stages.begin(), v.consumer_stages.end()));
    EXPECT_EQ(v.bytes, g.nodes[v.node].output_bytes);
    got[v.node] = std::set<int32_t>(v.consumer_stages.begin(), v.consumer_stages.end());
    EXPECT_EQ(got[v.node].size(), v.consumer_stages.size()) << "no repeated stage";
  }
  EXPECT_EQ(got, ref.crossing);

  // Placement of everything that is not Compute.
  size_t param_index = 0;
  for (int i = 0; i < n; ++i) {
    const Node& node = g.nodes[i];
    const auto& readers = ref.reader_stages[i];
    const int32_t first = readers.empty() ? -1 : *readers.begin();
    const std::vector<int32_t> expected(readers.begin(), readers.end());
    switch (node.kind) {
      case NodeKind::Input:
        EXPECT_EQ(plan.node_stage[i], first) << "input " << i;
        break;
      case NodeKind::Parameter:
      case NodeKind::Buffer: {
        ASSERT_LT(param_index, plan.parameters.size());
        const auto& p = plan.parameters[param_index++];
        EXPECT_EQ(p.node, i);
        EXPECT_EQ(p.fqn, node.fqn);
        EXPECT_EQ(p.stages, expected) << "parameter " << node.fqn;
        EXPECT_EQ(p.shared(), expected.size() > 1);
        EXPECT_EQ(plan.node_stage[i], first);
        break;
      }
      case NodeKind::Constant:
        EXPECT_EQ(plan.constant_stages[i], expected) << "constant " << i;
        EXPECT_EQ(plan.node_stage[i], first);
        break;
      case NodeKind::Output:
        EXPECT_EQ(plan.node_stage[i], S - 1);
        break;
      case NodeKind::Marker:
      case NodeKind::Compute:
        EXPECT_TRUE(plan.constant_stages[i].empty());
        break;
    }
  }
  EXPECT_EQ(param_index, plan.parameters.size());

  // Costs and parameter bytes per stage.
  std::vector<double> cost(S, 0.0);
  std::vector<int64_t> bytes(S, 0);
  for (int i = 0; i < n; ++i) {
    if (g.nodes[i].kind == NodeKind::Compute) cost[compute_stage[i]] += g.nodes[i].cost;
    if (g.nodes[i].kind == NodeKind::Parameter || g.nodes[i].kind == NodeKind::Buffer)
      for (int32_t s : ref.reader_stages[i]) bytes[s] += g.nodes[i].output_bytes;
  }
  EXPECT_EQ(plan.stage_cost, cost);
  EXPECT_EQ(plan.stage_parameter_bytes, bytes);
}

// The first error the reference predicts for these Compute stages, or "".
std::string expectedError(const Graph& g, const std::vector<int32_t>& compute_stage, int S) {
  std::vector<int> count(S, 0);
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (g.nodes[i].kind == NodeKind::Compute) ++count[compute_stage[i]];
  for (int s = 0; s < S; ++s)
    if (count[s] == 0) return fmt::format("stage {} ", s);
  Reference ref = reference(g, compute_stage, S);
  for (int b = 1; b < S; ++b) {
    bool crossed = false;
    for (const auto& [producer, consumers] : ref.crossing)
      crossed |= compute_stage[producer] < b && *consumers.rbegin() >= b;
    if (!crossed)
      return fmt::format("no value crosses the boundary between stage {} and stage {}", b - 1, b);
  }
  return "";
}

TEST(PartitionRandomDag, MarkerPlansMatchTheReferenceOrFailExactlyAsPredicted) {
  std::mt19937 rng(2024);
  int planned = 0, empty_errors = 0, crossing_errors = 0;
  for (int trial = 0; trial < 400; ++trial) {
    RandomGraph rg = randomGraph(rng, 30, trial % 2 ? 0.15 : 0.3);
    const Graph& g = rg.g;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " nodes " << g.nodes.size());
    std::vector<int32_t> compute_stage(g.nodes.size(), -1);
    int markers = 0;
    for (const Node& node : g.nodes) {
      if (node.kind == NodeKind::Marker) ++markers;
      if (node.kind == NodeKind::Compute) compute_stage[node.id] = markers;
    }
    const std::string predicted = expectedError(g, compute_stage, markers + 1);
    if (!predicted.empty()) {
      try {
        partitionByMarkers(g);
        ADD_FAILURE() << "expected an error containing: " << predicted;
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(predicted), std::string::npos) << e.what();
      }
      (predicted.rfind("stage ", 0) == 0 ? empty_errors : crossing_errors)++;
      continue;
    }
    PartitionPlan plan = partitionByMarkers(g);
    ASSERT_EQ(plan.num_stages, markers + 1);
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      if (g.nodes[i].kind != NodeKind::Compute) continue;
      EXPECT_EQ(plan.node_stage[i], compute_stage[i]);
    }
    expectPlanMatchesReference(g, plan);
    // Deterministic, and the same plan through the equivalent split points.
    EXPECT_EQ(partitionByMarkers(g).hash, plan.hash);
    PartitionPlan at = partitionAtNodes(g, rg.stage_starts);
    EXPECT_EQ(at.hash, plan.hash);
    EXPECT_EQ(at.node_stage, plan.node_stage);
    ++planned;
  }
  EXPECT_GT(planned, 100);
  EXPECT_GT(empty_errors, 20);
  EXPECT_GT(crossing_errors, 5);
}

TEST(PartitionRandomDag, BalancedPlansAreContiguousAndMatchTheReference) {
  std::mt19937 rng(77);
  int planned = 0;
  for (int trial = 0; trial < 200; ++trial) {
    RandomGraph rg = randomGraph(rng, 40, 0.0);
    const Graph& g = rg.g;
    int computes = 0;
    for (const Node& node : g.nodes) computes += node.kind == NodeKind::Compute;
    const int k = 1 + static_cast<int>(rng() % std::min(computes, 6));
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " computes " << computes
                                      << " k " << k);
    PartitionPlan plan;
    try {
      plan = partitionBalanced(g, k);
    } catch (const std::invalid_argument& e) {
      // Only a boundary that no value crosses may stop a feasible split.
      EXPECT_NE(std::string(e.what()).find("no value crosses"), std::string::npos) << e.what();
      continue;
    }
    EXPECT_EQ(plan.num_stages, k);
    expectPlanMatchesReference(g, plan);
    EXPECT_EQ(partitionBalanced(g, k).hash, plan.hash);
    ++planned;
  }
  EXPECT_GT(planned, 100);
}

TEST(PartitionRandomDag, DifferentPlansOfOneGraphHaveDifferentHashes) {
  std::mt19937 rng(5);
  std::set<uint64_t> hashes;
  int plans = 0;
  for (int trial = 0; trial < 50; ++trial) {
    RandomGraph rg = randomGraph(rng, 30, 0.0);
    for (int k = 1; k <= 4; ++k) {
      try {
        hashes.insert(partitionBalanced(rg.g, k).hash);
        ++plans;
      } catch (const std::invalid_argument&) {
      }
    }
  }
  // Graphs differ in random ways; every distinct plan gets a distinct hash.
  EXPECT_EQ(static_cast<int>(hashes.size()), plans);
  EXPECT_GT(plans, 50);
}

}  // namespace
}  // namespace mpmd
