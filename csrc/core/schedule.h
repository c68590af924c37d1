// Schedule: the per-rank action programs of one pipeline step.
//
// A compute-only schedule holds F/B/I/W actions; a lowered one also holds the
// SEND/RECV, REDUCE_GRAD and UNSHARD/RESHARD actions the executor runs (see
// lowering.h). Both
// share this type: lowering is a function Schedule -> Schedule.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "action.h"

namespace mpmd {

// A data dependency between stages: stage `consumer` reads a value produced by
// stage `producer` (producer < consumer). The default is the chain
// 0->1->...->n-1; a skip connection adds e.g. {0, 3}.
struct StageEdge {
  int producer = 0;
  int consumer = 0;
  friend bool operator==(const StageEdge&, const StageEdge&) = default;
};

std::vector<StageEdge> chainEdges(int num_stages);

// Stage s on rank s % num_ranks: the placement of GPipe, 1F1B, interleaved
// and looped schedules.
std::vector<int> loopPlacement(int num_ranks, int stages_per_rank);

// V placement of 2 stages per rank: stage s on rank s for s < p, and on rank
// 2p-1-s after that, so the last rank holds the two middle stages.
std::vector<int> vPlacement(int num_ranks);

struct Schedule {
  std::string name = "custom";
  int num_ranks = 0;
  int num_stages = 0;
  int num_microbatches = 0;
  std::vector<int> stage_to_rank;               // size num_stages
  std::vector<StageEdge> edges;                 // stage data dependencies
  std::vector<std::vector<Action>> programs;    // one program per rank
  // Largest number of forwards a rank may hold before their backward (B or I)
  // per the schedule's design (1F1B: p - rank); empty when none is stated.
  std::vector<int> activation_bound;

  int stagesPerRank() const { return num_ranks ? num_stages / num_ranks : 0; }
  bool isLowered() const;       // holds any non-compute action (SEND/RECV, REDUCE_GRAD, UNSHARD/RESHARD)
  bool splitsBackward() const;  // uses I/W instead of B
  size_t numActions() const;
  // Producers of each stage and consumers of each stage, from `edges`.
  std::vector<std::vector<int>> producersOf() const;
  std::vector<std::vector<int>> consumersOf() const;
};

// Builds an empty schedule with a placement and the chain edges; checks the
// shape (positive sizes, placement covering every rank) with ScheduleError.
Schedule makeEmptySchedule(std::string name, int num_ranks, int num_microbatches,
                           std::vector<int> stage_to_rank);

// Fills num_stages, num_microbatches and stage_to_rank of a schedule read from
// text, from its compute actions (each stage must run on exactly one rank).
// Throws ScheduleError naming a stage seen on two ranks or never computed.
void inferShape(Schedule& schedule);

}  // namespace mpmd
