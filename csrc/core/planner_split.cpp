// The planner's stage splits: the exact min-max split (minMaxSplit), its
// communication-aware variant, and the refinement of the finalists' splits on
// the simulated step (NOTE [Split refinement]).
#include <algorithm>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "planner_steps.h"
#include "schedules/registry.h"

namespace mpmd {
namespace planner {

namespace {

// The exact min-max split over part weights w(j, i) (units j..i-1), then the
// least sum of squares among the splits that reach the min-max.
template <typename Weight>
std::vector<int> splitBy(int n, int parts, const Weight& w) {
  if (parts < 1 || parts > n) {
    throw std::invalid_argument(fmt::format("cannot split {} units into {} non-empty stages", n, parts));
  }
  // f[k][i]: the least possible max over the first i units in k parts.
  const size_t N = static_cast<size_t>(n) + 1;
  std::vector<double> f(static_cast<size_t>(parts + 1) * N, kInf);
  auto F = [&](int k, int i) -> double& { return f[static_cast<size_t>(k) * N + i]; };
  F(0, 0) = 0.0;
  for (int k = 1; k <= parts; ++k) {
    // k parts need i >= k; the rest (parts - k) need n - i >= parts - k.
    for (int i = k; i <= n - (parts - k); ++i) {
      double best = kInf;
      for (int j = i - 1; j >= k - 1; --j) {
        const double wij = w(j, i);
        if (wij >= best) {
          // w(j, i) only grows as j falls when the weights are >= 0.
          break;
        }
        best = std::min(best, std::max(F(k - 1, j), wij));
      }
      F(k, i) = best;
    }
  }
  const double bound = F(parts, n);
  // g[k][i]: least sum of squares with every part <= bound; back pointers.
  std::vector<double> g(static_cast<size_t>(parts + 1) * N, kInf);
  std::vector<int> from(static_cast<size_t>(parts + 1) * N, -1);
  auto G = [&](int k, int i) -> double& { return g[static_cast<size_t>(k) * N + i]; };
  G(0, 0) = 0.0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n - (parts - k); ++i) {
      for (int j = i - 1; j >= k - 1; --j) {
        const double wij = w(j, i);
        if (wij > bound) break;
        const double prev = G(k - 1, j);
        if (prev == kInf) continue;
        const double value = prev + wij * wij;
        if (value < G(k, i)) {
          G(k, i) = value;
          from[static_cast<size_t>(k) * N + i] = j;
        }
      }
    }
  }
  std::vector<int> starts(static_cast<size_t>(parts));
  int i = n;
  for (int k = parts; k >= 1; --k) {
    const int j = from[static_cast<size_t>(k) * N + i];
    starts[k - 1] = j;
    i = j;
  }
  return starts;
}

std::vector<double> unitWeights(const CostSheet& sheet) {
  std::vector<double> w;
  for (const auto& u : sheet.units) w.push_back(u.forward + u.backward_input + u.backward_weight);
  return w;
}

std::vector<double> prefix(const std::vector<double>& w) {
  std::vector<double> p(w.size() + 1, 0.0);
  for (size_t i = 0; i < w.size(); ++i) p[i + 1] = p[i] + w[i];
  return p;
}

}  // namespace

std::vector<int> computeSplit(const CostSheet& sheet, int parts) {
  const auto P = prefix(unitWeights(sheet));
  return splitBy(static_cast<int>(sheet.units.size()), parts, [&](int j, int i) { return P[i] - P[j]; });
}

// Stage weight plus the round trip of its output over the link, at the
// reference microbatch (compute and bytes scale alike; latency does not, a
// small distortion the simulation then judges).
std::vector<int> commAwareSplit(const CostSheet& sheet, int parts) {
  const auto P = prefix(unitWeights(sheet));
  const int n = static_cast<int>(sheet.units.size());
  std::vector<double> cut(n, 0.0);
  const double bw = sheet.inter_node_bandwidth > 0.0 && sheet.ranks_per_node > 0
                        ? std::min(sheet.link_bandwidth > 0.0 ? sheet.link_bandwidth : kInf, sheet.inter_node_bandwidth)
                        : sheet.link_bandwidth;
  for (int u = 0; u < n; ++u) {
    cut[u] = 2.0 * (sheet.link_latency + (bw > 0.0 && bw < kInf ? sheet.units[u].output_bytes / bw : 0.0));
  }
  return splitBy(n, parts, [&](int j, int i) { return P[i] - P[j] + (i < n ? cut[i - 1] : 0.0); });
}

// NOTE [Split refinement]: the min-max split balances each stage's compute,
// which is what a schedule needs in its steady state; around the warm-up and
// cool-down the makespan also depends on which stages are short (in a V
// schedule, a light first stage lets the second rank start sooner while its
// rank's last stage takes up the slack). So each finalist of the search
// (PlanResult::top) is refined by a local search on the simulated makespan:
// from its split, every move of one stage boundary by one unit, and of two
// boundaries at once by one unit each (either sign: a stage's two bounds, or
// a boundary and its mirror), is simulated; the best move that shortens the
// step is taken, and so on until none does or kRefineSimulations ran for
// that finalist. A move keeps every stage non-empty and must fit the memory
// limit (recompute chosen as in the search). Deterministic: moves are tried
// in a fixed order and ties keep the earlier.
constexpr int64_t kRefineSimulations = 400;

