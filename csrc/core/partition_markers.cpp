// Stages from explicit boundaries: Marker nodes (partitionByMarkers) or the
// first Compute node of each stage (partitionAtNodes, what split_points
// resolve to). Both hand the Compute stages to buildPlan, so the same
// boundaries give the same plan and hash.
#include <stdexcept>

#include <fmt/format.h>

#include "partition.h"
#include "partition_build.h"

namespace mpmd {

using partition_detail::buildPlan;
using partition_detail::nodeLabel;
using partition_detail::ReadIndex;

PartitionPlan partitionByMarkers(const Graph& graph) {
  const ReadIndex reads(graph);
  const auto& markers = reads.markerNodes();
  const int32_t num_stages = static_cast<int32_t>(markers.size()) + 1;
  std::vector<int32_t> compute_stage(graph.nodes.size(), -1);
  std::vector<int32_t> count(num_stages, 0);
  int32_t stage = 0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (graph.nodes[i].kind == NodeKind::Marker) ++stage;
    if (graph.nodes[i].kind == NodeKind::Compute) {
      compute_stage[i] = stage;
      ++count[stage];
    }
  }
  for (int32_t s = 0; s < num_stages; ++s) {
    if (count[s] > 0) continue;
    if (num_stages == 1) {
      throw std::invalid_argument("stage 0 has no compute nodes: the graph has none");
    }
    if (s == 0) {
      throw std::invalid_argument(fmt::format(
          "stage 0 has no compute nodes (marker {} comes before any compute node)",
          nodeLabel(graph, markers.front())));
    }
    if (s == num_stages - 1) {
      throw std::invalid_argument(fmt::format(
          "stage {} has no compute nodes (marker {} comes after the last compute node)", s,
          nodeLabel(graph, markers.back())));
    }
    throw std::invalid_argument(fmt::format(
        "stage {} has no compute nodes (markers at nodes {} and {} are adjacent: no compute "
        "node between them)",
        s, nodeLabel(graph, markers[s - 1]), nodeLabel(graph, markers[s])));
  }
  return buildPlan(graph, reads, num_stages, compute_stage);
}

PartitionPlan partitionAtNodes(const Graph& graph, const std::vector<int32_t>& stage_starts) {
  const ReadIndex reads(graph);
  const int32_t n = static_cast<int32_t>(graph.nodes.size());
  for (size_t k = 0; k < stage_starts.size(); ++k) {
    const int32_t id = stage_starts[k];
    if (id < 0 || id >= n) {
      throw std::invalid_argument(fmt::format(
          "stage_starts[{}]={} is not a node id (the graph has nodes 0..{})", k, id, n - 1));
    }
    if (graph.nodes[id].kind != NodeKind::Compute) {
      throw std::invalid_argument(fmt::format(
          "stage_starts[{}]={} names node {}, which is not a Compute node: a stage must begin "
          "at a Compute node",
          k, id, nodeLabel(graph, id)));
    }
    if (k > 0 && id <= stage_starts[k - 1]) {
      throw std::invalid_argument(fmt::format(
          "stage_starts must be strictly ascending, but stage_starts[{}]={} ({}) follows "
          "stage_starts[{}]={} ({})",
          k, id, graph.nodes[id].name, k - 1, stage_starts[k - 1],
          graph.nodes[stage_starts[k - 1]].name));
    }
  }
  const int32_t num_stages = static_cast<int32_t>(stage_starts.size()) + 1;
  const auto& compute = reads.computeNodes();
  if (compute.empty()) {
    throw std::invalid_argument("stage 0 has no compute nodes: the graph has none");
  }
  if (!stage_starts.empty() && stage_starts.front() == compute.front()) {
    throw std::invalid_argument(fmt::format(
        "stage 0 has no compute nodes: stage_starts[0]={} is the first compute node {}",
        stage_starts.front(), nodeLabel(graph, compute.front())));
  }
  std::vector<int32_t> compute_stage(n, -1);
  size_t next = 0;  // stages that started at or before the current node
  for (int32_t i : compute) {
    while (next < stage_starts.size() && stage_starts[next] <= i) ++next;
    compute_stage[i] = static_cast<int32_t>(next);
  }
  return buildPlan(graph, reads, num_stages, compute_stage);
}

}  // namespace mpmd
