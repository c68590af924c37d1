#include "greedy.h"

#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "common.h"

namespace mpmd::schedules {

namespace {

constexpr int kNotDone = std::numeric_limits<int>::max();

struct RankState {
  std::vector<int> stages;  // local stages, highest first (priority order)
  int free_at = 0;          // time the running action ends
  int held = 0;             // forwards whose backward has not started
  std::vector<int> deferred_w;  // stage*m+mb of I's whose W is pending, FIFO
  size_t w_head = 0;
  int pendingW() const { return static_cast<int>(deferred_w.size() - w_head); }
};

// Unit-cost simulation state. f_end/b_end hold the end time of the forward and
// of the backward (B or I) of each (stage, mb); next_* the next microbatch of
// each stage.
struct State {
  int num_stages = 0;
  int m = 0;
  bool split = true;
  std::vector<int> f_end, b_end, next_f, next_b;

  size_t at(int stage, int mb) const { return static_cast<size_t>(stage) * m + mb; }

  bool forwardReady(int stage, int t) const {
    const int mb = next_f[stage];
    return mb < m && (stage == 0 || f_end[at(stage - 1, mb)] <= t);
  }
  bool backwardReady(int stage, int t) const {
    const int mb = next_b[stage];
    return mb < m && f_end[at(stage, mb)] <= t &&
           (stage == num_stages - 1 || b_end[at(stage + 1, mb)] <= t);
  }
};

struct Choice {
  ActionKind kind = ActionKind::Forward;
  int stage = -1;  // -1: nothing to start
};

Choice pick(const State& st, const RankState& rank, int t, int activation_cap, int max_pending_w) {
  const bool has_w = rank.pendingW() > 0;
  if (has_w && rank.pendingW() >= max_pending_w) return {ActionKind::BackwardWeight, 0};
  if (rank.held < activation_cap) {
    for (int stage : rank.stages) {
      if (st.forwardReady(stage, t)) return {ActionKind::Forward, stage};
    }
  }
  const ActionKind backward = st.split ? ActionKind::BackwardInput : ActionKind::FullBackward;
  for (int stage : rank.stages) {
    if (st.backwardReady(stage, t)) return {backward, stage};
  }
  if (has_w) return {ActionKind::BackwardWeight, 0};
  return {};
}

// Starts `choice` on rank `r` at time t: records the action and its end time.
void start(Schedule& s, State& st, RankState& rank, int r, Choice choice, int t) {
  const int m = st.m;
  switch (choice.kind) {
    case ActionKind::Forward: {
      const int mb = st.next_f[choice.stage]++;
      st.f_end[st.at(choice.stage, mb)] = t + 1;
      ++rank.held;
      rank.free_at = t + 1;
      emit(s, r, choice.stage, ActionKind::Forward, mb);
      return;
    }
    case ActionKind::BackwardWeight: {
      const int index = rank.deferred_w[rank.w_head++];
      rank.free_at = t + 1;
      emit(s, r, index / m, ActionKind::BackwardWeight, index % m);
      return;
    }
    default: {  // B or I
      const int mb = st.next_b[choice.stage]++;
      const int cost = choice.kind == ActionKind::FullBackward ? 2 : 1;
      st.b_end[st.at(choice.stage, mb)] = t + cost;
      --rank.held;
      if (st.split) rank.deferred_w.push_back(static_cast<int>(st.at(choice.stage, mb)));
      rank.free_at = t + cost;
      emit(s, r, choice.stage, choice.kind, mb);
      return;
    }
  }
}

}  // namespace

void fillGreedy(Schedule& s, const GreedyOptions& options) {
  State st;
  st.num_stages = s.num_stages;
  st.m = s.num_microbatches;
  st.split = options.split_backward;
  const size_t cells = static_cast<size_t>(s.num_stages) * s.num_microbatches;
  st.f_end.assign(cells, kNotDone);
  st.b_end.assign(cells, kNotDone);
  st.next_f.assign(s.num_stages, 0);
  st.next_b.assign(s.num_stages, 0);

  std::vector<RankState> ranks(s.num_ranks);
  for (int stage = s.num_stages - 1; stage >= 0; --stage) {
    ranks[s.stage_to_rank[stage]].stages.push_back(stage);
  }
  for (int r = 0; r < s.num_ranks; ++r) {
    const size_t cells_of_rank = ranks[r].stages.size() * s.num_microbatches;
    ranks[r].deferred_w.reserve(st.split ? cells_of_rank : 0);
    s.programs[r].reserve(cells_of_rank * (st.split ? 3 : 2));
  }

  size_t remaining = cells * (st.split ? 3 : 2);
  for (int t = 0; remaining > 0; ++t) {
    bool busy = false;
    for (int r = 0; r < s.num_ranks; ++r) {
      RankState& rank = ranks[r];
      if (rank.free_at <= t) {
        const Choice choice = pick(st, rank, t, options.activation_cap[r], options.max_pending_w[r]);
        if (choice.stage < 0) continue;
        start(s, st, rank, r, choice, t);
        --remaining;
      }
      busy = true;
    }
    if (!busy) {
      throw std::logic_error(fmt::format(
          "greedy scheduler for {} stalled at time {} with {} actions left (activation caps "
          "too small)", s.name, t, remaining));
    }
  }
}

}  // namespace mpmd::schedules
