// Backward split into I and W programs (core/backward_split.h, NOTE
// [Backward split]). Python hands the backward graph over as plain read lists
// and gets a read-only BackwardSplit back; std::invalid_argument from the
// core arrives as ValueError.
#include "core/backward_split.h"

#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

size_t countTrue(const std::vector<bool>& v) {
  size_t k = 0;
  for (bool b : v) k += b ? 1 : 0;
  return k;
}

}  // namespace

void bindBackwardSplit(py::module_& m) {
  py::class_<BackwardSplit>(m, "BackwardSplit",
                            "Which backward nodes I computes, which W computes, and what I "
                            "hands to W. Read-only; lists are copies.")
      .def_readonly("input_part", &BackwardSplit::input_part,
                    "Per node: computed in I (non-placeholder ancestor of an input gradient).")
      .def_readonly("weight_part", &BackwardSplit::weight_part,
                    "Per node: computed in W (non-placeholder ancestor of a weight gradient, "
                    "not in I).")
      .def_readonly("carry", &BackwardSplit::carry,
                    "Ascending ids of I nodes and placeholders that W reads or returns.")
      .def_readonly("input_reads", &BackwardSplit::input_reads,
                    "Ascending ids of the placeholders I reads or returns.")
      .def_readonly("weight_reads_saved", &BackwardSplit::weight_reads_saved,
                    "Ascending ids of the placeholders in carry.")
      .def("__repr__", [](const BackwardSplit& s) {
        return "BackwardSplit(nodes=" + std::to_string(s.input_part.size()) +
               ", input_part=" + std::to_string(countTrue(s.input_part)) +
               ", weight_part=" + std::to_string(countTrue(s.weight_part)) +
               ", carry=" + std::to_string(s.carry.size()) + ")";
      });

  // NOTE [GIL in bindings] (bindings.h): splitBackward is pure C++.
  m.def("split_backward", &splitBackward, py::arg("inputs"), py::arg("is_placeholder"),
        py::arg("input_grad_outputs"), py::arg("weight_grad_outputs"),
        py::arg("is_projection") = std::vector<bool>{}, py::call_guard<py::gil_scoped_release>(),
        "Split a backward graph (node ids 0..n-1 in topological order, inputs[v] the ids node v "
        "reads) into I (ancestors of input_grad_outputs) and W (ancestors of "
        "weight_grad_outputs not in I); is_projection marks tuple-element nodes, computed in I when "
        "their source is. ValueError naming the values for mismatched lengths, a "
        "read of a later or negative id, a placeholder with inputs, an output id out of range.");
}

}  // namespace mpmd::python
