// Automatic partitioning: contiguous runs of Compute nodes (in id order)
// minimizing the largest stage cost, optionally under a per-stage cap on
// parameter/buffer bytes.
//
// NOTE [Balanced search]: feasibility of a threshold T ("every stage costs
// <= T and reads <= cap parameter bytes") is monotone in T, and a greedy scan
// that grows each stage as far as both limits allow uses the fewest stages
// (both limits hold for any sub-run of a run that satisfies them, since costs
// are >= 0 and a sub-run reads a subset of the parameters). So T is feasible
// for k stages iff the greedy needs <= k. Costs are non-negative doubles,
// whose bit patterns order like the values, so bisecting over the 64-bit
// pattern finds the smallest feasible double exactly in at most 64 greedy
// passes: O(64 * (nodes + reads)). The scan runs from the last node
// backwards, so of the optimal splits we take the one whose boundaries come
// earliest; forced splits (to reach exactly k non-empty stages) go at the
// front, one node per stage.
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "partition.h"
#include "partition_build.h"

namespace mpmd {

namespace {

using partition_detail::buildPlan;
using partition_detail::nodeLabel;
using partition_detail::ReadIndex;

// The Compute nodes as a sequence of items: cost, and the distinct
// parameters/buffers each reads (the Output's reads join the last item,
// which is always on the last stage).
class Sequence {
 public:
  Sequence(const Graph& graph, const ReadIndex& reads) : nodes_(reads.computeNodes()) {
    const auto& nodes = graph.nodes;
    std::vector<int32_t> param_index(nodes.size(), -1);
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i].kind == NodeKind::Parameter || nodes[i].kind == NodeKind::Buffer) {
        param_index[i] = static_cast<int32_t>(param_bytes_.size());
        param_bytes_.push_back(nodes[i].output_bytes);
      }
    }
    stamp_.assign(param_bytes_.size(), 0);
    cost_.reserve(nodes_.size());
    offsets_.reserve(nodes_.size() + 1);
    offsets_.push_back(0);
    for (size_t k = 0; k < nodes_.size(); ++k) {
      const int32_t id = nodes_[k];
      const double c = nodes[id].cost;
      if (!std::isfinite(c) || c < 0) {
        throw std::invalid_argument(fmt::format(
            "Compute node {} has cost {}: costs must be finite and >= 0 for partitionBalanced",
            nodeLabel(graph, id), c));
      }
      cost_.push_back(c);
      ++token_;
      auto addReads = [&](int32_t j) {
        reads.forEachRead(graph, j, [&](int32_t i) {
          const int32_t p = param_index[i];
          if (p >= 0 && stamp_[p] != token_) {
            stamp_[p] = token_;
            params_.push_back(p);
          }
        });
      };
      addReads(id);
      if (k + 1 == nodes_.size()) addReads(static_cast<int32_t>(nodes.size()) - 1);
      offsets_.push_back(params_.size());
    }
  }

  int32_t size() const { return static_cast<int32_t>(nodes_.size()); }
  int32_t nodeId(int32_t k) const { return nodes_[k]; }

  int64_t itemBytes(int32_t k) const {
    int64_t b = 0;
    for (size_t q = offsets_[k]; q < offsets_[k + 1]; ++q) b += param_bytes_[params_[q]];
    return b;
  }

  // Right-to-left greedy at threshold `limit` under `cap` (0 = none). With
  // `k` >= 1 and `stage_of` non-null, assigns exactly k stages (forcing
  // single-node stages at the front when needed; the caller guarantees the
  // plain greedy needs <= k). Returns the number of stages the greedy used,
  // stopping early once above `stop_above`; INT32_MAX if one node alone
  // breaks a limit.
  int32_t greedy(double limit, int64_t cap, int32_t stop_above, int32_t k,
                 std::vector<int32_t>* stage_of) {
    int32_t count = 0;
    double sum = 0.0;
    int64_t bytes = 0;
    for (int32_t r = size() - 1; r >= 0; --r) {
      const double with = sum + cost_[r];
      int64_t added = 0;
      for (size_t q = offsets_[r]; q < offsets_[r + 1]; ++q)
        if (stamp_[params_[q]] != token_) added += param_bytes_[params_[q]];
      const bool forced = stage_of != nullptr && count > 0 && r + 1 <= k - count;
      if (count > 0 && !forced && with <= limit && (cap == 0 || bytes + added <= cap)) {
        sum = with;
        bytes += added;
      } else {
        if (++count > stop_above) return count;
        ++token_;
        sum = cost_[r];
        bytes = itemBytes(r);
        if (sum > limit || (cap != 0 && bytes > cap)) return std::numeric_limits<int32_t>::max();
      }
      for (size_t q = offsets_[r]; q < offsets_[r + 1]; ++q) stamp_[params_[q]] = token_;
      if (stage_of != nullptr) (*stage_of)[r] = k - count;
    }
    return count;
  }

 private:
  const std::vector<int32_t>& nodes_;  // Compute node ids, ascending
  std::vector<double> cost_;
  std::vector<size_t> offsets_;        // item k reads params_[offsets_[k] .. offsets_[k+1])
  std::vector<int32_t> params_;        // dense parameter indices
  std::vector<int64_t> param_bytes_;   // per dense parameter index
  std::vector<uint64_t> stamp_;        // per parameter: the stage token that counted it
  uint64_t token_ = 0;
};

}  // namespace

