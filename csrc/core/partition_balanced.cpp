// Automatic partitioning: contiguous runs of Compute nodes (in id order)
// minimizing the largest stage cost (compute plus the bytes crossing the
// stage's boundaries times bytes_cost, NOTE [Bytes cost] in partition.h),
// optionally under a per-stage cap on parameter/buffer bytes.
//
// NOTE [Balanced search]: with m Compute nodes ("items") and cut positions
// c = 0..m (a cut at c starts a stage at item c), a stage [c, c') costs
//   P[c'] - P[c] + w * (x[c] + x[c']) = hi[c'] - lo[c],
// where P is the prefix sum of item costs, x[c] the bytes crossing cut c
// (x[0] = x[m] = 0), w the bytes cost, hi[c'] = P[c'] + w x[c'] and
// lo[c] = P[c] - w x[c]. The cost separates into a term per end, but it is
// not monotone in the run (a shorter stage may cost more: its cuts may cross
// more bytes), so the greedy scan of a compute-only balance does not apply.
// Instead, for a threshold T, reach_j[c'] ("items [0, c') split into j
// stages of cost <= T, at allowed cuts, each within the parameter cap")
// holds iff c' is an allowed cut and some c in [start[c'], c') with
// reach_{j-1}[c] has hi[c'] - lo[c] <= T, i.e. iff the largest such lo[c]
// passes. start[c'] (the first item a stage ending at c' may begin at under
// the cap) never decreases, so that maximum is a sliding-window maximum: one
// monotone queue per layer. Only cuts whose compute fits are scanned
// (stage costs are at least their compute, so j stages ending at c' need
// P[c'] <= j T and the rest P[m] - P[c'] <= (k - j) T): near the optimum a
// narrow band per layer, at worst O(m) per layer and O(k m) per threshold.
// Feasibility is monotone in T; T is bisected over the bit patterns of
// non-negative doubles (which order like the values) from the average stage's
// compute (a lower bound) to that plus the costliest item and two cuts'
// traffic (feasible in practice; else the costliest possible stage), stopping
// at 2^20 patterns apart: a relative 2^-32, the tolerance within which stage
// costs count as equal. About 30 passes, plus O(nodes + reads) to build the
// tables (scripts/bench_partition.cpp's 100k-node graph at bytes_cost=0:
// ~30 ms into 8 stages, ~50 ms into 64, plan construction included).
//
// The split at the found threshold is read back from the last stage to the
// first, keeping every reach_j row: of the admissible starts of each stage
// (those that still leave a feasible split of what precedes) the one at the
// shallowest module boundary (fewest leading module_fqn components shared by
// the items either side), then the earliest: with equal module paths, the
// split whose boundaries come earliest, comparing the last one first.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

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
  double cost(int32_t k) const { return cost_[k]; }

  int64_t itemBytes(int32_t k) const {
    int64_t b = 0;
    for (size_t q = offsets_[k]; q < offsets_[k + 1]; ++q) b += param_bytes_[params_[q]];
    return b;
  }

  // The fewest stages that keep every stage's parameter bytes <= cap (a
  // greedy from the last item: any sub-run of a run within the cap is within
  // it too); INT32_MAX if one item alone exceeds it.
  int32_t stagesNeededForCap(int64_t cap) {
    int32_t count = 0;
    int64_t bytes = 0;
    for (int32_t r = size() - 1; r >= 0; --r) {
      int64_t added = 0;
      for (size_t q = offsets_[r]; q < offsets_[r + 1]; ++q)
        if (stamp_[params_[q]] != token_) added += param_bytes_[params_[q]];
      if (count > 0 && bytes + added <= cap) {
        bytes += added;
      } else {
        ++count;
        ++token_;
        bytes = itemBytes(r);
        if (bytes > cap) return std::numeric_limits<int32_t>::max();
      }
      for (size_t q = offsets_[r]; q < offsets_[r + 1]; ++q) stamp_[params_[q]] = token_;
    }
    return count;
  }

  // start[c'] for c' = 0..m: the first item a stage ending before item c'
  // may begin at with its parameter bytes <= cap (0 = no cap, all 0); equal
  // to c' when item c'-1 alone exceeds the cap. Non-decreasing (two
  // pointers over per-parameter counts).
  std::vector<int32_t> capStarts(int64_t cap) const {
    const int32_t m = size();
    std::vector<int32_t> start(m + 1, 0);
    if (cap == 0) return start;
    std::vector<int32_t> count(param_bytes_.size(), 0);
    int64_t bytes = 0;
    int32_t left = 0;
    for (int32_t end = 1; end <= m; ++end) {
      for (size_t q = offsets_[end - 1]; q < offsets_[end]; ++q)
        if (count[params_[q]]++ == 0) bytes += param_bytes_[params_[q]];
      while (bytes > cap && left < end) {
        for (size_t q = offsets_[left]; q < offsets_[left + 1]; ++q)
          if (--count[params_[q]] == 0) bytes -= param_bytes_[params_[q]];
        ++left;
      }
      start[end] = left;
    }
    return start;
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

// Leading dot-separated components two module paths share: "a.b.c" and
// "a.b.d" share 2, "a.b" and "a.bc" 1, "" and anything 0.
int32_t sharedModuleDepth(std::string_view a, std::string_view b) {
  int32_t depth = 0;
  size_t i = 0;
  while (!a.empty() && !b.empty()) {
    const size_t ea = std::min(a.find('.', i), a.size());
    const size_t eb = std::min(b.find('.', i), b.size());
    if (ea != eb || a.compare(i, ea - i, b, i, eb - i) != 0) break;
    ++depth;
    if (ea == a.size() || eb == b.size()) break;
    i = ea + 1;
  }
  return depth;
}

// Per cut position c = 0..m: the bytes of Compute values produced before
// item c and read at or after it, whether any value (of any size) crosses,
// and the module depth of the boundary. Cuts 0 and m are the ends.
struct Cuts {
  std::vector<int64_t> bytes;
  std::vector<uint8_t> allowed;  // a value crosses (always at 0 and m)
  std::vector<int32_t> depth;    // sharedModuleDepth of items c-1 and c (0 at the ends)
  int32_t num_allowed_inner = 0;
};

Cuts crossingCuts(const Graph& graph, const ReadIndex& reads, const Sequence& seq) {
  const auto& nodes = graph.nodes;
  const int32_t m = seq.size();
  std::vector<int32_t> item(nodes.size(), -1), last(m, -1);
  for (int32_t k = 0; k < m; ++k) item[seq.nodeId(k)] = k;
  auto readBy = [&](int32_t reader, int32_t k) {
    reads.forEachRead(graph, reader, [&](int32_t i) {
      if (item[i] >= 0) last[item[i]] = std::max(last[item[i]], k);
    });
  };
  for (int32_t k = 0; k < m; ++k) readBy(seq.nodeId(k), k);
  readBy(static_cast<int32_t>(nodes.size()) - 1, m - 1);  // the Output is on the last stage
  // Item p's value crosses the cuts p+1 .. last[p]: difference arrays.
  std::vector<int64_t> dbytes(m + 2, 0);
  std::vector<int32_t> dcount(m + 2, 0);
  for (int32_t p = 0; p < m; ++p) {
    if (last[p] <= p) continue;
    dbytes[p + 1] += nodes[seq.nodeId(p)].output_bytes;
    dbytes[last[p] + 1] -= nodes[seq.nodeId(p)].output_bytes;
    ++dcount[p + 1];
    --dcount[last[p] + 1];
  }
  Cuts cuts;
  cuts.bytes.assign(m + 1, 0);
  cuts.allowed.assign(m + 1, 1);
  cuts.depth.assign(m + 1, 0);
  int64_t b = 0;
  int32_t n = 0;
  for (int32_t c = 1; c < m; ++c) {
    b += dbytes[c];
    n += dcount[c];
    cuts.bytes[c] = b;
    cuts.allowed[c] = n > 0;
    cuts.num_allowed_inner += n > 0;
    cuts.depth[c] = sharedModuleDepth(nodes[seq.nodeId(c - 1)].module_fqn,
                                      nodes[seq.nodeId(c)].module_fqn);
  }
  return cuts;
}

// The layered reachability of NOTE [Balanced search], each layer kept as the
// ascending list of its reachable cuts.
class Search {
 public:
  Search(const Sequence& seq, const Cuts& cuts, std::vector<int32_t> start, double bytes_cost,
         int32_t num_stages)
      : m_(seq.size()), k_(num_stages), cuts_(cuts), start_(std::move(start)) {
    prefix_.resize(m_ + 1);
    hi_.resize(m_ + 1);
    lo_.resize(m_ + 1);
    double prefix = 0.0;
    for (int32_t c = 0; c <= m_; ++c) {
      if (c > 0) prefix += seq.cost(c - 1);
      const double traffic = bytes_cost * static_cast<double>(cuts.bytes[c]);
      prefix_[c] = prefix;
      hi_[c] = prefix + traffic;
      lo_[c] = prefix - traffic;
      max_item_ = std::max(max_item_, c > 0 ? seq.cost(c - 1) : 0.0);
      max_traffic_ = std::max(max_traffic_, traffic);
    }
    queue_.resize(m_ + 1);
  }

  // Every split has a stage of at least the average compute.
  double lowerBound() const { return prefix_[m_] / k_; }
  // Feasible whenever any split is, but loose: no stage costs more.
  double looseUpperBound() const {
    return *std::max_element(hi_.begin(), hi_.end()) - *std::min_element(lo_.begin(), lo_.end());
  }
  // Usually feasible and close: the compute-only greedy would reach the
  // average plus one item; traffic adds at most two cuts' worth.
  double likelyUpperBound() const {
    return (lowerBound() + max_item_ + 2 * max_traffic_) * (1 + 1e-9);
  }

  // Whether k stages of cost <= limit exist. With `rows`, keeps the
  // reachable cuts of every layer j = 0..k for split().
  //
  // Only ends whose compute fits are scanned: stage costs are at least their
  // compute, so j stages ending at c' need P[c'] <= j * limit, and the k - j
  // after them P[m] - P[c'] <= (k - j) * limit. Near the optimum that leaves
  // a narrow band of cuts per layer instead of all m (the bounds are loosened
  // by a relative 1e-9 so rounding never drops a reachable cut).
  bool feasible(double limit, std::vector<std::vector<int32_t>>* rows = nullptr) {
    constexpr double kLoose = 1 + 1e-9;
    prev_.assign(1, 0);
    if (rows != nullptr) rows->assign(1, prev_);
    for (int32_t j = 1; j <= k_; ++j) {
      const double most = j * limit * kLoose;
      const double least = j == k_ ? prefix_[m_] : prefix_[m_] - (k_ - j) * limit * kLoose;
      int32_t first = std::max(j, prev_.front() + 1);
      first = std::max<int32_t>(
          first, static_cast<int32_t>(std::lower_bound(prefix_.begin(), prefix_.end(), least) -
                                      prefix_.begin()));
      const int32_t last = std::min<int32_t>(
          m_ - (k_ - j), static_cast<int32_t>(std::upper_bound(prefix_.begin(), prefix_.end(),
                                                               most) - prefix_.begin()) - 1);
      cur_.clear();
      int32_t head = 0, tail = 0;  // queue_[head, tail): reachable starts, lo_ decreasing
      size_t next = 0;             // prev_[next] is the next start to enqueue
      for (int32_t end = first; end <= last; ++end) {
        for (; next < prev_.size() && prev_[next] < end; ++next) {
          const int32_t c = prev_[next];
          while (tail > head && lo_[queue_[tail - 1]] <= lo_[c]) --tail;
          queue_[tail++] = c;
        }
        while (head < tail && queue_[head] < start_[end]) ++head;
        if (head < tail && cuts_.allowed[end] && hi_[end] - lo_[queue_[head]] <= limit) {
          cur_.push_back(end);
        }
      }
      if (cur_.empty()) return false;
      std::swap(prev_, cur_);
      if (rows != nullptr) rows->push_back(prev_);
    }
    return prev_.back() == m_;
  }

  // The split at `limit` (feasible), as stage_of per item; see NOTE.
  std::vector<int32_t> split(double limit) {
    std::vector<std::vector<int32_t>> rows;
    if (!feasible(limit, &rows)) {
      throw std::logic_error("partitioner bug: split at an infeasible limit");
    }
    std::vector<int32_t> stage_of(m_, -1);
    int32_t end = m_;
    for (int32_t j = k_; j >= 1; --j) {
      const auto& starts = rows[j - 1];
      int32_t best = -1;
      for (auto it = std::lower_bound(starts.begin(), starts.end(), start_[end]);
           it != starts.end() && *it < end; ++it) {
        const int32_t c = *it;
        if (!(hi_[end] - lo_[c] <= limit)) continue;
        if (best < 0 || cuts_.depth[c] < cuts_.depth[best]) best = c;
      }
      if (best < 0) throw std::logic_error("partitioner bug: no start for a reachable stage");
      for (int32_t i = best; i < end; ++i) stage_of[i] = j - 1;
      end = best;
    }
    return stage_of;
  }

 private:
  int32_t m_, k_;
  const Cuts& cuts_;
  std::vector<int32_t> start_;
  std::vector<double> prefix_, hi_, lo_;
  double max_item_ = 0.0, max_traffic_ = 0.0;
  std::vector<int32_t> queue_;
  std::vector<int32_t> prev_, cur_;  // reachable cuts of the previous and current layer
};

}  // namespace

