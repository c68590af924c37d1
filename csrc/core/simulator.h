// Discrete-event simulation of all ranks' lowered programs.
//
// Model: each rank runs its program in order. A compute action takes its
// cost. A SEND costs the sender nothing (sends are asynchronous) and its data
// arrives comm_latency + bytes / comm_bandwidth later. A RECV blocks the rank
// until the data has arrived.
//
// Data-parallel collectives run on one "collective stream" per rank, one
// after another, as NCCL's and gloo's per-group queues run them, beside the
// rank's compute:
//   UNSHARD      costs the rank nothing when issued; its all-gather starts
//                when the stream is free and ends `unshard` later, and the
//                stage's next compute action (or RESHARD) waits for it;
//   REDUCE_GRAD  the same, for `reduce_grad`: nothing waits for it in the
//                step, but the step ends when it ends (the makespan counts it);
//   RESHARD      blocks the rank for `reshard` (after the gather it frees).
// Collectives over several pipeline ranks (CostModel::cross_rank_reduces:
// the sum of a tied weight's gradients) are posted by a REDUCE_GRAD on each
// rank they join, the last one in that rank's program of a stage in the
// group, once the stage's own reduction has left the stream; the collective
// starts when every member rank has posted it and takes `cost`; each member's
// step ends no earlier (nothing waits for it inside the step). Its time on
// the members' streams is not charged to later collectives there.
// There is no other contention: the makespan is the exact critical path of
// the program order.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule.h"

namespace mpmd {

struct KindCosts {
  double forward = 1.0;
  double backward = 2.0;         // B
  double backward_input = 1.0;   // I
  double backward_weight = 1.0;  // W
  double reduce_grad = 0.0;      // REDUCE_GRAD, on the collective stream
  double unshard = 0.0;          // UNSHARD's all-gather, on the collective stream
  double reshard = 0.0;          // RESHARD, blocking the rank
};

// A gradient reduction over the ranks of several stages (tied weights).
struct CrossRankReduce {
  std::vector<int32_t> stages;  // the stages holding the shared parameters
  double cost = 0.0;            // time of the collective once all have posted
};

struct CostModel {
  KindCosts costs;
  std::vector<KindCosts> stage_costs;  // per stage; empty = `costs` everywhere
  double comm_latency = 0.0;           // per message
  // NOTE [Action overhead]: the runtime's own time per action, spent by the
  // rank before each action it runs (compute, SEND, RECV once its data is
  // there, collectives' posting): the executor's dispatch, the runner's
  // Python around each program, a transfer's posting. A measured step knows
  // it as the gaps between one action's end and the next one's begin.
  double action_overhead = 0.0;
  // The runtime's fixed time per step, outside every action: the Python
  // around the executor (the call's checks, the begin and end exchanges, the
  // loss's delivery, waiting for reductions). Added to the makespan once; a
  // measured step knows it as its wall time minus its timeline's span.
  double step_overhead = 0.0;
  double comm_bandwidth = 0.0;         // bytes per time unit; 0 = infinite
  double message_bytes = 0.0;          // bytes per transfer
  std::vector<double> stage_output_bytes;  // per producing stage; overrides message_bytes
  std::vector<CrossRankReduce> cross_rank_reduces;  // posted at REDUCE_GRAD (see above)
  // NOTE [Microbatch costs]: microbatches of different sizes (explicit
  // microbatches of different lengths) cost in proportion: microbatch k's
  // F, B, I and W costs and its transfers' bytes are multiplied by
  // microbatch_scale[k] (the latency per message is not). Empty, or a
  // microbatch past its end: 1.
  std::vector<double> microbatch_scale;

  double microbatchScale(int32_t microbatch) const {
    return microbatch >= 0 && static_cast<size_t>(microbatch) < microbatch_scale.size()
               ? microbatch_scale[microbatch]
               : 1.0;
  }

  double computeCost(const Action& action) const;
  double transferTime(const Action& send) const;
};

// For UNSHARD and REDUCE_GRAD: the collective's span on the collective
// stream, not the rank's (which it does not hold up).
struct ActionTiming {
  double start = 0.0;
  double end = 0.0;
};

struct SimulationResult {
  double makespan = 0.0;
  std::vector<double> busy;             // per rank: time spent in compute (F, B, I, W)
  std::vector<double> bubble_fraction;  // per rank: (makespan - busy) / makespan
  std::vector<int> peak_activations;    // per rank (see peakActivations)
  int64_t messages = 0;                 // cross-rank transfers
  double comm_bytes = 0.0;
  std::vector<std::vector<ActionTiming>> timeline;  // per rank, per action; if requested
};

// Input must be lowered (a compute-only schedule with cross-rank dependencies
// can never receive its inputs). Throws DeadlockError listing every blocked
// rank, its action and what it waits for; ScheduleError for a RECV with no
// SEND, or for a cross-rank reduce naming a stage out of range. Runs in time
// linear in the number of actions. The deadlock check looks at transfers
// only: the collectives pair a rank with its data-parallel replicas, which
// run the same program, or (cross-rank reduces) are waited for only at the
// step's end, so they cannot close a cycle here.
SimulationResult simulate(const Schedule& lowered, const CostModel& model = {},
                          bool record_timeline = false);

}  // namespace mpmd
