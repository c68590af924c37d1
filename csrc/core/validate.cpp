#include "validate.h"

#include <algorithm>
#include <utility>

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

// Position of each compute kind per (stage, microbatch), -1 when absent;
// key stage * m + mb, positions fit int32. I and W get their own table, made
// only when a schedule splits its backward: most do not, and these tables
// are the bulk of validation's memory.
class ComputePositions {
 public:
  explicit ComputePositions(size_t keys) : fb_(keys, {-1, -1}) {}
  int32_t f(size_t key) const { return fb_[key].first; }
  int32_t b(size_t key) const { return fb_[key].second; }
  int32_t i(size_t key) const { return iw_.empty() ? -1 : iw_[key].first; }
  int32_t w(size_t key) const { return iw_.empty() ? -1 : iw_[key].second; }
  // B if any, else I: the backward that produces the input gradient.
  int32_t backward(size_t key) const { return b(key) >= 0 ? b(key) : i(key); }
  int32_t& at(size_t key, ActionKind kind) {
    if (kind == ActionKind::Forward) return fb_[key].first;
    if (kind == ActionKind::FullBackward) return fb_[key].second;
    if (iw_.empty()) iw_.assign(fb_.size(), {-1, -1});
    return kind == ActionKind::BackwardInput ? iw_[key].first : iw_[key].second;
  }

 private:
  std::vector<std::pair<int32_t, int32_t>> fb_ = {}, iw_ = {};
};

