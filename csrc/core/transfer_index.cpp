#include "transfer_index.h"

#include <fmt/format.h>

#include "errors.h"

namespace mpmd {

TransferIndex::TransferIndex(const Schedule& schedule)
    : edges_(schedule.edges),
      by_producer_(schedule.num_stages),
      num_microbatches_(schedule.num_microbatches) {
  num_stages_ = schedule.num_stages;
  for (const auto& e : edges_) {
    if (e.producer < 0 || e.producer >= num_stages_ || e.consumer < 0 || e.consumer >= num_stages_) {
      throw ScheduleError(fmt::format("stage edge {}->{} names a stage outside 0..{}", e.producer, e.consumer,
                                      num_stages_ - 1));
    }
  }
  for (size_t e = 0; e < edges_.size(); ++e) {
    by_producer_[edges_[e].producer].emplace_back(edges_[e].consumer, static_cast<int>(e));
  }
  if (num_stages_ <= kDenseStages) {
    dense_.assign(static_cast<size_t>(num_stages_) * num_stages_, -1);
    for (size_t e = 0; e < edges_.size(); ++e) {
      dense_[static_cast<size_t>(edges_[e].producer) * num_stages_ + edges_[e].consumer] = static_cast<int>(e);
    }
  }
}

namespace {
struct SlotParts {
  StageEdge edge;
  bool backward;
  int microbatch;
};
SlotParts split(const std::vector<StageEdge>& edges, int64_t slot, int m) {
  int mb = static_cast<int>(slot % m);
  int64_t rest = slot / m;
  return {edges[rest / 2], rest % 2 == 1, mb};
}
}  // namespace

Action TransferIndex::sendOf(int64_t slot) const {
  auto [edge, backward, mb] = split(edges_, slot, num_microbatches_);
  return backward ? commAction(edge.consumer, ActionKind::SendB, mb, edge.producer)
                  : commAction(edge.producer, ActionKind::SendF, mb, edge.consumer);
}

Action TransferIndex::recvOf(int64_t slot) const {
  auto [edge, backward, mb] = split(edges_, slot, num_microbatches_);
  return backward ? commAction(edge.producer, ActionKind::RecvB, mb, edge.consumer)
                  : commAction(edge.consumer, ActionKind::RecvF, mb, edge.producer);
}

ChannelOrder receiveOrder(const Schedule& s, const TransferIndex& index) {
  ChannelOrder order;
  const int p = order.num_ranks = s.num_ranks;
  order.offsets.assign(static_cast<size_t>(p) * p + 1, 0);
  // Channels are numbered receiver-major (see ChannelOrder::channel), so each
  // rank's program fills a contiguous block: count its RECVs per sender, then
  // fill, while the program is still in cache. No temporary list of pairs.
  const auto senderOf = [&](const Action& a) {
    return isRecv(a.kind) && a.peer_stage >= 0 && a.peer_stage < s.num_stages ? s.stage_to_rank[a.peer_stage]
                                                                               : -1;
  };
  for (int r = 0; r < p; ++r) {
    int64_t* counts = &order.offsets[order.channel(0, r) + 1];
    for (const Action& a : s.programs[r]) {
      const int sender = senderOf(a);
      if (sender >= 0 && index.slotOf(a) >= 0) ++counts[sender];
    }
    for (int q = 0; q < p; ++q) counts[q] += counts[q - 1];  // counts[-1] is the block's base
    order.slots.resize(static_cast<size_t>(counts[p - 1]));
    std::vector<int64_t> fill(counts - 1, counts + p - 1);
    for (const Action& a : s.programs[r]) {
      const int sender = senderOf(a);
      if (sender < 0) continue;
      const int64_t slot = index.slotOf(a);
      if (slot >= 0) order.slots[fill[sender]++] = slot;
    }
  }
  return order;
}

}  // namespace mpmd
