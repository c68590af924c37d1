// The planner (core/planner.h): cost sheets in, plans out. Its errors are
// std::invalid_argument, ValueError in Python.
#include "core/planner.h"

#include <pybind11/stl.h>

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

using Released = py::call_guard<py::gil_scoped_release>;

void bindSheet(py::module_& m) {
  py::class_<UnitCost>(m, "UnitCost", "One unit of a cost sheet: times per microbatch and bytes.")
      .def(py::init<>())
      .def_readwrite("name", &UnitCost::name)
      .def_readwrite("forward", &UnitCost::forward)
      .def_readwrite("backward_input", &UnitCost::backward_input)
      .def_readwrite("backward_weight", &UnitCost::backward_weight)
      .def_readwrite("forward_fixed", &UnitCost::forward_fixed)
      .def_readwrite("backward_input_fixed", &UnitCost::backward_input_fixed)
      .def_readwrite("backward_weight_fixed", &UnitCost::backward_weight_fixed)
      .def_readwrite("saved_bytes", &UnitCost::saved_bytes)
      .def_readwrite("saved_input_bytes", &UnitCost::saved_input_bytes)
      .def_readwrite("param_bytes", &UnitCost::param_bytes)
      .def_readwrite("output_bytes", &UnitCost::output_bytes);

  py::class_<CostSheet>(m, "CostSheet", "Per-unit costs, link rates and memory facts of one model.")
      .def(py::init<>())
      .def_readwrite("units", &CostSheet::units)
      .def_readwrite("global_batch", &CostSheet::global_batch)
      .def_readwrite("reference_microbatch", &CostSheet::reference_microbatch)
      .def_readwrite("input_bytes", &CostSheet::input_bytes)
      .def_readwrite("action_overhead", &CostSheet::action_overhead)
      .def_readwrite("step_overhead", &CostSheet::step_overhead)
      .def_readwrite("link_latency", &CostSheet::link_latency)
      .def_readwrite("link_bandwidth", &CostSheet::link_bandwidth)
      .def_readwrite("ranks_per_node", &CostSheet::ranks_per_node)
      .def_readwrite("inter_node_bandwidth", &CostSheet::inter_node_bandwidth)
      .def_readwrite("grad_bytes_per_param_byte", &CostSheet::grad_bytes_per_param_byte)
      .def_readwrite("optimizer_bytes_per_param_byte", &CostSheet::optimizer_bytes_per_param_byte)
      .def_readwrite("pp_size", &CostSheet::pp_size)
      .def_readwrite("memory_limit", &CostSheet::memory_limit)
      .def_readwrite("dp_size", &CostSheet::dp_size)
      .def_readwrite("dp_latency", &CostSheet::dp_latency)
      .def_readwrite("dp_bandwidth", &CostSheet::dp_bandwidth);

  py::class_<SearchOptions>(m, "SearchOptions", "What the search may choose; empty lists: everything.")
      .def(py::init<>())
      .def_readwrite("schedules", &SearchOptions::schedules)
      .def_readwrite("stages_per_rank", &SearchOptions::stages_per_rank)
      .def_readwrite("microbatch_counts", &SearchOptions::microbatch_counts)
      .def_readwrite("top_k", &SearchOptions::top_k)
      .def_readwrite("comm_aware_split", &SearchOptions::comm_aware_split)
      .def_readwrite("refine_split", &SearchOptions::refine_split)
      .def_readwrite("allow_recompute", &SearchOptions::allow_recompute)
      .def_readwrite("data_parallel", &SearchOptions::data_parallel);
}

void bindResults(py::module_& m) {
  py::class_<Plan>(m, "PlanCandidate", "One plan with its predicted step and peak bytes per rank.")
      .def(py::init<>())
      .def_readwrite("schedule", &Plan::schedule)
      .def_readwrite("stages_per_rank", &Plan::stages_per_rank)
      .def_readwrite("num_microbatches", &Plan::num_microbatches)
      .def_readwrite("microbatch_samples", &Plan::microbatch_samples)
      .def_readwrite("stage_starts", &Plan::stage_starts)
      .def_readwrite("recompute", &Plan::recompute)
      .def_readwrite("comm_aware_split", &Plan::comm_aware_split)
      .def_readwrite("refined_split", &Plan::refined_split)
      .def_readwrite("data_parallel", &Plan::data_parallel)
      .def_readwrite("step_seconds", &Plan::step_seconds)
      .def_readwrite("peak_bytes", &Plan::peak_bytes)
      .def_readwrite("stage_seconds", &Plan::stage_seconds);

  py::class_<Rejection>(m, "Rejection", "A candidate that lost for a reason other than its time.")
      .def_readonly("schedule", &Rejection::schedule)
      .def_readonly("stages_per_rank", &Rejection::stages_per_rank)
      .def_readonly("num_microbatches", &Rejection::num_microbatches)
      .def_readonly("reason", &Rejection::reason)
      .def_readonly("step_seconds", &Rejection::step_seconds)
      .def_readonly("max_peak_bytes", &Rejection::max_peak_bytes)
      .def_readonly("data_parallel", &Rejection::data_parallel);

  py::class_<PlanResult>(m, "PlanResult", "The best plan, the top candidates, the rejected, the counts.")
      .def_readonly("best", &PlanResult::best)
      .def_readonly("top", &PlanResult::top)
      .def_readonly("rejected", &PlanResult::rejected)
      .def_readonly("candidates", &PlanResult::candidates)
      .def_readonly("simulations", &PlanResult::simulations)
      .def_readonly("search_seconds", &PlanResult::search_seconds);
}

}  // namespace

void bindPlanner(py::module_& m) {
  bindSheet(m);
  bindResults(m);
  m.def("check_sheet", &checkSheet, py::arg("sheet"), "ValueError naming a bad field of the sheet.");
  m.def("plan_pipeline", &planPipeline, py::arg("sheet"), py::arg("options") = SearchOptions{}, Released(),
        "The plan with the least simulated step under the sheet's memory limit (core/planner.h). "
        "ValueError for a bad sheet, no valid triple, or nothing that fits (naming the smallest peak).");
  m.def("evaluate_plan", &evaluatePlan, py::arg("sheet"), py::arg("schedule"), py::arg("stages_per_rank"),
        py::arg("num_microbatches"), py::arg("stage_starts"), py::arg("recompute") = std::vector<bool>{},
        py::arg("data_parallel") = std::string("replicate"), Released(),
        "One given plan's predicted step and peak bytes on the sheet (no memory limit applied).");
  m.def("min_max_split", &minMaxSplit, py::arg("weights"), py::arg("parts"), Released(),
        "Where each part starts in the exact min-max contiguous split (ties: least sum of squares).");
}

}  // namespace mpmd::python
