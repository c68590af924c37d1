#include "validate.h"

#include <algorithm>

#include <fmt/format.h>

#include "errors.h"
#include "lowering.h"
#include "simulator.h"
#include "transfer_index.h"

namespace mpmd {

namespace {

[[noreturn]] void failAt(int rank, size_t pos, const Action& a, std::string_view why) {
  throw ScheduleError(fmt::format("rank {}, action #{} '{}': {}", rank, pos, toString(a), why));
}

void checkShape(const Schedule& s) {
  if (s.num_ranks < 1 || static_cast<int>(s.programs.size()) != s.num_ranks) {
    throw ScheduleError(fmt::format("num_ranks={} but the schedule has {} rank programs",
                                    s.num_ranks, s.programs.size()));
  }
  if (s.num_stages < 1 || static_cast<int>(s.stage_to_rank.size()) != s.num_stages) {
    throw ScheduleError(fmt::format("num_stages={} but the placement lists {} stages",
                                    s.num_stages, s.stage_to_rank.size()));
  }
  if (s.num_microbatches < 1) {
    throw ScheduleError(fmt::format("num_microbatches={} must be >= 1", s.num_microbatches));
  }
  for (int st = 0; st < s.num_stages; ++st) {
    if (s.stage_to_rank[st] < 0 || s.stage_to_rank[st] >= s.num_ranks) {
      throw ScheduleError(fmt::format("stage {} is placed on rank {}, outside 0..{}", st,
                                      s.stage_to_rank[st], s.num_ranks - 1));
    }
  }
  std::vector<std::pair<int, int>> seen;
  for (const auto& e : s.edges) {
    if (e.producer < 0 || e.consumer >= s.num_stages || e.producer >= e.consumer) {
      throw ScheduleError(fmt::format("stage edge {}->{} must satisfy 0 <= producer < consumer < {}",
                                      e.producer, e.consumer, s.num_stages));
    }
    seen.emplace_back(e.producer, e.consumer);
  }
  std::sort(seen.begin(), seen.end());
  auto dup = std::adjacent_find(seen.begin(), seen.end());
  if (dup != seen.end()) {
    throw ScheduleError(fmt::format("stage edge {}->{} is listed twice", dup->first, dup->second));
  }
  if (s.activation_bound.size() != 0 && static_cast<int>(s.activation_bound.size()) != s.num_ranks) {
    throw ScheduleError(fmt::format("activation_bound has {} entries for {} ranks",
                                    s.activation_bound.size(), s.num_ranks));
  }
}

// Position of each compute kind per (stage, microbatch), -1 when absent.
struct ComputePositions {
  std::vector<int32_t> f, b, i, w;  // index stage * m + mb; positions fit int32
};

void checkActionFields(const Schedule& s, int r, size_t pos, const Action& a) {
  if (a.stage < 0 || a.stage >= s.num_stages) {
    failAt(r, pos, a, fmt::format("stage {} is outside 0..{}", a.stage, s.num_stages - 1));
  }
  if (a.kind != ActionKind::ReduceGrad && (a.microbatch < 0 || a.microbatch >= s.num_microbatches)) {
    failAt(r, pos, a, fmt::format("microbatch {} is outside 0..{}", a.microbatch, s.num_microbatches - 1));
  }
  if (s.stage_to_rank[a.stage] != r) {
    failAt(r, pos, a, fmt::format("stage {} runs on rank {}, not rank {}", a.stage,
                                  s.stage_to_rank[a.stage], r));
  }
  if (isCommunication(a.kind)) {
    if (a.peer_stage < 0 || a.peer_stage >= s.num_stages) {
      failAt(r, pos, a, fmt::format("peer stage {} is outside 0..{}", a.peer_stage, s.num_stages - 1));
    }
    if (s.stage_to_rank[a.peer_stage] == r) {
      failAt(r, pos, a, fmt::format("peer stage {} is on the same rank: local handoff needs no transfer",
                                    a.peer_stage));
    }
  }
}

ComputePositions collectCompute(const Schedule& s) {
  const size_t n = static_cast<size_t>(s.num_stages) * s.num_microbatches;
  ComputePositions cp{std::vector<int32_t>(n, -1), std::vector<int32_t>(n, -1),
                      std::vector<int32_t>(n, -1), std::vector<int32_t>(n, -1)};
  for (int r = 0; r < s.num_ranks; ++r) {
    const auto& program = s.programs[r];
    for (size_t pos = 0; pos < program.size(); ++pos) {
      const Action& a = program[pos];
      checkActionFields(s, r, pos, a);
      if (!isCompute(a.kind)) continue;
      const size_t key = static_cast<size_t>(a.stage) * s.num_microbatches + a.microbatch;
      auto& slot = a.kind == ActionKind::Forward        ? cp.f[key]
                   : a.kind == ActionKind::FullBackward ? cp.b[key]
                   : a.kind == ActionKind::BackwardInput ? cp.i[key]
                                                        : cp.w[key];
      if (slot >= 0) failAt(r, pos, a, fmt::format("runs twice (first at #{})", slot));
      slot = static_cast<int32_t>(pos);
    }
  }
  return cp;
}

void checkComputeOrder(const Schedule& s, const ComputePositions& cp) {
  const int m = s.num_microbatches;
  for (int st = 0; st < s.num_stages; ++st) {
    const int r = s.stage_to_rank[st];
    for (int mb = 0; mb < m; ++mb) {
      const size_t key = static_cast<size_t>(st) * m + mb;
      const auto missing = [&](std::string_view what) {
        throw ScheduleError(fmt::format("rank {}: stage {} microbatch {} {}", r, st, mb, what));
      };
      if (cp.f[key] < 0) missing(fmt::format("has no forward {}F{}", st, mb));
      const bool full = cp.b[key] >= 0, split = cp.i[key] >= 0 || cp.w[key] >= 0;
      if (full && split) missing("has both a full backward (B) and a split one (I/W)");
      if (!full && !split) missing(fmt::format("has no backward ({}B{} or {}I{} and {}W{})", st, mb, st, mb, st, mb));
      if (split && (cp.i[key] < 0 || cp.w[key] < 0)) missing("has only half of its split backward (needs both I and W)");
      if (split && cp.w[key] < cp.i[key]) missing(fmt::format("runs {}W{} before {}I{}", st, mb, st, mb));
      const int64_t bwd = full ? cp.b[key] : cp.i[key];
      if (bwd < cp.f[key]) missing("runs its backward before its forward");
    }
  }
  // Same-rank dependencies follow program order (cross-rank ones are
  // enforced by RECV and proven by simulation).
  for (const auto& e : s.edges) {
    const int r = s.stage_to_rank[e.producer];
    if (s.stage_to_rank[e.consumer] != r) continue;
    for (int mb = 0; mb < m; ++mb) {
      const size_t kp = static_cast<size_t>(e.producer) * m + mb, kc = static_cast<size_t>(e.consumer) * m + mb;
      if (cp.f[kc] < cp.f[kp]) {
        throw ScheduleError(fmt::format("rank {}: {}F{} runs before {}F{}, whose output it reads", r,
                                        e.consumer, mb, e.producer, mb));
      }
      const int64_t bp = cp.b[kp] >= 0 ? cp.b[kp] : cp.i[kp];
      const int64_t bc = cp.b[kc] >= 0 ? cp.b[kc] : cp.i[kc];
      if (bp < bc) {
        throw ScheduleError(fmt::format("rank {}: backward of stage {} microbatch {} runs before the "
                                        "backward of stage {}, whose gradient it needs",
                                        r, e.producer, mb, e.consumer));
      }
    }
  }
}

// Each directed channel's k-th SEND is the receiver's k-th RECV from it
// (NOTE [Channel order] in lowering.h). Runs after every transfer is known to
// be posted exactly once on both sides.
void checkChannelOrder(const Schedule& s, const TransferIndex& index) {
  const ChannelOrder order = receiveOrder(s, index);
  std::vector<int64_t> next(order.offsets.begin(), order.offsets.end() - 1);
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.programs[r]) {
      if (!isSend(a.kind)) continue;
      const int peer = s.stage_to_rank[a.peer_stage];
      const size_t ch = order.channel(r, peer);
      const int64_t slot = index.slotOf(a);
      if (order.slots[next[ch]] != slot) {
        throw ScheduleError(fmt::format(
            "channel rank {} -> rank {} is not matched by order: transfer #{} is '{}' on rank {} but '{}' on "
            "rank {} (NCCL p2p matches by order alone)",
            r, peer, next[ch] - order.offsets[ch], toString(a), r, toString(index.recvOf(order.slots[next[ch]])),
            peer));
      }
      ++next[ch];
    }
  }
}

