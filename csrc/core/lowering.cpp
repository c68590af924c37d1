#include "lowering.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "errors.h"
#include "transfer_index.h"

namespace mpmd {

namespace {

void requireComputeOnly(const Schedule& schedule, std::string_view pass) {
  for (int r = 0; r < schedule.num_ranks; ++r) {
    for (const auto& a : schedule.programs[r]) {
      if (!isCompute(a.kind)) {
        throw ScheduleError(fmt::format("{} needs a compute-only schedule, but rank {} holds '{}'",
                                        pass, r, toString(a)));
      }
    }
  }
}

// Everything but the programs (copying them only to clear them would double
// the cost of each pass on large schedules).
Schedule withEmptyPrograms(const Schedule& schedule) {
  Schedule out;
  out.name = schedule.name;
  out.num_ranks = schedule.num_ranks;
  out.num_stages = schedule.num_stages;
  out.num_microbatches = schedule.num_microbatches;
  out.stage_to_rank = schedule.stage_to_rank;
  out.edges = schedule.edges;
  out.activation_bound = schedule.activation_bound;
  out.programs.resize(schedule.programs.size());
  return out;
}

}  // namespace

Schedule insertTransfers(const Schedule& compute_only) {
  requireComputeOnly(compute_only, "insertTransfers");
  const auto producers = compute_only.producersOf();
  const auto consumers = compute_only.consumersOf();
  const auto& owner = compute_only.stage_to_rank;
  Schedule out = withEmptyPrograms(compute_only);

  // Transfers a compute action of stage s gains on rank r: one per
  // neighbour stage on another rank (F, B and I; W gains none). Counted once
  // per stage for its own rank, where its actions are (per action otherwise),
  // so sizing is linear in stages plus actions, not ranks x stages.
  const auto crossings = [&](int s, int r) {
    size_t n = 0;
    for (int q : producers[s]) n += owner[q] != r;
    for (int c : consumers[s]) n += owner[c] != r;
    return n;
  };
  std::vector<size_t> extra(compute_only.num_stages), stages_on(compute_only.num_ranks, 0);
  for (int s = 0; s < compute_only.num_stages; ++s) {
    extra[s] = crossings(s, owner[s]);
    ++stages_on[owner[s]];
  }
  for (int r = 0; r < compute_only.num_ranks; ++r) {
    // Exact size (a 3x guess would touch, and page-fault, far more memory on
    // large schedules), plus room for insertGradReduce's one action per local
    // stage, so that pass can insert in place.
    size_t size = 0;
    for (const Action& a : compute_only.programs[r]) {
      ++size;
      if (a.kind == ActionKind::BackwardWeight) continue;
      size += owner[a.stage] == r ? extra[a.stage] : crossings(a.stage, r);
    }
    auto& program = out.programs[r];
    program.reserve(size + stages_on[r]);
    for (const Action& a : compute_only.programs[r]) {
      const int s = a.stage, mb = a.microbatch;
      if (a.kind == ActionKind::Forward) {
        for (int p : producers[s])
          if (owner[p] != r) program.push_back(commAction(s, ActionKind::RecvF, mb, p));
        program.push_back(a);
        for (int c : consumers[s])
          if (owner[c] != r) program.push_back(commAction(s, ActionKind::SendF, mb, c));
      } else if (isBackward(a.kind)) {
        for (int c : consumers[s])
          if (owner[c] != r) program.push_back(commAction(s, ActionKind::RecvB, mb, c));
        program.push_back(a);
        for (int p : producers[s])
          if (owner[p] != r) program.push_back(commAction(s, ActionKind::SendB, mb, p));
      } else {
        program.push_back(a);  // W needs and produces nothing across stages
      }
    }
  }
  return out;
}

namespace {

// True when every rank's sends to each peer already come in that peer's
// receive order: the common case, which needs no rewrite.
bool channelsMatch(const Schedule& s, const TransferIndex& index, const ChannelOrder& order) {
  std::vector<int64_t> next = order.cursors();
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.programs[r]) {
      if (!isSend(a.kind)) continue;
      const int64_t slot = index.slotOf(a);
      if (slot < 0 || s.stage_to_rank[a.peer_stage] == r) return false;
      const size_t ch = order.channel(r, s.stage_to_rank[a.peer_stage]);
      if (ch == ChannelOrder::kNoChannel) return false;
      if (next[ch] >= order.offsets[ch + 1] || order.slots[next[ch]] != slot) return false;
      ++next[ch];
    }
  }
  return true;
}

