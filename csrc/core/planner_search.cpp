// The planner's search (planPipeline in planner.h), as the named steps that
// planner_steps.h lists: the search space, each triple's schedule, each
// candidate's evaluation, and the finish.
#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "errors.h"
#include "planner_steps.h"
#include "schedules/registry.h"
#include "schedules/table.h"

namespace mpmd::planner {

SearchSpace searchSpace(const CostSheet& sheet, const SearchOptions& options) {
  if (options.top_k < 1) throw std::invalid_argument(fmt::format("top_k={} must be >= 1", options.top_k));
  SearchSpace space;
  const auto known = scheduleNames();
  space.schedules = options.schedules.empty() ? known : options.schedules;
  for (const auto& name : space.schedules) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw std::invalid_argument(fmt::format("unknown schedule '{}'; known schedules: {}", name,
                                              fmt::join(known, ", ")));
    }
  }
  space.default_stages = options.stages_per_rank.empty();
  space.stages_per_rank = space.default_stages ? std::vector<int>{1, 2, 4} : options.stages_per_rank;
  for (int v : space.stages_per_rank) {
    if (v < 1) throw std::invalid_argument(fmt::format("stages_per_rank={} must be >= 1", v));
  }
  space.microbatch_counts = options.microbatch_counts;
  if (space.microbatch_counts.empty()) {
    for (int64_t d = 1; d <= sheet.global_batch && d <= (1 << 20); ++d) {
      if (sheet.global_batch % d == 0) space.microbatch_counts.push_back(static_cast<int>(d));
    }
  }
  for (int m : space.microbatch_counts) {
    if (m < 1 || m > sheet.global_batch || sheet.global_batch % m != 0) {
      throw std::invalid_argument(fmt::format(
          "num_microbatches={} must divide global_batch={} (a microbatch is a whole number of samples >= 1)", m,
          sheet.global_batch));
    }
  }
  space.modes = searchModes(sheet, options);
  return space;
}

bool triesTriple(const SearchSpace& space, const std::string& schedule, int v) {
  return !(v == 1 && space.default_stages && !scheduleFacts(schedule).same_at_one_stage.empty());
}

namespace {

// One search's state, filled step by step (planner_steps.h).
class Search {
 public:
  Search(const CostSheet& sheet, const SearchOptions& options, const SimulateFn& simulate)
      : sheet_(sheet), options_(options), simulate_(simulate), space_(searchSpace(sheet, options)),
        k_(static_cast<size_t>(options.top_k)) {}

  PlanResult run() {
    const int p = sheet_.pp_size, n = static_cast<int>(sheet_.units.size());
    for (const auto& name : space_.schedules) {
      for (int v : space_.stages_per_rank) {
        if (!triesTriple(space_, name, v)) continue;
        if (p * v > n) {
          result_.rejected.push_back({name, v, 0,
                                      fmt::format("pp_size={} x stages_per_rank={} = {} stages is more than the {} "
                                                  "units",
                                                  p, v, p * v, n)});
          continue;
        }
        reported_ = false;
        for (int m : space_.microbatch_counts) searchTriple(name, v, m);
      }
    }
    finishSearch();
    return std::move(result_);
  }

 private:
  // Rejects (schedule, v) once, for the first m whose schedule or lowering
  // it refuses: the same reason repeats for the others.
  void rejectTriple(const std::string& name, int v, int m, const std::string& reason) {
    if (!reported_) result_.rejected.push_back({name, v, m, reason});
    reported_ = true;
  }

  // buildTriple and every candidate of (name, v, m).
  void searchTriple(const std::string& name, int v, int m) {
    const int S = sheet_.pp_size * v;
    Schedule compute;
    try {
      compute = makeSchedule(name, ScheduleSpec{sheet_.pp_size, v, m});
    } catch (const ScheduleError& e) {  // a triple the schedule does not take
      rejectTriple(name, v, m, e.what());
      return;
    }
    any_valid_ = true;
    if (!base_splits_.count(S)) {
      base_splits_[S] = computeSplit(sheet_, S);
      comm_splits_[S] = commAwareSplit(sheet_, S);
    }
    std::vector<std::pair<const std::vector<int>*, bool>> splits = {{&base_splits_[S], false}};
    if (options_.comm_aware_split && comm_splits_[S] != base_splits_[S]) splits.push_back({&comm_splits_[S], true});
    for (const DpMode mode : space_.modes) {
      const DataParallel dp{mode, sheet_.dp_size};
      Built b;
      try {
        b = lowerFor(compute, dp);
      } catch (const ScheduleError& e) {  // a lowering pass refused it
        rejectTriple(name, v, m, e.what());
        continue;
      }
      for (const auto& [starts, comm_aware] : splits) evaluateCandidate(name, v, m, dp, b, *starts, comm_aware);
    }
  }