// Lowered schedules: transfers exist, are used in the right place, and each
// channel is matched by order alone (NOTE [Channel order] in lowering.h).
void checkTransfers(const Schedule& s, const ComputePositions& cp) {
  const TransferIndex index(s);
  const int64_t slots = index.numSlots();
  std::vector<int32_t> send_pos(slots, -1), recv_pos(slots, -1);
  for (int r = 0; r < s.num_ranks; ++r) {
    const auto& program = s.programs[r];
    for (size_t pos = 0; pos < program.size(); ++pos) {
      const Action& a = program[pos];
      if (!isCommunication(a.kind)) continue;
      const int64_t slot = index.slotOf(a);
      if (slot < 0) {
        failAt(r, pos, a, fmt::format("stages {} and {} share no edge, so nothing flows between them",
                                      a.stage, a.peer_stage));
      }
      auto& at = isSend(a.kind) ? send_pos[slot] : recv_pos[slot];
      if (at >= 0) failAt(r, pos, a, fmt::format("transfer already posted at #{}", at));
      at = static_cast<int32_t>(pos);
    }
  }
  // Every cross-rank dependency is sent after it is produced and received
  // before it is used.
  const int m = s.num_microbatches;
  for (int e = 0; e < static_cast<int>(index.edges().size()); ++e) {
    const StageEdge edge = index.edges()[e];
    const int rp = s.stage_to_rank[edge.producer], rc = s.stage_to_rank[edge.consumer];
    if (rp == rc) continue;
    for (int mb = 0; mb < m; ++mb) {
      for (bool backward : {false, true}) {
        const int64_t slot = index.slot(e, backward, mb);
        const int sender = backward ? rc : rp, receiver = backward ? rp : rc;
        const int send_stage = backward ? edge.consumer : edge.producer;
        const int recv_stage = backward ? edge.producer : edge.consumer;
        if (send_pos[slot] < 0) {
          throw ScheduleError(fmt::format("rank {} never posts '{}' (rank {} needs it)", sender,
                                          toString(index.sendOf(slot)), receiver));
        }
        if (recv_pos[slot] < 0) {
          throw ScheduleError(fmt::format("rank {} never posts '{}' for rank {}'s '{}'", receiver,
                                          toString(index.recvOf(slot)), sender, toString(index.sendOf(slot))));
        }
        // Producer compute on the sender precedes the send; consumer compute
        // on the receiver follows the receive.
        const auto backwardAt = [&](size_t key) { return cp.b[key] >= 0 ? cp.b[key] : cp.i[key]; };
        const size_t send_key = static_cast<size_t>(send_stage) * m + mb;
        const size_t recv_key = static_cast<size_t>(recv_stage) * m + mb;
        const int64_t produced_at = backward ? backwardAt(send_key) : cp.f[send_key];
        const int64_t used_at = backward ? backwardAt(recv_key) : cp.f[recv_key];
        if (produced_at > send_pos[slot]) {
          failAt(sender, send_pos[slot], index.sendOf(slot), "is posted before the compute that produces it");
        }
        if (used_at < recv_pos[slot]) {
          failAt(receiver, recv_pos[slot], index.recvOf(slot), "is posted after the compute that uses it");
        }
      }
    }
  }
  checkChannelOrder(s, index);
}

}  // namespace

