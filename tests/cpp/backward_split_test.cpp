// Backward split into I and W (core/backward_split.h) on hand-made backward
// graphs (a linear layer, a node shared by both sides, a weight gradient
// computed by I, placeholder outputs, dead nodes), on random DAGs against a
// reference written independently (ancestor sets by depth-first search), and
// every documented error with its message.
#include <gtest/gtest.h>

#include "test_util.h"

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/backward_split.h"

namespace mpmd {
namespace {

using Ids = std::vector<int32_t>;

// A backward graph built node by node; each call returns the new node's id.
struct BackwardGraph {
  std::vector<Ids> inputs;
  std::vector<bool> is_placeholder;

  int32_t placeholder() { return add(true, {}); }
  int32_t op(Ids reads) { return add(false, std::move(reads)); }
  int32_t add(bool ph, Ids reads) {
    inputs.push_back(std::move(reads));
    is_placeholder.push_back(ph);
    return static_cast<int32_t>(inputs.size()) - 1;
  }
  BackwardSplit split(const Ids& input_grads, const Ids& weight_grads) const {
    return splitBackward(inputs, is_placeholder, input_grads, weight_grads);
  }
};

Ids idsWhere(const std::vector<bool>& flags) {
  Ids out;
  for (size_t i = 0; i < flags.size(); ++i)
    if (flags[i]) out.push_back(static_cast<int32_t>(i));
  return out;
}

// The invariants of NOTE [Backward split], checked from the definitions
// only: nothing computed twice or left out, every read of each part
// available to it, carry and the read lists sorted and exact.
void expectInvariants(const BackwardGraph& g, const Ids& input_grads, const Ids& weight_grads,
                      const BackwardSplit& s) {
  const size_t n = g.inputs.size();
  ASSERT_EQ(s.input_part.size(), n);
  ASSERT_EQ(s.weight_part.size(), n);
  const std::set<int32_t> carry(s.carry.begin(), s.carry.end());
  EXPECT_TRUE(std::is_sorted(s.carry.begin(), s.carry.end()));
  EXPECT_EQ(carry.size(), s.carry.size()) << "carry has duplicates";
  EXPECT_TRUE(std::is_sorted(s.input_reads.begin(), s.input_reads.end()));
  EXPECT_TRUE(std::is_sorted(s.weight_reads_saved.begin(), s.weight_reads_saved.end()));

  std::set<int32_t> want_carry, want_input_reads;
  for (size_t v = 0; v < n; ++v) {
    const bool ph = g.is_placeholder[v];
    EXPECT_FALSE(s.input_part[v] && s.weight_part[v]) << "node " << v << " in both I and W";
    if (ph) {
      EXPECT_FALSE(s.input_part[v] || s.weight_part[v]) << "placeholder " << v << " computed";
    }
    for (int32_t u : g.inputs[v]) {
      const bool u_outside = g.is_placeholder[u] || s.input_part[u];
      if (s.input_part[v]) {
        EXPECT_TRUE(s.input_part[u] || g.is_placeholder[u]) << "I node " << v << " reads " << u;
        if (g.is_placeholder[u]) want_input_reads.insert(u);
      }
      if (s.weight_part[v]) {
        EXPECT_TRUE(s.weight_part[u] || carry.count(u)) << "W node " << v << " reads " << u;
        if (u_outside) want_carry.insert(u);
      }
    }
  }
  for (int32_t o : input_grads) {
    if (g.is_placeholder[o]) {
      want_input_reads.insert(o);
    } else {
      EXPECT_TRUE(s.input_part[o]) << "input gradient " << o << " not computed by I";
    }
  }
  for (int32_t o : weight_grads) {
    if (g.is_placeholder[o] || s.input_part[o]) {
      want_carry.insert(o);
    } else {
      EXPECT_TRUE(s.weight_part[o]) << "weight gradient " << o << " not computed by W";
    }
  }
  for (int32_t c : s.carry) {
    EXPECT_TRUE(s.input_part[c] || g.is_placeholder[c]) << "carry " << c << " not from I";
  }
  EXPECT_EQ(s.carry, Ids(want_carry.begin(), want_carry.end()));
  EXPECT_EQ(s.input_reads, Ids(want_input_reads.begin(), want_input_reads.end()));
  Ids saved;
  for (int32_t c : s.carry)
    if (g.is_placeholder[c]) saved.push_back(c);
  EXPECT_EQ(s.weight_reads_saved, saved);
}

TEST(BackwardSplit, LinearLayerPutsDxInIAndDwDbInWCarryingDyAndX) {
  // y = x @ w.T + b:  dx = dy @ w;  dw = dy.T @ x;  db = sum(dy, 0)
  BackwardGraph g;
  const int32_t x = g.placeholder(), w = g.placeholder(), dy = g.placeholder();
  const int32_t dx = g.op({dy, w});
  const int32_t dy_t = g.op({dy});
  const int32_t dw = g.op({dy_t, x});
  const int32_t db = g.op({dy});
  const BackwardSplit s = g.split({dx}, {dw, db});
  expectInvariants(g, {dx}, {dw, db}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids({dx}));
  EXPECT_EQ(idsWhere(s.weight_part), Ids({dy_t, dw, db}));
  EXPECT_EQ(s.carry, Ids({x, dy}));
  EXPECT_EQ(s.input_reads, Ids({w, dy}));
  EXPECT_EQ(s.weight_reads_saved, Ids({x, dy}));
}

TEST(BackwardSplit, NodeBothSidesNeedIsComputedOnceInIAndCarried) {
  // relu(x @ w.T): g = relu_backward(dy, mask) feeds both dx and dw.
  BackwardGraph g;
  const int32_t x = g.placeholder(), w = g.placeholder(), mask = g.placeholder();
  const int32_t dy = g.placeholder();
  const int32_t grad = g.op({dy, mask});
  const int32_t dx = g.op({grad, w});
  const int32_t grad_t = g.op({grad});
  const int32_t dw = g.op({grad_t, x});
  const BackwardSplit s = g.split({dx}, {dw});
  expectInvariants(g, {dx}, {dw}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids({grad, dx}));
  EXPECT_EQ(idsWhere(s.weight_part), Ids({grad_t, dw}));
  EXPECT_EQ(s.carry, Ids({x, grad}));
  EXPECT_EQ(s.input_reads, Ids({w, mask, dy}));
  EXPECT_EQ(s.weight_reads_saved, Ids({x}));
}

TEST(BackwardSplit, WeightGradientComputedByIIsCarriedAndWComputesNothing) {
  // A bias whose gradient is also on the path to dx (dx = expand(db)).
  BackwardGraph g;
  const int32_t dy = g.placeholder();
  const int32_t db = g.op({dy});
  const int32_t dx = g.op({db});
  const BackwardSplit s = g.split({dx}, {db});
  expectInvariants(g, {dx}, {db}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids({db, dx}));
  EXPECT_EQ(idsWhere(s.weight_part), Ids{});
  EXPECT_EQ(s.carry, Ids({db}));
  EXPECT_EQ(s.input_reads, Ids({dy}));
  EXPECT_EQ(s.weight_reads_saved, Ids{});
}

TEST(BackwardSplit, PlaceholderOutputsAreReadNotComputed) {
  // Identity backward: dx is dy itself; a weight gradient is a saved value.
  BackwardGraph g;
  const int32_t saved = g.placeholder(), dy = g.placeholder();
  const BackwardSplit s = g.split({dy}, {saved, dy});
  expectInvariants(g, {dy}, {saved, dy}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids{});
  EXPECT_EQ(idsWhere(s.weight_part), Ids{});
  EXPECT_EQ(s.carry, Ids({saved, dy}));
  EXPECT_EQ(s.input_reads, Ids({dy}));
  EXPECT_EQ(s.weight_reads_saved, Ids({saved, dy}));
}

TEST(BackwardSplit, DeadNodesAreInNeitherPartAndTheirReadsAreNotListed) {
  BackwardGraph g;
  const int32_t dy = g.placeholder(), unused = g.placeholder(), x = g.placeholder();
  const int32_t dead = g.op({unused});
  const int32_t dead2 = g.op({dead, dy});
  const int32_t dx = g.op({dy});
  const int32_t dw = g.op({dy, x});
  const BackwardSplit s = g.split({dx}, {dw});
  expectInvariants(g, {dx}, {dw}, s);
  EXPECT_FALSE(s.input_part[dead] || s.weight_part[dead]);
  EXPECT_FALSE(s.input_part[dead2] || s.weight_part[dead2]);
  EXPECT_EQ(s.carry, Ids({dy, x}));
  EXPECT_EQ(s.input_reads, Ids({dy}));
}

TEST(BackwardSplit, RepeatedAndSharedOutputIdsCountOnce) {
  BackwardGraph g;
  const int32_t dy = g.placeholder();
  const int32_t a = g.op({dy, dy});
  const int32_t b = g.op({a});
  const BackwardSplit s = g.split({a, a}, {a, b, b});
  expectInvariants(g, {a, a}, {a, b, b}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids({a}));
  EXPECT_EQ(idsWhere(s.weight_part), Ids({b}));
  EXPECT_EQ(s.carry, Ids({a}));
}

TEST(BackwardSplit, NoInputGradientsPutsEverythingNeededInW) {
  // The first stage sends no input gradient: I is empty, W does all.
  BackwardGraph g;
  const int32_t x = g.placeholder(), dy = g.placeholder();
  const int32_t dw = g.op({dy, x});
  const BackwardSplit s = g.split({}, {dw});
  expectInvariants(g, {}, {dw}, s);
  EXPECT_EQ(idsWhere(s.input_part), Ids{});
  EXPECT_EQ(idsWhere(s.weight_part), Ids({dw}));
  EXPECT_EQ(s.carry, Ids({x, dy}));
  EXPECT_EQ(s.input_reads, Ids{});
}

TEST(BackwardSplit, EmptyGraphSplitsIntoNothing) {
  const BackwardSplit s = splitBackward({}, {}, {}, {});
  EXPECT_TRUE(s.input_part.empty());
  EXPECT_TRUE(s.weight_part.empty());
  EXPECT_TRUE(s.carry.empty());
  EXPECT_TRUE(s.input_reads.empty());
  EXPECT_TRUE(s.weight_reads_saved.empty());
}

// Reference: ancestors (inclusive) of `from` by depth-first search,
// not entering placeholders or nodes in `stop`.
std::set<int32_t> reachedFrom(const BackwardGraph& g, const Ids& from,
                              const std::set<int32_t>& stop) {
  std::set<int32_t> seen;
  std::vector<int32_t> todo(from.begin(), from.end());
  while (!todo.empty()) {
    const int32_t v = todo.back();
    todo.pop_back();
    if (!seen.insert(v).second) continue;
    if (g.is_placeholder[v] || stop.count(v)) continue;
    for (int32_t u : g.inputs[v]) todo.push_back(u);
  }
  return seen;
}

TEST(BackwardSplit, RandomGraphsMatchReferenceAndHoldEveryInvariant) {
  int with_carry_from_i = 0, with_dead = 0;
  for (uint32_t seed = 0; seed < 400; ++seed) {
    std::mt19937 rng(seed);
    BackwardGraph g;
    const int n = 1 + static_cast<int>(rng() % 40);
    const int placeholders = 1 + static_cast<int>(rng() % 6);
    for (int v = 0; v < n; ++v) {
      if (v < placeholders || rng() % 8 == 0) {
        g.placeholder();
        continue;
      }
      Ids reads;
      for (int k = static_cast<int>(rng() % 4); k > 0; --k) {
        // Mostly recent nodes, sometimes any earlier one.
        const int span = rng() % 3 ? std::min(v, 5) : v;
        reads.push_back(v - 1 - static_cast<int32_t>(rng() % span));
      }
      g.op(std::move(reads));
    }
    Ids input_grads, weight_grads;
    for (int k = static_cast<int>(rng() % 3); k > 0; --k) input_grads.push_back(rng() % n);
    for (int k = static_cast<int>(rng() % 5); k > 0; --k) weight_grads.push_back(rng() % n);

    SCOPED_TRACE("seed " + std::to_string(seed));
    const BackwardSplit s = g.split(input_grads, weight_grads);
    expectInvariants(g, input_grads, weight_grads, s);

    std::set<int32_t> want_i;
    for (int32_t v : reachedFrom(g, input_grads, {}))
      if (!g.is_placeholder[v]) want_i.insert(v);
    std::set<int32_t> want_w;
    for (int32_t v : reachedFrom(g, weight_grads, want_i))
      if (!g.is_placeholder[v] && !want_i.count(v)) want_w.insert(v);
    EXPECT_EQ(idsWhere(s.input_part), Ids(want_i.begin(), want_i.end()));
    EXPECT_EQ(idsWhere(s.weight_part), Ids(want_w.begin(), want_w.end()));

    // I + W + dead = all non-placeholders; dead = needed by no output.
    const std::set<int32_t> live = reachedFrom(g, [&] {
      Ids all = input_grads;
      all.insert(all.end(), weight_grads.begin(), weight_grads.end());
      return all;
    }(), {});
    for (int v = 0; v < n; ++v) {
      if (g.is_placeholder[v]) continue;
      const bool computed = s.input_part[v] || s.weight_part[v];
      EXPECT_EQ(computed, live.count(v) == 1) << "node " << v;
      if (!computed) ++with_dead;
    }
    for (int32_t c : s.carry) with_carry_from_i += s.input_part[c] ? 1 : 0;
  }
  // The sweep exercises the interesting cases, not only trivial graphs.
  EXPECT_GT(with_carry_from_i, 50);
  EXPECT_GT(with_dead, 50);
}

TEST(BackwardSplit, RejectsMismatchedLengthsNamingBoth) {
  const std::string msg =
      testing::errorOf([] { splitBackward({{}, {0}}, {true, false, false}, {}, {}); });
  EXPECT_NE(msg.find("inputs has 2 entries but is_placeholder has 3"), std::string::npos) << msg;
}

TEST(BackwardSplit, RejectsReadOfLaterSelfOrNegativeId) {
  std::string msg = testing::errorOf([] { splitBackward({{}, {2}, {}}, {true, false, true}, {}, {}); });
  EXPECT_NE(msg.find("node 1 reads node id 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(0..0)"), std::string::npos) << msg;
  msg = testing::errorOf([] { splitBackward({{}, {1}}, {true, false}, {}, {}); });
  EXPECT_NE(msg.find("node 1 reads node id 1"), std::string::npos) << msg;
  msg = testing::errorOf([] { splitBackward({{}, {-1}}, {true, false}, {}, {}); });
  EXPECT_NE(msg.find("node 1 reads node id -1"), std::string::npos) << msg;
}

TEST(BackwardSplit, RejectsPlaceholderWithInputsNamingThem) {
  const std::string msg =
      testing::errorOf([] { splitBackward({{}, {}, {0, 1}}, {true, true, true}, {}, {}); });
  EXPECT_NE(msg.find("placeholder node 2 reads [0, 1]"), std::string::npos) << msg;
}

TEST(BackwardSplit, RejectsOutputIdOutOfRangeNamingListAndPosition) {
  const std::vector<Ids> inputs = {{}, {0}};
  const std::vector<bool> ph = {true, false};
  std::string msg = testing::errorOf([&] { splitBackward(inputs, ph, {1, 2}, {}); });
  EXPECT_NE(msg.find("input_grad_outputs[1] = 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("graph of 2 nodes (0..1)"), std::string::npos) << msg;
  msg = testing::errorOf([&] { splitBackward(inputs, ph, {1}, {-3}); });
  EXPECT_NE(msg.find("weight_grad_outputs[0] = -3"), std::string::npos) << msg;
  msg = testing::errorOf([] { splitBackward({}, {}, {0}, {}); });
  EXPECT_NE(msg.find("input_grad_outputs[0] = 0 is not a node id of a graph of 0 nodes"),
            std::string::npos)
      << msg;
}

TEST(BackwardSplit, ProjectionOfATupleComputedInIGoesToIAndIsCarriedNotTheTuple) {
  // (dx, dgamma) = norm_backward(dy, x): dx feeds the input gradient, dgamma
  // only the weight gradient; the tuple node is in I, so its dgamma element
  // is taken in I and carried (a tuple cannot be).
  const std::vector<Ids> inputs = {{}, {}, {0, 1}, {2}, {2}, {4}};
  const std::vector<bool> ph = {true, true, false, false, false, false};
  const std::vector<bool> proj = {false, false, false, true, true, false};
  const BackwardSplit s = splitBackward(inputs, ph, {3}, {5}, proj);
  EXPECT_EQ(idsWhere(s.input_part), Ids({2, 3, 4}));
  EXPECT_EQ(idsWhere(s.weight_part), Ids({5}));
  EXPECT_EQ(s.carry, Ids({4}));
  // Without the flags, the element would be in W reading the tuple.
  const BackwardSplit plain = splitBackward(inputs, ph, {3}, {5});
  EXPECT_EQ(plain.carry, Ids({2}));
}

TEST(BackwardSplit, ProjectionOfAWNodeStaysInW) {
  const std::vector<Ids> inputs = {{}, {0}, {1}, {1}};
  const std::vector<bool> ph = {true, false, false, false};
  const BackwardSplit s = splitBackward(inputs, ph, {}, {2, 3}, {false, false, true, true});
  EXPECT_EQ(idsWhere(s.weight_part), Ids({1, 2, 3}));
  EXPECT_TRUE(s.carry == Ids({0}));
}

TEST(BackwardSplit, RejectsProjectionFlagsOfWrongLengthOrReads) {
  std::string msg = testing::errorOf(
      [] { splitBackward({{}, {0}}, {true, false}, {}, {1}, {false}); });
  EXPECT_NE(msg.find("is_projection has 1 entries for a graph of 2 nodes"), std::string::npos)
      << msg;
  msg = testing::errorOf(
      [] { splitBackward({{}, {}, {0, 1}}, {true, true, false}, {}, {2}, {false, false, true}); });
  EXPECT_NE(msg.find("projection node 2 reads [0, 1]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace mpmd
