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

// NOTE [Bytes cost]: the default price, in cost units, of one byte crossing
// a stage boundary, for partitionBalanced. Cost units are fx_to_ir's
// (node_cost): FLOPs for matmul/conv/attention-like ops, bytes read and
// written for the rest, i.e. about one unit per FLOP of the stage's device.
// A byte sent costs R_c / R_p units on a device running R_c units/s over a
// link moving R_p bytes/s. Per microbatch, forward plus backward compute
// about 3x the forward's cost while every crossing byte travels twice (the
// activation forward, its gradient backward), so in the forward units the
// partitioner sums, one forward byte costs (2/3) * R_c / R_p.
// Measured on this project's reference setup (BENCHMARKS.md: one CPU thread
// per rank, gloo over 127.0.0.1): R_c = 3.4e10..6.5e10 units/s (a 6-layer
// Llama's forward, d=128..512, against its estimated cost), R_p = 3.15e8 B/s
// (416 us per 128 KiB activation during a 1F1B step; an idle ping-pong
// reaches 2 GB/s). (2/3) * 5e10 / 3.15e8 = 106, rounded to 100. GPUs have a
// far larger ratio (e.g. 4e14 FLOP/s over 5e10 B/s of InfiniBand, (2/3) *
// 8000 = 5300; over NVLink at 2e11 B/s, 1300): pass bytes_cost for them.
constexpr double kDefaultBytesCost = 100.0;

// Automatic: `num_stages` contiguous runs of Compute nodes in id order
// minimizing the largest stage cost, where a stage's cost is the sum of its
// Compute costs plus `bytes_cost` (cost units per byte, >= 0; see NOTE
// [Bytes cost]) times the bytes crossing its two boundaries: the
// output_bytes of every Compute value produced before a boundary and read
// after it, counted once per boundary it crosses (so a value skipping a
// stage is charged to that stage too, as if relayed). Boundaries no value
// crosses are never chosen. Among the splits of least cost it prefers, from
// the last boundary backwards, boundaries between shallower modules (fewer
// leading components of module_fqn shared by the Compute nodes on either
// side: a cut between `layers.2` and `layers.3.norm` leaves one module open,
// one between `layers.3.attn` and `layers.3.mlp` two), then earlier ones.
// Stage costs within a relative 2^-32 count as equal. Optionally keeps each
// stage's parameter bytes <= `max_stage_parameter_bytes` (0 = no cap).
// Throws std::invalid_argument when num_stages exceeds the number of Compute
// nodes, no split satisfies the cap (naming both), bytes_cost is negative or
// not finite, or every split has a boundary that no value crosses.
PartitionPlan partitionBalanced(const Graph& graph, int32_t num_stages,
                                int64_t max_stage_parameter_bytes = 0,
                                double bytes_cost = kDefaultBytesCost);

// Text summary for messages and logs: per stage cost, nodes, parameters.
std::string describePlan(const Graph& graph, const PartitionPlan& plan);

}  // namespace mpmd
