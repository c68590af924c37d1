#include "runtime/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>

#include "core/errors.h"

namespace mpmd::runtime {

std::string describe(const TransferKey& key) {
  return fmt::format("{} {}->{} mb {}", key.backward ? "gradients" : "activations", key.producer,
                     key.consumer, key.microbatch);
}

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Executor::Executor(Schedule schedule, int rank, StageRunner& runner, Transport& transport,
                   ExecutorOptions options)
    : schedule_(std::move(schedule)),
      rank_(rank),
      runner_(runner),
      transport_(transport),
      options_(options) {
  if (rank < 0 || rank >= schedule_.num_ranks) {
    throw ScheduleError(fmt::format("executor rank {} is not a rank of the schedule '{}' "
                                    "(num_ranks={})", rank, schedule_.name, schedule_.num_ranks));
  }
  if (!schedule_.isLowered() && schedule_.num_ranks > 1) {
    throw ScheduleError(fmt::format("the executor runs lowered programs; schedule '{}' has no "
                                    "SEND/RECV actions (call lower() first)", schedule_.name));
  }
  if (options_.lookahead < 1) {
    throw ScheduleError(fmt::format("lookahead={} must be >= 1", options_.lookahead));
  }
  if (options_.timeout.count() <= 0) {
    throw ScheduleError(fmt::format("timeout={} ms must be positive", options_.timeout.count()));
  }
  checkProgram();
  producers_ = schedule_.producersOf();
  consumers_ = schedule_.consumersOf();
  const auto& prog = program();
  for (size_t i = 0; i < prog.size(); ++i) {
    if (isRecv(prog[i].kind)) receive_indices_.push_back(static_cast<int64_t>(i));
  }
  // NOTE [Runner state]: one slot per (local stage, microbatch), and which
  // F and I leave a state that a later action of the program reads.
  local_stage_.assign(schedule_.num_stages, -1);
  int local_stages = 0;
  for (int s = 0; s < schedule_.num_stages; ++s) {
    if (schedule_.stage_to_rank[s] == rank_) local_stage_[s] = local_stages++;
  }
  states_.resize(static_cast<size_t>(local_stages) * schedule_.num_microbatches);
  keeps_state_.assign(prog.size(), 0);
  std::vector<uint8_t> backward_later(states_.size(), 0), weight_later(states_.size(), 0);
  forward_in_program_.assign(states_.size(), 0);
  input_in_program_.assign(states_.size(), 0);
  for (size_t i = prog.size(); i-- > 0;) {
    const Action& a = prog[i];
    if (!isCompute(a.kind)) continue;
    const size_t slot = stateIndex(a.stage, a.microbatch);
    switch (a.kind) {
      case ActionKind::Forward:
        keeps_state_[i] = backward_later[slot];
        forward_in_program_[slot] = 1;
        break;
      case ActionKind::BackwardInput:
        keeps_state_[i] = weight_later[slot];
        input_in_program_[slot] = 1;
        [[fallthrough]];
      case ActionKind::FullBackward: backward_later[slot] = 1; break;
      case ActionKind::BackwardWeight: weight_later[slot] = 1; break;
      default: break;
    }
  }
}

void Executor::checkProgram() const {
  // Cheap range checks so a malformed program fails here, not out of bounds;
  // the schedule invariants (csrc/core/validate.h) are the caller's (Schedule.validate()).
  const auto& prog = program();
  for (size_t i = 0; i < prog.size(); ++i) {
    const Action& a = prog[i];
    const bool stage_ok = a.stage >= 0 && a.stage < schedule_.num_stages;
    const bool mb_ok = isStageCollective(a.kind) ||
                       (a.microbatch >= 0 && a.microbatch < schedule_.num_microbatches);
    const bool peer_ok = !isCommunication(a.kind) ||
                         (a.peer_stage >= 0 && a.peer_stage < schedule_.num_stages);
    if (!stage_ok || !mb_ok || !peer_ok || schedule_.stage_to_rank[a.stage] != rank_) {
      throw ScheduleError(fmt::format(
          "action {} (#{}) of rank {} does not fit schedule '{}' ({} stages, {} microbatches, "
          "stage {} on rank {})", toString(a), i, rank_, schedule_.name, schedule_.num_stages,
          schedule_.num_microbatches, a.stage,
          stage_ok ? schedule_.stage_to_rank[a.stage] : -1));
    }
  }
}

int64_t Executor::keyId(const TransferKey& k) const {
  const int64_t s = schedule_.num_stages;
  return ((static_cast<int64_t>(k.producer) * s + k.consumer) * 2 + (k.backward ? 1 : 0)) *
             schedule_.num_microbatches +
         k.microbatch;
}

TransferKey Executor::transferKey(const Action& a) const {
  switch (a.kind) {
    case ActionKind::SendF: return {a.stage, a.peer_stage, a.microbatch, false};
    case ActionKind::RecvF: return {a.peer_stage, a.stage, a.microbatch, false};
    case ActionKind::SendB: return {a.peer_stage, a.stage, a.microbatch, true};
    case ActionKind::RecvB: return {a.stage, a.peer_stage, a.microbatch, true};
    default: throw std::logic_error("transferKey of a compute action");
  }
}

void Executor::put(const TransferKey& key, Values values) {
  auto [it, inserted] = buffers_.try_emplace(keyId(key), std::move(values));
  if (!inserted) {
    throw std::runtime_error(fmt::format("{} was produced twice in one step", describe(key)));
  }
  stats_.peak_buffered = std::max(stats_.peak_buffered, static_cast<int>(buffers_.size()));
}

void Executor::checkState(const StateSlot& slot, StatePhase expected,
                          const Action& reader) const {
  if (slot.phase == expected) return;
  if (expected == StatePhase::kNone) {
    throw std::runtime_error(fmt::format(
        "internal error: {} finds a state held although this program runs no action that "
        "produces it (stage {} mb {})", toString(reader), reader.stage, reader.microbatch));
  }
  const char* wanted = expected == StatePhase::kSaved ? "state of its forward"
                                                      : "carry of its I";
  const char* found = slot.phase == StatePhase::kNone
                          ? "no forward ran, or an earlier backward already took its state"
                      : slot.phase == StatePhase::kSaved ? "its forward ran but no I"
                                                         : "an earlier I already took it";
  throw std::runtime_error(fmt::format("internal error: {} finds no {} (stage {} mb {}: {})",
                                       toString(reader), wanted, reader.stage, reader.microbatch,
                                       found));
}

void Executor::addStateValues(int64_t delta) {
  state_values_ += delta;
  stats_.peak_state_values =
      std::max(stats_.peak_state_values, static_cast<int>(state_values_));
}

Values Executor::take(const TransferKey& key, const Action& reader) {
  auto it = buffers_.find(keyId(key));
  if (it == buffers_.end()) {
    throw std::runtime_error(fmt::format("{} needs {}, which no earlier action produced or "
                                         "received", toString(reader), describe(key)));
  }
  Values values = std::move(it->second);
  buffers_.erase(it);
  return values;
}

void Executor::postReceivesFor(int64_t index) {
  // Post in program order (NOTE [Transport ordering]) until `lookahead` are
  // outstanding, and always up to the receive at `index` itself.
  while (next_receive_ < receive_indices_.size()) {
    const int64_t at = receive_indices_[next_receive_];
    const size_t outstanding = posted_.size() - posted_head_;
    if (at > index && outstanding >= static_cast<size_t>(options_.lookahead)) break;
    const Action& a = program()[at];
    auto pending = transport_.recv(peerRank(a), transferKey(a));
    posted_.emplace_back(at, std::move(pending));
    ++next_receive_;
  }
}

void Executor::reapSends(bool wait_all) {
  // Sends complete roughly in posting order: poll from the oldest and stop at
  // the first still in flight, so a SEND costs O(1) polls, not O(outstanding)
  // (gloo's send work never reports completion before it is waited on).
  size_t done = 0;
  for (; done < sends_.size(); ++done) {
    auto& s = sends_[done];
    try {
      if (wait_all) {
        s.transfer->wait(options_.timeout);
      } else if (!s.transfer->poll()) {
        break;
      }
    } catch (const TransportError& e) {
      fail(s.action_index, e.what(), e.peer());
    }
  }
  sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(done));
}

