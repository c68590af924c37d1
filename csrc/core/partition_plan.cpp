// Plan construction shared by every partitioning mode, the plan hash, and
// describePlan. See partition.h for the semantics and partition_build.h for
// the internal contract.
#include <algorithm>
#include <iterator>
#include <span>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "partition.h"
#include "partition_build.h"

namespace mpmd {
namespace partition_detail {

namespace {

const char* kindName(NodeKind kind) {
  switch (kind) {
    case NodeKind::Input: return "Input";
    case NodeKind::Parameter: return "Parameter";
    case NodeKind::Buffer: return "Buffer";
    case NodeKind::Constant: return "Constant";
    case NodeKind::Compute: return "Compute";
    case NodeKind::Marker: return "Marker";
    case NodeKind::Output: return "Output";
  }
  return "?";
}

bool isPlaceholder(NodeKind kind) {
  return kind == NodeKind::Input || kind == NodeKind::Parameter || kind == NodeKind::Buffer;
}

class Fnv1a {
 public:
  void byte(uint8_t b) {
    h_ ^= b;
    h_ *= 0x100000001b3ULL;
  }
  void u64(uint64_t x) {
    for (int k = 0; k < 8; ++k) byte(static_cast<uint8_t>(x >> (8 * k)));
  }
  void i64(int64_t x) { u64(static_cast<uint64_t>(x)); }
  void i32(int32_t x) {
    const auto u = static_cast<uint32_t>(x);
    for (int k = 0; k < 4; ++k) byte(static_cast<uint8_t>(u >> (8 * k)));
  }
  void str(const std::string& s) {
    u64(s.size());
    for (char c : s) byte(static_cast<uint8_t>(c));
  }
  void stages(const std::vector<int32_t>& v) {
    u64(v.size());
    for (int32_t s : v) i32(s);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

}  // namespace

ReadIndex::ReadIndex(const Graph& graph) {
  checkGraph(graph);
  const auto& nodes = graph.nodes;
  const int32_t n = static_cast<int32_t>(nodes.size());
  marker_reads_.resize(n);
  for (int32_t j = 0; j < n; ++j) {
    const Node& node = nodes[j];
    if (node.kind == NodeKind::Compute) compute_nodes_.push_back(j);
    if (node.kind == NodeKind::Marker) {
      marker_nodes_.push_back(j);
      std::vector<int32_t> resolved;
      forEachRead(graph, j, [&](int32_t i) { resolved.push_back(i); });
      std::sort(resolved.begin(), resolved.end());
      resolved.erase(std::unique(resolved.begin(), resolved.end()), resolved.end());
      marker_reads_[j] = std::move(resolved);
    }
    if (isPlaceholder(node.kind) && !node.inputs.empty()) {
      throw std::invalid_argument(fmt::format(
          "{} node {} reads {}: Input, Parameter and Buffer nodes read nothing",
          kindName(node.kind), nodeLabel(graph, j), nodeLabel(graph, node.inputs.front())));
    }
    if (node.kind == NodeKind::Constant) {
      forEachRead(graph, j, [&](int32_t i) {
        if (nodes[i].kind != NodeKind::Constant) {
          throw std::invalid_argument(fmt::format(
              "Constant node {} reads {} node {}: a Constant may read only other Constants "
              "(it depends on no Input, Parameter, Buffer or Compute node)",
              nodeLabel(graph, j), kindName(nodes[i].kind), nodeLabel(graph, i)));
        }
      });
    }
  }
}

std::string nodeLabel(const Graph& graph, int32_t id) {
  return fmt::format("'{}' (id {})", graph.nodes[id].name, id);
}

PartitionPlan buildPlan(const Graph& graph, const ReadIndex& reads, int32_t num_stages,
                        const std::vector<int32_t>& compute_stage) {
  const auto& nodes = graph.nodes;
  const int32_t n = static_cast<int32_t>(nodes.size());
  const int32_t last = num_stages - 1;
  PartitionPlan plan;
  plan.num_stages = num_stages;
  plan.node_stage.assign(n, -1);
  plan.constant_stages.resize(n);
  plan.stage_cost.assign(num_stages, 0.0);
  plan.stage_parameter_bytes.assign(num_stages, 0);

  // Compute nodes as given; Markers take the stage of the last Compute node
  // before them (the stage they end); Output takes the last stage.
  std::vector<int32_t> compute_count(num_stages, 0);
  int32_t current = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (nodes[i].kind == NodeKind::Compute) {
      const int32_t s = compute_stage[i];
      if (s < 0 || s > last || s < current) {
        throw std::logic_error(fmt::format(
            "partitioner bug: Compute node {} got stage {} (num_stages={}, previous stage {})",
            nodeLabel(graph, i), s, num_stages, current));
      }
      plan.node_stage[i] = current = s;
      ++compute_count[s];
      plan.stage_cost[s] += nodes[i].cost;
    } else if (nodes[i].kind == NodeKind::Marker) {
      plan.node_stage[i] = current;
    }
  }
  plan.node_stage[n - 1] = last;
  for (int32_t s = 0; s < num_stages; ++s) {
    if (compute_count[s] == 0) {
      throw std::invalid_argument(
          fmt::format("stage {} of {} has no compute nodes", s, num_stages));
    }
  }

