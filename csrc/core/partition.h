// Partitioner: Graph -> PartitionPlan (which stage computes each node, what
// crosses stages, where each parameter lives). Identical on every rank for
// the same input; `hash` lets ranks compare plans cheaply.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph_ir.h"

namespace mpmd {

// A value produced on one stage and read by later stages.
struct CrossStageValue {
  int32_t node = 0;               // producing node id
  int32_t producer_stage = 0;
  std::vector<int32_t> consumer_stages;  // ascending, all > producer_stage
  int64_t bytes = 0;
};

struct ParameterPlacement {
  int32_t node = 0;               // Parameter or Buffer node id
  std::string fqn;
  std::vector<int32_t> stages;    // ascending stages that read it
  bool shared() const { return stages.size() > 1; }  // tied weights
};

struct PartitionPlan {
  int32_t num_stages = 0;
  // Per node: the stage that computes it. Input, Parameter, Buffer and
  // Constant nodes get the first stage that reads them (-1 when unused);
  // Constant nodes are recomputed on every stage that reads them (see
  // constant_stages); Marker nodes get the stage they end; Output gets the
  // last stage.
  std::vector<int32_t> node_stage;
  std::vector<std::vector<int32_t>> constant_stages;  // per node; only Constant nodes non-empty
  std::vector<CrossStageValue> cross_stage_values;    // ordered by producing node id
  std::vector<ParameterPlacement> parameters;         // Parameter and Buffer nodes, by id
  std::vector<double> stage_cost;                     // sum of Compute costs per stage
  std::vector<int64_t> stage_parameter_bytes;
  uint64_t hash = 0;                                  // of everything above except costs
};

// Stages from markers: compute node k belongs to the stage equal to the
// number of Marker nodes before it. Throws std::invalid_argument (message
// naming the values) for: an empty stage (no Compute node between two
// markers, or before the first / after the last), a boundary that no value
// crosses (the stages after it would not depend on the stages before it).
PartitionPlan partitionByMarkers(const Graph& graph);

// Stages from split points: `stage_starts` lists, ascending, the ids of the
// first Compute node of stages 1..n-1 (what split_points=[FQN] resolve to in
// Python). Same errors as partitionByMarkers.
PartitionPlan partitionAtNodes(const Graph& graph, const std::vector<int32_t>& stage_starts);

// Automatic: `num_stages` contiguous runs of Compute nodes in id order
// minimizing the largest stage cost (exact for contiguous runs), optionally
// keeping each stage's parameter bytes <= `max_stage_parameter_bytes`
// (0 = no cap). Throws std::invalid_argument when num_stages exceeds the
// number of Compute nodes or no split satisfies the cap (naming both).
PartitionPlan partitionBalanced(const Graph& graph, int32_t num_stages,
                                int64_t max_stage_parameter_bytes = 0);

// Text summary for messages and logs: per stage cost, nodes, parameters.
std::string describePlan(const Graph& graph, const PartitionPlan& plan);

}  // namespace mpmd