void checkActionFields(const Schedule& s, int r, size_t pos, const Action& a) {
  if (a.stage < 0 || a.stage >= s.num_stages) {
    failAt(r, pos, a, fmt::format("stage {} is outside 0..{}", a.stage, s.num_stages - 1));
  }
  if (!isStageCollective(a.kind) && (a.microbatch < 0 || a.microbatch >= s.num_microbatches)) {
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

void checkComputeOrder(const Schedule& s, const ComputePositions& cp) {
  const int m = s.num_microbatches;
  for (int st = 0; st < s.num_stages; ++st) {
    const int r = s.stage_to_rank[st];
    for (int mb = 0; mb < m; ++mb) {
      const size_t key = static_cast<size_t>(st) * m + mb;
      const auto missing = [&](std::string_view what) {
        throw ScheduleError(fmt::format("rank {}: stage {} microbatch {} {}", r, st, mb, what));
      };
      if (cp.f(key) < 0) missing(fmt::format("has no forward {}F{}", st, mb));
      const bool full = cp.b(key) >= 0, split = cp.i(key) >= 0 || cp.w(key) >= 0;
      if (full && split) missing("has both a full backward (B) and a split one (I/W)");
      if (!full && !split) missing(fmt::format("has no backward ({}B{} or {}I{} and {}W{})", st, mb, st, mb, st, mb));
      if (split && (cp.i(key) < 0 || cp.w(key) < 0)) missing("has only half of its split backward (needs both I and W)");
      if (split && cp.w(key) < cp.i(key)) missing(fmt::format("runs {}W{} before {}I{}", st, mb, st, mb));
      const int64_t bwd = full ? cp.b(key) : cp.i(key);
      if (bwd < cp.f(key)) missing("runs its backward before its forward");
    }
  }
  // Same-rank dependencies follow program order (cross-rank ones are
  // enforced by RECV and proven by simulation).
  for (const auto& e : s.edges) {
    const int r = s.stage_to_rank[e.producer];
    if (s.stage_to_rank[e.consumer] != r) continue;
    for (int mb = 0; mb < m; ++mb) {
      const size_t kp = static_cast<size_t>(e.producer) * m + mb, kc = static_cast<size_t>(e.consumer) * m + mb;
      if (cp.f(kc) < cp.f(kp)) {
        throw ScheduleError(fmt::format("rank {}: {}F{} runs before {}F{}, whose output it reads", r,
                                        e.consumer, mb, e.producer, mb));
      }
      const int64_t bp = cp.backward(kp);
      const int64_t bc = cp.backward(kc);
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
  std::vector<int64_t> next = order.cursors();
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.programs[r]) {
      if (!isSend(a.kind)) continue;
      const int peer = s.stage_to_rank[a.peer_stage];
      const size_t ch = order.channel(r, peer);
      const int64_t slot = index.slotOf(a);
      if (ch == ChannelOrder::kNoChannel || next[ch] >= order.offsets[ch + 1]) {
        // Unreachable after the per-slot checks (each send has its receive); kept as a guard.
        throw ScheduleError(fmt::format("rank {} posts '{}' but rank {} posts no receive left on channel "
                                        "rank {} -> rank {}",
                                        r, toString(a), peer, r, peer));
      }
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
//
// The reference check, run only when checkTransfersFast could not prove the
// schedule valid: it names the first violation in a stable order.
void checkTransfersSlow(const Schedule& s, const ComputePositions& cp) {
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
        const size_t send_key = static_cast<size_t>(send_stage) * m + mb;
        const size_t recv_key = static_cast<size_t>(recv_stage) * m + mb;
        const int64_t produced_at = backward ? cp.backward(send_key) : cp.f(send_key);
        const int64_t used_at = backward ? cp.backward(recv_key) : cp.f(recv_key);
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

// What the one pass over the programs (collect) learns.
struct Collected {
  ComputePositions cp{0};
  bool lowered = false;  // holds a non-compute action, as Schedule::isLowered
  // Per transfer slot, tracked only while every transfer seen is fine; once
  // transfers_ok is false, checkTransfersSlow names the problem.
  struct SlotState {  // 8 bytes: with cp, the main memory cost of validation
    int32_t recv_pos = -1;
    uint32_t ord : 31 = 0;  // index in its rank channel of whichever side came first
    uint32_t sent : 1 = 0;
  };
  std::vector<SlotState> slots;
  bool transfers_ok = true;
  std::vector<int> peak;  // as peakActivations
  std::vector<int> sharded_ranks;  // ranks whose program holds UNSHARD or RESHARD, ascending
};

// The transfers of a program touch many slot streams at once, which the
// hardware prefetcher does not follow; fetch the slot of a transfer ahead.
template <typename T>
inline void prefetchSlotAhead(const TransferIndex& index, const std::vector<Action>& program, size_t pos,
                              const std::vector<T>& slots) {
  constexpr size_t kLookahead = 8;
  if (pos + kLookahead < program.size() && isCommunication(program[pos + kLookahead].kind)) {
    const int64_t ahead = index.slotOf(program[pos + kLookahead]);
    if (ahead >= 0 && ahead < static_cast<int64_t>(slots.size())) __builtin_prefetch(&slots[ahead]);
  }
}

// Checks each action's fields and that each compute runs once (throwing at
// the first problem, in program order), and gathers everything the later
// checks need, so the programs are read once.
Collected collect(const Schedule& s, const TransferIndex& index) {
  const int p = s.num_ranks, m = s.num_microbatches;
  Collected c;
  c.cp = ComputePositions(static_cast<size_t>(s.num_stages) * m);
  c.peak.assign(p, 0);
  // Transfers rank r has posted so far to (sent_to) and from (received_from)
  // each peer: the channels r -> peer and peer -> r, by r's side. Only the
  // current rank's counters are live, so one row per direction, reset after
  // each rank through the peers it touched: O(p) memory, not O(p^2) (a
  // 20,000-rank text needed 3.2 GB for two dense p x p tables).
  std::vector<uint32_t> sent_to(p, 0), received_from(p, 0);
  std::vector<int> touched;
  for (int r = 0; r < p; ++r) {
    for (int peer : touched) sent_to[peer] = received_from[peer] = 0;
    touched.clear();
    const auto& program = s.programs[r];
    int live = 0;
    for (size_t pos = 0; pos < program.size(); ++pos) {
      const Action& a = program[pos];
      checkActionFields(s, r, pos, a);
      if (isCompute(a.kind)) {
        int32_t& slot = c.cp.at(static_cast<size_t>(a.stage) * m + a.microbatch, a.kind);
        if (slot >= 0) failAt(r, pos, a, fmt::format("runs twice (first at #{})", slot));
        slot = static_cast<int32_t>(pos);
        if (a.kind == ActionKind::Forward) c.peak[r] = std::max(c.peak[r], ++live);
        else if (isBackward(a.kind)) --live;
        continue;
      }
      c.lowered = true;
      if ((a.kind == ActionKind::Unshard || a.kind == ActionKind::Reshard) &&
          (c.sharded_ranks.empty() || c.sharded_ranks.back() != r)) {
        c.sharded_ranks.push_back(r);
      }
      if (!isCommunication(a.kind) || !c.transfers_ok) continue;
      if (c.slots.empty()) c.slots.resize(index.numSlots());
      prefetchSlotAhead(index, program, pos, c.slots);
      const int64_t slot = index.slotOf(a);
      if (slot < 0) {
        c.transfers_ok = false;
        continue;
      }
      auto& st = c.slots[slot];
      const int peer = s.stage_to_rank[a.peer_stage];  // checkActionFields: not r
      if (isSend(a.kind)) {
        // The producer is on this rank, so it is recorded iff it came first.
        const size_t key = static_cast<size_t>(a.stage) * m + a.microbatch;
        const int32_t produced_at = a.kind == ActionKind::SendF ? c.cp.f(key) : c.cp.backward(key);
        if (sent_to[peer] == 0 && received_from[peer] == 0) touched.push_back(peer);
        const uint32_t ord = sent_to[peer]++;
        if (st.sent || produced_at < 0 || (st.recv_pos >= 0 && st.ord != ord)) c.transfers_ok = false;
        st.sent = 1;
        if (st.recv_pos < 0) st.ord = ord;
      } else {
        if (sent_to[peer] == 0 && received_from[peer] == 0) touched.push_back(peer);
        const uint32_t ord = received_from[peer]++;
        if (st.recv_pos >= 0 || (st.sent && st.ord != ord)) c.transfers_ok = false;
        st.recv_pos = static_cast<int32_t>(pos);
        if (!st.sent) st.ord = ord;
      }
    }
  }
  if (c.lowered && c.slots.empty()) c.slots.resize(index.numSlots());
  return c;
}

// True when collect's data proves what checkTransfersSlow checks: every
// transfer valid and posted once per side, each send after its producer, each
// receive before its consumer, and per channel the k-th send is the k-th
// receive (equal indices per slot, given each slot's sides share a channel).
bool transfersProvenValid(const Schedule& s, const TransferIndex& index, const Collected& c) {
  if (!c.transfers_ok) return false;
  const int m = s.num_microbatches;
  for (int e = 0; e < static_cast<int>(index.edges().size()); ++e) {
    const StageEdge edge = index.edges()[e];
    if (s.stage_to_rank[edge.producer] == s.stage_to_rank[edge.consumer]) continue;
    for (int mb = 0; mb < m; ++mb) {
      const size_t consumer = static_cast<size_t>(edge.consumer) * m + mb;
      const size_t producer = static_cast<size_t>(edge.producer) * m + mb;
      const auto& fwd = c.slots[index.slot(e, false, mb)];
      const auto& bwd = c.slots[index.slot(e, true, mb)];
      if (!fwd.sent || fwd.recv_pos < 0 || c.cp.f(consumer) < fwd.recv_pos) return false;
      if (!bwd.sent || bwd.recv_pos < 0 || c.cp.backward(producer) < bwd.recv_pos) return false;
    }
  }
  return true;
}

// NOTE [Unshard placement] in lowering.h: on a rank that gathers parameters,
// each local stage's compute actions lie in UNSHARD..RESHARD windows that
// neither nest nor stay open at the end. Fields were checked by collect.
// `open_at` (per stage: position of the open window's UNSHARD, -1 when
// closed) is all -1 on entry and on return, so ranks share it: the check
// costs the rank's actions, not the schedule's stages.
void checkShardWindows(const Schedule& s, int r, std::vector<int64_t>& open_at) {
  const auto& program = s.programs[r];
  std::vector<int> opened;  // stages whose window opened on this rank, each once
  for (size_t pos = 0; pos < program.size(); ++pos) {
    const Action& a = program[pos];
    int64_t& open = open_at[a.stage];
    if (a.kind == ActionKind::Unshard) {
      if (open >= 0) {
        failAt(r, pos, a, fmt::format("gathers stage {}'s parameters again while its UNSHARD at #{} "
                                      "has no RESHARD yet", a.stage, open));
      }
      open = static_cast<int64_t>(pos);
      opened.push_back(a.stage);
    } else if (a.kind == ActionKind::Reshard) {
      if (open < 0) failAt(r, pos, a, fmt::format("no UNSHARD of stage {} is open to close", a.stage));
      open = -1;
    } else if (isCompute(a.kind) && open < 0) {
      failAt(r, pos, a, fmt::format("stage {}'s parameters are not gathered here (no UNSHARD of stage {} "
                                    "before it since its last RESHARD)", a.stage, a.stage));
    }
  }
  int64_t first_open = -1;  // the earliest window still open, reported first
  for (int stage : opened) {
    if (open_at[stage] >= 0 && (first_open < 0 || open_at[stage] < first_open)) first_open = open_at[stage];
  }
  for (int stage : opened) open_at[stage] = -1;
  if (first_open >= 0) {
    const Action& a = program[static_cast<size_t>(first_open)];
    failAt(r, static_cast<size_t>(first_open), a,
           fmt::format("stage {}'s parameters are still gathered at the end of the program (no RESHARD "
                       "after this UNSHARD)", a.stage));
  }
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
  const TransferIndex index(schedule);
  const Collected c = collect(schedule, index);
  checkComputeOrder(schedule, c.cp);
  if (!c.sharded_ranks.empty()) {
    std::vector<int64_t> open_at(schedule.num_stages, -1);
    for (int r : c.sharded_ranks) checkShardWindows(schedule, r, open_at);
  }
  if (c.lowered && !transfersProvenValid(schedule, index, c)) checkTransfersSlow(schedule, c.cp);
  if (!schedule.activation_bound.empty()) {
    for (int r = 0; r < schedule.num_ranks; ++r) {
      if (c.peak[r] > schedule.activation_bound[r]) {
        throw ScheduleError(fmt::format("rank {} holds {} forwards' activations at its peak, above the "
                                        "bound of {} that schedule '{}' promises",
                                        r, c.peak[r], schedule.activation_bound[r], schedule.name));
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
