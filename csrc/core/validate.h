// Schedule invariants, checked for every generated and every
// loaded schedule.
#pragma once

#include <vector>

#include "schedule.h"

namespace mpmd {

// Checks, without running anything, and throws ScheduleError naming the rank,
// the action and its position:
//  - stage and microbatch in range; every compute action on its stage's rank;
//  - each (stage, mb) forward once and backward once (B, or I and W once each
//    with I before W), the backward after the forward;
//  - same-rank dependencies in order: F(s, mb) after F(producer, mb), backward
//    of a producer after the backward of its consumers;
//  - in a lowered schedule: every cross-rank dependency received before use
//    and sent after production, every SEND with exactly one RECV, each
//    channel's send order equal to its receive order (NOTE [Channel order]);
//  - on a rank whose program holds UNSHARD/RESHARD: every compute action of
//    each local stage inside one UNSHARD..RESHARD window of its stage, no
//    UNSHARD while the stage's window is open, no RESHARD without one open,
//    no window open at the end (NOTE [Unshard placement] in lowering.h);
//    other ranks run replicated parameters and need none;
//  - peak in-flight activations per rank within activation_bound if stated.
void validateStatic(const Schedule& schedule);

// Forwards whose backward (B or I) has not run yet, at their peak, per rank,
// counting each (stage, microbatch) once, in program order.
std::vector<int> peakActivations(const Schedule& schedule);

// validateStatic, then lowers (if compute-only) and simulates with unit costs
// to prove the program completes; throws DeadlockError naming the blocked
// actions otherwise.
void validate(const Schedule& schedule);

}  // namespace mpmd
