#include "planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "errors.h"
#include "lowering.h"
#include "schedules/registry.h"
#include "simulator.h"

namespace mpmd {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// "1.50 GiB (1610612736 bytes)": readable, and exact for a caller that parses it.
std::string gib(double bytes) {
  const double kib = 1024.0, mib = kib * 1024, gib = mib * 1024;
  if (bytes >= gib) return fmt::format("{:.2f} GiB ({:.0f} bytes)", bytes / gib, bytes);
  if (bytes >= mib) return fmt::format("{:.2f} MiB ({:.0f} bytes)", bytes / mib, bytes);
  return fmt::format("{:.2f} KiB ({:.0f} bytes)", bytes / kib, bytes);
}

void checkFinite(const std::string& what, double value) {
  if (!std::isfinite(value) || value < 0.0) {
    throw std::invalid_argument(fmt::format("{}={} must be a finite number >= 0", what, value));
  }
}

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

// NOTE [Data-parallel modes]: the mode and the replicas' count.
enum class DpMode { Replicate, Shard };

struct DataParallel {
  DpMode mode = DpMode::Replicate;
  int size = 1;
  bool on() const { return size > 1; }
  bool sharded() const { return size > 1 && mode == DpMode::Shard; }
};

const char* modeName(DpMode mode) { return mode == DpMode::Shard ? "shard" : "replicate"; }

DpMode parseMode(const std::string& name) {
  if (name == "replicate") return DpMode::Replicate;
  if (name == "shard") return DpMode::Shard;
  throw std::invalid_argument(fmt::format("data_parallel='{}' is not a mode; known: replicate, shard", name));
}

// What the memory walk of one rank's lowered program sees (NOTE [Planner
// memory model]), per stage.
enum class MemEvent : uint8_t {
  Hold,       // F: the stage's saved bytes of one microbatch
  Free,       // B, or W where the backward is split: they are freed
  FirstGrad,  // the stage's first gradient-producing action of the step
  Gather,     // UNSHARD: the all-gather's buffers
  Ready,      // the window's first compute: full parameters in, buffers out
  Release,    // RESHARD: the full parameters freed
  Reduce,     // REDUCE_GRAD
};

// A (schedule, v, m) triple lowered for one data-parallel mode.
struct Built {
  Schedule lowered;
  std::vector<std::vector<std::pair<int, MemEvent>>> events;  // per rank, in program order
  std::vector<int64_t> actions;                               // per rank, in the lowered program
};

Built lowerFor(const Schedule& compute, const DataParallel& dp) {
  const bool split = compute.splitsBackward();
  LowerOptions options;
  options.grad_reduce = dp.on();   // no reduction without replicas
  options.shard = dp.sharded();    // default ShardOptions, as the runtime lowers
  Built b;
  b.lowered = lower(compute, options);
  const int p = b.lowered.num_ranks, S = b.lowered.num_stages;
  b.events.resize(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    const auto& program = b.lowered.programs[r];
    auto& ev = b.events[r];
    ev.reserve(program.size());
    std::vector<bool> gathering(static_cast<size_t>(S), false), graded(static_cast<size_t>(S), false);
    for (const Action& a : program) {
      const int s = a.stage;
      if (isCompute(a.kind) && gathering[s]) {
        ev.emplace_back(s, MemEvent::Ready);
        gathering[s] = false;
      }
      switch (a.kind) {
        case ActionKind::Forward: ev.emplace_back(s, MemEvent::Hold); break;
        case ActionKind::FullBackward:
        case ActionKind::BackwardWeight:
          if (!graded[s]) ev.emplace_back(s, MemEvent::FirstGrad);
          graded[s] = true;
          if (a.kind == ActionKind::FullBackward || split) ev.emplace_back(s, MemEvent::Free);
          break;
        case ActionKind::Unshard:
          ev.emplace_back(s, MemEvent::Gather);
          gathering[s] = true;
          break;
        case ActionKind::Reshard: ev.emplace_back(s, MemEvent::Release); break;
        case ActionKind::ReduceGrad: ev.emplace_back(s, MemEvent::Reduce); break;
        default: break;
      }
    }
  }
  for (const auto& program : b.lowered.programs) b.actions.push_back(static_cast<int64_t>(program.size()));
  return b;
}

// The modes the search tries (NOTE [Data-parallel modes]).
std::vector<DpMode> searchModes(const CostSheet& sheet, const SearchOptions& options) {
  if (options.data_parallel.empty()) {
    return sheet.dp_size > 1 ? std::vector<DpMode>{DpMode::Replicate, DpMode::Shard}
                             : std::vector<DpMode>{DpMode::Replicate};
  }
  std::vector<DpMode> modes;
  for (const auto& name : options.data_parallel) {
    const DpMode mode = parseMode(name);
    if (std::find(modes.begin(), modes.end(), mode) == modes.end()) modes.push_back(mode);
  }
  return modes;
}

// Everything about the sheet at one microbatch size and one split.
struct Staged {
  int S = 0;
  std::vector<int> starts;
  std::vector<double> F, I, W;          // per stage, at this microbatch size
  std::vector<double> saved, input, output, params;  // bytes per stage
  std::vector<double> link_seconds;     // per producing stage: bytes / bandwidth of its link
};

double linkBandwidth(const CostSheet& sheet, int rank_a, int rank_b) {
  if (sheet.ranks_per_node > 0 && rank_a / sheet.ranks_per_node != rank_b / sheet.ranks_per_node &&
      sheet.inter_node_bandwidth > 0.0) {
    return sheet.inter_node_bandwidth;
  }
  return sheet.link_bandwidth;
}

Staged stage(const CostSheet& sheet, const std::vector<int>& starts, double scale,
             const std::vector<int>& placement) {
  Staged st;
  st.S = static_cast<int>(starts.size());
  st.starts = starts;
  const int n = static_cast<int>(sheet.units.size());
  for (int s = 0; s < st.S; ++s) {
    const int begin = starts[s], end = s + 1 < st.S ? starts[s + 1] : n;
    double f = 0, i = 0, w = 0, saved = 0, params = 0;
    for (int u = begin; u < end; ++u) {
      const UnitCost& c = sheet.units[u];
      // NOTE [Microbatch scaling]: the fixed part does not scale.
      f += c.forward_fixed + (c.forward - c.forward_fixed) * scale;
      i += c.backward_input_fixed + (c.backward_input - c.backward_input_fixed) * scale;
      w += c.backward_weight_fixed + (c.backward_weight - c.backward_weight_fixed) * scale;
      saved += c.saved_bytes + (u > begin ? c.saved_input_bytes : 0.0);
      params += c.param_bytes;
    }
    if (begin == 0) {
      // NOTE [The first stage's backward]: the model's inputs carry no
      // gradient, so the runtime's I program of the first stage computes
      // nothing and its W runs the whole backward (the gradients flowing
      // back through its units, then their weights'); the units' own I/W
      // split, measured unit by unit, does not hold for it. In the
      // zero-bubble schedules, which put W last, this decides the first
      // rank's tail (measured: I 0.1 ms, W 14.3 ms, where the units said
      // 8.2 and 6.1).
      w += i;
      i = 0.0;
    }
    st.F.push_back(f);
    st.I.push_back(i);
    st.W.push_back(w);
    st.saved.push_back(saved * scale);
    st.params.push_back(params);
    st.input.push_back((begin == 0 ? sheet.input_bytes : sheet.units[begin - 1].output_bytes) * scale);
    st.output.push_back(sheet.units[end - 1].output_bytes * scale);
    double seconds = 0.0;
    if (s + 1 < st.S) {
      const double bw = linkBandwidth(sheet, placement[s], placement[s + 1]);
      seconds = bw > 0.0 ? st.output.back() / bw : 0.0;
    }
    st.link_seconds.push_back(seconds);
  }
  return st;
}

struct Memory {
  std::vector<double> peak;  // per rank
  std::vector<bool> recompute;
  bool fits = true;
  double max_peak = 0.0;
  int worst_rank = 0;
};

double savedOf(const Staged& st, const std::vector<bool>& rec, int s) {
  return rec[s] ? st.input[s] : st.saved[s];
}

// NOTE [Planner memory model] for one rank.
double rankPeak(const CostSheet& sheet, const Staged& st, const Built& b, const std::vector<int>& placement,
                const std::vector<bool>& rec, const DataParallel& dp, int r) {
  const double g = sheet.grad_bytes_per_param_byte;
  const double state = 1.0 + g + sheet.optimizer_bytes_per_param_byte;
  const double d = static_cast<double>(dp.size);
  const bool shard = dp.sharded();
  double fixed = 0.0, transient = 0.0;
  for (int s = 0; s < st.S; ++s) {
    if (placement[s] != r) continue;
    fixed += st.params[s] * (shard ? state / d : state);
    if (s > 0 && placement[s - 1] != r) fixed += st.input[s];
    if (s + 1 < st.S && placement[s + 1] != r) fixed += st.output[s];
    if (rec[s]) transient = std::max(transient, st.saved[s]);
  }
  double live = 0.0, peak = 0.0;
  for (const auto& [s, event] : b.events[r]) {
    const double P = st.params[s];
    switch (event) {
      case MemEvent::Hold: live += savedOf(st, rec, s); break;
      case MemEvent::Free: live -= savedOf(st, rec, s); break;
      case MemEvent::FirstGrad:
        if (shard) live += g * P;  // full gradients (replicate: counted in `fixed`)
        break;
      case MemEvent::Gather: live += P + P / d; break;  // the gather's output and input
      case MemEvent::Ready:
        live += P;  // the full parameters, while the gather's buffers still live
        peak = std::max(peak, live);
        live -= P + P / d;
        break;
      case MemEvent::Release: live -= P; break;
      case MemEvent::Reduce:
        live += g * P;  // replicate: the increments' buffer; shard: the reduce-scatter's table
        if (shard) {
          peak = std::max(peak, live);
          live += g * P / d - g * P;  // its output shard in, the full gradients out
        }
        break;
    }
    peak = std::max(peak, live);
  }
  return fixed + peak + transient;
}

// NOTE [Recompute choice].
Memory chooseRecompute(const CostSheet& sheet, const Staged& st, const Built& b, const std::vector<int>& placement,
                       const DataParallel& dp, const std::vector<bool>& forced, bool allow) {
  Memory mem;
  const int p = static_cast<int>(b.events.size());
  mem.recompute = forced.empty() ? std::vector<bool>(st.S, false) : forced;
  mem.peak.assign(p, 0.0);
  const double limit = sheet.memory_limit;
  for (int r = 0; r < p; ++r) {
    double peak = rankPeak(sheet, st, b, placement, mem.recompute, dp, r);
    if (forced.empty() && allow && limit > 0.0 && peak > limit) {
      std::vector<int> order;
      for (int s = 0; s < st.S; ++s) {
        if (placement[s] == r && st.saved[s] > st.input[s]) order.push_back(s);
      }
      std::stable_sort(order.begin(), order.end(), [&](int a, int c) {
        return st.saved[a] - st.input[a] > st.saved[c] - st.input[c];
      });
      for (int s : order) {
        mem.recompute[s] = true;
        peak = rankPeak(sheet, st, b, placement, mem.recompute, dp, r);
        if (peak <= limit) break;
      }
    }
    mem.peak[r] = peak;
    if (peak > mem.max_peak) {
      mem.max_peak = peak;
      mem.worst_rank = r;
    }
  }
  mem.fits = limit <= 0.0 || mem.max_peak <= limit;
  return mem;
}

// Seconds of a ring collective over dp.size ranks moving `bytes` (the full
// tensor's): `rounds` = 1 for an all-gather or reduce-scatter, 2 for an
// all-reduce (NOTE [Data-parallel modes]).
double ringSeconds(const CostSheet& sheet, const DataParallel& dp, double bytes, int rounds) {
  const double d = static_cast<double>(dp.size);
  const double latency = sheet.dp_latency.value_or(sheet.link_latency);
  const double bandwidth = sheet.dp_bandwidth.value_or(sheet.link_bandwidth);
  const double steps = rounds * (d - 1.0);
  return steps * latency + (bandwidth > 0.0 ? steps / d * bytes / bandwidth : 0.0);
}

CostModel costModel(const CostSheet& sheet, const Staged& st, const std::vector<bool>& rec,
                    const DataParallel& dp) {
  CostModel model;
  model.stage_costs.resize(st.S);
  const double g = sheet.grad_bytes_per_param_byte;
  for (int s = 0; s < st.S; ++s) {
    KindCosts& c = model.stage_costs[s];
    const double extra = rec[s] ? st.F[s] : 0.0;  // recompute: one more forward before the backward
    c.forward = st.F[s];
    c.backward = st.I[s] + st.W[s] + extra;
    c.backward_input = st.I[s] + extra;
    c.backward_weight = st.W[s];
    c.reduce_grad = 0.0;
    c.unshard = 0.0;
    c.reshard = 0.0;
    if (dp.sharded()) {
      c.unshard = ringSeconds(sheet, dp, st.params[s], 1);
      c.reduce_grad = ringSeconds(sheet, dp, g * st.params[s], 1);
    } else if (dp.on()) {
      c.reduce_grad = ringSeconds(sheet, dp, g * st.params[s], 2);
    }
  }
  model.comm_latency = sheet.link_latency;
  model.action_overhead = sheet.action_overhead;
  model.step_overhead = sheet.step_overhead;
  // Per-link rates: each producer's bytes expressed as seconds at bandwidth 1.
  model.comm_bandwidth = 1.0;
  model.stage_output_bytes = st.link_seconds;
  return model;
}

// The busiest rank's compute plus its per-action overhead: no simulation can
// finish earlier (NOTE [Planner pruning]).
double lowerBound(const CostSheet& sheet, const Staged& st, const Built& b, const std::vector<int>& placement,
                  const std::vector<bool>& rec, int m) {
  std::vector<double> busy(b.actions.size(), 0.0);
  for (int s = 0; s < st.S; ++s) {
    busy[placement[s]] += m * (st.F[s] + st.I[s] + st.W[s] + (rec[s] ? st.F[s] : 0.0));
  }
  double bound = 0.0;
  for (size_t r = 0; r < busy.size(); ++r) {
    bound = std::max(bound, busy[r] + sheet.action_overhead * static_cast<double>(b.actions[r]));
  }
  return bound + sheet.step_overhead;
}

Plan makePlan(const std::string& name, int v, int m, int64_t mb_samples, const Staged& st, bool comm_aware,
              const Memory& mem, double step, DpMode mode) {
  Plan plan;
  plan.data_parallel = modeName(mode);
  plan.schedule = name;
  plan.stages_per_rank = v;
  plan.num_microbatches = m;
  plan.microbatch_samples = mb_samples;
  plan.stage_starts = st.starts;
  plan.recompute = mem.recompute;
  plan.comm_aware_split = comm_aware;
  plan.step_seconds = step;
  plan.peak_bytes = mem.peak;
  for (int s = 0; s < st.S; ++s) {
    plan.stage_seconds.push_back(st.F[s] + st.I[s] + st.W[s] + (mem.recompute[s] ? st.F[s] : 0.0));
  }
  return plan;
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

bool better(const Plan& a, const Plan& b) {
  if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
  // NOTE [Data-parallel modes]: on equal steps, replicate.
  if (a.data_parallel != b.data_parallel) return a.data_parallel == "replicate";
  const double pa = *std::max_element(a.peak_bytes.begin(), a.peak_bytes.end());
  const double pb = *std::max_element(b.peak_bytes.begin(), b.peak_bytes.end());
  return pa < pb;
}

std::string recomputeText(const std::vector<bool>& rec) {
  int on = 0;
  for (bool b : rec) on += b;
  if (on == 0) return "no recompute";
  return fmt::format("recompute on {} of {} stages", on, rec.size());
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

Plan refineSplit(const CostSheet& sheet, const SearchOptions& options, const Plan& plan, int64_t& simulations) {
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
      const double step = simulate(b.lowered, costModel(sheet, st, mem.recompute, dp)).makespan;
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

}  // namespace

void checkSheet(const CostSheet& sheet) {
  if (sheet.units.empty()) throw std::invalid_argument("the cost sheet has no units");
  for (size_t u = 0; u < sheet.units.size(); ++u) {
    const UnitCost& c = sheet.units[u];
    const std::string where = fmt::format("units[{}] ('{}').", u, c.name);
    checkFinite(where + "forward", c.forward);
    checkFinite(where + "backward_input", c.backward_input);
    checkFinite(where + "backward_weight", c.backward_weight);
    const std::pair<double, double> parts[] = {{c.forward_fixed, c.forward},
                                               {c.backward_input_fixed, c.backward_input},
                                               {c.backward_weight_fixed, c.backward_weight}};
    const char* names[] = {"forward_fixed", "backward_input_fixed", "backward_weight_fixed"};
    for (int k = 0; k < 3; ++k) {
      checkFinite(where + names[k], parts[k].first);
      if (parts[k].first > parts[k].second) {
        throw std::invalid_argument(fmt::format("{}{}={} must be at most the time it is part of, {}",
                                                where, names[k], parts[k].first, parts[k].second));
      }
    }
    checkFinite(where + "saved_bytes", c.saved_bytes);
    checkFinite(where + "saved_input_bytes", c.saved_input_bytes);
    checkFinite(where + "param_bytes", c.param_bytes);
    checkFinite(where + "output_bytes", c.output_bytes);
  }
  if (sheet.pp_size < 1) throw std::invalid_argument(fmt::format("pp_size={} must be >= 1", sheet.pp_size));
  if (static_cast<size_t>(sheet.pp_size) > sheet.units.size()) {
    throw std::invalid_argument(fmt::format("pp_size={} is more than the sheet's {} units: every rank needs a unit",
                                            sheet.pp_size, sheet.units.size()));
  }
  if (sheet.global_batch < 1) {
    throw std::invalid_argument(fmt::format("global_batch={} must be >= 1", sheet.global_batch));
  }
  if (sheet.reference_microbatch < 1) {
    throw std::invalid_argument(fmt::format("reference_microbatch={} must be >= 1", sheet.reference_microbatch));
  }
  if (sheet.ranks_per_node < 0) {
    throw std::invalid_argument(fmt::format("ranks_per_node={} must be >= 0", sheet.ranks_per_node));
  }
  checkFinite("input_bytes", sheet.input_bytes);
  checkFinite("action_overhead", sheet.action_overhead);
  checkFinite("step_overhead", sheet.step_overhead);
  checkFinite("link_latency", sheet.link_latency);
  checkFinite("link_bandwidth", sheet.link_bandwidth);
  checkFinite("inter_node_bandwidth", sheet.inter_node_bandwidth);
  checkFinite("grad_bytes_per_param_byte", sheet.grad_bytes_per_param_byte);
  checkFinite("optimizer_bytes_per_param_byte", sheet.optimizer_bytes_per_param_byte);
  checkFinite("memory_limit", sheet.memory_limit);
  if (sheet.dp_size < 1) throw std::invalid_argument(fmt::format("dp_size={} must be >= 1", sheet.dp_size));
  if (sheet.dp_latency) checkFinite("dp_latency", *sheet.dp_latency);
  if (sheet.dp_bandwidth) checkFinite("dp_bandwidth", *sheet.dp_bandwidth);
}

std::vector<int> minMaxSplit(const std::vector<double>& weights, int parts) {
  for (size_t i = 0; i < weights.size(); ++i) checkFinite(fmt::format("weights[{}]", i), weights[i]);
  const auto P = prefix(weights);
  return splitBy(static_cast<int>(weights.size()), parts, [&](int j, int i) { return P[i] - P[j]; });
}

Plan evaluatePlan(const CostSheet& sheet, const std::string& name, int v, int m,
                  const std::vector<int>& stage_starts, const std::vector<bool>& recompute,
                  const std::string& data_parallel) {
  checkSheet(sheet);
  const DataParallel dp{parseMode(data_parallel), sheet.dp_size};
  const int p = sheet.pp_size, S = p * v, n = static_cast<int>(sheet.units.size());
  if (v < 1 || m < 1) {
    throw std::invalid_argument(fmt::format("stages_per_rank={} and num_microbatches={} must be >= 1", v, m));
  }
  if (static_cast<int>(stage_starts.size()) != S) {
    throw std::invalid_argument(fmt::format("stage_starts has {} entries; pp_size={} x stages_per_rank={} needs {}",
                                            stage_starts.size(), p, v, S));
  }
  for (int s = 0; s < S; ++s) {
    const int lo = s == 0 ? 0 : stage_starts[s - 1] + 1;
    if ((s == 0 && stage_starts[0] != 0) || stage_starts[s] < lo || stage_starts[s] >= n) {
      throw std::invalid_argument(fmt::format(
          "stage_starts[{}]={} is not a valid start: starts must begin at 0 and increase, below {} units", s,
          stage_starts[s], n));
    }
  }
  if (!recompute.empty() && static_cast<int>(recompute.size()) != S) {
    throw std::invalid_argument(fmt::format("recompute has {} flags for {} stages", recompute.size(), S));
  }
  if (sheet.global_batch % m != 0) {
    throw std::invalid_argument(fmt::format("num_microbatches={} must divide global_batch={}", m, sheet.global_batch));
  }
  const int64_t mb = sheet.global_batch / m;
  const double scale = static_cast<double>(mb) / static_cast<double>(sheet.reference_microbatch);
  const Built b = lowerFor(makeSchedule(name, ScheduleSpec{p, v, m}), dp);
  const auto placement = b.lowered.stage_to_rank;
  const Staged st = stage(sheet, stage_starts, scale, placement);
  const Memory mem = chooseRecompute(sheet, st, b, placement, dp,
                                     recompute.empty() ? std::vector<bool>(S, false) : recompute, false);
  const double step = simulate(b.lowered, costModel(sheet, st, mem.recompute, dp)).makespan;
  return makePlan(name, v, m, mb, st, false, mem, step, dp.mode);
}

PlanResult planPipeline(const CostSheet& sheet, const SearchOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  checkSheet(sheet);
  if (options.top_k < 1) throw std::invalid_argument(fmt::format("top_k={} must be >= 1", options.top_k));
  const auto known = scheduleNames();
  std::vector<std::string> names = options.schedules.empty() ? known : options.schedules;
  for (const auto& name : names) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw std::invalid_argument(fmt::format("unknown schedule '{}'; known schedules: {}", name,
                                              fmt::join(known, ", ")));
    }
  }
  const std::vector<int> vs = options.stages_per_rank.empty() ? std::vector<int>{1, 2, 4} : options.stages_per_rank;
  for (int v : vs) {
    if (v < 1) throw std::invalid_argument(fmt::format("stages_per_rank={} must be >= 1", v));
  }
  std::vector<int> ms = options.microbatch_counts;
  if (ms.empty()) {
    for (int64_t d = 1; d <= sheet.global_batch && d <= (1 << 20); ++d) {
      if (sheet.global_batch % d == 0) ms.push_back(static_cast<int>(d));
    }
  }
  for (int m : ms) {
    if (m < 1 || m > sheet.global_batch || sheet.global_batch % m != 0) {
      throw std::invalid_argument(fmt::format(
          "num_microbatches={} must divide global_batch={} (a microbatch is a whole number of samples >= 1)", m,
          sheet.global_batch));
    }
  }
  const std::vector<DpMode> modes = searchModes(sheet, options);
  const int p = sheet.pp_size, n = static_cast<int>(sheet.units.size());
  const size_t k = static_cast<size_t>(options.top_k);

  PlanResult result;
  std::vector<Plan>& top = result.top;
  std::vector<Rejection> over;  // simulated without the recompute the limit forced, or not fitting
  std::map<int, std::vector<int>> base_splits, comm_splits;
  double smallest_peak = kInf;
  std::string smallest_what;
  bool any_valid = false;

  auto kth = [&]() { return top.size() < k ? kInf : top.back().step_seconds; };
  auto insert = [&](Plan plan) {
    for (auto it = top.begin(); it != top.end(); ++it) {
      if (it->schedule == plan.schedule && it->stages_per_rank == plan.stages_per_rank &&
          it->num_microbatches == plan.num_microbatches && it->data_parallel == plan.data_parallel) {
        if (!better(plan, *it)) return;
        top.erase(it);
        break;
      }
    }
    auto pos = std::find_if(top.begin(), top.end(), [&](const Plan& q) { return better(plan, q); });
    top.insert(pos, std::move(plan));
    if (top.size() > k) top.pop_back();
  };

  for (const auto& name : names) {
    for (int v : vs) {
      if (v == 1 && options.stages_per_rank.empty() && (name == "interleaved_1f1b" || name == "looped_bfs")) {
        continue;  // 1f1b and gpipe
      }
      const int S = p * v;
      if (S > n) {
        result.rejected.push_back({name, v, 0,
                                   fmt::format("pp_size={} x stages_per_rank={} = {} stages is more than the {} units",
                                               p, v, S, n)});
        continue;
      }
      bool reported = false;
      for (int m : ms) {
        Schedule compute;
        try {
          compute = makeSchedule(name, ScheduleSpec{p, v, m});
        } catch (const std::exception& e) {  // ScheduleError: the triple is not one the schedule takes
          if (!reported) result.rejected.push_back({name, v, m, e.what()});
          reported = true;
          continue;
        }
        any_valid = true;
        const int64_t mb = sheet.global_batch / m;
        const double scale = static_cast<double>(mb) / static_cast<double>(sheet.reference_microbatch);
        if (!base_splits.count(S)) {
          base_splits[S] = computeSplit(sheet, S);
          comm_splits[S] = commAwareSplit(sheet, S);
        }
        std::vector<std::pair<const std::vector<int>*, bool>> splits = {{&base_splits[S], false}};
        if (options.comm_aware_split && comm_splits[S] != base_splits[S]) splits.push_back({&comm_splits[S], true});
        for (const DpMode mode : modes) {
          const DataParallel dp{mode, sheet.dp_size};
          Built b;
          try {
            b = lowerFor(compute, dp);
          } catch (const std::exception& e) {  // ScheduleError from a lowering pass
            if (!reported) result.rejected.push_back({name, v, m, e.what()});
            reported = true;
            continue;
          }
          const auto& placement = b.lowered.stage_to_rank;
          const std::string dp_text = dp.on() ? fmt::format(", data_parallel={}", modeName(mode)) : "";
          for (const auto& [starts, comm_aware] : splits) {
            ++result.candidates;
            const Staged st = stage(sheet, *starts, scale, placement);
            const Memory mem = chooseRecompute(sheet, st, b, placement, dp, {}, options.allow_recompute);
            if (mem.max_peak < smallest_peak) {
              smallest_peak = mem.max_peak;
              smallest_what = fmt::format("{} v={} m={} ({}{}), on rank {}", name, v, m,
                                          recomputeText(mem.recompute), dp_text, mem.worst_rank);
            }
            const bool forced = std::find(mem.recompute.begin(), mem.recompute.end(), true) != mem.recompute.end();
            if (!mem.fits || forced) {
              // The plan without the recompute the limit forced (or with it, not
              // fitting): worth a simulation only if it might have won.
              const std::vector<bool> none(st.S, false);
              const Memory bare = chooseRecompute(sheet, st, b, placement, dp, none, false);
              const double bound = lowerBound(sheet, st, b, placement, none, m);
              const double best = top.empty() ? kInf : top.front().step_seconds;
              if (bound < best) {
                try {
                  const double step = simulate(b.lowered, costModel(sheet, st, none, dp)).makespan;
                  ++result.simulations;
                  Rejection r{name, v, m,
                              fmt::format("peak {} on rank {} over memory_limit {}", gib(bare.max_peak),
                                          bare.worst_rank, gib(sheet.memory_limit)),
                              step, bare.max_peak};
                  r.data_parallel = modeName(mode);
                  over.push_back(std::move(r));
                } catch (const std::exception&) {
                }
              }
            }
            if (!mem.fits) continue;
            if (lowerBound(sheet, st, b, placement, mem.recompute, m) >= kth()) continue;
            double step;
            try {
              step = simulate(b.lowered, costModel(sheet, st, mem.recompute, dp)).makespan;
            } catch (const std::exception& e) {  // DeadlockError
              if (!reported) result.rejected.push_back({name, v, m, e.what()});
              reported = true;
              continue;
            }
            ++result.simulations;
            insert(makePlan(name, v, m, mb, st, comm_aware, mem, step, mode));
          }
        }
      }
    }
  }
  if (!any_valid) {
    std::string why;
    for (const auto& r : result.rejected) why += fmt::format("\n  {} v={}: {}", r.schedule, r.stages_per_rank, r.reason);
    throw std::invalid_argument(fmt::format("no (schedule, stages_per_rank, num_microbatches) is valid for pp_size={} "
                                            "and global_batch={}:{}",
                                            p, sheet.global_batch, why));
  }
  if (top.empty()) {
    throw std::invalid_argument(fmt::format(
        "no plan fits memory_limit={} per rank: the smallest predicted peak is {}, from {}; it needs a limit of at "
        "least that, more pipeline ranks, or less per rank (smaller microbatches, less optimizer state)",
        gib(sheet.memory_limit), gib(smallest_peak), smallest_what));
  }
  if (options.refine_split) {  // NOTE [Split refinement]
    for (auto& plan : top) plan = refineSplit(sheet, options, plan, result.simulations);
    std::stable_sort(top.begin(), top.end(), better);
  }
  result.best = top.front();
  // Over-limit candidates that would have beaten the winner, fastest first.
  std::stable_sort(over.begin(), over.end(),
                   [](const Rejection& a, const Rejection& b) { return a.step_seconds < b.step_seconds; });
  size_t kept = 0;
  for (auto& r : over) {
    if (kept == k || !(r.step_seconds < result.best.step_seconds)) break;
    bool dup = false;
    for (const auto& q : result.rejected) {
      dup |= q.schedule == r.schedule && q.stages_per_rank == r.stages_per_rank &&
             q.num_microbatches == r.num_microbatches && q.data_parallel == r.data_parallel && q.reason == r.reason;
    }
    if (dup) continue;
    result.rejected.push_back(std::move(r));
    ++kept;
  }
  result.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace mpmd
