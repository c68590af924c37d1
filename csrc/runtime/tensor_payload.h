// Tensor values of the production runtime (NOTE [Opaque values] in value.h).
// Included only by the torch-facing translation units.
#pragma once

#include <ATen/core/Tensor.h>

#include "runtime/value.h"

namespace mpmd::runtime {

struct TensorPayload final : Payload {
  explicit TensorPayload(at::Tensor t) : tensor(std::move(t)) {}
  at::Tensor tensor;
};

inline Value tensorValue(at::Tensor t) { return std::make_shared<const TensorPayload>(std::move(t)); }

// The tensor of a value made by tensorValue (undefined behaviour otherwise).
inline const at::Tensor& tensorOf(const Value& v) {
  return static_cast<const TensorPayload&>(*v).tensor;
}

}  // namespace mpmd::runtime
