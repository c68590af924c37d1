// Executor: runs one rank's lowered program (DESIGN.md 6).
//
// For each action in program order:
//   F / B / I / W   call the StageRunner; their inputs are taken from the
//                   buffers, their outputs put there;
//   RECV_F/RECV_B   wait for a receive posted ahead (up to `lookahead`
//                   receives are outstanding, posted in program order) and
//                   put its values in the buffers;
//   SEND_F/SEND_B   take the values from the buffers and start an
//                   asynchronous send; completed sends are reaped as the
//                   program runs and all are waited for at the end;
//   REDUCE_GRAD     tell the runner the stage's backward is over.
// Buffers are keyed by TransferKey (stage edge, microbatch, direction) and
// dropped at their single use, so activations live from their producer (or
// RECV) to their consumer (or SEND) and nothing longer. Stages on the same rank
// hand values off through the buffers: no action, no copy.
//
// Errors: every wait is bounded by the timeout. Any failure (runner
// exception, transport error, timeout, a program that reads a value nothing
// produced) throws ExecutorError naming this rank, the action, the peer rank
// for transfers, and listing the program with the failing step marked; the
// transport is aborted first so peers stop early where it can.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/schedule.h"
#include "runtime/stage_runner.h"
#include "runtime/transport.h"

namespace mpmd::runtime {

struct ExecutorOptions {
  int lookahead = 2;                          // receives posted ahead; >= 1
  std::chrono::milliseconds timeout{60000};   // bound of every single wait
  bool trace = false;                         // record a TraceEvent per action
};

// Begin and end of one action, in ns of std::chrono::steady_clock.
struct TraceEvent {
  int32_t action_index = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

struct ExecutorStats {
  int64_t steps = 0;
  int peak_live_forwards = 0;   // forwards whose backward (B or I) had not run
  int peak_buffered = 0;        // keys held in the buffers at once
  std::vector<TraceEvent> trace;  // last step only, when options.trace
};

class ExecutorError : public std::runtime_error {
 public:
  ExecutorError(const std::string& what, int rank, std::string action, int peer)
      : std::runtime_error(what), rank_(rank), action_(std::move(action)), peer_(peer) {}
  int rank() const { return rank_; }
  const std::string& action() const { return action_; }  // text form; "" if none
  int peer() const { return peer_; }                      // -1 if none

 private:
  int rank_;
  std::string action_;
  int peer_;
};

class Executor {
 public:
  // `schedule` must be lowered and valid (Schedule.validate(); programs
  // derived from a valid one, like its forward-only part, are fine) and
  // `rank` one of its ranks; actions that do not fit the schedule's shape
  // throw ScheduleError. Runner and transport must outlive the executor.
  Executor(Schedule schedule, int rank, StageRunner& runner, Transport& transport,
           ExecutorOptions options = {});

  // Runs the program once (one training step). Blocks; throws ExecutorError.
  // After an error the executor is reset and may run again, if the transport
  // still works (the in-memory one does; a c10d group may not after a timeout).
  void run();

  const Schedule& schedule() const { return schedule_; }
  const std::vector<Action>& program() const { return schedule_.programs[rank_]; }
  int rank() const { return rank_; }
  const ExecutorOptions& options() const { return options_; }
  const ExecutorStats& stats() const { return stats_; }

  // The program, one action per line, with `<-- FAILED HERE` after the
  // action at `mark` (none when mark < 0). Long programs are cut to a window
  // around the mark.
  std::string formatProgram(int64_t mark) const;

 private:
  struct PendingSend {
    int64_t action_index;
    std::unique_ptr<PendingTransfer> transfer;
  };

  void checkProgram() const;
  void execute(int64_t index, const Action& action);
  void postReceivesFor(int64_t index);
  void reapSends(bool wait_all);
  int64_t keyId(const TransferKey& key) const;
  TransferKey transferKey(const Action& action) const;  // SEND/RECV only
  void put(const TransferKey& key, Values values);
  Values take(const TransferKey& key, const Action& reader);
  int peerRank(const Action& action) const { return schedule_.stage_to_rank[action.peer_stage]; }
  [[noreturn]] void fail(int64_t index, const std::string& cause, int peer);
  void reset();

  Schedule schedule_;
  int rank_;
  StageRunner& runner_;
  Transport& transport_;
  ExecutorOptions options_;
  std::vector<std::vector<int>> producers_;
  std::vector<std::vector<int>> consumers_;
  std::vector<int64_t> receive_indices_;  // program positions of RECV actions

  // Per-step state.
  std::unordered_map<int64_t, Values> buffers_;
  std::vector<std::pair<int64_t, std::unique_ptr<PendingTransfer>>> posted_;  // FIFO
  size_t posted_head_ = 0;
  size_t next_receive_ = 0;
  std::vector<PendingSend> sends_;
  int live_forwards_ = 0;
  ExecutorStats stats_;
};

}  // namespace mpmd::runtime