  // Stages reading each node, as one flat table (no allocation per node):
  // Compute and Output readers in id order have non-decreasing stages, so a
  // node's reader stages arrive ascending and repeats are adjacent.
  std::vector<int32_t> last_stage(n, -1);
  std::vector<std::pair<int32_t, int32_t>> pairs;  // (read node, reader stage)
  pairs.reserve(n);
  for (int32_t j = 0; j < n; ++j) {
    const NodeKind kind = nodes[j].kind;
    if (kind != NodeKind::Compute && kind != NodeKind::Output) continue;
    const int32_t s = plan.node_stage[j];
    reads.forEachRead(graph, j, [&](int32_t i) {
      if (last_stage[i] != s) {
        last_stage[i] = s;
        pairs.emplace_back(i, s);
      }
    });
  }
  std::vector<int32_t> offset(n + 1, 0);  // node i's stages: flat[offset[i] .. offset[i+1])
  for (const auto& p : pairs) ++offset[p.first + 1];
  for (int32_t i = 0; i < n; ++i) offset[i + 1] += offset[i];
  std::vector<int32_t> flat(pairs.size());
  {
    std::vector<int32_t> fill(offset.begin(), offset.end() - 1);
    for (const auto& p : pairs) flat[fill[p.first]++] = p.second;
  }
  auto readersOf = [&](int32_t i) {
    return std::span<const int32_t>(flat.data() + offset[i], flat.data() + offset[i + 1]);
  };
  // Constants: their own readers plus every stage needing a Constant that
  // reads them, from the last node down so each set is complete before it is
  // passed on. plan.constant_stages accumulates what readers pass on.
  std::vector<int32_t> merged;
  for (int32_t j = n - 1; j >= 0; --j) {
    if (nodes[j].kind != NodeKind::Constant) continue;
    auto own = readersOf(j);
    auto& set = plan.constant_stages[j];
    merged.clear();
    std::set_union(own.begin(), own.end(), set.begin(), set.end(), std::back_inserter(merged));
    set = merged;
    if (set.empty()) continue;
    reads.forEachRead(graph, j, [&](int32_t i) {
      auto& target = plan.constant_stages[i];
      merged.clear();
      std::set_union(set.begin(), set.end(), target.begin(), target.end(),
                     std::back_inserter(merged));
      target = merged;
    });
  }

  std::vector<int32_t> boundary_cover(num_stages + 1, 0);  // difference array
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = nodes[i];
    const auto r = readersOf(i);
    switch (node.kind) {
      case NodeKind::Compute: {
        const int32_t producer = plan.node_stage[i];
        if (!r.empty() && r.front() < producer) {
          throw std::logic_error(fmt::format(
              "partitioner bug: Compute node {} on stage {} is read by stage {}",
              nodeLabel(graph, i), producer, r.front()));
        }
        auto later = std::upper_bound(r.begin(), r.end(), producer);
        if (later != r.end()) {
          CrossStageValue v;
          v.node = i;
          v.producer_stage = producer;
          v.consumer_stages.assign(later, r.end());
          v.bytes = node.output_bytes;
          ++boundary_cover[producer + 1];
          --boundary_cover[v.consumer_stages.back() + 1];
          plan.cross_stage_values.push_back(std::move(v));
        }
        break;
      }
      case NodeKind::Constant: {
        const auto& c = plan.constant_stages[i];
        plan.node_stage[i] = c.empty() ? -1 : c.front();
        break;
      }
      case NodeKind::Parameter:
      case NodeKind::Buffer:
        for (int32_t s : r) plan.stage_parameter_bytes[s] += node.output_bytes;
        plan.node_stage[i] = r.empty() ? -1 : r.front();
        plan.parameters.push_back(
            ParameterPlacement{i, node.fqn, std::vector<int32_t>(r.begin(), r.end())});
        break;
      case NodeKind::Input:
        plan.node_stage[i] = r.empty() ? -1 : r.front();
        break;
      case NodeKind::Marker:
      case NodeKind::Output:
        break;
    }
  }

  int32_t cover = boundary_cover[0];
  for (int32_t b = 1; b < num_stages; ++b) {
    cover += boundary_cover[b];
    if (cover == 0) {
      // The nodes on either side of the boundary, to point at it.
      int32_t end_of_prev = -1, start_of_next = -1;
      for (int32_t i : reads.computeNodes()) {
        if (plan.node_stage[i] == b - 1) end_of_prev = i;
        if (plan.node_stage[i] == b && start_of_next < 0) start_of_next = i;
      }
      throw std::invalid_argument(fmt::format(
          "no value crosses the boundary between stage {} and stage {}: stages from {} on do not "
          "depend on stages before it (stage {} ends at node {}, stage {} begins at node {})",
          b - 1, b, b, b - 1, nodeLabel(graph, end_of_prev), b, nodeLabel(graph, start_of_next)));
    }
  }

