// Planner: the pipeline plan with the lowest predicted step time under a
// memory limit, from a cost sheet. The search's steps: planner_steps.h.
//
// A CostSheet describes a model as an ordered list of units (a block, the
// embedding, the head): per unit its forward, input-gradient (I) and
// weight-gradient (W) times and its bytes. planPipeline searches, for the
// sheet's pipeline size p:
//   - schedule: every name of scheduleNames() the project builds for the
//     (p, v, m) triple; makeSchedule's own checks, from the schedule table
//     (schedules/table.h), decide validity (its ScheduleError rejects a
//     triple, a failed simulation the candidate, each with its reason).
//     A schedule the table calls another at v = 1 (interleaved_1f1b is
//     1f1b there) is not tried twice;
//   - stages per rank v in {1, 2, 4} (the schedule's checks reject the v its
//     table row does not take);
//   - microbatch count m: the divisors of global_batch (a microbatch is at
//     least one sample; the schedules reject m below what they need);
//   - stage split: the exact min-max contiguous split of the units into p*v
//     stages on their compute time F + I + W (ties: the least sum of squared
//     stage times), and a communication-aware variant whose stage weight adds
//     the round trip of its output over the link (activation forward,
//     gradient back: 2 * (latency + bytes / bandwidth));
//     then each finalist's split refined by a local search on the simulated
//     makespan (NOTE [Split refinement] in planner_split.cpp);
//   - recompute per stage, none or full, chosen greedily (NOTE [Recompute
//     choice]), never 2^S;
//   - with dp_size > 1, the data-parallel mode: "replicate" or "shard"
//     (NOTE [Data-parallel modes]).
// Objective: the simulated makespan (simulator.h) of the lowered schedule
// with per-stage costs, the sheet's action overhead, link latency and
// per-link bandwidth and per-stage output bytes, and with dp_size > 1 the
// data-parallel collectives on each rank's collective stream. Constraint: the
// predicted peak bytes of every rank <= memory_limit (NOTE [Planner memory
// model]).
//
// NOTE [Microbatch scaling]: a sheet's times and per-microbatch bytes are
// measured (or computed) at reference_microbatch samples per microbatch. At
// b = global_batch / m samples every per-microbatch byte count scales by
// b / reference_microbatch, and so does every time but its fixed part (a
// unit's *_fixed: what its program costs whatever the size, e.g. the
// dispatch of each of its operators, which dominates small microbatches):
// t(b) = fixed + (t - fixed) * b / reference_microbatch. The runtime's own
// cost per action is action_overhead, which does not scale either.
//
// A stage's F, I and W are its units' sums, but for the first stage: the
// model's inputs carry no gradient, so its I is nothing and its W the whole
// backward (NOTE [The first stage's backward] in planner_model.cpp).
//
// NOTE [Planner memory model]: the predicted peak of rank r is
//   static:      sum over its stages of param_bytes * (1 + grad_bytes_per_param_byte
//                + optimizer_bytes_per_param_byte);
//   activations: the peak, over the rank's compute program in order, of the
//                saved bytes held: F(s, mb) adds the stage's saved bytes per
//                microbatch, its backward frees them: B, or W in schedules
//                that split the backward (the W half needs the layer inputs,
//                which are most of what a forward saves, so I is taken to
//                free nothing: a conservative rule);
//   recompute:   a recomputed stage saves only its input (the output bytes of
//                the unit before it, input_bytes for the first), and rebuilds
//                its activations for one microbatch during its backward: the
//                rank's peak adds the largest such stage's full saved bytes;
//   transfers:   one microbatch's buffer per cross-rank edge end: a stage
//                whose producer is on another rank holds its input (the
//                received activation), one whose consumer is on another rank
//                holds its output bytes (the received gradient).
// Stages on the same rank hand values over without a buffer.
// With dp_size = d > 1 (P = a stage's param_bytes, g and o the sheet's
// gradient and optimizer bytes per parameter byte), walking the rank's
// lowered program (lowering.h) in order, as torch_mpmd/parallel runs it:
//   replicate:   static as above; at REDUCE_GRAD(s) the flat buffer of the
//                step's gradient increments that the all-reduce reads and
//                writes, g * P, is held to the step's end (data_parallel.py);
//   shard:       static is the shards: P / d * (1 + g + o). UNSHARD(s)
//                allocates the all-gather's output, P, and its input, P / d;
//                the window's first compute (which waits for the gather)
//                refills the full parameters, P, then frees both buffers;
//                RESHARD(s) frees the full parameters. The stage's first
//                gradient-producing action of the step (B, or W where the
//                schedule splits the backward) starts its full gradients,
//                g * P; REDUCE_GRAD(s) copies them into the reduce-scatter's
//                input table, g * P, before freeing them, and the table and
//                its output shard, g * P / d, are held to the step's end
//                (sharding.py). Padding to whole rows per rank is not counted.
//
// NOTE [Data-parallel modes]: with dp_size = d > 1 every pipeline rank has
// d - 1 replicas running the same program on their own batches, and the
// search tries each allowed mode (SearchOptions::data_parallel) on every
// (schedule, v, m, split), lowering the schedule as the runtime does:
//   replicate:   insertGradReduce's REDUCE_GRAD(s) all-reduces the stage's
//                gradients, g * P bytes: a ring, 2 (d - 1) dp_latency +
//                2 (d - 1) / d * g * P / dp_bandwidth;
//   shard:       also insertUnshardReshard (default ShardOptions: prefetch 1,
//                one window per stage, as pipeline(data_parallel="shard")
//                runs without reshard_after_forward): each window's UNSHARD(s)
//                all-gathers P bytes, (d - 1) dp_latency + (d - 1) / d * P /
//                dp_bandwidth, and REDUCE_GRAD(s) reduce-scatters g * P bytes
//                at the same price for g * P.
// These are the stages' KindCosts::unshard and reduce_grad: the simulator
// runs them on each rank's collective stream (simulator.h), so a gather
// hides behind the compute before its window and a reduction behind the
// compute after it exactly as far as the program order allows. dp_latency
// and dp_bandwidth are per ring step and per link (unset: the pipeline
// link's). On equal predicted steps replicate wins (the runtime's gathers
// also copy every parameter twice, which the sheet does not price).
//
// NOTE [Recompute choice]: for each (schedule, v, m, split) the planner first
// predicts memory with no recompute; a rank over the limit turns recompute on
// for its stages, the one that frees the most bytes first, until it fits or
// all its stages recompute. A candidate that does not fit with every stage
// recomputed is rejected before it is simulated. Recompute is never chosen
// where it is not needed: it only adds time.
//
// NOTE [Planner pruning]: a candidate is simulated only if it fits and its
// lower bound (the busiest rank's compute time plus one action overhead per
// compute action) is below the k-th best makespan found so far. The schedule
// and its lowering are built once per (schedule, v, m); the splits once per
// stage count. candidates counts every (schedule, v, m, split) looked at,
// simulations the ones simulated.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace mpmd {

