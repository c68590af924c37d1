// Values the executor moves between the stage runner and the transport.
//
// NOTE [Opaque values]: the executor never looks inside a value; in production
// a Payload holds an at::Tensor (tensor_payload.h), in the C++ tests a plain
// number. Keeping the type opaque keeps the executor, its scheduling logic and
// its tests free of torch headers (every ATen translation unit costs ~30 s to build).
// Payloads must be safe to copy and destroy without the Python GIL.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mpmd::runtime {

class Payload {
 public:
  virtual ~Payload() = default;
};

using Value = std::shared_ptr<const Payload>;
using Values = std::vector<Value>;

// The values of one stage edge `producer -> consumer` for one microbatch, in
// one direction: activations (forward) or their gradients (backward). Every
// SEND, RECV and local handoff moves exactly the values of one key.
struct TransferKey {
  int32_t producer = 0;
  int32_t consumer = 0;
  int32_t microbatch = 0;
  bool backward = false;

  friend bool operator==(const TransferKey&, const TransferKey&) = default;
};

// "activations 0->1 mb 3" / "gradients 0->1 mb 3", for messages.
std::string describe(const TransferKey& key);

}  // namespace mpmd::runtime