  plan.hash = hashPlan(plan);
  return plan;
}

uint64_t hashPlan(const PartitionPlan& plan) {
  Fnv1a h;
  h.str("mpmd.PartitionPlan.v1");
  h.i32(plan.num_stages);
  h.stages(plan.node_stage);
  // Sparse: the number of nodes, then (node, stages) for each Constant in use.
  h.u64(plan.constant_stages.size());
  uint64_t in_use = 0;
  for (const auto& c : plan.constant_stages) in_use += !c.empty();
  h.u64(in_use);
  for (size_t i = 0; i < plan.constant_stages.size(); ++i) {
    if (plan.constant_stages[i].empty()) continue;
    h.i32(static_cast<int32_t>(i));
    h.stages(plan.constant_stages[i]);
  }
  h.u64(plan.cross_stage_values.size());
  for (const auto& v : plan.cross_stage_values) {
    h.i32(v.node);
    h.i32(v.producer_stage);
    h.stages(v.consumer_stages);
    h.i64(v.bytes);
  }
  h.u64(plan.parameters.size());
  for (const auto& p : plan.parameters) {
    h.i32(p.node);
    h.str(p.fqn);
    h.stages(p.stages);
  }
  h.u64(plan.stage_parameter_bytes.size());
  for (int64_t b : plan.stage_parameter_bytes) h.i64(b);
  return h.value();
}

}  // namespace partition_detail

namespace {

std::string joinStages(const std::vector<int32_t>& stages) {
  std::string out;
  for (int32_t s : stages) {
    if (!out.empty()) out += ',';
    out += std::to_string(s);
  }
  return out;
}

}  // namespace

std::string describePlan(const Graph& graph, const PartitionPlan& plan) {
  const auto& nodes = graph.nodes;
  if (plan.node_stage.size() != nodes.size() ||
      plan.stage_cost.size() != static_cast<size_t>(plan.num_stages)) {
    throw std::invalid_argument(fmt::format(
        "describePlan: the plan covers {} nodes and {} stage costs but the graph has {} nodes "
        "and the plan {} stages",
        plan.node_stage.size(), plan.stage_cost.size(), nodes.size(), plan.num_stages));
  }
  constexpr size_t kMaxListed = 8;
  std::string out = fmt::format("partition plan: {} stages, hash {:016x}\n", plan.num_stages,
                                plan.hash);
  const size_t num_stages = plan.stage_cost.size();
  std::vector<int32_t> count(num_stages, 0), first(num_stages, -1), last(num_stages, -1);
  std::vector<int32_t> params(num_stages, 0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const int32_t s = plan.node_stage[i];
    if (nodes[i].kind != NodeKind::Compute || s < 0 || s >= plan.num_stages) continue;
    if (first[s] < 0) first[s] = static_cast<int32_t>(i);
    last[s] = static_cast<int32_t>(i);
    ++count[s];
  }
  for (const auto& p : plan.parameters)
    for (int32_t s : p.stages)
      if (s >= 0 && s < plan.num_stages) ++params[s];
  for (size_t s = 0; s < num_stages; ++s) {
    const int64_t param_bytes =
        s < plan.stage_parameter_bytes.size() ? plan.stage_parameter_bytes[s] : 0;
    out += fmt::format("  stage {}: cost {:g}, {} compute nodes", s, plan.stage_cost[s], count[s]);
    if (count[s] > 0)
      out += fmt::format(" ('{}' .. '{}')", nodes[first[s]].name, nodes[last[s]].name);
    out += fmt::format(", {} parameters/buffers ({} bytes)\n", params[s], param_bytes);
  }
  int64_t cross_bytes = 0;
  for (const auto& v : plan.cross_stage_values) cross_bytes += v.bytes;
  out += fmt::format("  cross-stage values: {} ({} bytes)", plan.cross_stage_values.size(),
                     cross_bytes);
  for (size_t k = 0; k < plan.cross_stage_values.size() && k < kMaxListed; ++k) {
    const auto& v = plan.cross_stage_values[k];
    out += fmt::format("{} '{}' {}->{}", k == 0 ? ":" : ";", nodes[v.node].name,
                       v.producer_stage, joinStages(v.consumer_stages));
  }
  if (plan.cross_stage_values.size() > kMaxListed)
    out += fmt::format("; ... {} more", plan.cross_stage_values.size() - kMaxListed);
  out += "\n";
  std::string shared;
  for (const auto& p : plan.parameters)
    if (p.shared()) shared += fmt::format(" '{}' on {};", p.fqn, joinStages(p.stages));
  if (!shared.empty()) {
    shared.pop_back();
    out += "  shared parameters:" + shared + "\n";
  }
  std::string replicated;
  for (size_t i = 0; i < plan.constant_stages.size(); ++i)
    if (plan.constant_stages[i].size() > 1)
      replicated += fmt::format(" '{}' on {};", nodes[i].name, joinStages(plan.constant_stages[i]));
  if (!replicated.empty()) {
    replicated.pop_back();
    out += "  constants recomputed on several stages:" + replicated + "\n";
  }
  return out;
}

}  // namespace mpmd
