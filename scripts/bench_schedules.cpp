// Schedule engine benchmark: generate + lower + validate at scale.
//
//   bash scripts/bench_schedules.sh [schedule] [ranks] [stages_per_rank] [microbatches]
//
// Defaults: interleaved_1f1b, p=64, stages_per_rank=4, m=1024 (about a
// million actions once lowered). Prints the median of several repetitions of
// each phase; "validate" is the full check (static invariants plus a
// simulation proving the program completes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/lowering.h"
#include "core/schedules/registry.h"
#include "core/simulator.h"
#include "core/validate.h"

namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double minimum(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

}  // namespace

int main(int argc, char** argv) {
  const std::string name = argc > 1 ? argv[1] : "interleaved_1f1b";
  mpmd::ScheduleSpec spec;
  spec.num_ranks = argc > 2 ? std::atoi(argv[2]) : 64;
  spec.stages_per_rank = argc > 3 ? std::atoi(argv[3]) : 4;
  spec.num_microbatches = argc > 4 ? std::atoi(argv[4]) : 1024;
  const int reps = 11;

  std::vector<double> gen, low, val, total;
  size_t compute_actions = 0, lowered_actions = 0;
  double makespan = 0.0, bubble = 0.0;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    mpmd::Schedule s = mpmd::makeSchedule(name, spec);  // includes the static check
    gen.push_back(msSince(t0));
    auto t1 = Clock::now();
    mpmd::Schedule lowered = mpmd::lower(s);
    low.push_back(msSince(t1));
    auto t2 = Clock::now();
    mpmd::validateStatic(lowered);
    mpmd::SimulationResult r = mpmd::simulate(lowered);
    val.push_back(msSince(t2));
    total.push_back(msSince(t0));
    compute_actions = s.numActions();
    lowered_actions = lowered.numActions();
    makespan = r.makespan;
    bubble = r.bubble_fraction[0];
  }
  std::printf("schedule=%s ranks=%d stages_per_rank=%d microbatches=%d\n", name.c_str(), spec.num_ranks,
              spec.stages_per_rank, spec.num_microbatches);
  std::printf("actions: %zu compute, %zu lowered\n", compute_actions, lowered_actions);
  std::printf("simulated makespan=%.0f bubble(rank 0)=%.4f\n", makespan, bubble);
  std::printf("median of %d: generate %.1f ms, lower %.1f ms, validate+simulate %.1f ms, total %.1f ms\n", reps,
              median(gen), median(low), median(val), median(total));
  std::printf("best of %d:   generate %.1f ms, lower %.1f ms, validate+simulate %.1f ms, total %.1f ms\n", reps,
              minimum(gen), minimum(low), minimum(val), minimum(total));
  return 0;
}