Values Executor::receive(int64_t index) {
  postReceivesFor(index);
  auto& [at, pending] = posted_[posted_head_];
  if (at != index) throw std::logic_error("receives posted out of program order");
  Values values = pending->wait(options_.timeout);
  pending.reset();
  ++posted_head_;
  postReceivesFor(index);
  return values;
}

void Executor::execute(int64_t index, const Action& a) {
  switch (a.kind) {
    case ActionKind::RecvF:
    case ActionKind::RecvB:
      put(transferKey(a), receive(index));
      break;
    case ActionKind::SendF:
    case ActionKind::SendB: {
      const TransferKey key = transferKey(a);
      Values values = take(key, a);
      sends_.push_back({index, transport_.send(peerRank(a), key, std::move(values))});
      reapSends(false);
      break;
    }
    case ActionKind::Forward: {
      std::vector<Values> inputs;
      inputs.reserve(producers_[a.stage].size());
      for (int p : producers_[a.stage]) inputs.push_back(take({p, a.stage, a.microbatch, false}, a));
      StateSlot& state = stateSlot(a);
      if (state.phase != StatePhase::kNone) {
        throw std::runtime_error(fmt::format(
            "internal error: {} runs while the state of an earlier forward of stage {} mb {} is "
            "still held", toString(a), a.stage, a.microbatch));
      }
      std::vector<Values> outputs =
          runner_.forward(a.stage, a.microbatch, std::move(inputs), state.values);
      if (keeps_state_[index]) {
        state.phase = StatePhase::kSaved;
        addStateValues(static_cast<int64_t>(state.values.size()));
      } else {
        state.values.clear();  // no B/I reads it: a forward-only program
      }
      const auto& consumers = consumers_[a.stage];
      if (outputs.size() != consumers.size()) {
        throw std::runtime_error(fmt::format(
            "the runner's forward of stage {} returned values for {} consumer stages, the "
            "schedule has {}", a.stage, outputs.size(), consumers.size()));
      }
      for (size_t i = 0; i < consumers.size(); ++i) {
        put({a.stage, consumers[i], a.microbatch, false}, std::move(outputs[i]));
      }
      stats_.peak_live_forwards = std::max(stats_.peak_live_forwards, ++live_forwards_);
      break;
    }
    case ActionKind::FullBackward:
    case ActionKind::BackwardInput: {
      std::vector<Values> grads;
      grads.reserve(consumers_[a.stage].size());
      for (int c : consumers_[a.stage]) grads.push_back(take({a.stage, c, a.microbatch, true}, a));
      StateSlot& state = stateSlot(a);
      checkState(state, forward_in_program_[stateIndex(a.stage, a.microbatch)]
                            ? StatePhase::kSaved : StatePhase::kNone, a);
      const int64_t saved = static_cast<int64_t>(state.values.size());
      const bool input_only = a.kind == ActionKind::BackwardInput;
      std::vector<Values> input_grads =
          runner_.backward(a.stage, a.microbatch, std::move(grads), input_only, state.values);
      if (input_only && keeps_state_[index]) {  // the carry for W
        state.phase = StatePhase::kCarry;
        addStateValues(static_cast<int64_t>(state.values.size()) - saved);
      } else {
        state.values.clear();
        state.phase = StatePhase::kNone;
        addStateValues(-saved);
      }
      const auto& producers = producers_[a.stage];
      if (input_grads.size() != producers.size()) {
        throw std::runtime_error(fmt::format(
            "the runner's backward of stage {} returned gradients for {} producer stages, the "
            "schedule has {}", a.stage, input_grads.size(), producers.size()));
      }
      for (size_t i = 0; i < producers.size(); ++i) {
        put({producers[i], a.stage, a.microbatch, true}, std::move(input_grads[i]));
      }
      --live_forwards_;
      break;
    }
    case ActionKind::BackwardWeight: {
      StateSlot& state = stateSlot(a);
      checkState(state, input_in_program_[stateIndex(a.stage, a.microbatch)]
                            ? StatePhase::kCarry : StatePhase::kNone, a);
      addStateValues(-static_cast<int64_t>(state.values.size()));
      state.phase = StatePhase::kNone;
      runner_.backwardWeight(a.stage, a.microbatch, std::move(state.values));
      state.values.clear();  // moved-from: valid, unspecified
      break;
    }
    case ActionKind::ReduceGrad:
      runner_.reduceGrad(a.stage);
      break;
    case ActionKind::Unshard:
      runner_.unshard(a.stage);
      break;
    case ActionKind::Reshard:
      runner_.reshard(a.stage);
      break;
  }
}