  // One (schedule, v, m, split, mode): memory and recompute, the over-limit
  // record, pruning, then the simulation; a candidate that fits and beats
  // the k-th best joins the top. One that does not fit is tried again on its
  // lighter split (`lighter`: this is that split).
  void evaluateCandidate(const std::string& name, int v, int m, const DataParallel& dp, const Built& b,
                         const std::vector<int>& starts, bool comm_aware, bool lighter = false) {
    ++result_.candidates;
    const int64_t mb = sheet_.global_batch / m;
    const double scale = static_cast<double>(mb) / static_cast<double>(sheet_.reference_microbatch);
    const auto& placement = b.lowered.stage_to_rank;
    const Staged st = stage(sheet_, starts, scale, placement);
    const Memory mem = chooseRecompute(sheet_, st, b, placement, dp, {}, options_.allow_recompute);
    if (mem.max_peak < smallest_peak_) {
      smallest_peak_ = mem.max_peak;
      smallest_what_ = fmt::format("{} v={} m={} ({}{}), on rank {}", name, v, m, recomputeText(mem.recompute),
                                   dpText(dp), mem.worst_rank);
    }
    const bool forced = std::find(mem.recompute.begin(), mem.recompute.end(), true) != mem.recompute.end();
    if ((!mem.fits || forced) && !lighter) recordOverLimit(name, v, m, dp, b, st);
    if (!mem.fits) {
      if (!lighter) {  // NOTE [Lighter split]
        const std::vector<int> at = lighterSplit(sheet_, options_, starts, scale, b, dp);
        if (at != starts) evaluateCandidate(name, v, m, dp, b, at, comm_aware, true);
      }
      return;
    }
    if (lowerBound(sheet_, st, b, placement, mem.recompute, m) >= kth()) return;
    double step = 0.0;
    if (!simulated(name, v, m, dp, b, st, mem.recompute, "", step)) return;
    insert(makePlan(name, v, m, mb, st, comm_aware, mem, step, dp.mode));
  }

  // The candidate without the recompute the limit forced (or with it, not
  // fitting): worth a simulation only if it might have won, to show what the
  // limit cost.
  void recordOverLimit(const std::string& name, int v, int m, const DataParallel& dp, const Built& b,
                       const Staged& st) {
    const auto& placement = b.lowered.stage_to_rank;
    const std::vector<bool> none(st.S, false);
    const Memory bare = chooseRecompute(sheet_, st, b, placement, dp, none, false);
    const double best = result_.top.empty() ? kInf : result_.top.front().step_seconds;
    if (lowerBound(sheet_, st, b, placement, none, m) >= best) return;
    const std::string over = fmt::format("peak {} on rank {} over memory_limit {}", gib(bare.max_peak),
                                         bare.worst_rank, gib(sheet_.memory_limit));
    double step = 0.0;
    if (!simulated(name, v, m, dp, b, st, none, over + "; without recompute, ", step)) return;
    Rejection r{name, v, m, over, step, bare.max_peak};
    r.data_parallel = modeName(dp.mode);
    over_.push_back(std::move(r));
  }

  // Simulates the candidate into `step`; false when the simulation failed,
  // which rejects it with `context` and the failure's message (once per
  // reason): never a candidate dropped unsaid.
  bool simulated(const std::string& name, int v, int m, const DataParallel& dp, const Built& b, const Staged& st,
                 const std::vector<bool>& rec, const std::string& context, double& step) {
    try {
      step = simulate_(b.lowered, costModel(sheet_, st, rec, dp));
    } catch (const std::exception& e) {
      Rejection r{name, v, m, fmt::format("{}simulation at m={}{} failed: {}", context, m, dpText(dp), e.what())};
      if (context.empty()) unsimulated_ = true;
      r.data_parallel = modeName(dp.mode);
      const bool seen = std::any_of(result_.rejected.begin(), result_.rejected.end(), [&](const Rejection& q) {
        return q.schedule == r.schedule && q.stages_per_rank == r.stages_per_rank && q.reason == r.reason;
      });
      if (!seen) result_.rejected.push_back(std::move(r));
      return false;
    }
    ++result_.simulations;
    return true;
  }

