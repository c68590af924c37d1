// Executor: runs one rank's lowered program.
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
//   REDUCE_GRAD     tell the runner the stage's backward is over;
//   UNSHARD         tell the runner to post the all-gather of the stage's
//                   parameters (it returns at once and waits for it itself);
//   RESHARD         tell the runner to free them.
// Buffers are keyed by TransferKey (stage edge, microbatch, direction) and
// dropped at their single use, so activations live from their producer (or
// RECV) to their consumer (or SEND) and nothing longer. Stages on the same rank
// hand values off through the buffers: no action, no copy. The state a runner
// saves in F for B/I, and the carry I leaves for W, are held per (stage,
// microbatch) apart from the buffers (NOTE [Runner state]).
//
// Errors: every wait is bounded by the timeout. Any failure (runner
// exception, transport error, timeout, a program that reads a value nothing
// produced) throws ExecutorError naming this rank, the action, the peer rank
// for transfers, and listing the program with the failing step marked; the
// transport is aborted first so peers stop early where it can. With
// options.drain a failure of this rank's own code is reported only after the
// program's transfers are finished with stand-ins (NOTE [Draining a failed
// step]).
//
// NOTE [Draining a failed step]: when this rank's own code fails mid-step
// (the runner raised, or the program is malformed), its transfers still
// work. Aborting would leave every peer waiting on this rank until its
// timeout and the channels out of step for any later step. With
// options.drain the executor finishes the program's communication instead:
// each later RECV is still received (its values dropped), each SEND sends a
// stand-in of the captured shapes (Transport::sendStandIn; zeros over c10d),
// compute actions are skipped, and REDUCE_GRAD, UNSHARD and RESHARD still
// tell the runner (a data-parallel collective pairs with the other replicas';
// their errors are dropped, the first failure is the one reported). The peers complete
// their step on stand-in values; the caller tells them afterwards that the
// step failed (torch_mpmd/parallel/lockstep.py). The ExecutorError thrown at the end
// names the first failure and has drained() true: every channel is in step
// and usable again. A transport failure (timeout, dead peer) or a transport
// without stand-ins ends the run at once, as without drain.
//
// NOTE [Runner state]: the `state` of StageRunner::forward and the carry of
// an I are kept in a table of their own, one slot per (local stage,
// microbatch), not in the transfer buffers: a state is not a single-use
// transfer (I rewrites it in place into the carry for W), it is handed to the
// runner by reference so the runner can consume it without a copy, and it has
// its own end-of-life rules:
//   F  stores what the runner left in `state` if a B or I of the same
//      (stage, microbatch) follows in the program, else drops it at once
//      (a forward-only program);
//   B  passes it in and drops whatever is left after the call;
//   I  passes it in and keeps what the runner left there (the carry) if a W
//      of the same (stage, microbatch) follows, else drops it;
//   W  moves the carry into the call, which is its last use.
// The table is allocated once, at construction, and indexed directly: no
// hashing and no allocation per action, so runners that keep their state
// themselves (every `state` empty) pay a one-byte check per action. That byte
// records where the slot is in F -> B or F -> I -> W; a B/I that finds no
// forward's state, a W that finds no I's carry, or a second F before the
// first one's backward is an internal error (a malformed program), reported
// like any other failure. reset() (every run, and every failure) empties the
// table, so a failed step leaves nothing to the next. The stat
// peak_state_values counts the Values in the table, not bytes: the executor
// never looks inside a value (NOTE [Opaque values]).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
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
  bool drain = false;                         // NOTE [Draining a failed step]
};

