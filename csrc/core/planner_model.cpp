// The planner's model of one candidate: its stages at a microbatch size,
// the memory it needs (NOTE [Planner memory model]), the recompute it takes
// (NOTE [Recompute choice]) and the simulator's costs of its actions (NOTE
// [Data-parallel modes]). The steps are declared in planner_steps.h.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "lowering.h"
#include "planner_steps.h"

namespace mpmd::planner {

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

const char* modeName(DpMode mode) { return mode == DpMode::Shard ? "shard" : "replicate"; }

DpMode parseMode(const std::string& name) {
  if (name == "replicate") return DpMode::Replicate;
  if (name == "shard") return DpMode::Shard;
  throw std::invalid_argument(fmt::format("data_parallel='{}' is not a mode; known: replicate, shard", name));
}

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

namespace {

double linkBandwidth(const CostSheet& sheet, int rank_a, int rank_b) {
  if (sheet.ranks_per_node > 0 && rank_a / sheet.ranks_per_node != rank_b / sheet.ranks_per_node &&
      sheet.inter_node_bandwidth > 0.0) {
    return sheet.inter_node_bandwidth;
  }
  return sheet.link_bandwidth;
}

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

}  // namespace

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

}  // namespace mpmd::planner
