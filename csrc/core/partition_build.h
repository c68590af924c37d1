// Internal to the partitioner (partition_*.cpp): the checks and the plan
// construction shared by the marker, split-point and balanced front ends.
// Not part of the public API; nothing outside csrc/core/partition_*.cpp
// should include it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph_ir.h"
#include "partition.h"

namespace mpmd::partition_detail {

// NOTE [Marker reads]: a Marker carries no value of its own. When a node reads
// a Marker (an identity-style `x = stage_boundary(x)`), it reads whatever the
// Marker reads, transitively; a Marker that reads nothing contributes no read.
class ReadIndex {
 public:
  // checkGraph, then the kind rules: Input/Parameter/Buffer read nothing; a
  // Constant reads only Constants. Throws std::invalid_argument naming nodes.
  explicit ReadIndex(const Graph& graph);

  // Calls f(id) for every non-Marker node that node `j` reads (duplicates possible).
  template <class F>
  void forEachRead(const Graph& graph, int32_t j, F&& f) const {
    for (int32_t in : graph.nodes[j].inputs) {
      if (graph.nodes[in].kind == NodeKind::Marker) {
        for (int32_t r : marker_reads_[in]) f(r);
      } else {
        f(in);
      }
    }
  }

  const std::vector<int32_t>& computeNodes() const { return compute_nodes_; }
  const std::vector<int32_t>& markerNodes() const { return marker_nodes_; }

 private:
  std::vector<std::vector<int32_t>> marker_reads_;  // per node id; only Markers non-empty
  std::vector<int32_t> compute_nodes_;              // Compute node ids, ascending
  std::vector<int32_t> marker_nodes_;               // Marker node ids, ascending
};

// "'name' (id 7)", for messages.
std::string nodeLabel(const Graph& graph, int32_t id);

// The plan for `num_stages` stages where `compute_stage[i]` is the stage of
// Compute node i (entries of other nodes are ignored). Fills every field,
// including the hash. Throws std::invalid_argument for an empty stage or a
// boundary no value crosses; std::logic_error if a read goes from a later
// stage to an earlier one (impossible for stages non-decreasing in id).
PartitionPlan buildPlan(const Graph& graph, const ReadIndex& reads, int32_t num_stages,
                        const std::vector<int32_t>& compute_stage);

// 64-bit FNV-1a over num_stages, node_stage, constant_stages,
// cross_stage_values, parameters and stage_parameter_bytes, fed as
// little-endian fixed-width integers: the same on every process and platform.
uint64_t hashPlan(const PartitionPlan& plan);

}  // namespace mpmd::partition_detail