// A sufficient condition for channelsMatch, in one pass and without building
// the receive order: every transfer is on its stages' ranks and posted at
// most once per side, every SEND has its RECV, and each slot's SEND and RECV
// have the same index among their channel's sends and receives (a slot's two
// sides share a channel). False means "unknown": the caller checks in full.
bool channelsSurelyMatch(const Schedule& s, const TransferIndex& index) {
  const int p = s.num_ranks;
  const auto& owner = s.stage_to_rank;
  struct SlotState {  // 4 bytes: this array is the pass's main memory cost
    uint32_t ord : 30;  // index in the channel of whichever side came first
    uint32_t seen : 2;  // kSent | kReceived
  };
  constexpr uint32_t kSent = 1, kReceived = 2, kMaxOrd = (1u << 30) - 1;
  std::vector<SlotState> slots(index.numSlots(), SlotState{0, 0});
  // Transfers rank r has posted so far to (sent_to) and from (received_from)
  // each peer: all of channel r -> peer's sends and peer -> r's receives are
  // in r's program, so one row per direction, reset after each rank through
  // the peers it touched, counts them (O(p), not a p x p table: NOTE [Sparse
  // channels] in transfer_index.h).
  std::vector<uint32_t> sent_to(p, 0), received_from(p, 0);
  std::vector<int> touched;
  int64_t sends = 0, pairs = 0;
  for (int r = 0; r < p; ++r) {
    for (int peer : touched) sent_to[peer] = received_from[peer] = 0;
    touched.clear();
    for (const Action& a : s.programs[r]) {
      if (!isCommunication(a.kind)) continue;
      const int64_t slot = index.slotOf(a);  // valid: both stages in range
      if (slot < 0 || owner[a.stage] != r || owner[a.peer_stage] == r) return false;
      const int peer = owner[a.peer_stage];
      const bool send = isSend(a.kind);
      const uint32_t side = send ? kSent : kReceived;
      if (sent_to[peer] == 0 && received_from[peer] == 0) touched.push_back(peer);
      const uint32_t ord = send ? sent_to[peer]++ : received_from[peer]++;
      SlotState& st = slots[slot];
      if ((st.seen & side) || ord > kMaxOrd) return false;
      if (st.seen) {
        if (st.ord != ord) return false;
        ++pairs;
      }
      st.seen |= side;
      st.ord = ord;
      sends += send;
    }
  }
  return pairs == sends;
}

}  // namespace

