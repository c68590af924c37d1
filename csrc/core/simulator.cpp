#include "simulator.h"

#include <algorithm>

#include <fmt/format.h>

#include "errors.h"
#include "transfer_index.h"
#include "validate.h"

namespace mpmd {

double CostModel::computeCost(const Action& action) const {
  const KindCosts& c =
      static_cast<size_t>(action.stage) < stage_costs.size() ? stage_costs[action.stage] : costs;
  switch (action.kind) {
    case ActionKind::Forward: return c.forward;
    case ActionKind::FullBackward: return c.backward;
    case ActionKind::BackwardInput: return c.backward_input;
    case ActionKind::BackwardWeight: return c.backward_weight;
    case ActionKind::ReduceGrad: return c.reduce_grad;
    default: return 0.0;
  }
}

double CostModel::transferTime(const Action& send) const {
  // Activations are the producer's output; gradients are the consumer's
  // input gradient, the same size as the producer's output.
  const int producer = send.kind == ActionKind::SendF ? send.stage : send.peer_stage;
  const double bytes = static_cast<size_t>(producer) < stage_output_bytes.size()
                           ? stage_output_bytes[producer]
                           : message_bytes;
  return comm_latency + (comm_bandwidth > 0.0 ? bytes / comm_bandwidth : 0.0);
}

namespace {

double messageBytes(const CostModel& model, const Action& send) {
  const int producer = send.kind == ActionKind::SendF ? send.stage : send.peer_stage;
  return static_cast<size_t>(producer) < model.stage_output_bytes.size()
             ? model.stage_output_bytes[producer]
             : model.message_bytes;
}

int64_t checkedSlot(const TransferIndex& index, int rank, const Action& a) {
  const int64_t slot = index.slotOf(a);
  if (slot < 0) {
    throw ScheduleError(fmt::format("rank {}: '{}' names no stage edge of this schedule", rank, toString(a)));
  }
  return slot;
}

// Some rank is blocked on a RECV. If its SEND exists nowhere the program is
// malformed (ScheduleError); otherwise the ranks wait on each other.
[[noreturn]] void reportStuck(const Schedule& s, const TransferIndex& index, const std::vector<size_t>& pc) {
  std::vector<uint8_t> has_send(index.numSlots(), 0);
  for (const auto& program : s.programs) {
    for (const Action& a : program) {
      if (isSend(a.kind)) has_send[index.slotOf(a)] = 1;
    }
  }
  for (int r = 0; r < s.num_ranks; ++r) {
    if (pc[r] >= s.programs[r].size()) continue;
    const Action& a = s.programs[r][pc[r]];
    const int64_t slot = index.slotOf(a);
    if (!has_send[slot]) {
      throw ScheduleError(fmt::format("rank {}: '{}' has no matching '{}' on any rank", r, toString(a),
                                      toString(index.sendOf(slot))));
    }
  }
  std::string blocked;
  for (int r = 0; r < s.num_ranks; ++r) {
    if (pc[r] >= s.programs[r].size()) continue;
    const Action& a = s.programs[r][pc[r]];
    const int64_t slot = index.slotOf(a);
    const int peer = s.stage_to_rank[a.peer_stage];
    const std::string peer_state =
        pc[peer] >= s.programs[peer].size()
            ? "which has finished"
            : fmt::format("which is blocked at #{} '{}'", pc[peer], toString(s.programs[peer][pc[peer]]));
    blocked += fmt::format("\n  rank {} is blocked at #{} '{}', waiting for '{}' from rank {}, {}", r, pc[r],
                           toString(a), toString(index.sendOf(slot)), peer, peer_state);
  }
  throw DeadlockError("deadlock: no rank can make progress" + blocked);
}

}  // namespace

SimulationResult simulate(const Schedule& s, const CostModel& model, bool record_timeline) {
  const TransferIndex index(s);
  const int p = s.num_ranks;
  SimulationResult result;
  result.busy.assign(p, 0.0);
  if (record_timeline) {
    result.timeline.resize(p);
    for (int r = 0; r < p; ++r) result.timeline[r].resize(s.programs[r].size());
  }
  std::vector<double> arrival(index.numSlots(), -1.0);
  std::vector<int> waiter(index.numSlots(), -1);
  std::vector<size_t> pc(p, 0);
  std::vector<double> now(p, 0.0);
  std::vector<int> live(p, 0), peak(p, 0);  // in-flight forwards, as peakActivations counts them
  std::vector<int> runnable;
  for (int r = p - 1; r >= 0; --r) runnable.push_back(r);

  // Each rank runs until it blocks on a RECV whose SEND has not happened;
  // that SEND wakes it. Every action is executed once: linear time.
  while (!runnable.empty()) {
    const int r = runnable.back();
    runnable.pop_back();
    const auto& program = s.programs[r];
    double t = now[r];
    while (pc[r] < program.size()) {
      const Action& a = program[pc[r]];
      double start = t;
      if (isRecv(a.kind)) {
        const int64_t slot = checkedSlot(index, r, a);
        if (arrival[slot] < 0.0) {
          waiter[slot] = r;
          break;
        }
        t = std::max(t, arrival[slot]);
        start = t;
      } else if (isSend(a.kind)) {
        const int64_t slot = checkedSlot(index, r, a);
        if (arrival[slot] < 0.0) {
          arrival[slot] = t + model.transferTime(a);
          result.messages += 1;
          result.comm_bytes += messageBytes(model, a);
          if (waiter[slot] >= 0) runnable.push_back(waiter[slot]);
        }
      } else {
        if (a.kind == ActionKind::Forward) peak[r] = std::max(peak[r], ++live[r]);
        else if (isBackward(a.kind)) --live[r];
        const double cost = model.computeCost(a);
        t += cost;
        if (isCompute(a.kind)) result.busy[r] += cost;
      }
      if (record_timeline) result.timeline[r][pc[r]] = {start, t};
      ++pc[r];
    }
    now[r] = t;
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < s.programs[r].size()) reportStuck(s, index, pc);
  }

  result.makespan = p ? *std::max_element(now.begin(), now.end()) : 0.0;
  result.bubble_fraction.resize(p);
  for (int r = 0; r < p; ++r) {
    result.bubble_fraction[r] = result.makespan > 0.0 ? (result.makespan - result.busy[r]) / result.makespan : 0.0;
  }
  result.peak_activations = std::move(peak);
  return result;
}

}  // namespace mpmd
