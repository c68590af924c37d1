// Partitioner benchmark: synthetic transformer-like graphs of about 10k and
// 100k nodes (pre-norm blocks: q/k/v/attention/projection, residual adds, an
// MLP, per-layer weights, a tied embedding/unembedding and a constant
// position index read by every attention), with 7 markers evenly spaced.
//
//   bash scripts/bench_partition.sh [nodes ...]      (default: 10000 100000)
//
// Prints, per size, the best of 5 runs in ms of partitionBalanced into 8
// stages (with and without a parameter cap), partitionByMarkers and
// partitionAtNodes at the same boundaries, and describePlan.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/graph_ir.h"
#include "core/partition.h"

namespace {

using Clock = std::chrono::steady_clock;
using mpmd::Graph;
using mpmd::Node;
using mpmd::NodeKind;

class Builder {
 public:
  int32_t add(NodeKind kind, std::string name, std::vector<int32_t> in, double cost = 0,
              int64_t bytes = 0, std::string fqn = "") {
    Node n;
    n.id = static_cast<int32_t>(g.nodes.size());
    n.kind = kind;
    n.name = std::move(name);
    n.inputs = std::move(in);
    n.cost = cost;
    n.output_bytes = bytes;
    n.fqn = std::move(fqn);
    g.nodes.push_back(std::move(n));
    return g.nodes.back().id;
  }
  Graph g;
};

// About `target` nodes; 22 per layer. Layer sizes vary (a seeded
// multiplier per layer) so the balanced split is not trivially uniform.
Graph transformer(int target, int markers, std::vector<int32_t>* stage_starts) {
  Builder b;
  std::mt19937 rng(7);
  const int layers = std::max(markers + 1, target / 22);
  const int64_t act = 4 * 1024 * 1024, w = 16 * 1024 * 1024;
  const int32_t tokens = b.add(NodeKind::Input, "tokens", {});
  const int32_t mask = b.add(NodeKind::Input, "attention_mask", {});
  const int32_t emb = b.add(NodeKind::Parameter, "embed.weight", {}, 0, 8 * w, "embed.weight");
  const int32_t pos = b.add(NodeKind::Constant, "arange", {}, 0, 8192);
  int32_t h = b.add(NodeKind::Compute, "embedding", {tokens, emb}, 2.0, act);
  int next_marker = 1;
  for (int l = 0; l < layers; ++l) {
    if (markers > 0 && l == next_marker * layers / (markers + 1)) {
      b.add(NodeKind::Marker, "stage_boundary_" + std::to_string(next_marker), {});
      ++next_marker;
    }
    const double size = 0.5 + (rng() % 100) / 50.0;  // 0.5 .. 2.5
    const std::string p = "layers." + std::to_string(l) + ".";
    auto param = [&](const char* name, int64_t bytes) {
      return b.add(NodeKind::Parameter, p + name, {}, 0, bytes, p + name);
    };
    auto op = [&](const char* name, std::vector<int32_t> in, double cost) {
      return b.add(NodeKind::Compute, p + name, std::move(in), cost * size, act);
    };
    const int32_t ln1_w = param("ln1.weight", 4096);
    const int32_t wq = param("attn.q.weight", w), wk = param("attn.k.weight", w);
    const int32_t wv = param("attn.v.weight", w), wo = param("attn.o.weight", w);
    const int32_t w1 = param("mlp.fc1.weight", 4 * w), w2 = param("mlp.fc2.weight", 4 * w);
    const int32_t ln2_w = param("ln2.weight", 4096);
    const int32_t x = op("ln1", {h, ln1_w}, 0.2);
    const int32_t q = op("q", {x, wq}, 1.0), k = op("k", {x, wk}, 1.0), v = op("v", {x, wv}, 1.0);
    const int32_t s = op("scores", {q, k, pos, mask}, 0.8);
    const int32_t a = op("softmax", {s}, 0.1);
    const int32_t c = op("context", {a, v}, 0.8);
    const int32_t o = op("o", {c, wo}, 1.0);
    h = op("add1", {h, o}, 0.05);
    const int32_t y = op("ln2", {h, ln2_w}, 0.2);
    const int32_t f1 = op("fc1", {y, w1}, 4.0);
    const int32_t ge = op("gelu", {f1}, 0.2);
    const int32_t f2 = op("fc2", {ge, w2}, 4.0);
    h = op("add2", {h, f2}, 0.05);
  }
  const int32_t logits = b.add(NodeKind::Compute, "unembed", {h, emb}, 8.0, 8 * act);
  b.add(NodeKind::Output, "output", {logits});
  // The split points equivalent to the markers: the first Compute node after each.
  bool after_marker = false;
  for (const Node& n : b.g.nodes) {
    if (n.kind == NodeKind::Marker) after_marker = true;
    if (n.kind == NodeKind::Compute && after_marker) {
      stage_starts->push_back(n.id);
      after_marker = false;
    }
  }
  return std::move(b.g);
}

double bestMs(int reps, const std::function<void()>& f) {
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {10000, 100000};
  const int reps = 5, stages = 8;
  std::printf("%9s %8s %8s | %13s %13s %10s %10s %9s | %s\n", "nodes", "compute", "params",
              "balanced8_ms", "bal8_cap_ms", "markers_ms", "atnodes_ms", "descr_ms",
              "max/mean stage cost: balanced, capped, markers");
  for (int target : sizes) {
    std::vector<int32_t> starts;
    const Graph g = transformer(target, stages - 1, &starts);
    int compute = 0, params = 0;
    for (const Node& n : g.nodes) {
      compute += n.kind == NodeKind::Compute;
      params += n.kind == NodeKind::Parameter;
    }
    mpmd::PartitionPlan balanced, capped, by_markers, at_nodes;
    const double t_bal = bestMs(reps, [&] { balanced = mpmd::partitionBalanced(g, stages); });
    // A cap 2% under the largest stage's parameter bytes in the plan
    // without a cap, so that it binds.
    const int64_t cap = *std::max_element(balanced.stage_parameter_bytes.begin(),
                                          balanced.stage_parameter_bytes.end()) / 50 * 49;
    const double t_cap = bestMs(reps, [&] { capped = mpmd::partitionBalanced(g, stages, cap); });
    const double t_mark = bestMs(reps, [&] { by_markers = mpmd::partitionByMarkers(g); });
    const double t_at = bestMs(reps, [&] { at_nodes = mpmd::partitionAtNodes(g, starts); });
    std::string text;
    const double t_desc = bestMs(reps, [&] { text = mpmd::describePlan(g, balanced); });
    auto ratio = [](const mpmd::PartitionPlan& p) {
      double mx = 0, sum = 0;  // max / mean stage cost
      for (double c : p.stage_cost) mx = std::max(mx, c), sum += c;
      return mx / (sum / static_cast<double>(p.stage_cost.size()));
    };
    if (at_nodes.hash != by_markers.hash) {
      std::fprintf(stderr, "markers and stage_starts disagree (hash %llx vs %llx)\n",
                   static_cast<unsigned long long>(by_markers.hash),
                   static_cast<unsigned long long>(at_nodes.hash));
      return 1;
    }
    std::printf("%9zu %8d %8d | %13.2f %13.2f %10.2f %10.2f %9.2f | %.4f %.4f %.4f\n",
                g.nodes.size(), compute, params, t_bal, t_cap, t_mark, t_at, t_desc,
                ratio(balanced), ratio(capped), ratio(by_markers));
  }
  return 0;
}