Schedule orderChannels(Schedule with_transfers) {
  const int p = with_transfers.num_ranks;
  const TransferIndex index(with_transfers);
  if (channelsSurelyMatch(with_transfers, index)) return with_transfers;
  const auto& owner = with_transfers.stage_to_rank;
  const ChannelOrder recv_order = receiveOrder(with_transfers, index);
  if (channelsMatch(with_transfers, index, recv_order)) return with_transfers;

  Schedule out = withEmptyPrograms(with_transfers);
  std::vector<uint8_t> ready(index.numSlots(), 0);
  std::vector<int64_t> next = recv_order.cursors();
  for (int r = 0; r < p; ++r) {
    auto& program = out.programs[r];
    const auto& source = with_transfers.programs[r];
    program.reserve(source.size());
    std::vector<Action> unmatched;  // sends no receiver expects: kept for the validator to report
    for (const Action& a : source) {
      if (!isSend(a.kind)) {
        program.push_back(a);
        continue;
      }
      int64_t slot = index.slotOf(a);
      if (slot < 0 || owner[a.peer_stage] == r) {
        unmatched.push_back(a);
        continue;
      }
      ready[slot] = 1;
      // Emit, in receive order, every send of this channel that is ready:
      // a send whose turn has not come waits for the ones before it.
      const size_t ch = recv_order.channel(r, owner[a.peer_stage]);
      if (ch == ChannelOrder::kNoChannel) continue;  // the receiver expects nothing from r: appended below
      while (next[ch] < recv_order.offsets[ch + 1] && ready[recv_order.slots[next[ch]]] == 1) {
        ready[recv_order.slots[next[ch]]] = 2;
        program.push_back(index.sendOf(recv_order.slots[next[ch]++]));
      }
    }
    // Ready sends that never got their turn (the receiver lacks a RECV they
    // precede): append them so validation names the mismatch.
    for (const Action& a : source) {
      if (!isSend(a.kind)) continue;
      int64_t slot = index.slotOf(a);
      if (slot >= 0 && ready[slot] == 1) {
        ready[slot] = 2;
        program.push_back(a);
      }
    }
    program.insert(program.end(), unmatched.begin(), unmatched.end());
  }
  return out;
}

Schedule insertGradReduce(Schedule with_transfers) {
  // Position of each stage's last backward (B or W; I is followed by W) on
  // the current rank; reset through the stages the rank touched, so the pass
  // costs stages plus actions, not ranks x stages.
  std::vector<int64_t> last(with_transfers.num_stages, -1);
  std::vector<int> touched;
  for (int r = 0; r < with_transfers.num_ranks; ++r) {
    const auto& source = with_transfers.programs[r];
    for (int s : touched) last[s] = -1;
    touched.clear();
    for (size_t i = 0; i < source.size(); ++i) {
      const auto kind = source[i].kind;
      if (kind == ActionKind::FullBackward || kind == ActionKind::BackwardWeight ||
          kind == ActionKind::BackwardInput) {
        if (last[source[i].stage] < 0) touched.push_back(source[i].stage);
        last[source[i].stage] = static_cast<int64_t>(i);
      }
    }
    // Insert after the backward and the sends right behind it, so the
    // reduction never delays a gradient a peer is waiting for.
    std::vector<std::pair<size_t, int>> reduce_after;  // (position, stage), sorted below
    for (int s : touched) {
      size_t at = static_cast<size_t>(last[s]);
      while (at + 1 < source.size() && isSend(source[at + 1].kind)) ++at;
      reduce_after.emplace_back(at, s);
    }
    std::sort(reduce_after.begin(), reduce_after.end());
    // Insert in place from the back: only the actions after the first
    // insertion point move (the tail of the program, as the last backwards
    // come late), instead of copying every program.
    auto& program = with_transfers.programs[r];
    size_t end = program.size();  // actions [0, end) are not yet at their final place
    program.resize(end + reduce_after.size());
    for (size_t j = reduce_after.size(); j-- > 0;) {
      const size_t after = reduce_after[j].first;
      std::move_backward(program.begin() + static_cast<ptrdiff_t>(after + 1),
                         program.begin() + static_cast<ptrdiff_t>(end),
                         program.begin() + static_cast<ptrdiff_t>(end + j + 1));
      program[after + 1 + j] = reduceGradAction(reduce_after[j].second);
      end = after + 1;
    }
  }
  return with_transfers;
}

Schedule lower(const Schedule& compute_only, const LowerOptions& options) {
  Schedule out = orderChannels(insertTransfers(compute_only));
  if (options.grad_reduce) out = insertGradReduce(std::move(out));
  if (options.shard) out = insertUnshardReshard(std::move(out), options.shard_options);
  return out;
}

}  // namespace mpmd