PartitionPlan partitionBalanced(const Graph& graph, int32_t num_stages,
                                int64_t max_stage_parameter_bytes, double bytes_cost) {
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
  if (!std::isfinite(bytes_cost) || bytes_cost < 0) {
    throw std::invalid_argument(fmt::format(
        "bytes_cost={} must be finite and >= 0 (cost units per byte crossing a stage boundary)",
        bytes_cost));
  }
  const int64_t cap = max_stage_parameter_bytes;
  Sequence seq(graph, reads);

  if (cap != 0) {
    const int32_t needed = seq.stagesNeededForCap(cap);
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

  const Cuts cuts = crossingCuts(graph, reads, seq);
  Search search(seq, cuts, seq.capStarts(cap), bytes_cost, num_stages);
  const double inf = std::numeric_limits<double>::infinity();
  if (!search.feasible(inf)) {
    throw std::invalid_argument(fmt::format(
        "cannot split into num_stages={} stages{}: every such split has a boundary that no value "
        "crosses (the stages after it would not depend on the stages before it); values cross "
        "only {} of the {} positions between Compute nodes",
        num_stages,
        cap != 0 ? fmt::format(" within max_stage_parameter_bytes={}", cap) : std::string(),
        cuts.num_allowed_inner, m - 1));
  }

  // Least feasible threshold to a relative 2^-32, bisecting over bit
  // patterns (see NOTE [Balanced search]). `hi` stays feasible.
  constexpr uint64_t kEqualWithin = uint64_t{1} << 20;
  uint64_t lo = std::bit_cast<uint64_t>(search.lowerBound());
  uint64_t hi = std::bit_cast<uint64_t>(search.likelyUpperBound());
  if (!search.feasible(std::bit_cast<double>(hi))) {
    lo = hi + 1;
    hi = std::bit_cast<uint64_t>(search.looseUpperBound());
    if (lo > hi || !search.feasible(std::bit_cast<double>(hi))) {
      lo = 0;  // rounding put a bound on the wrong side: search everything
      hi = std::bit_cast<uint64_t>(inf);
    }
  }
  while (hi - lo > kEqualWithin) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (search.feasible(std::bit_cast<double>(mid))) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const std::vector<int32_t> stage_of_item = search.split(std::bit_cast<double>(hi));

  std::vector<int32_t> compute_stage(graph.nodes.size(), -1);
  for (int32_t k = 0; k < m; ++k) compute_stage[seq.nodeId(k)] = stage_of_item[k];
  return buildPlan(graph, reads, num_stages, compute_stage);
}

}  // namespace mpmd