std::vector<int> peakActivations(const Schedule& schedule) {
  std::vector<int> peak(schedule.num_ranks, 0);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    int live = 0;
    for (const Action& a : schedule.programs[r]) {
      if (a.kind == ActionKind::Forward) peak[r] = std::max(peak[r], ++live);
      else if (isBackward(a.kind)) --live;
    }
  }
  return peak;
}

void validateStatic(const Schedule& schedule) {
  checkShape(schedule);
  const ComputePositions cp = collectCompute(schedule);
  checkComputeOrder(schedule, cp);
  if (schedule.isLowered()) checkTransfers(schedule, cp);
  if (!schedule.activation_bound.empty()) {
    const auto peak = peakActivations(schedule);
    for (int r = 0; r < schedule.num_ranks; ++r) {
      if (peak[r] > schedule.activation_bound[r]) {
        throw ScheduleError(fmt::format("rank {} holds {} forwards' activations at its peak, above the "
                                        "bound of {} that schedule '{}' promises",
                                        r, peak[r], schedule.activation_bound[r], schedule.name));
      }
    }
  }
}

void validate(const Schedule& schedule) {
  validateStatic(schedule);
  if (schedule.isLowered()) {
    simulate(schedule);
    return;
  }
  const Schedule lowered = lower(schedule);
  validateStatic(lowered);
  simulate(lowered);
}

}  // namespace mpmd
