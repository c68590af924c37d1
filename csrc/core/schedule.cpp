#include "schedule.h"

#include <algorithm>

#include <fmt/format.h>

#include "errors.h"

namespace mpmd {

std::vector<StageEdge> chainEdges(int num_stages) {
  std::vector<StageEdge> edges;
  for (int s = 0; s + 1 < num_stages; ++s) edges.push_back({s, s + 1});
  return edges;
}

std::vector<int> loopPlacement(int num_ranks, int stages_per_rank) {
  if (num_ranks < 1 || stages_per_rank < 1) {
    throw ScheduleError(fmt::format("num_ranks={} and stages_per_rank={} must both be >= 1",
                                    num_ranks, stages_per_rank));
  }
  std::vector<int> placement(static_cast<size_t>(num_ranks) * stages_per_rank);
  for (size_t s = 0; s < placement.size(); ++s) placement[s] = static_cast<int>(s % num_ranks);
  return placement;
}

std::vector<int> vPlacement(int num_ranks) {
  if (num_ranks < 1) throw ScheduleError(fmt::format("num_ranks={} must be >= 1", num_ranks));
  std::vector<int> placement(2 * static_cast<size_t>(num_ranks));
  for (int s = 0; s < 2 * num_ranks; ++s) placement[s] = s < num_ranks ? s : 2 * num_ranks - 1 - s;
  return placement;
}

bool Schedule::isLowered() const {
  for (const auto& program : programs)
    for (const auto& a : program)
      if (!isCompute(a.kind)) return true;
  return false;
}

bool Schedule::splitsBackward() const {
  for (const auto& program : programs)
    for (const auto& a : program)
      if (a.kind == ActionKind::BackwardInput || a.kind == ActionKind::BackwardWeight) return true;
  return false;
}

size_t Schedule::numActions() const {
  size_t n = 0;
  for (const auto& program : programs) n += program.size();
  return n;
}

std::vector<std::vector<int>> Schedule::producersOf() const {
  std::vector<std::vector<int>> out(num_stages);
  for (const auto& e : edges) out[e.consumer].push_back(e.producer);
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

std::vector<std::vector<int>> Schedule::consumersOf() const {
  std::vector<std::vector<int>> out(num_stages);
  for (const auto& e : edges) out[e.producer].push_back(e.consumer);
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

Schedule makeEmptySchedule(std::string name, int num_ranks, int num_microbatches,
                           std::vector<int> stage_to_rank) {
  if (num_ranks < 1) throw ScheduleError(fmt::format("num_ranks={} must be >= 1", num_ranks));
  if (num_microbatches < 1) {
    throw ScheduleError(fmt::format("num_microbatches={} must be >= 1", num_microbatches));
  }
  std::vector<bool> used(num_ranks, false);
  for (size_t s = 0; s < stage_to_rank.size(); ++s) {
    int r = stage_to_rank[s];
    if (r < 0 || r >= num_ranks) {
      throw ScheduleError(fmt::format("stage {} placed on rank {}, outside 0..{}", s, r, num_ranks - 1));
    }
    used[r] = true;
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (!used[r]) throw ScheduleError(fmt::format("rank {} holds no stage", r));
  }
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.num_ranks = num_ranks;
  schedule.num_stages = static_cast<int>(stage_to_rank.size());
  schedule.num_microbatches = num_microbatches;
  schedule.stage_to_rank = std::move(stage_to_rank);
  schedule.edges = chainEdges(schedule.num_stages);
  schedule.programs.assign(num_ranks, {});
  return schedule;
}

void inferShape(Schedule& schedule) {
  schedule.num_ranks = static_cast<int>(schedule.programs.size());
  if (schedule.num_ranks == 0) throw ScheduleError("schedule has no ranks (no rows)");
  int max_stage = -1, max_mb = -1;
  for (const auto& program : schedule.programs) {
    for (const auto& a : program) {
      max_stage = std::max({max_stage, a.stage, a.peer_stage});
      max_mb = std::max(max_mb, a.microbatch);
    }
  }
  if (max_stage < 0) throw ScheduleError("schedule has no actions");
  // Guard against absurd indices from hand-written or fuzzed input before
  // allocating per-stage tables.
  const size_t total = schedule.numActions();
  if (static_cast<size_t>(max_stage) >= total + 1 || static_cast<size_t>(max_mb) >= total + 1) {
    throw ScheduleError(fmt::format(
        "stage index {} or microbatch index {} is larger than the schedule's {} actions allow",
        max_stage, max_mb, total));
  }
  schedule.num_stages = max_stage + 1;
  schedule.num_microbatches = max_mb + 1;
  schedule.stage_to_rank.assign(schedule.num_stages, -1);
  for (int r = 0; r < schedule.num_ranks; ++r) {
    for (const auto& a : schedule.programs[r]) {
      if (!isCompute(a.kind) && !isStageCollective(a.kind)) continue;
      int& owner = schedule.stage_to_rank[a.stage];
      if (owner >= 0 && owner != r) {
        throw ScheduleError(fmt::format("stage {} has compute actions on rank {} and rank {} ({})",
                                        a.stage, owner, r, toString(a)));
      }
      owner = r;
    }
  }
  for (int s = 0; s < schedule.num_stages; ++s) {
    if (schedule.stage_to_rank[s] < 0) {
      throw ScheduleError(fmt::format("stage {} appears in no compute action, so no rank owns it", s));
    }
  }
  if (schedule.num_microbatches < 1) throw ScheduleError("schedule has no microbatch actions");
  if (schedule.edges.empty()) schedule.edges = chainEdges(schedule.num_stages);
}

}  // namespace mpmd
