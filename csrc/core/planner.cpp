// The planner's public entry points (planner.h): the sheet's checks, one
// given plan's evaluation, and the search, whose steps live in
// planner_search.cpp (planner_steps.h lists them).
#include "planner.h"

#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "planner_steps.h"
#include "schedules/registry.h"
#include "simulator.h"

namespace mpmd {

using planner::checkFinite;

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

namespace planner {

double simulatedStep(const Schedule& lowered, const CostModel& model) { return simulate(lowered, model).makespan; }

}  // namespace planner

Plan evaluatePlan(const CostSheet& sheet, const std::string& name, int v, int m,
                  const std::vector<int>& stage_starts, const std::vector<bool>& recompute,
                  const std::string& data_parallel) {
  using namespace planner;
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
  const double step = simulatedStep(b.lowered, costModel(sheet, st, mem.recompute, dp));
  return makePlan(name, v, m, mb, st, false, mem, step, dp.mode);
}

PlanResult planPipeline(const CostSheet& sheet, const SearchOptions& options) {
  return planner::searchPlans(sheet, options, planner::simulatedStep);
}

}  // namespace mpmd