PartitionPlan partitionBalanced(const Graph& graph, int32_t num_stages,
                                int64_t max_stage_parameter_bytes) {
  const ReadIndex reads(graph);
  const int32_t m = static_cast<int32_t>(reads.computeNodes().size());
  if (num_stages < 1) {
    throw std::invalid_argument(
        fmt::format("num_stages={} must be at least 1", num_stages));
  }
  if (num_stages > m) {
    throw std::invalid_argument(fmt::format(
        "num_stages={} exceeds the number of Compute nodes ({}): every stage needs at least one",
        num_stages, m));
  }
  if (max_stage_parameter_bytes < 0) {
    throw std::invalid_argument(fmt::format(
        "max_stage_parameter_bytes={} must be >= 0 (0 = no cap)", max_stage_parameter_bytes));
  }
  const int64_t cap = max_stage_parameter_bytes;
  Sequence seq(graph, reads);
  const double inf = std::numeric_limits<double>::infinity();

  if (cap != 0) {
    const int32_t needed = seq.greedy(inf, cap, m, 0, nullptr);
    if (needed > num_stages) {
      for (int32_t k = 0; k < m; ++k) {
        if (seq.itemBytes(k) > cap) {
          throw std::invalid_argument(fmt::format(
              "max_stage_parameter_bytes={} cannot be met: Compute node {} alone reads {} "
              "parameter/buffer bytes",
              cap, nodeLabel(graph, seq.nodeId(k)), seq.itemBytes(k)));
        }
      }
      throw std::invalid_argument(fmt::format(
          "max_stage_parameter_bytes={} cannot be met with num_stages={}: the parameters and "
          "buffers need at least {} stages",
          cap, num_stages, needed));
    }
  }

  // Smallest feasible threshold, bisecting over bit patterns (see NOTE).
  uint64_t lo = 0, hi = std::bit_cast<uint64_t>(inf);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (seq.greedy(std::bit_cast<double>(mid), cap, num_stages, 0, nullptr) <= num_stages) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  std::vector<int32_t> stage_of_item(m, -1);
  seq.greedy(std::bit_cast<double>(hi), cap, num_stages, num_stages, &stage_of_item);

  std::vector<int32_t> compute_stage(graph.nodes.size(), -1);
  for (int32_t k = 0; k < m; ++k) compute_stage[seq.nodeId(k)] = stage_of_item[k];
  return buildPlan(graph, reads, num_stages, compute_stage);
}

}  // namespace mpmd
