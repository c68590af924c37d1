#include "common.h"

#include <algorithm>

namespace mpmd::schedules {

std::vector<int> microbatchGroups(int num_ranks, int num_microbatches) {
  const int count = std::max(1, num_microbatches / num_ranks);
  std::vector<int> sizes(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    sizes[i] = num_microbatches / count + (i < num_microbatches % count ? 1 : 0);
  }
  return sizes;
}

std::vector<StageMb> groupedOrder(const ScheduleSpec& spec, int rank, bool backward) {
  const int p = spec.num_ranks, v = spec.stages_per_rank, m = spec.num_microbatches;
  std::vector<StageMb> order;
  order.reserve(static_cast<size_t>(v) * m);
  int first = 0;
  for (int size : microbatchGroups(p, m)) {
    for (int i = 0; i < v; ++i) {
      const int chunk = backward ? v - 1 - i : i;
      for (int mb = first; mb < first + size; ++mb) order.push_back({chunk * p + rank, mb});
    }
    first += size;
  }
  return order;
}

int appendOneFOneB(Schedule& s, int rank, const std::vector<StageMb>& forwards,
                   const std::vector<StageMb>& backwards, int warmup) {
  const int n = static_cast<int>(forwards.size());
  warmup = std::clamp(warmup, 0, n);
  for (int k = 0; k < warmup; ++k) emit(s, rank, forwards[k].stage, ActionKind::Forward, forwards[k].mb);
  for (int k = 0; k + warmup < n; ++k) {
    const StageMb& f = forwards[k + warmup];
    emit(s, rank, f.stage, ActionKind::Forward, f.mb);
    emit(s, rank, backwards[k].stage, ActionKind::FullBackward, backwards[k].mb);
  }
  for (int k = n - warmup; k < n; ++k) {
    emit(s, rank, backwards[k].stage, ActionKind::FullBackward, backwards[k].mb);
  }
  // In the steady state a forward comes before its paired backward, so the
  // rank holds one more than the warmup, unless there is no steady state.
  return warmup == n ? n : warmup + 1;
}

}  // namespace mpmd::schedules
