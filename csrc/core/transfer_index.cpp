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
  order.num_ranks = s.num_ranks;
  const size_t channels = static_cast<size_t>(s.num_ranks) * s.num_ranks;
  // One pass over the programs collects (channel, slot) in program order;
  // a counting sort by channel then keeps that order within each channel.
  std::vector<std::pair<uint32_t, int64_t>> recvs;
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.programs[r]) {
      if (!isRecv(a.kind) || a.peer_stage < 0 || a.peer_stage >= s.num_stages) continue;
      const int64_t slot = index.slotOf(a);
      if (slot < 0) continue;
      recvs.emplace_back(static_cast<uint32_t>(order.channel(s.stage_to_rank[a.peer_stage], r)), slot);
    }
  }
  order.offsets.assign(channels + 1, 0);
  for (const auto& [ch, slot] : recvs) ++order.offsets[ch + 1];
  for (size_t ch = 0; ch < channels; ++ch) order.offsets[ch + 1] += order.offsets[ch];
  order.slots.resize(recvs.size());
  std::vector<int64_t> fill(order.offsets.begin(), order.offsets.end() - 1);
  for (const auto& [ch, slot] : recvs) order.slots[fill[ch]++] = slot;
  return order;
}

}  // namespace mpmd
