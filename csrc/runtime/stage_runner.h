// StageRunner: the compute side of the executor.
//
// The executor calls one method per compute action of its program; the
// production implementation (torch_mpmd/runner.py, through the pybind layer)
// runs the stage's fx.GraphModule under autograd. Producers and consumers of a
// stage are listed in ascending stage order (Schedule::producersOf/consumersOf)
// and index the vectors below. Any exception thrown is reported by the
// executor with the rank, the action and the program (see executor.h).
#pragma once

#include <vector>

#include "runtime/value.h"

namespace mpmd::runtime {

class StageRunner {
 public:
  virtual ~StageRunner() = default;

  // F(stage, microbatch). inputs[i]: the values received from the i-th
  // producer of `stage`. Returns one Values per consumer of `stage` (the
  // activations for that consumer); the runner keeps whatever its backward
  // needs. Stage inputs from the user's batch are the runner's business.
  virtual std::vector<Values> forward(int stage, int microbatch, std::vector<Values> inputs) = 0;

  // B(stage, microbatch) when input_only is false, I(stage, microbatch) when
  // true. output_grads[i]: gradients from the i-th consumer (empty for the
  // last stage, whose backward starts from the loss). Returns one Values per
  // producer (gradients of the values received from it). After B the runner
  // frees the microbatch's saved activations; after I it keeps what W needs.
  virtual std::vector<Values> backward(int stage, int microbatch,
                                       std::vector<Values> output_grads, bool input_only) = 0;

  // W(stage, microbatch): weight gradients after the same microbatch's I;
  // frees the microbatch's saved activations.
  virtual void backwardWeight(int stage, int microbatch) = 0;

  // REDUCE_GRAD(stage): this stage's last backward of the step is done.
  virtual void reduceGrad(int stage) = 0;
};

}  // namespace mpmd::runtime
