// StageRunner: the compute side of the executor.
//
// The executor calls one method per compute action of its program (and per
// REDUCE_GRAD, UNSHARD and RESHARD); the
// production implementation (torch_mpmd/runtime/runner.py, through the pybind layer)
// runs the stage's fx.GraphModule under autograd. Producers and consumers of a
// stage are listed in ascending stage order (Schedule::producersOf/consumersOf)
// and index the vectors below. Any exception thrown is reported by the
// executor with the rank, the action and the program (see executor.h).
//
// Runner state: what a forward saves for its backward (`state`) and what an
// input-gradient pass hands to the weight-gradient pass (the carry) may be
// kept by the executor, per (stage, microbatch), instead of by the runner
// (NOTE [Runner state] in executor.h). A runner that keeps its own state
// leaves every `state` empty; empty states cost nothing. None of the methods
// is called concurrently with another of the same runner.
#pragma once

#include <vector>

#include "runtime/value.h"

namespace mpmd::runtime {

class StageRunner {
 public:
  virtual ~StageRunner() = default;

  // F(stage, microbatch). inputs[i]: the values received from the i-th
  // producer of `stage`, moved in. Returns one Values per consumer of `stage`
  // (the activations for that consumer). Stage inputs from the user's batch
  // are the runner's business.
  // `state` is empty on entry; the runner may fill it with what this
  // microbatch's backward needs. The executor keeps it until the matching B
  // or I, and drops it at once when the program has none (a forward-only
  // program). A runner that keeps its state itself leaves it empty.
  virtual std::vector<Values> forward(int stage, int microbatch, std::vector<Values> inputs,
                                      Values& state) = 0;

  // B(stage, microbatch) when input_only is false, I(stage, microbatch) when
  // true. output_grads[i]: gradients from the i-th consumer (empty for the
  // last stage, whose backward starts from the loss), moved in. Returns one
  // Values per producer (gradients of the values received from it).
  // `state` holds exactly what this (stage, microbatch)'s forward left in its
  // `state` (empty if it left nothing); the executor owns it.
  //   B: the runner may consume it (move or clear values to free them
  //      early); the executor drops whatever is left after the call. A runner
  //      keeping its own state frees the microbatch's saved activations.
  //   I: the runner replaces its content with the carry W needs (clearing
  //      what W does not need); the executor keeps what is in `state` after
  //      the call for the W of the same (stage, microbatch) and nothing else.
  //      A runner keeping its own state keeps what W needs itself.
  virtual std::vector<Values> backward(int stage, int microbatch,
                                       std::vector<Values> output_grads, bool input_only,
                                       Values& state) = 0;

  // W(stage, microbatch): weight gradients after the same microbatch's I.
  // `state` is the carry that I left, moved in (empty if it left none); it is
  // the last use, so whatever the runner does not keep is freed when the call
  // returns. A runner keeping its own state frees the microbatch's saved
  // activations.
  virtual void backwardWeight(int stage, int microbatch, Values state) = 0;

  // REDUCE_GRAD(stage): this stage's last backward of the step is done.
  virtual void reduceGrad(int stage) = 0;

  // Sharded data parallel (NOTE [Unshard placement] in core/lowering.h);
  // replicated runners keep the defaults, which do nothing.
  // UNSHARD(stage): post the all-gather of the stage's parameters and return
  // at once; the runner itself waits for it before the stage's next compute
  // call (forward, backward or backwardWeight) or its reshard. Also called in
  // a drained step (NOTE [Draining a failed step] in executor.h), where no
  // compute follows: it pairs with the other replicas' all-gathers.
  virtual void unshard(int stage) { (void)stage; }
  // RESHARD(stage): free the gathered parameters of the stage (waiting first
  // for a gather still in flight). Called in a drained step too.
  virtual void reshard(int stage) { (void)stage; }
};

}  // namespace mpmd::runtime
