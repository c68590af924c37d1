// Discrete-event simulation of all ranks' lowered programs.
//
// Model: each rank runs its program in order. A compute action takes its
// cost. A SEND costs the sender nothing (sends are asynchronous) and its data
// arrives comm_latency + bytes / comm_bandwidth later. A RECV blocks the rank
// until the data has arrived. REDUCE_GRAD takes reduce_grad. There is no
// contention: the makespan is the exact critical path of the program order.
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
  double reduce_grad = 0.0;
};

struct CostModel {
  KindCosts costs;
  std::vector<KindCosts> stage_costs;  // per stage; empty = `costs` everywhere
  double comm_latency = 0.0;           // per message
  double comm_bandwidth = 0.0;         // bytes per time unit; 0 = infinite
  double message_bytes = 0.0;          // bytes per transfer
  std::vector<double> stage_output_bytes;  // per producing stage; overrides message_bytes

  double computeCost(const Action& action) const;
  double transferTime(const Action& send) const;
};

struct ActionTiming {
  double start = 0.0;
  double end = 0.0;
};

struct SimulationResult {
  double makespan = 0.0;
  std::vector<double> busy;             // per rank: time spent in compute
  std::vector<double> bubble_fraction;  // per rank: (makespan - busy) / makespan
  std::vector<int> peak_activations;    // per rank (see peakActivations)
  int64_t messages = 0;                 // cross-rank transfers
  double comm_bytes = 0.0;
  std::vector<std::vector<ActionTiming>> timeline;  // per rank, per action; if requested
};

// Input must be lowered (a compute-only schedule with cross-rank dependencies
// can never receive its inputs). Throws DeadlockError listing every blocked
// rank, its action and what it waits for; ScheduleError for a RECV with no
// SEND. Runs in time linear in the number of actions.
SimulationResult simulate(const Schedule& lowered, const CostModel& model = {},
                          bool record_timeline = false);

}  // namespace mpmd