// Begin and end of one action, in ns of std::chrono::steady_clock.
struct TraceEvent {
  int32_t action_index = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

// What the last run did (peaks and trace are per run), and how many runs
// completed so far.
struct ExecutorStats {
  int64_t steps = 0;            // runs completed since construction
  int peak_live_forwards = 0;   // forwards whose backward (B or I) had not run
  int peak_buffered = 0;        // keys held in the buffers at once
  int peak_state_values = 0;    // Values held as runner state at once (NOTE [Runner state])
  std::vector<TraceEvent> trace;  // last step only, when options.trace
};

class ExecutorError : public std::runtime_error {
 public:
  ExecutorError(const std::string& what, int rank, std::string action, int peer,
                bool drained = false)
      : std::runtime_error(what), rank_(rank), action_(std::move(action)), peer_(peer),
        drained_(drained) {}
  int rank() const { return rank_; }
  const std::string& action() const { return action_; }  // text form; "" if none
  int peer() const { return peer_; }                      // -1 if none
  // The failure was this rank's own and the program's transfers were finished
  // with stand-ins: the channels are in step (NOTE [Draining a failed step]).
  bool drained() const { return drained_; }

 private:
  int rank_;
  std::string action_;
  int peer_;
  bool drained_;
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
  // still works (the in-memory one does; a c10d group may not after a timeout;
  // it does after a drained failure).
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

  // The first failure of a run being drained (NOTE [Draining a failed step]).
  struct Failure {
    int64_t index;
    std::string cause;
    int peer;
  };

  // Where a (stage, microbatch) is between F and its last B/I/W (NOTE [Runner state]).
  enum class StatePhase : uint8_t { kNone, kSaved, kCarry };
  struct StateSlot {
    Values values;
    StatePhase phase = StatePhase::kNone;
  };

  void checkProgram() const;
  void execute(int64_t index, const Action& action);
  void drainAction(int64_t index, const Action& action);  // NOTE [Draining a failed step]
  Values receive(int64_t index);  // waits for the RECV at `index`, posted ahead
  void postReceivesFor(int64_t index);
  void reapSends(bool wait_all);
  int64_t keyId(const TransferKey& key) const;
  TransferKey transferKey(const Action& action) const;  // SEND/RECV only
  void put(const TransferKey& key, Values values);
  Values take(const TransferKey& key, const Action& reader);
  size_t stateIndex(int stage, int microbatch) const {
    return static_cast<size_t>(local_stage_[stage]) * schedule_.num_microbatches + microbatch;
  }
  StateSlot& stateSlot(const Action& a) { return states_[stateIndex(a.stage, a.microbatch)]; }
  // Throws unless `slot` is in `expected` when `reader` (B, I or W) runs.
  void checkState(const StateSlot& slot, StatePhase expected, const Action& reader) const;
  void addStateValues(int64_t delta);
  int peerRank(const Action& action) const { return schedule_.stage_to_rank[action.peer_stage]; }
  [[noreturn]] void fail(int64_t index, const std::string& cause, int peer);
  [[noreturn]] void failDrained();
  std::string failureText(int64_t index, const std::string& cause, int peer) const;
  void reset();

  Schedule schedule_;
  int rank_;
  StageRunner& runner_;
  Transport& transport_;
  ExecutorOptions options_;
  std::vector<std::vector<int>> producers_;
  std::vector<std::vector<int>> consumers_;
  std::vector<int64_t> receive_indices_;  // program positions of RECV actions
  std::vector<int> local_stage_;           // stage -> index among this rank's stages, or -1
  // Per action: F whose state a later B/I reads, I whose carry a later W reads.
  std::vector<uint8_t> keeps_state_;
  // Per state slot: the program runs its F (its I). A backward-only program
  // (the compile door runs forward and backward as two programs) has B/I/W
  // whose state no action of this program produced: they get an empty one.
  std::vector<uint8_t> forward_in_program_;
  std::vector<uint8_t> input_in_program_;

  // Per-step state.
  std::unordered_map<int64_t, Values> buffers_;
  std::vector<std::pair<int64_t, std::unique_ptr<PendingTransfer>>> posted_;  // FIFO
  size_t posted_head_ = 0;
  size_t next_receive_ = 0;
  std::vector<PendingSend> sends_;
  int live_forwards_ = 0;
  std::vector<StateSlot> states_;  // (local stage, microbatch); NOTE [Runner state]
  int64_t state_values_ = 0;       // Values in states_
  std::optional<Failure> failure_;  // set while draining
  ExecutorStats stats_;
};

}  // namespace mpmd::runtime
