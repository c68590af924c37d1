// Cost model and discrete-event simulation (core/simulator.h). The timeline
// crosses as per-rank lists of (start, end) tuples aligned with the programs.
#include "core/simulator.h"

#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

using Span = std::pair<double, double>;

std::vector<std::vector<Span>> timelineSpans(const SimulationResult& r) {
  std::vector<std::vector<Span>> out(r.timeline.size());
  for (size_t rank = 0; rank < r.timeline.size(); ++rank) {
    out[rank].reserve(r.timeline[rank].size());
    for (const auto& t : r.timeline[rank]) out[rank].emplace_back(t.start, t.end);
  }
  return out;
}

}  // namespace

void bindSimulator(py::module_& m) {
  py::class_<KindCosts>(m, "KindCosts", "Time per action kind (defaults F=1, B=2, I=1, W=1; collectives 0).")
      .def(py::init<>())
      .def_readwrite("forward", &KindCosts::forward)
      .def_readwrite("backward", &KindCosts::backward)
      .def_readwrite("backward_input", &KindCosts::backward_input)
      .def_readwrite("backward_weight", &KindCosts::backward_weight)
      .def_readwrite("reduce_grad", &KindCosts::reduce_grad)
      .def_readwrite("unshard", &KindCosts::unshard)
      .def_readwrite("reshard", &KindCosts::reshard);

  py::class_<CrossRankReduce>(m, "CrossRankReduce",
                              "A gradient reduction over the ranks of several stages (tied weights).")
      .def(py::init<>())
      .def_readwrite("stages", &CrossRankReduce::stages)
      .def_readwrite("cost", &CrossRankReduce::cost);

  py::class_<CostModel>(m, "CostModel", "Compute costs plus a latency/bandwidth link model.")
      .def(py::init<>())
      .def_readwrite("costs", &CostModel::costs)
      .def_readwrite("stage_costs", &CostModel::stage_costs)
      .def_readwrite("comm_latency", &CostModel::comm_latency)
      .def_readwrite("action_overhead", &CostModel::action_overhead)
      .def_readwrite("microbatch_scale", &CostModel::microbatch_scale)
      .def_readwrite("step_overhead", &CostModel::step_overhead)
      .def_readwrite("comm_bandwidth", &CostModel::comm_bandwidth)
      .def_readwrite("message_bytes", &CostModel::message_bytes)
      .def_readwrite("stage_output_bytes", &CostModel::stage_output_bytes)
      .def_readwrite("cross_rank_reduces", &CostModel::cross_rank_reduces);

  py::class_<SimulationResult>(m, "SimulationResult")
      .def_readonly("makespan", &SimulationResult::makespan)
      .def_readonly("busy", &SimulationResult::busy)
      .def_readonly("bubble_fraction", &SimulationResult::bubble_fraction)
      .def_readonly("peak_activations", &SimulationResult::peak_activations)
      .def_readonly("messages", &SimulationResult::messages)
      .def_readonly("comm_bytes", &SimulationResult::comm_bytes)
      .def_property_readonly("timeline", &timelineSpans,
                             "Per rank, per action (start, end); empty unless recorded.");

  m.def("simulate", &simulate, py::arg("schedule"), py::arg("model") = CostModel{},
        py::arg("record_timeline") = false, py::call_guard<py::gil_scoped_release>(),
        "Simulate a lowered schedule. DeadlockError names the blocked ranks and actions.");
}

}  // namespace mpmd::python
