// Partitioner on hand-built graphs: markers, split points (stage_starts),
// the plan's cross-stage values, parameter and constant placement, the hash,
// describePlan, checkGraph, and every documented error with its message.
#include <gtest/gtest.h>

#include "test_util.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "core/graph_ir.h"
#include "core/partition.h"

namespace mpmd {
namespace {

// Builds a Graph node by node; each call returns the new node's id.
class Builder {
 public:
  int32_t input(const std::string& name) { return add(NodeKind::Input, name, {}); }
  int32_t param(const std::string& fqn, int64_t bytes = 100) {
    int32_t id = add(NodeKind::Parameter, fqn, {});
    g_.nodes[id].fqn = fqn;
    g_.nodes[id].output_bytes = bytes;
    return id;
  }
  int32_t buffer(const std::string& fqn, int64_t bytes = 10) {
    int32_t id = add(NodeKind::Buffer, fqn, {});
    g_.nodes[id].fqn = fqn;
    g_.nodes[id].output_bytes = bytes;
    return id;
  }
  int32_t constant(const std::string& name, std::vector<int32_t> in = {}) {
    return add(NodeKind::Constant, name, std::move(in));
  }
  int32_t compute(const std::string& name, std::vector<int32_t> in, double cost = 1.0,
                  int64_t bytes = 8) {
    int32_t id = add(NodeKind::Compute, name, std::move(in));
    g_.nodes[id].cost = cost;
    g_.nodes[id].output_bytes = bytes;
    return id;
  }
  int32_t marker(const std::string& name, std::vector<int32_t> in = {}) {
    return add(NodeKind::Marker, name, std::move(in));
  }
  Graph output(std::vector<int32_t> in) {
    add(NodeKind::Output, "output", std::move(in));
    return g_;
  }

