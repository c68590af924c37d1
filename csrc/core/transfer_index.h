// Dense numbering of the transfers of a schedule (internal to the core).
//
// A transfer is one direction of one stage edge for one microbatch:
// activations producer->consumer (forward) or gradients consumer->producer
// (backward). Lowering, validation and simulation all need "which SEND
// matches this RECV"; numbering transfers densely lets them use flat arrays
// instead of hash maps, which keeps a million-action schedule in tens of ms.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schedule.h"

namespace mpmd {

class TransferIndex {
 public:
  // Requires edges with stages in range (checked by the caller).
  explicit TransferIndex(const Schedule& schedule);

  // Index of the stage edge, or -1 when the schedule has no such edge.
  int edgeId(int producer, int consumer) const {
    if (producer < 0 || producer >= num_stages_ || consumer < 0 || consumer >= num_stages_) return -1;
    if (!dense_.empty()) return dense_[static_cast<size_t>(producer) * num_stages_ + consumer];
    for (const auto& [c, id] : by_producer_[producer]) {
      if (c == consumer) return id;
    }
    return -1;
  }

  // Slot of a SEND/RECV action in [0, numSlots()), or -1 when the action
  // names a peer its stage has no edge with. Called per action by every
  // pass, hence inline.
  int64_t slotOf(const Action& a) const {
    if (a.microbatch < 0 || a.microbatch >= num_microbatches_) return -1;
    int edge;
    switch (a.kind) {
      case ActionKind::SendF: edge = edgeId(a.stage, a.peer_stage); break;
      case ActionKind::RecvF: edge = edgeId(a.peer_stage, a.stage); break;
      case ActionKind::SendB: return slotOrInvalid(edgeId(a.peer_stage, a.stage), true, a.microbatch);
      case ActionKind::RecvB: return slotOrInvalid(edgeId(a.stage, a.peer_stage), true, a.microbatch);
      default: return -1;
    }
    return slotOrInvalid(edge, false, a.microbatch);
  }
  // Slot of the transfer carrying edge `edge` in direction `backward` for mb.
  int64_t slot(int edge, bool backward, int microbatch) const {
    return (static_cast<int64_t>(edge) * 2 + (backward ? 1 : 0)) * num_microbatches_ + microbatch;
  }
  int64_t numSlots() const { return static_cast<int64_t>(edges_.size()) * 2 * num_microbatches_; }

  // The SEND (or RECV) action that carries `slot`, for messages and passes.
  Action sendOf(int64_t slot) const;
  Action recvOf(int64_t slot) const;

  const std::vector<StageEdge>& edges() const { return edges_; }

 private:
  int64_t slotOrInvalid(int edge, bool backward, int microbatch) const {
    return edge < 0 ? -1 : slot(edge, backward, microbatch);
  }

  int num_stages_ = 0;
  // producer * num_stages + consumer -> edge id; only for up to
  // kDenseStages stages (a 4 MiB table), else by_producer_ is scanned.
  static constexpr int kDenseStages = 1024;
  std::vector<int> dense_;
  std::vector<StageEdge> edges_;
  std::vector<std::vector<std::pair<int, int>>> by_producer_;  // (consumer, edge id)
  int num_microbatches_ = 0;
};

// Receive order of every directed rank channel sender -> receiver that
// carries a RECV, in CSR form (NOTE [Sparse channels]): the channels of
// receiver r are ids first_channel[r] .. first_channel[r + 1], one per
// sender it receives from, senders ascending; channel `ch` holds
// slots[offsets[ch] .. offsets[ch + 1]) in the receiver's program order.
// RECVs that name no edge are left out (validation reports them).
//
// NOTE [Sparse channels]: a dense table of the num_ranks^2 possible channels
// made lowering a 20,000-rank text take 3 GB and 9 s; a rank talks to a few
// peers, so only channels that occur are stored, and channel() finds one by
// a binary search over its receiver's few senders. Memory and time stay
// linear in the ranks plus the actions.
struct ChannelOrder {
  static constexpr size_t kNoChannel = static_cast<size_t>(-1);
  std::vector<int64_t> first_channel;  // per receiver rank, plus one
  std::vector<int> senders;            // per channel
  std::vector<int64_t> offsets;        // per channel, plus one
  std::vector<int64_t> slots;

  // The channel sender -> receiver, or kNoChannel when the receiver posts no
  // RECV from that sender. Requires 0 <= receiver < num_ranks.
  size_t channel(int sender, int receiver) const;
  size_t numChannels() const { return senders.size(); }
  // One cursor per channel at its first slot: passes that walk the sends
  // advance channel ch's cursor through offsets[ch] .. offsets[ch + 1].
  std::vector<int64_t> cursors() const { return {offsets.begin(), offsets.end() - 1}; }
};
ChannelOrder receiveOrder(const Schedule& schedule, const TransferIndex& index);

}  // namespace mpmd