void Executor::drainAction(int64_t index, const Action& a) {
  switch (a.kind) {
    case ActionKind::RecvF:
    case ActionKind::RecvB:
      receive(index);  // dropped: nothing computes any more
      break;
    case ActionKind::SendF:
    case ActionKind::SendB: {
      const TransferKey key = transferKey(a);
      buffers_.erase(keyId(key));  // a value computed before the failure, if any
      auto standIn = transport_.sendStandIn(peerRank(a), key);
      if (!standIn) {
        throw TransportError(peerRank(a), "the transport has no stand-in values to finish the "
                                          "failed step's transfers with");
      }
      sends_.push_back({index, std::move(standIn)});
      reapSends(false);
      break;
    }
    case ActionKind::ReduceGrad:
    case ActionKind::Unshard:
    case ActionKind::Reshard:
      try {
        // Pairs with the other replicas' collectives (RESHARD frees what the
        // UNSHARD gathered).
        if (a.kind == ActionKind::ReduceGrad) runner_.reduceGrad(a.stage);
        else if (a.kind == ActionKind::Unshard) runner_.unshard(a.stage);
        else runner_.reshard(a.stage);
      } catch (const std::exception&) {
        // The step has failed already; the first failure is the one reported.
      }
      break;
    default:
      break;  // compute: skipped
  }
}