  // The errors for no valid triple and nothing fitting, the finalists'
  // refinement, and the over-limit candidates that would have won.
  void finishSearch() {
    std::vector<Plan>& top = result_.top;
    if (!any_valid_) {
      std::string why;
      for (const auto& r : result_.rejected) {
        why += fmt::format("\n  {} v={}: {}", r.schedule, r.stages_per_rank, r.reason);
      }
      throw std::invalid_argument(fmt::format(
          "no (schedule, stages_per_rank, num_microbatches) is valid for pp_size={} and global_batch={}:{}",
          sheet_.pp_size, sheet_.global_batch, why));
    }
    if (top.empty() && unsimulated_) {  // some fitted, and every one of those failed its simulation
      std::string why;
      for (const auto& r : result_.rejected) {
        why += fmt::format("\n  {} v={}: {}", r.schedule, r.stages_per_rank, r.reason);
      }
      throw std::invalid_argument(fmt::format("no plan that fits could be simulated:{}", why));
    }
    if (top.empty()) {
      throw std::invalid_argument(fmt::format(
          "no plan fits memory_limit={} per rank: the smallest predicted peak is {}, from {}; it needs a limit of at "
          "least that, more pipeline ranks, or less per rank (smaller microbatches, less optimizer state)",
          gib(sheet_.memory_limit), gib(smallest_peak_), smallest_what_));
    }
    if (options_.refine_split) {  // NOTE [Split refinement]
      for (auto& plan : top) plan = refineSplit(sheet_, options_, plan, result_.simulations, simulate_);
      std::stable_sort(top.begin(), top.end(), better);
    }
    result_.best = top.front();
    std::stable_sort(over_.begin(), over_.end(),
                     [](const Rejection& a, const Rejection& b) { return a.step_seconds < b.step_seconds; });
    size_t kept = 0;
    for (auto& r : over_) {
      if (kept == k_ || !(r.step_seconds < result_.best.step_seconds)) break;
      bool dup = false;
      for (const auto& q : result_.rejected) {
        dup |= q.schedule == r.schedule && q.stages_per_rank == r.stages_per_rank &&
               q.num_microbatches == r.num_microbatches && q.data_parallel == r.data_parallel && q.reason == r.reason;
      }
      if (dup) continue;
      result_.rejected.push_back(std::move(r));
      ++kept;
    }
  }

  static std::string dpText(const DataParallel& dp) {
    return dp.on() ? fmt::format(", data_parallel={}", modeName(dp.mode)) : "";
  }

  double kth() const { return result_.top.size() < k_ ? kInf : result_.top.back().step_seconds; }

  // Into the top, best first, one plan per (schedule, v, m, mode), at most k.
  void insert(Plan plan) {
    std::vector<Plan>& top = result_.top;
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
    if (top.size() > k_) top.pop_back();
  }

  const CostSheet& sheet_;
  const SearchOptions& options_;
  const SimulateFn& simulate_;
  const SearchSpace space_;
  const size_t k_;
  PlanResult result_;
  std::vector<Rejection> over_;  // simulated without the recompute the limit forced, or not fitting
  std::map<int, std::vector<int>> base_splits_, comm_splits_;
  double smallest_peak_ = kInf;
  std::string smallest_what_;
  bool any_valid_ = false;
  bool reported_ = false;     // (schedule, v) already rejected
  bool unsimulated_ = false;  // a candidate that fits failed its simulation
};

}  // namespace

PlanResult searchPlans(const CostSheet& sheet, const SearchOptions& options, const SimulateFn& simulate) {
  const auto t0 = std::chrono::steady_clock::now();
  checkSheet(sheet);
  PlanResult result = Search(sheet, options, simulate).run();
  result.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace mpmd::planner
