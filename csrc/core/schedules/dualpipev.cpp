// DualPipeV (DeepSeek): the "cut in half" DualPipe on the V placement. Rank r
// holds chunk 0 = stage r and chunk 1 = stage 2p-1-r; every microbatch runs
// chunk 0 down the ranks and chunk 1 back up. The program of rank r has eight
// phases (counts in brackets):
//   1. chunk-0 forwards                       [2(p-r-1)]
//   2. F0 F1 pairs                             [r+1]
//   3. I1 W1 F1: zero-bubble backward of chunk 1, W at once   [p-r-1]
//   4. steady state F0 B1 F1 B0                [m-2p+r+1]
//   5. B1 F1 B0                                [p-r-1]
//   6. B1 B0, switching to I (W deferred) halfway: ranks alternate which chunk
//      switches first so neighbours do not defer at the same time   [r+1]
//   7. W I0: one deferred W, then chunk 0's input gradient         [p-r-1]
//   8. the remaining deferred W's                                   [r+1]
// In DualPipe the F/B pairs of phases 4-5 overlap one microbatch's compute
// with another's communication; here they are emitted in sequence.
// Phase 4 needs m >= 2p-1-r on every rank; like DeepSeek's implementation we
// ask for m >= 2p so every rank has a full steady state.
#include <cstddef>
#include <deque>

#include "common.h"
#include "table.h"

namespace mpmd {

namespace {

// Emits one rank's actions, tracking the next microbatch of each chunk and
// the weight gradients deferred by zero-bubble backwards.
class RankProgram {
 public:
  RankProgram(Schedule& s, int rank)
      : s_(s), rank_(rank), stage_{rank, 2 * s.num_ranks - 1 - rank} {}

  void forward(int chunk) {
    schedules::emit(s_, rank_, stage_[chunk], ActionKind::Forward, next_f_[chunk]++);
  }
  // Full backward, or input gradient only with the W deferred.
  void backward(int chunk, bool zero_bubble = false) {
    const int mb = next_b_[chunk]++;
    if (!zero_bubble) {
      schedules::emit(s_, rank_, stage_[chunk], ActionKind::FullBackward, mb);
      return;
    }
    schedules::emit(s_, rank_, stage_[chunk], ActionKind::BackwardInput, mb);
    deferred_.push_back({stage_[chunk], mb});
  }
  void weight() {
    const schedules::StageMb w = deferred_.front();
    deferred_.pop_front();
    schedules::emit(s_, rank_, w.stage, ActionKind::BackwardWeight, w.mb);
  }
  bool hasDeferred() const { return !deferred_.empty(); }

 private:
  Schedule& s_;
  int rank_;
  int stage_[2];
  int next_f_[2] = {0, 0};
  int next_b_[2] = {0, 0};
  std::deque<schedules::StageMb> deferred_;
};

void buildRank(Schedule& s, int r) {
  const int p = s.num_ranks, m = s.num_microbatches;
  RankProgram prog(s, r);
  for (int i = 0; i < 2 * (p - r - 1); ++i) prog.forward(0);
  for (int i = 0; i < r + 1; ++i) {
    prog.forward(0);
    prog.forward(1);
  }
  for (int i = 0; i < p - r - 1; ++i) {
    prog.backward(1, /*zero_bubble=*/true);
    prog.weight();
    prog.forward(1);
  }
  for (int i = 0; i < m - 2 * p + r + 1; ++i) {
    prog.forward(0);
    prog.backward(1);
    prog.forward(1);
    prog.backward(0);
  }
  for (int i = 0; i < p - r - 1; ++i) {
    prog.backward(1);
    prog.forward(1);
    prog.backward(0);
  }
  bool zero_bubble = false;
  const int half = (r + 1) / 2;
  for (int i = 0; i < r + 1; ++i) {
    if (i == half && r % 2 == 1) zero_bubble = true;
    prog.backward(1, zero_bubble);
    if (i == half && r % 2 == 0) zero_bubble = true;
    prog.backward(0, zero_bubble);
  }
  for (int i = 0; i < p - r - 1; ++i) {
    prog.weight();
    prog.backward(0, /*zero_bubble=*/true);
  }
  while (prog.hasDeferred()) prog.weight();
}

}  // namespace

Schedule makeDualPipeV(const ScheduleSpec& spec) {
  checkSpec(scheduleFacts("dualpipev"), spec);
  const int p = spec.num_ranks, m = spec.num_microbatches;
  Schedule s = makeEmptySchedule("dualpipev", p, m, vPlacement(p));
  schedules::reservePrograms(s, 6 * static_cast<size_t>(m));  // at most F, I, W per (stage, mb)
  for (int r = 0; r < p; ++r) buildRank(s, r);
  // Phases 1-2 leave 2p forwards in flight; each steady-state F0 (phase 4)
  // briefly adds one more before the B1 that follows it.
  s.activation_bound.assign(static_cast<size_t>(p), 2 * p + 1);
  return s;
}

}  // namespace mpmd