Plan refineSplit(const CostSheet& sheet, const SearchOptions& options, const Plan& plan, int64_t& simulations,
                 const SimulateFn& simulate) {
  const int p = sheet.pp_size, n = static_cast<int>(sheet.units.size());
  const Schedule compute = makeSchedule(plan.schedule, ScheduleSpec{p, plan.stages_per_rank, plan.num_microbatches});
  const DataParallel dp{parseMode(plan.data_parallel), sheet.dp_size};
  const Built b = lowerFor(compute, dp);
  const auto& placement = b.lowered.stage_to_rank;
  const double scale = static_cast<double>(plan.microbatch_samples) / static_cast<double>(sheet.reference_microbatch);
  const int S = static_cast<int>(plan.stage_starts.size());
  // Moves: one boundary by one unit, then two at once (either sign): the
  // two bounds of one stage (it shifts, grows or shrinks), and a boundary
  // with its mirror S - a (in a V placement the stages a - 1 and S - a
  // share a rank). O(S) moves a round, so that large pipelines stay cheap.
  std::vector<std::vector<int>> moves;  // per move: the change of each boundary 1..S-1
  auto add = [&](int a, int da, int c, int dc) {
    std::vector<int> d(S, 0);
    d[a] = da;
    if (c > 0) d[c] = dc;
    moves.push_back(std::move(d));
  };
  for (int a = 1; a < S; ++a) {
    for (int da : {-1, 1}) add(a, da, 0, 0);
  }
  for (int a = 1; a < S; ++a) {
    std::vector<int> partners{a + 1};
    if (S - a != a + 1) partners.push_back(S - a);
    for (int c : partners) {
      if (c <= a || c >= S) continue;
      for (int da : {-1, 1}) {
        for (int dc : {-1, 1}) add(a, da, c, dc);
      }
    }
  }
  Plan best = plan;
  int64_t spent = 0;
  bool moved = true;
  while (moved && spent < kRefineSimulations) {
    moved = false;
    Plan round = best;
    for (const auto& d : moves) {
      if (spent >= kRefineSimulations) break;
      std::vector<int> starts = best.stage_starts;
      bool valid = true;
      for (int k = 1; k < S; ++k) starts[k] += d[k];
      for (int k = 1; k < S && valid; ++k) valid = starts[k] > starts[k - 1];
      if (!valid || starts[S - 1] >= n) continue;
      const Staged st = stage(sheet, starts, scale, placement);
      const Memory mem = chooseRecompute(sheet, st, b, placement, dp, {}, options.allow_recompute);
      if (!mem.fits || lowerBound(sheet, st, b, placement, mem.recompute, plan.num_microbatches) >= round.step_seconds) {
        continue;
      }
      ++spent;
      const double step = simulate(b.lowered, costModel(sheet, st, mem.recompute, dp));
      if (step < round.step_seconds * (1.0 - 1e-9)) {
        round = makePlan(plan.schedule, plan.stages_per_rank, plan.num_microbatches, plan.microbatch_samples, st,
                         plan.comm_aware_split, mem, step, dp.mode);
        round.refined_split = true;
        moved = true;
      }
    }
    best = round;
  }
  simulations += spent;
  return best;
}

// NOTE [Lighter split]: a candidate's split balances time (computeSplit),
// so its predicted peak follows the measured timings: a limit close to the
// peaks could be met in one launch and not in the next, whose calibration
// moved a boundary. Where that split does not fit, the search also tries the
// split this descent finds: from it, every move of one boundary by one unit
// is priced, the move that lowers the greatest rank peak most is taken, until
// the split fits, no move lowers the peak, or as many rounds as units ran.
// The peak it descends is the least the recompute choice reaches (every
// stage that helps recomputed), whatever the limit: so the path is the same
// under every limit, and a limit equal to the smallest peak the search names
// is met on it. Deterministic: moves in a fixed order, ties keep the earlier.
// No simulation: memory alone is priced here; the lighter split is then a
// candidate like any other.
std::vector<int> lighterSplit(const CostSheet& sheet, const SearchOptions& options, const std::vector<int>& starts,
                              double scale, const Built& b, const DataParallel& dp) {
  const auto& placement = b.lowered.stage_to_rank;
  const int S = static_cast<int>(starts.size()), n = static_cast<int>(sheet.units.size());
  CostSheet least = sheet;
  least.memory_limit = 1.0;  // over it, every stage whose recompute helps recomputes
  auto memory = [&](const CostSheet& under, const std::vector<int>& at) {
    return chooseRecompute(under, stage(sheet, at, scale, placement), b, placement, dp, {}, options.allow_recompute);
  };
  std::vector<int> best = starts;
  double peak = memory(least, best).max_peak;
  for (int round = 0; round < n && !memory(sheet, best).fits; ++round) {
    std::vector<int> next;
    double next_peak = peak;
    for (int k = 1; k < S; ++k) {
      for (int d : {-1, 1}) {
        std::vector<int> at = best;
        at[k] += d;
        if (at[k] <= at[k - 1] || (k + 1 < S && at[k] >= at[k + 1]) || at[k] >= n) continue;
        const double p = memory(least, at).max_peak;
        if (p < next_peak * (1.0 - 1e-12)) {
          next = std::move(at);
          next_peak = p;
        }
      }
    }
    if (next.empty()) break;
    best = std::move(next);
    peak = next_peak;
  }
  return best;
}

}  // namespace planner

std::vector<int> minMaxSplit(const std::vector<double>& weights, int parts) {
  using namespace planner;
  for (size_t i = 0; i < weights.size(); ++i) checkFinite(fmt::format("weights[{}]", i), weights[i]);
  const auto P = prefix(weights);
  return splitBy(static_cast<int>(weights.size()), parts, [&](int j, int i) { return P[i] - P[j]; });
}

}  // namespace mpmd