void Executor::run() {
  reset();
  stats_.peak_live_forwards = stats_.peak_buffered = stats_.peak_state_values = 0;
  const auto& prog = program();
  if (options_.trace) stats_.trace.reserve(prog.size());
  for (size_t i = 0; i < prog.size(); ++i) {
    const Action& a = prog[i];
    const int64_t index = static_cast<int64_t>(i);
    const int64_t begin = options_.trace ? nowNs() : 0;
    try {
      if (failure_) {
        drainAction(index, a);
      } else {
        execute(index, a);
      }
    } catch (const ExecutorError&) {
      throw;
    } catch (const TransportError& e) {
      fail(index, e.what(), e.peer());
    } catch (const std::exception& e) {
      const int peer = isCommunication(a.kind) ? peerRank(a) : -1;
      if (!options_.drain || failure_) fail(index, e.what(), peer);
      failure_ = Failure{index, e.what(), peer};  // NOTE [Draining a failed step]
    }
    if (options_.trace) stats_.trace.push_back({static_cast<int32_t>(i), begin, nowNs()});
  }
  reapSends(true);
  if (failure_) failDrained();
  if (!buffers_.empty()) {
    std::vector<std::string> left;
    const int64_t per_edge = schedule_.num_microbatches;
    for (const auto& [id, values] : buffers_) {
      (void)values;
      const int64_t edge = id / per_edge / 2;
      left.push_back(describe({static_cast<int32_t>(edge / schedule_.num_stages),
                               static_cast<int32_t>(edge % schedule_.num_stages),
                               static_cast<int32_t>(id % per_edge), (id / per_edge) % 2 == 1}));
    }
    std::sort(left.begin(), left.end());
    fail(-1, fmt::format("the step ended with values nothing consumed: {}",
                         fmt::join(left, ", ")), -1);
  }
  ++stats_.steps;
}

void Executor::reset() {
  buffers_.clear();
  posted_.clear();
  posted_head_ = 0;
  next_receive_ = 0;
  sends_.clear();
  live_forwards_ = 0;
  for (StateSlot& slot : states_) {
    slot.values.clear();
    slot.phase = StatePhase::kNone;
  }
  state_values_ = 0;
  failure_.reset();
  stats_.trace.clear();
}

std::string Executor::failureText(int64_t index, const std::string& cause, int peer) const {
  std::string where = index >= 0 ? fmt::format("action {} (#{})", toString(program()[index]), index)
                                 : std::string("the end of the step");
  return fmt::format("rank {}: {} failed{}: {}", rank_, where,
                     peer >= 0 ? fmt::format(" (peer rank {})", peer) : "", cause);
}

void Executor::fail(int64_t index, const std::string& cause, int peer) {
  std::string msg;
  int64_t mark = index;
  std::string action = index >= 0 ? toString(program()[index]) : std::string();
  if (failure_) {  // the first failure is the cause; finishing its transfers failed too
    mark = failure_->index;
    action = toString(program()[mark]);
    msg = fmt::format("{}\nFinishing the step's transfers with stand-ins then failed: {}",
                      failureText(mark, failure_->cause, failure_->peer),
                      failureText(index, cause, peer));
  } else {
    msg = failureText(index, cause, peer);
  }
  msg += fmt::format("\nprogram of rank {}:\n{}", rank_, formatProgram(mark));
  transport_.abort(msg);
  // Drop outstanding work before unwinding; buffers and runner state of a
  // failed step are never reused (run() resets).
  reset();
  throw ExecutorError(msg, rank_, action, peer);
}

void Executor::failDrained() {
  const Failure f = *failure_;
  const std::string msg = fmt::format(
      "{}\n(this rank then finished the step's transfers with stand-in values, so that its "
      "peers could end the step)\nprogram of rank {}:\n{}",
      failureText(f.index, f.cause, f.peer), rank_, formatProgram(f.index));
  reset();
  throw ExecutorError(msg, rank_, toString(program()[f.index]), f.peer, /*drained=*/true);
}

std::string Executor::formatProgram(int64_t mark) const {
  const auto& prog = program();
  const int64_t n = static_cast<int64_t>(prog.size());
  constexpr int64_t kWindow = 40;
  int64_t lo = 0, hi = n;
  if (n > 2 * kWindow + 1) {
    const int64_t center = mark >= 0 ? mark : n - 1;
    lo = std::max<int64_t>(0, center - kWindow);
    hi = std::min<int64_t>(n, center + kWindow + 1);
  }
  std::string out;
  if (lo > 0) out += fmt::format("  ... {} earlier actions\n", lo);
  for (int64_t i = lo; i < hi; ++i) {
    out += fmt::format("  {:>5}  {}{}\n", i, toString(prog[i]), i == mark ? "  <-- FAILED HERE" : "");
  }
  if (hi < n) out += fmt::format("  ... {} later actions\n", n - hi);
  return out;
}

}  // namespace mpmd::runtime
