// insertUnshardReshard: the sharded-data-parallel pass of lowering.h
// (NOTE [Unshard placement] there).
#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "errors.h"
#include "lowering.h"

namespace mpmd {

namespace {

// A span of one stage's compute in which its parameters are gathered: the
// indices, among the rank's compute actions, of its first and last action.
struct Window {
  int stage = 0;
  size_t first = 0;
  size_t last = 0;
};

// An action to insert before the program position `gap` (the program's size
// for the end). Sorted, insertions at one gap keep NOTE [Unshard placement]'s
// order: RESHARDs, then UNSHARDs, each in the order of their windows.
struct Insertion {
  size_t gap = 0;
  size_t window_first = 0;
  Action action;

  friend bool operator<(const Insertion& a, const Insertion& b) {
    const bool a_gathers = a.action.kind == ActionKind::Unshard;
    const bool b_gathers = b.action.kind == ActionKind::Unshard;
    return std::tie(a.gap, a_gathers, a.window_first) < std::tie(b.gap, b_gathers, b.window_first);
  }
};

void checkInput(const Schedule& schedule, const ShardOptions& options) {
  if (options.unshard_prefetch < 0) {
    throw ScheduleError(fmt::format("unshard_prefetch={} must be >= 0", options.unshard_prefetch));
  }
  for (int r = 0; r < schedule.num_ranks; ++r) {
    for (const Action& a : schedule.programs[r]) {
      if (a.kind == ActionKind::Unshard || a.kind == ActionKind::Reshard) {
        throw ScheduleError(fmt::format("insertUnshardReshard needs a schedule without UNSHARD/RESHARD, "
                                        "but rank {} holds '{}'", r, toString(a)));
      }
    }
  }
}

// The windows of every stage computing in `program`, whose compute actions
// sit at the positions `compute`. One per stage; two when
// reshard_after_forward splits it after the stage's last F (NOTE [When to
// reshard after forward]).
std::vector<Window> windowsOf(const std::vector<Action>& program, const std::vector<size_t>& compute,
                              const ShardOptions& options) {
  std::vector<std::pair<int, size_t>> by_stage;  // (stage, compute index), grouped below
  by_stage.reserve(compute.size());
  for (size_t i = 0; i < compute.size(); ++i) by_stage.emplace_back(program[compute[i]].stage, i);
  std::sort(by_stage.begin(), by_stage.end());
  std::vector<Window> windows;
  for (size_t begin = 0, end = 0; begin < by_stage.size(); begin = end) {
    const int stage = by_stage[begin].first;
    size_t last_forward = by_stage.size();  // index into by_stage; none yet
    for (end = begin; end < by_stage.size() && by_stage[end].first == stage; ++end) {
      if (program[compute[by_stage[end].second]].kind == ActionKind::Forward) last_forward = end;
    }
    const size_t first = by_stage[begin].second, last = by_stage[end - 1].second;
    // Compute actions of other stages between the last F and the stage's next one.
    const size_t between = last_forward + 1 < end
                               ? by_stage[last_forward + 1].second - by_stage[last_forward].second - 1
                               : 0;
    const bool split = options.reshard_after_forward && last_forward + 1 < end &&
                       between > static_cast<size_t>(options.unshard_prefetch);
    if (split) {
      windows.push_back({stage, first, by_stage[last_forward].second});
      windows.push_back({stage, by_stage[last_forward + 1].second, last});
    } else {
      windows.push_back({stage, first, last});
    }
  }
  return windows;
}

// Where RESHARD of a window whose last compute action is at `last_compute`
// goes: after that action and the SENDs directly behind it.
size_t reshardGap(const std::vector<Action>& program, size_t last_compute) {
  size_t gap = last_compute + 1;
  while (gap < program.size() && isSend(program[gap].kind)) ++gap;
  return gap;
}

// Where UNSHARD of a window starting at compute index `first` goes: before the
// compute action `prefetch` earlier (or the first one), above the RECVs
// directly before it.
size_t unshardGap(const std::vector<Action>& program, const std::vector<size_t>& compute, size_t first,
                  int prefetch) {
  const size_t target = first >= static_cast<size_t>(prefetch) ? first - static_cast<size_t>(prefetch) : 0;
  size_t gap = compute[target];
  while (gap > 0 && isRecv(program[gap - 1].kind)) --gap;
  return gap;
}

std::vector<Insertion> insertionsFor(const std::vector<Action>& program, const ShardOptions& options) {
  std::vector<size_t> compute;
  for (size_t i = 0; i < program.size(); ++i) {
    if (isCompute(program[i].kind)) compute.push_back(i);
  }
  // windowsOf lists a stage's windows together and in order, so `closed`
  // (the RESHARD gap of the stage's previous window) needs no table.
  std::vector<Insertion> out;
  int previous_stage = -1;
  size_t closed = 0;
  for (const Window& w : windowsOf(program, compute, options)) {
    if (w.stage != previous_stage) closed = 0;
    previous_stage = w.stage;
    const size_t open = std::max(unshardGap(program, compute, w.first, options.unshard_prefetch), closed);
    closed = reshardGap(program, compute[w.last]);
    out.push_back({open, w.first, unshardAction(w.stage)});
    out.push_back({closed, w.first, reshardAction(w.stage)});
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Schedule insertUnshardReshard(Schedule lowered, const ShardOptions& options) {
  checkInput(lowered, options);
  for (auto& program : lowered.programs) {
    const std::vector<Insertion> insertions = insertionsFor(program, options);
    std::vector<Action> out;
    out.reserve(program.size() + insertions.size());
    size_t next = 0;
    for (size_t pos = 0; pos <= program.size(); ++pos) {
      for (; next < insertions.size() && insertions[next].gap == pos; ++next) out.push_back(insertions[next].action);
      if (pos < program.size()) out.push_back(program[pos]);
    }
    program = std::move(out);
  }
  return lowered;
}

}  // namespace mpmd
