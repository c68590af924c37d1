#include "transfer_index.h"

namespace mpmd {

TransferIndex::TransferIndex(const Schedule& schedule)
    : edges_(schedule.edges),
      by_producer_(schedule.num_stages),
      num_microbatches_(schedule.num_microbatches) {
  for (size_t e = 0; e < edges_.size(); ++e) {
    by_producer_[edges_[e].producer].emplace_back(edges_[e].consumer, static_cast<int>(e));
  }
}

int TransferIndex::edgeId(int producer, int consumer) const {
  if (producer < 0 || producer >= static_cast<int>(by_producer_.size())) return -1;
  for (const auto& [c, id] : by_producer_[producer]) {
    if (c == consumer) return id;
  }
  return -1;
}

int64_t TransferIndex::slotOf(const Action& a) const {
  if (a.microbatch < 0 || a.microbatch >= num_microbatches_) return -1;
  int edge = -1;
  bool backward = false;
  switch (a.kind) {
    case ActionKind::SendF: edge = edgeId(a.stage, a.peer_stage); break;
    case ActionKind::RecvF: edge = edgeId(a.peer_stage, a.stage); break;
    case ActionKind::SendB: edge = edgeId(a.peer_stage, a.stage); backward = true; break;
    case ActionKind::RecvB: edge = edgeId(a.stage, a.peer_stage); backward = true; break;
    default: return -1;
  }
  return edge < 0 ? -1 : slot(edge, backward, a.microbatch);
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

}  // namespace mpmd