 private:
  int32_t add(NodeKind kind, const std::string& name, std::vector<int32_t> in) {
    Node n;
    n.id = static_cast<int32_t>(g_.nodes.size());
    n.kind = kind;
    n.name = name;
    n.target = "test.op";
    n.inputs = std::move(in);
    g_.nodes.push_back(n);
    return n.id;
  }
  Graph g_;
};


using Stages = std::vector<int32_t>;

// x -> fc1(w1) -> relu1 | fc2(w2) -> relu2 | fc3(w3) -> out
struct Mlp {
  Graph g;
  int32_t x, w1, w2, w3, fc1, relu1, m1, fc2, relu2, m2, fc3;
};
Mlp makeMlp() {
  Mlp m;
  Builder b;
  m.x = b.input("x");
  m.w1 = b.param("fc1.weight", 400);
  m.w2 = b.param("fc2.weight", 300);
  m.w3 = b.param("fc3.weight", 200);
  m.fc1 = b.compute("fc1", {m.x, m.w1}, 4.0, 64);
  m.relu1 = b.compute("relu1", {m.fc1}, 1.0, 64);
  m.m1 = b.marker("boundary_0");
  m.fc2 = b.compute("fc2", {m.relu1, m.w2}, 3.0, 32);
  m.relu2 = b.compute("relu2", {m.fc2}, 1.0, 32);
  m.m2 = b.marker("boundary_1");
  m.fc3 = b.compute("fc3", {m.relu2, m.w3}, 2.0, 16);
  m.g = b.output({m.fc3});
  return m;
}

TEST(GraphCheck, AcceptsWellFormedGraph) { EXPECT_NO_THROW(checkGraph(makeMlp().g)); }

TEST(GraphCheck, RejectsIdsNotInOrderNamingTheNode) {
  Graph g = makeMlp().g;
  g.nodes[3].id = 7;
  std::string msg = testing::errorOf([&] { checkGraph(g); });
  EXPECT_NE(msg.find("'fc3.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("id 7"), std::string::npos) << msg;
}

TEST(GraphCheck, RejectsInputThatIsNotAnEarlierNode) {
  Graph g = makeMlp().g;
  g.nodes[4].inputs.push_back(4);
  std::string msg = testing::errorOf([&] { checkGraph(g); });
  EXPECT_NE(msg.find("'fc1' (id 4) reads node id 4"), std::string::npos) << msg;
  g.nodes[4].inputs.back() = -1;
  EXPECT_NE(testing::errorOf([&] { checkGraph(g); }).find("reads node id -1"), std::string::npos);
}

TEST(GraphCheck, RejectsMissingMisplacedOrDuplicateOutput) {
  Graph g = makeMlp().g;
  EXPECT_NE(testing::errorOf([&] { checkGraph(Graph{}); }).find("no nodes"), std::string::npos);
  Graph no_output = g;
  no_output.nodes.back().kind = NodeKind::Compute;
  EXPECT_NE(testing::errorOf([&] { checkGraph(no_output); }).find("no Output node"), std::string::npos);
  Graph early = g;
  early.nodes[5].kind = NodeKind::Output;
  early.nodes.back().kind = NodeKind::Compute;
  std::string msg = testing::errorOf([&] { checkGraph(early); });
  EXPECT_NE(msg.find("'relu1' has id 5 but must be the last node (id 11)"), std::string::npos)
      << msg;
  Graph two = g;
  two.nodes[5].kind = NodeKind::Output;
  EXPECT_NE(testing::errorOf([&] { checkGraph(two); }).find("more than one Output"), std::string::npos);
}

TEST(PartitionMarkers, MlpChainWithTwoMarkersGivesThreeStagesInProgramOrder) {
  Mlp m = makeMlp();
  PartitionPlan plan = partitionByMarkers(m.g);
  EXPECT_EQ(plan.num_stages, 3);
  EXPECT_EQ(plan.node_stage, (Stages{0, 0, 1, 2, 0, 0, 0, 1, 1, 1, 2, 2}));
  ASSERT_EQ(plan.cross_stage_values.size(), 2u);
  EXPECT_EQ(plan.cross_stage_values[0].node, m.relu1);
  EXPECT_EQ(plan.cross_stage_values[0].producer_stage, 0);
  EXPECT_EQ(plan.cross_stage_values[0].consumer_stages, Stages{1});
  EXPECT_EQ(plan.cross_stage_values[0].bytes, 64);
  EXPECT_EQ(plan.cross_stage_values[1].node, m.relu2);
  EXPECT_EQ(plan.cross_stage_values[1].consumer_stages, Stages{2});
  ASSERT_EQ(plan.parameters.size(), 3u);
  EXPECT_EQ(plan.parameters[0].fqn, "fc1.weight");
  EXPECT_EQ(plan.parameters[0].stages, Stages{0});
  EXPECT_EQ(plan.parameters[2].stages, Stages{2});
  EXPECT_FALSE(plan.parameters[1].shared());
  EXPECT_EQ(plan.stage_cost, (std::vector<double>{5.0, 4.0, 2.0}));
  EXPECT_EQ(plan.stage_parameter_bytes, (std::vector<int64_t>{400, 300, 200}));
  EXPECT_NE(plan.hash, 0u);
}

TEST(PartitionMarkers, SkipConnectionAcrossThreeStagesListsEveryConsumerStage) {
  Builder b;
  int32_t x = b.input("x");
  int32_t h0 = b.compute("h0", {x});
  b.marker("m0");
  int32_t h1 = b.compute("h1", {h0});
  b.marker("m1");
  int32_t h2 = b.compute("h2", {h1});
  b.marker("m2");
  int32_t h3 = b.compute("add", {h2, h0});  // skip connection from stage 0 to stage 3
  Graph g = b.output({h3});
  PartitionPlan plan = partitionByMarkers(g);
  ASSERT_EQ(plan.num_stages, 4);
  ASSERT_EQ(plan.cross_stage_values.size(), 3u);
  EXPECT_EQ(plan.cross_stage_values[0].node, h0);
  EXPECT_EQ(plan.cross_stage_values[0].consumer_stages, (Stages{1, 3}));
  EXPECT_EQ(plan.cross_stage_values[1].node, h1);
  EXPECT_EQ(plan.cross_stage_values[2].node, h2);
  EXPECT_EQ(plan.cross_stage_values[2].consumer_stages, Stages{3});
}

TEST(PartitionMarkers, ValuesTheOutputReadsAreConsumedByTheLastStage) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  b.marker("m0");
  int32_t c = b.compute("c", {a});
  b.marker("m1");
  int32_t d = b.compute("d", {c});
  Graph g = b.output({d, a, x});  // several outputs, one from stage 0, one an input
  PartitionPlan plan = partitionByMarkers(g);
  ASSERT_EQ(plan.cross_stage_values.size(), 2u);
  EXPECT_EQ(plan.cross_stage_values[0].node, a);
  EXPECT_EQ(plan.cross_stage_values[0].consumer_stages, (Stages{1, 2}));
  EXPECT_EQ(plan.node_stage.back(), 2);
  EXPECT_EQ(plan.node_stage[x], 0);  // inputs never cross: first reader only
}

TEST(PartitionMarkers, TiedParameterReadByStageZeroAndTwoIsSharedOnBoth) {
  Builder b;
  int32_t tok = b.input("tokens");
  int32_t emb = b.param("embed.weight", 1000);
  int32_t w = b.param("block.weight", 50);
  int32_t unused = b.param("unused.weight", 7);
  int32_t stats = b.buffer("norm.running_mean", 12);
  int32_t e = b.compute("embedding", {tok, emb});
  b.marker("m0");
  int32_t h = b.compute("block", {e, w, stats});
  b.marker("m1");
  int32_t logits = b.compute("unembed", {h, emb});  // tied with the embedding
  Graph g = b.output({logits});
  PartitionPlan plan = partitionByMarkers(g);
  ASSERT_EQ(plan.parameters.size(), 4u);
  EXPECT_EQ(plan.parameters[0].node, emb);
  EXPECT_EQ(plan.parameters[0].stages, (Stages{0, 2}));
  EXPECT_TRUE(plan.parameters[0].shared());
  EXPECT_EQ(plan.parameters[1].stages, Stages{1});
  EXPECT_EQ(plan.parameters[2].node, unused);
  EXPECT_TRUE(plan.parameters[2].stages.empty());
  EXPECT_EQ(plan.node_stage[unused], -1);
  EXPECT_EQ(plan.parameters[3].fqn, "norm.running_mean");
  EXPECT_EQ(plan.parameters[3].stages, Stages{1});
  EXPECT_EQ(plan.node_stage[emb], 0);
  // A shared parameter counts on every stage that reads it.
  EXPECT_EQ(plan.stage_parameter_bytes, (std::vector<int64_t>{1000, 62, 1000}));
}

TEST(PartitionMarkers, ConstantReadByTwoStagesIsRecomputedOnBoth) {
  Builder b;
  int32_t x = b.input("x");
  int32_t pos = b.constant("arange");
  int32_t lone = b.constant("unused_const");
  int32_t a = b.compute("a", {x, pos});
  b.marker("m0");
  int32_t c = b.compute("c", {a});
  b.marker("m1");
  int32_t d = b.compute("d", {c, pos});
  Graph g = b.output({d});
  PartitionPlan plan = partitionByMarkers(g);
  EXPECT_EQ(plan.constant_stages[pos], (Stages{0, 2}));
  EXPECT_EQ(plan.node_stage[pos], 0);
  EXPECT_TRUE(plan.constant_stages[lone].empty());
  EXPECT_EQ(plan.node_stage[lone], -1);
  EXPECT_TRUE(plan.constant_stages[a].empty());
  for (const auto& v : plan.cross_stage_values) EXPECT_NE(v.node, pos);
}

TEST(PartitionMarkers, ConstantsReadByConstantsAreAvailableOnEveryStageThatNeedsThem) {
  Builder b;
  int32_t x = b.input("x");
  int32_t base = b.constant("base");
  int32_t mid = b.constant("mid", {base});
  int32_t top = b.constant("top", {mid, base});
  int32_t other = b.constant("other", {base});
  int32_t a = b.compute("a", {x, top});
  b.marker("m0");
  int32_t c = b.compute("c", {a});
  b.marker("m1");
  int32_t d = b.compute("d", {c, other});
  Graph g = b.output({d, mid});
  PartitionPlan plan = partitionByMarkers(g);
  EXPECT_EQ(plan.constant_stages[top], Stages{0});
  EXPECT_EQ(plan.constant_stages[other], Stages{2});
  EXPECT_EQ(plan.constant_stages[mid], (Stages{0, 2}));  // via top, and the output
  EXPECT_EQ(plan.constant_stages[base], (Stages{0, 2}));
  EXPECT_EQ(plan.node_stage[other], 2);
}

TEST(PartitionMarkers, NoMarkersGivesOneStageWithNothingCrossing) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x}, 2.5);
  Graph g = b.output({a});
  PartitionPlan plan = partitionByMarkers(g);
  EXPECT_EQ(plan.num_stages, 1);
  EXPECT_TRUE(plan.cross_stage_values.empty());
  EXPECT_EQ(plan.stage_cost, std::vector<double>{2.5});
}

