// The planner's steps (planner.h says what the search does; this header says
// how, one named step at a time). Internal to csrc/core: planner.cpp,
// planner_model.cpp, planner_split.cpp and planner_search.cpp share it, and
// the GTests call the steps directly. Not part of the public API.
//
// The search (searchPlans) runs, for each (schedule, v, m) of its space:
//   buildTriple      the schedule and its lowering per data-parallel mode;
//                    a ScheduleError there rejects the triple;
//   then per split and mode, evaluateCandidate:
//     stage            the sheet's costs and bytes per stage at this m;
//     chooseRecompute  NOTE [Recompute choice];
//     recordOverLimit  what the limit (or its forced recompute) cost;
//     lowerBound       NOTE [Planner pruning];
//     the simulation   through the search's SimulateFn; a failure rejects
//                      the candidate with its reason;
// and then finishSearch: the errors for no valid triple or nothing fitting,
// refineSplit on the finalists, the over-limit rejections worth showing.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "planner.h"
#include "schedule.h"
#include "simulator.h"

namespace mpmd::planner {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// "1.50 GiB (1610612736 bytes)": readable, and exact for a caller that parses it.
std::string gib(double bytes);

// std::invalid_argument "{what}={value} must be a finite number >= 0" unless it is.
void checkFinite(const std::string& what, double value);

// ---------------------------------------------------------------- data parallel
// NOTE [Data-parallel modes]: the mode and the replicas' count.
enum class DpMode { Replicate, Shard };

struct DataParallel {
  DpMode mode = DpMode::Replicate;
  int size = 1;
  bool on() const { return size > 1; }
  bool sharded() const { return size > 1 && mode == DpMode::Shard; }
};

const char* modeName(DpMode mode);
// std::invalid_argument naming an unknown mode.
DpMode parseMode(const std::string& name);
// The modes the search tries: options.data_parallel, or both with dp_size > 1.
std::vector<DpMode> searchModes(const CostSheet& sheet, const SearchOptions& options);

// ---------------------------------------------------------------- the model
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

// Lowers `compute` as the runtime does for `dp`; ScheduleError from a pass.
Built lowerFor(const Schedule& compute, const DataParallel& dp);

// Everything about the sheet at one microbatch size and one split.
struct Staged {
  int S = 0;
  std::vector<int> starts;
  std::vector<double> F, I, W;                       // per stage, at this microbatch size
  std::vector<double> saved, input, output, params;  // bytes per stage
  std::vector<double> link_seconds;  // per producing stage: bytes / bandwidth of its link
};

// The stages that start at `starts` (valid: increasing from 0, below the
// unit count), at `scale` = microbatch samples / reference_microbatch.
Staged stage(const CostSheet& sheet, const std::vector<int>& starts, double scale,
             const std::vector<int>& placement);

struct Memory {
  std::vector<double> peak;  // per rank
  std::vector<bool> recompute;
  bool fits = true;
  double max_peak = 0.0;
  int worst_rank = 0;
};

// NOTE [Recompute choice]: the predicted peaks with `forced` recompute flags,
// or (forced empty, allow) with the recompute the limit needs.
Memory chooseRecompute(const CostSheet& sheet, const Staged& st, const Built& b, const std::vector<int>& placement,
                       const DataParallel& dp, const std::vector<bool>& forced, bool allow);

// The simulator's costs of the staged sheet with recompute flags `rec`.
CostModel costModel(const CostSheet& sheet, const Staged& st, const std::vector<bool>& rec, const DataParallel& dp);

// NOTE [Planner pruning]: no simulation of this candidate finishes earlier.
double lowerBound(const CostSheet& sheet, const Staged& st, const Built& b, const std::vector<int>& placement,
                  const std::vector<bool>& rec, int m);

Plan makePlan(const std::string& name, int v, int m, int64_t mb_samples, const Staged& st, bool comm_aware,
              const Memory& mem, double step, DpMode mode);

// The search's order: the shorter step, then replicate, then the lower peak.
bool better(const Plan& a, const Plan& b);

// "no recompute" or "recompute on 2 of 8 stages".
std::string recomputeText(const std::vector<bool>& rec);

// ---------------------------------------------------------------- splits
// The min-max split of the units on F + I + W into `parts` stages, and its
// communication-aware variant (planner.h). std::invalid_argument when the
// units cannot make `parts` non-empty stages.
std::vector<int> computeSplit(const CostSheet& sheet, int parts);
std::vector<int> commAwareSplit(const CostSheet& sheet, int parts);

// NOTE [Lighter split]: from `starts` (a candidate's split, at `scale` =
// microbatch samples / reference_microbatch, under the lowered schedule `b`
// and `dp`), boundaries moved one unit at a time while the greatest rank
// peak falls, until it fits the sheet's memory limit; `starts` itself when it
// fits or no move lowers its peak.
std::vector<int> lighterSplit(const CostSheet& sheet, const SearchOptions& options, const std::vector<int>& starts,
                              double scale, const Built& b, const DataParallel& dp);

// The predicted step of a lowered schedule under a cost model. The search
// takes it as a parameter so that a test can make it fail; whatever it throws
// rejects the candidate with the exception's message.
using SimulateFn = std::function<double(const Schedule& lowered, const CostModel& model)>;

// The simulator's makespan (simulator.h): DeadlockError when it cannot finish.
double simulatedStep(const Schedule& lowered, const CostModel& model);

// NOTE [Split refinement]: `plan` (a finalist) with its split moved while
// the simulated step shortens; adds the simulations it ran to `simulations`.
Plan refineSplit(const CostSheet& sheet, const SearchOptions& options, const Plan& plan, int64_t& simulations,
                 const SimulateFn& simulate);

// ---------------------------------------------------------------- the search
// The (schedule, v, m) triples and modes a search covers, its options checked:
// std::invalid_argument naming a bad value (top_k < 1, an unknown schedule, a
// v < 1, an m that does not divide global_batch, an unknown mode).
struct SearchSpace {
  std::vector<std::string> schedules;
  std::vector<int> stages_per_rank;
  std::vector<int> microbatch_counts;
  std::vector<DpMode> modes;
  bool default_stages = true;  // stages_per_rank was not given
};
SearchSpace searchSpace(const CostSheet& sheet, const SearchOptions& options);

// Whether the search tries `schedule` at `v`: not at v = 1 where the
// schedule table says it is another schedule there (interleaved_1f1b is
// 1f1b, looped_bfs gpipe), unless the caller gave the stages per rank.
bool triesTriple(const SearchSpace& space, const std::string& schedule, int v);

// planPipeline with `simulate` for the simulator: checks the sheet and the
// options, and throws what planPipeline documents.
PlanResult searchPlans(const CostSheet& sheet, const SearchOptions& options, const SimulateFn& simulate);

}  // namespace mpmd::planner