struct UnitCost {
  std::string name;               // e.g. "layers.3"; a plan names its cuts by it
  double forward = 0.0;           // seconds per microbatch (NOTE [Microbatch scaling])
  double backward_input = 0.0;    // I: the input gradient
  double backward_weight = 0.0;   // W: the weight gradient; B = I + W
  double saved_bytes = 0.0;       // held from its forward to its backward, per microbatch
  double param_bytes = 0.0;       // its parameters
  double output_bytes = 0.0;      // what crosses a cut right after it, per microbatch
  // Of each time above, the part that does not scale with the microbatch's
  // size (NOTE [Microbatch scaling]); at most the time itself.
  double forward_fixed = 0.0;
  double backward_input_fixed = 0.0;
  double backward_weight_fixed = 0.0;
  // Of its inputs, the bytes its forward keeps for its backward: not in
  // saved_bytes (a stage's received values are transfer buffers), held
  // anew where an earlier unit of the same stage produces them.
  double saved_input_bytes = 0.0;
};

struct CostSheet {
  std::vector<UnitCost> units;          // in model order; at least pp_size of them
  int64_t global_batch = 1;             // samples per step (per pipeline replica)
  int64_t reference_microbatch = 1;     // samples at which the costs were taken
  double input_bytes = 0.0;             // the model input per microbatch (stage 0's recompute)
  double action_overhead = 0.0;         // seconds per action (NOTE [Action overhead])
  double step_overhead = 0.0;           // seconds per step outside its actions: added to
                                        // every candidate's step (it does not rank them)
  double link_latency = 0.0;            // seconds per transfer
  double link_bandwidth = 0.0;          // bytes/s between ranks; 0 = infinite
  // Ranks [k*ranks_per_node, (k+1)*ranks_per_node) share a node; a transfer
  // between nodes runs at inter_node_bandwidth (0 = link_bandwidth). 0 = one node.
  int ranks_per_node = 0;
  double inter_node_bandwidth = 0.0;
  double grad_bytes_per_param_byte = 1.0;
  double optimizer_bytes_per_param_byte = 2.0;  // AdamW: two states the size of the parameters
  int pp_size = 1;
  double memory_limit = 0.0;            // bytes per rank; 0 = none
  // Data parallel (NOTE [Data-parallel modes]): replicas of every pipeline
  // rank; the collectives' seconds per ring step and bytes/s per link (0 =
  // infinite), unset: link_latency and link_bandwidth.
  int dp_size = 1;
  std::optional<double> dp_latency;
  std::optional<double> dp_bandwidth;
};

