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
  const double scale = microbatchScale(action.microbatch);  // NOTE [Microbatch costs]
  switch (action.kind) {
    case ActionKind::Forward: return c.forward * scale;
    case ActionKind::FullBackward: return c.backward * scale;
    case ActionKind::BackwardInput: return c.backward_input * scale;
    case ActionKind::BackwardWeight: return c.backward_weight * scale;
    case ActionKind::ReduceGrad: return c.reduce_grad;
    case ActionKind::Unshard: return c.unshard;
    case ActionKind::Reshard: return c.reshard;
    default: return 0.0;
  }
}

double CostModel::transferTime(const Action& send) const {
  // Activations are the producer's output; gradients are the consumer's
  // input gradient, the same size as the producer's output.
  const int producer = send.kind == ActionKind::SendF ? send.stage : send.peer_stage;
  const double bytes = (static_cast<size_t>(producer) < stage_output_bytes.size()
                            ? stage_output_bytes[producer]
                            : message_bytes) *
                       microbatchScale(send.microbatch);
  return comm_latency + (comm_bandwidth > 0.0 ? bytes / comm_bandwidth : 0.0);
}

namespace {

double messageBytes(const CostModel& model, const Action& send) {
  const int producer = send.kind == ActionKind::SendF ? send.stage : send.peer_stage;
  return static_cast<size_t>(producer) < model.stage_output_bytes.size()
             ? model.stage_output_bytes[producer]
             : model.message_bytes;
}

[[noreturn, gnu::noinline]] void throwNoEdge(int rank, const Action& a) {
  throw ScheduleError(fmt::format("rank {}: '{}' names no stage edge of this schedule", rank, toString(a)));
}

inline int64_t checkedSlot(const TransferIndex& index, int rank, const Action& a) {
  const int64_t slot = index.slotOf(a);
  if (slot < 0) [[unlikely]] throwNoEdge(rank, a);
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

// Per-(stage, kind) costs and per-producer transfer times, looked up in the
// hot loop instead of re-deriving them per action from the CostModel.
struct CostTable {
  std::vector<double> compute;  // stage * kNumActionKinds + kind; 0 for transfers
  std::vector<double> transfer_time, transfer_bytes;  // per producing stage

  CostTable(const CostModel& model, int num_stages) {
    compute.resize(static_cast<size_t>(num_stages) * kNumActionKinds);
    transfer_time.resize(num_stages);
    transfer_bytes.resize(num_stages);
    for (int st = 0; st < num_stages; ++st) {
      for (int k = 0; k < kNumActionKinds; ++k) {
        compute[static_cast<size_t>(st) * kNumActionKinds + k] =
            model.computeCost(Action{st, static_cast<ActionKind>(k), -1, -1});  // unscaled
      }
      const Action send{st, ActionKind::SendF, -1, st + 1};  // producer is `st`, unscaled
      transfer_time[st] = model.transferTime(send) - model.comm_latency;
      transfer_bytes[st] = messageBytes(model, send);
    }
  }
};

// Per rank, the program index of the REDUCE_GRAD that posts each cross-rank
// reduce there (its last REDUCE_GRAD of a stage in the group; -1: none).
std::vector<std::vector<int64_t>> crossRankPosts(const Schedule& s, const CostModel& model) {
  std::vector<std::vector<int64_t>> posts(model.cross_rank_reduces.size(),
                                          std::vector<int64_t>(s.num_ranks, -1));
  for (size_t g = 0; g < model.cross_rank_reduces.size(); ++g) {
    std::vector<uint8_t> member(std::max(s.num_stages, 0), 0);
    for (int32_t st : model.cross_rank_reduces[g].stages) {
      if (st < 0 || st >= s.num_stages) {
        throw ScheduleError(fmt::format("cross-rank reduce {} names stage {}, not a stage in 0..{}", g, st,
                                        s.num_stages - 1));
      }
      member[st] = 1;
    }
    for (int r = 0; r < s.num_ranks; ++r) {
      const auto& program = s.programs[r];
      for (size_t i = 0; i < program.size(); ++i) {
        const Action& a = program[i];
        if (a.kind == ActionKind::ReduceGrad && a.stage >= 0 && a.stage < s.num_stages && member[a.stage]) {
          posts[g][r] = static_cast<int64_t>(i);
        }
      }
    }
  }
  return posts;
}

}  // namespace

SimulationResult simulate(const Schedule& s, const CostModel& model, bool record_timeline) {
  const TransferIndex index(s);
  const CostTable table(model, s.num_stages);
  const size_t num_stages = static_cast<size_t>(std::max(s.num_stages, 0));
  const int p = s.num_ranks;
  SimulationResult result;
  result.busy.assign(p, 0.0);
  if (record_timeline) {
    result.timeline.resize(p);
    for (int r = 0; r < p; ++r) result.timeline[r].resize(s.programs[r].size());
  }
  // Per transfer: when its data arrives (-1 until sent) and the rank blocked
  // on its RECV (-1 if none), side by side so a SEND touches one cache line.
  struct SlotTime {
    double arrival = -1.0;
    int waiter = -1;
  };
  std::vector<SlotTime> slots(index.numSlots());
  std::vector<size_t> pc(p, 0);
  std::vector<double> now(p, 0.0);
  // The collective stream of each rank: when its last collective ends. And
  // per stage: when its last UNSHARD's gather ends (a stage is on one rank).
  std::vector<double> stream(p, 0.0), gathered(num_stages, 0.0);
  std::vector<int> live(p, 0), peak(p, 0);  // in-flight forwards, as peakActivations counts them
  std::vector<int> runnable;
  for (int r = p - 1; r >= 0; --r) runnable.push_back(r);
  // Cross-rank reduces: where each rank posts them, and when it did (-1: not yet).
  const auto cross_posts = crossRankPosts(s, model);
  std::vector<std::vector<double>> cross_posted(cross_posts.size(), std::vector<double>(p, -1.0));
  std::vector<uint8_t> posts_cross(p, 0);
  for (const auto& g : cross_posts) {
    for (int r = 0; r < p; ++r) posts_cross[r] |= g[r] >= 0;
  }

  const double overhead = model.action_overhead;  // NOTE [Action overhead]
  constexpr size_t kLookahead = 8;
  // Each rank runs until it blocks on a RECV whose SEND has not happened;
  // that SEND wakes it. Every action is executed once: linear time.
  while (!runnable.empty()) {
    const int r = runnable.back();
    runnable.pop_back();
    const auto& program = s.programs[r];
    const size_t size = program.size();
    double t = now[r], busy = result.busy[r], rank_stream = stream[r];
    int rank_live = live[r], rank_peak = peak[r];
    size_t i = pc[r];
    for (; i < size; ++i) {
      const Action& a = program[i];
      // Transfers of a rank hit many slot streams at once; fetch ahead.
      if (i + kLookahead < size && isCommunication(program[i + kLookahead].kind)) {
        const int64_t ahead = index.slotOf(program[i + kLookahead]);
        if (ahead >= 0) __builtin_prefetch(&slots[ahead]);
      }
      double start = t;
      if (isRecv(a.kind)) {
        SlotTime& slot = slots[checkedSlot(index, r, a)];
        if (slot.arrival < 0.0) {
          slot.waiter = r;
          break;
        }
        t = std::max(t, slot.arrival) + overhead;
        start = t;
      } else if (isSend(a.kind)) {
        t += overhead;
        start = t;
        SlotTime& slot = slots[checkedSlot(index, r, a)];
        if (slot.arrival < 0.0) {
          // A valid slot has both stages in range.
          const int producer = a.kind == ActionKind::SendF ? a.stage : a.peer_stage;
          const double scale = model.microbatchScale(a.microbatch);  // NOTE [Microbatch costs]
          slot.arrival = t + model.comm_latency + table.transfer_time[producer] * scale;
          result.messages += 1;
          result.comm_bytes += table.transfer_bytes[producer] * scale;
          if (slot.waiter >= 0) {
            runnable.push_back(slot.waiter);
            // Ranks resume often and out of the cache: fetch where it resumes.
            __builtin_prefetch(s.programs[slot.waiter].data() + pc[slot.waiter]);
          }
        }
      } else {
        if (a.kind == ActionKind::Forward) rank_peak = std::max(rank_peak, ++rank_live);
        else if (isBackward(a.kind)) --rank_live;
        // Unvalidated input may name a stage out of range: cost it as
        // computeCost does, with no gather to wait for.
        const bool known = static_cast<size_t>(a.stage) < num_stages;
        const double cost =
            known ? table.compute[static_cast<size_t>(a.stage) * kNumActionKinds +
                                  static_cast<size_t>(a.kind)] *
                        (isCompute(a.kind) ? model.microbatchScale(a.microbatch) : 1.0)
                  : model.computeCost(a);
        t += overhead;
        if (a.kind == ActionKind::Unshard || a.kind == ActionKind::ReduceGrad) {
          // Issued at t, run on the collective stream; the rank goes on.
          start = std::max(t, rank_stream);
          rank_stream = start + cost;
          if (known && a.kind == ActionKind::Unshard) gathered[a.stage] = rank_stream;
          if (record_timeline) result.timeline[r][i] = {start, rank_stream};
          if (posts_cross[r] && a.kind == ActionKind::ReduceGrad) {
            for (size_t g = 0; g < cross_posts.size(); ++g) {
              if (cross_posts[g][r] == static_cast<int64_t>(i)) cross_posted[g][r] = rank_stream;
            }
          }
          continue;
        }
        if (known) t = std::max(t, gathered[a.stage]);  // compute and RESHARD need the gather
        start = t;
        t += cost;
        if (isCompute(a.kind)) busy += cost;
      }
      if (record_timeline) result.timeline[r][i] = {start, t};
    }
    pc[r] = i;
    now[r] = t;
    stream[r] = rank_stream;
    result.busy[r] = busy;
    live[r] = rank_live;
    peak[r] = rank_peak;
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < s.programs[r].size()) reportStuck(s, index, pc);
  }

  // A rank's step ends when its program and its collectives have; a
  // cross-rank reduce ends `cost` after its last member posted it.
  for (int r = 0; r < p; ++r) now[r] = std::max(now[r], stream[r]);
  for (size_t g = 0; g < cross_posts.size(); ++g) {
    const double start = *std::max_element(cross_posted[g].begin(), cross_posted[g].end());
    if (start < 0.0) continue;  // no rank posts it (no REDUCE_GRAD of its stages)
    const double end = start + model.cross_rank_reduces[g].cost;
    for (int r = 0; r < p; ++r) {
      if (cross_posts[g][r] >= 0) now[r] = std::max(now[r], end);
    }
  }
  result.makespan = p ? *std::max_element(now.begin(), now.end()) + model.step_overhead : 0.0;
  result.bubble_fraction.resize(p);
  for (int r = 0; r < p; ++r) {
    result.bubble_fraction[r] = result.makespan > 0.0 ? (result.makespan - result.busy[r]) / result.makespan : 0.0;
  }
  result.peak_activations = std::move(peak);
  return result;
}

}  // namespace mpmd
