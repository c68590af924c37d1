#include "transfer_index.h"

#include <algorithm>

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

size_t ChannelOrder::channel(int sender, int receiver) const {
  const auto begin = senders.begin() + first_channel[receiver];
  const auto end = senders.begin() + first_channel[receiver + 1];
  const auto it = std::lower_bound(begin, end, sender);
  return it != end && *it == sender ? static_cast<size_t>(it - senders.begin()) : kNoChannel;
}

ChannelOrder receiveOrder(const Schedule& s, const TransferIndex& index) {
  const int p = s.num_ranks;
  ChannelOrder order;
  order.first_channel.reserve(static_cast<size_t>(p) + 1);
  order.first_channel.push_back(0);
  order.offsets.push_back(0);
  const auto senderOf = [&](const Action& a) {
    return isRecv(a.kind) && a.peer_stage >= 0 && a.peer_stage < s.num_stages && index.slotOf(a) >= 0
               ? s.stage_to_rank[a.peer_stage]
               : -1;
  };
  // Channels are numbered receiver-major, so each rank's program fills a
  // contiguous block: count its RECVs per sender (in a row indexed by rank,
  // reset through the senders it touched: O(p) memory in all), number the
  // senders it has in ascending order, then fill.
  std::vector<int64_t> row(p, 0);  // RECVs per sender, then the sender's next fill position
  std::vector<int> touched;
  for (int r = 0; r < p; ++r) {
    touched.clear();
    for (const Action& a : s.programs[r]) {
      const int sender = senderOf(a);
      if (sender < 0) continue;
      if (row[sender]++ == 0) touched.push_back(sender);
    }
    std::sort(touched.begin(), touched.end());
    int64_t fill = static_cast<int64_t>(order.slots.size());
    for (int sender : touched) {
      const int64_t count = row[sender];
      row[sender] = fill;
      fill += count;
      order.senders.push_back(sender);
      order.offsets.push_back(fill);
    }
    order.first_channel.push_back(static_cast<int64_t>(order.senders.size()));
    order.slots.resize(static_cast<size_t>(fill));
    for (const Action& a : s.programs[r]) {
      const int sender = senderOf(a);
      if (sender >= 0) order.slots[row[sender]++] = index.slotOf(a);
    }
    for (int sender : touched) row[sender] = 0;
  }
  return order;
}

}  // namespace mpmd