// Throws std::invalid_argument naming the field and value: no units, a
// negative or non-finite cost, pp_size < 1 or above the number of units,
// global_batch or reference_microbatch < 1, a bad node size, dp_size < 1.
void checkSheet(const CostSheet& sheet);

struct SearchOptions {
  std::vector<std::string> schedules;     // empty: all of scheduleNames()
  std::vector<int> stages_per_rank;       // empty: {1, 2, 4}
  std::vector<int> microbatch_counts;     // empty: every divisor of global_batch
  int top_k = 5;                          // >= 1
  bool comm_aware_split = true;           // also try the communication-aware split
  bool refine_split = true;               // refine the finalists' splits (NOTE [Split refinement])
  bool allow_recompute = true;
  // "replicate" and/or "shard"; empty: both when the sheet's dp_size > 1,
  // else "replicate". With dp_size = 1 "shard" shards nothing: priced as
  // replicate (the runtime runs it replicated), the plan names it.
  std::vector<std::string> data_parallel;
};

struct Plan {
  std::string schedule;
  int stages_per_rank = 1;
  int num_microbatches = 1;
  int64_t microbatch_samples = 1;
  std::vector<int> stage_starts;          // unit index where each stage starts; [0] == 0
  std::vector<bool> recompute;            // per stage
  bool comm_aware_split = false;          // which split variant
  bool refined_split = false;             // moved from it by NOTE [Split refinement]
  std::string data_parallel = "replicate";  // NOTE [Data-parallel modes]
  double step_seconds = 0.0;              // predicted (simulated) step
  std::vector<double> peak_bytes;         // predicted, per rank
  std::vector<double> stage_seconds;      // per stage: F + B of one microbatch
};

// A candidate that lost for a reason other than its time.
struct Rejection {
  std::string schedule;
  int stages_per_rank = 1;
  int num_microbatches = 1;
  std::string reason;                     // e.g. the schedule's error, "peak ... over memory_limit ..."
  double step_seconds = std::numeric_limits<double>::quiet_NaN();  // if simulated
  double max_peak_bytes = 0.0;            // 0 when never predicted
  std::string data_parallel = "replicate";
};

struct PlanResult {
  Plan best;
  std::vector<Plan> top;                  // best first, at most top_k, distinct (schedule, v, m, dp mode)
  std::vector<Rejection> rejected;        // invalid triples (one per schedule and v), candidates
                                          // whose simulation failed (one per reason), and the
                                          // fastest ones over the memory limit (at most top_k)
  int64_t candidates = 0;                 // (schedule, v, m, split, dp mode) looked at
  int64_t simulations = 0;                // of which simulated (NOTE [Planner pruning])
  double search_seconds = 0.0;
};

// The search (see above). Throws std::invalid_argument for a bad sheet or
// options, when no (schedule, v, m) is valid, when every candidate that fits
// failed its simulation (naming the reasons), and when nothing fits the
// memory limit: the message names the smallest predicted peak, the limit and
// the plan that gave it. Deterministic: the same input gives the same result.
PlanResult planPipeline(const CostSheet& sheet, const SearchOptions& options = {});

// One given plan on the sheet: `stage_starts` (p*v entries, increasing,
// starting at 0) and `recompute` (p*v flags, or empty for none). Returns the
// plan with step_seconds, peak_bytes and stage_seconds filled; does not apply
// the memory limit. `data_parallel`: "replicate" or "shard" (with dp_size = 1
// both run replicated and price nothing). Throws std::invalid_argument for a
// bad split, an unknown mode or an invalid schedule (its ScheduleError).
Plan evaluatePlan(const CostSheet& sheet, const std::string& schedule, int stages_per_rank,
                  int num_microbatches, const std::vector<int>& stage_starts,
                  const std::vector<bool>& recompute = {}, const std::string& data_parallel = "replicate");

// The exact min-max contiguous split of `weights` into `parts` non-empty
// parts (ties: least sum of squares); returns where each part starts.
// Throws std::invalid_argument when parts < 1 or parts > weights.size().
std::vector<int> minMaxSplit(const std::vector<double>& weights, int parts);

}  // namespace mpmd