TEST(PartitionMarkers, ReadingAMarkerReadsWhatTheMarkerReads) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  int32_t m = b.marker("m0", {a});  // identity-style x = stage_boundary(x)
  int32_t c = b.compute("c", {m});
  Graph g = b.output({c});
  PartitionPlan plan = partitionByMarkers(g);
  EXPECT_EQ(plan.node_stage[m], 0);  // the stage it ends
  ASSERT_EQ(plan.cross_stage_values.size(), 1u);
  EXPECT_EQ(plan.cross_stage_values[0].node, a);
  EXPECT_EQ(plan.cross_stage_values[0].consumer_stages, Stages{1});
}

TEST(PartitionMarkers, AdjacentMarkersAreAnEmptyStageNamingBothMarkers) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  b.marker("mark_x");
  b.marker("mark_y");
  int32_t c = b.compute("c", {a});
  Graph g = b.output({c});
  std::string msg = testing::errorOf([&] { partitionByMarkers(g); });
  EXPECT_NE(msg.find("stage 1 has no compute nodes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'mark_x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'mark_y'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("adjacent"), std::string::npos) << msg;
}

TEST(PartitionMarkers, MarkerBeforeFirstOrAfterLastComputeIsAnEmptyStage) {
  Builder b1;
  int32_t x = b1.input("x");
  b1.marker("too_early");
  int32_t a = b1.compute("a", {x});
  Graph g1 = b1.output({a});
  std::string msg = testing::errorOf([&] { partitionByMarkers(g1); });
  EXPECT_NE(msg.find("stage 0 has no compute nodes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'too_early'"), std::string::npos) << msg;

  Builder b2;
  x = b2.input("x");
  a = b2.compute("a", {x});
  b2.marker("too_late");
  Graph g2 = b2.output({a});
  msg = testing::errorOf([&] { partitionByMarkers(g2); });
  EXPECT_NE(msg.find("stage 1 has no compute nodes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'too_late'"), std::string::npos) << msg;
}

TEST(PartitionMarkers, BoundaryNoValueCrossesIsAnErrorNamingTheStages) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  b.marker("m0");
  int32_t c = b.compute("c", {a});
  b.marker("m1");
  int32_t d = b.compute("d", {x});  // stage 2 reads only the input
  Graph g = b.output({d});
  std::string msg = testing::errorOf([&] { partitionByMarkers(g); });
  EXPECT_NE(msg.find("no value crosses the boundary between stage 1 and stage 2"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("stages from 2 on do not depend on stages before it"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'c'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'d'"), std::string::npos) << msg;
  (void)c;
}

TEST(PartitionMarkers, GraphWithoutComputeNodesIsRejected) {
  Builder b;
  int32_t x = b.input("x");
  Graph g = b.output({x});
  EXPECT_NE(testing::errorOf([&] { partitionByMarkers(g); }).find("no compute nodes"), std::string::npos);
}

TEST(PartitionMarkers, MalformedKindsAreRejectedNamingTheNodes) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  int32_t k = b.constant("bad_const", {a});
  int32_t c = b.compute("c", {k});
  Graph g = b.output({c});
  std::string msg = testing::errorOf([&] { partitionByMarkers(g); });
  EXPECT_NE(msg.find("Constant node 'bad_const' (id 2) reads Compute node 'a' (id 1)"),
            std::string::npos)
      << msg;

  Builder b2;
  x = b2.input("x");
  int32_t w = b2.param("w");
  a = b2.compute("a", {x, w});
  Graph g2 = b2.output({a});
  g2.nodes[w].inputs = {x};
  msg = testing::errorOf([&] { partitionByMarkers(g2); });
  EXPECT_NE(msg.find("Parameter node 'w' (id 1) reads 'x' (id 0)"), std::string::npos) << msg;
}

TEST(PartitionAtNodes, SameBoundariesAsMarkersGiveIdenticalPlanAndHash) {
  Mlp m = makeMlp();
  PartitionPlan by_markers = partitionByMarkers(m.g);
  PartitionPlan by_starts = partitionAtNodes(m.g, {m.fc2, m.fc3});
  EXPECT_EQ(by_starts.node_stage, by_markers.node_stage);
  EXPECT_EQ(by_starts.constant_stages, by_markers.constant_stages);
  EXPECT_EQ(by_starts.stage_cost, by_markers.stage_cost);
  EXPECT_EQ(by_starts.stage_parameter_bytes, by_markers.stage_parameter_bytes);
  ASSERT_EQ(by_starts.cross_stage_values.size(), by_markers.cross_stage_values.size());
  EXPECT_EQ(by_starts.hash, by_markers.hash);
  EXPECT_EQ(describePlan(m.g, by_starts), describePlan(m.g, by_markers));
}

TEST(PartitionAtNodes, NoStartsGivesOneStage) {
  Mlp m = makeMlp();
  PartitionPlan plan = partitionAtNodes(m.g, {});
  EXPECT_EQ(plan.num_stages, 1);
  EXPECT_TRUE(plan.cross_stage_values.empty());
  EXPECT_EQ(plan.stage_cost, std::vector<double>{11.0});
}

TEST(PartitionAtNodes, StartsThatAreNotAscendingComputeIdsInRangeAreRejected) {
  Mlp m = makeMlp();
  std::string msg = testing::errorOf([&] { partitionAtNodes(m.g, {m.fc3, m.fc2}); });
  EXPECT_NE(msg.find("strictly ascending"), std::string::npos) << msg;
  EXPECT_NE(msg.find("stage_starts[1]=7 (fc2)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("stage_starts[0]=10 (fc3)"), std::string::npos) << msg;
  msg = testing::errorOf([&] { partitionAtNodes(m.g, {m.fc2, m.fc2}); });
  EXPECT_NE(msg.find("strictly ascending"), std::string::npos) << msg;
  msg = testing::errorOf([&] { partitionAtNodes(m.g, {m.w2}); });
  EXPECT_NE(msg.find("'fc2.weight' (id 2), which is not a Compute node"), std::string::npos)
      << msg;
  msg = testing::errorOf([&] { partitionAtNodes(m.g, {m.fc2, 99}); });
  EXPECT_NE(msg.find("stage_starts[1]=99 is not a node id"), std::string::npos) << msg;
  msg = testing::errorOf([&] { partitionAtNodes(m.g, {-1}); });
  EXPECT_NE(msg.find("stage_starts[0]=-1"), std::string::npos) << msg;
}

TEST(PartitionAtNodes, StartAtTheFirstComputeNodeIsAnEmptyStageZero) {
  Mlp m = makeMlp();
  std::string msg = testing::errorOf([&] { partitionAtNodes(m.g, {m.fc1, m.fc2}); });
  EXPECT_NE(msg.find("stage 0 has no compute nodes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'fc1'"), std::string::npos) << msg;
}

TEST(PartitionAtNodes, BoundaryNoValueCrossesIsAnError) {
  Builder b;
  int32_t x = b.input("x");
  int32_t a = b.compute("a", {x});
  int32_t c = b.compute("c", {x});
  Graph g = b.output({a, c});  // a reaches the output: the boundary is crossed
  EXPECT_NO_THROW(partitionAtNodes(g, {c}));
  Builder b2;
  x = b2.input("x");
  a = b2.compute("a", {x});
  c = b2.compute("c", {x});
  Graph g2 = b2.output({c});  // a is dead: nothing crosses
  std::string msg = testing::errorOf([&] { partitionAtNodes(g2, {c}); });
  EXPECT_NE(msg.find("no value crosses the boundary between stage 0 and stage 1"),
            std::string::npos)
      << msg;
}

TEST(PartitionPlanHash, IsAFixedValueForAFixedPlan) {
  // The hash is compared across processes and machines: it must not depend
  // on the platform, the standard library or the process. A change here is a
  // change of the plan format that every rank must agree on. The value was
  // cross-checked with an independent Python FNV-1a over the same byte stream.
  PartitionPlan plan = partitionByMarkers(makeMlp().g);
  EXPECT_EQ(plan.hash, partitionByMarkers(makeMlp().g).hash);
  EXPECT_EQ(plan.hash, 0xe14ab24afd15545bULL) << std::hex << plan.hash;
}

TEST(PartitionPlanHash, ChangesWithBoundariesAndParameterNames) {
  Mlp m = makeMlp();
  const uint64_t base = partitionAtNodes(m.g, {m.fc2, m.fc3}).hash;
  EXPECT_NE(partitionAtNodes(m.g, {m.relu1, m.fc3}).hash, base);
  EXPECT_NE(partitionAtNodes(m.g, {m.fc2}).hash, base);
  Graph renamed = m.g;
  renamed.nodes[m.w2].fqn = "fc2.bias";
  EXPECT_NE(partitionAtNodes(renamed, {m.fc2, m.fc3}).hash, base);
  Graph costlier = m.g;
  costlier.nodes[m.fc1].cost = 100.0;  // costs are not part of the hash
  EXPECT_EQ(partitionAtNodes(costlier, {m.fc2, m.fc3}).hash, base);
}

TEST(PartitionDescribe, SummarizesStagesCrossingValuesAndSharedParameters) {
  Builder b;
  int32_t tok = b.input("tokens");
  int32_t emb = b.param("embed.weight", 1000);
  int32_t e = b.compute("embedding", {tok, emb}, 3.0);
  b.marker("m0");
  int32_t h = b.compute("block", {e}, 5.0);
  int32_t logits = b.compute("unembed", {h, emb}, 2.0);
  Graph g = b.output({logits});
  PartitionPlan plan = partitionByMarkers(g);
  std::string text = describePlan(g, plan);
  EXPECT_NE(text.find("2 stages"), std::string::npos) << text;
  EXPECT_NE(text.find("stage 1: cost 7, 2 compute nodes ('block' .. 'unembed')"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("'embedding' 0->1"), std::string::npos) << text;
  EXPECT_NE(text.find("shared parameters: 'embed.weight' on 0,1"), std::string::npos) << text;
  PartitionPlan wrong = plan;
  wrong.node_stage.pop_back();
  EXPECT_THROW(describePlan(g, wrong), std::invalid_argument);
}

}  // namespace
}  // namespace mpmd
