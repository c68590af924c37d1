// Schedule, generators, the schedule table, lowering passes, validation and
// text/CSV forms (core/schedule.h, schedules/registry.h, schedules/table.h,
// lowering.h, validate.h, schedule_io.h). Edges cross as (producer, consumer) tuples, programs as
// lists of Action.
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "core/errors.h"
#include "core/lowering.h"
#include "core/schedule.h"
#include "core/schedule_io.h"
#include "core/schedules/registry.h"
#include "core/schedules/table.h"
#include "core/validate.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

using EdgeTuple = std::pair<int, int>;
using Released = py::call_guard<py::gil_scoped_release>;

std::vector<EdgeTuple> edgesToTuples(const std::vector<StageEdge>& edges) {
  std::vector<EdgeTuple> out;
  out.reserve(edges.size());
  for (const auto& e : edges) out.emplace_back(e.producer, e.consumer);
  return out;
}

// Checks every edge against num_stages before it can index a per-stage table.
std::vector<StageEdge> checkedEdges(const std::vector<EdgeTuple>& edges, int num_stages) {
  std::vector<StageEdge> out;
  out.reserve(edges.size());
  for (const auto& [producer, consumer] : edges) {
    if (producer < 0 || consumer >= num_stages || producer >= consumer) {
      throw ScheduleError("edge (" + std::to_string(producer) + ", " + std::to_string(consumer) +
                          ") must satisfy 0 <= producer < consumer < num_stages=" +
                          std::to_string(num_stages));
    }
    out.push_back({producer, consumer});
  }
  return out;
}

// A copy of `schedule` with its edge list replaced (checked, not validated).
Schedule withEdges(const Schedule& schedule, const std::vector<EdgeTuple>& edges) {
  Schedule out = schedule;
  out.edges = checkedEdges(edges, schedule.num_stages);
  return out;
}

// Builds a schedule from per-rank programs and infers its shape (inferShape);
// `edges` replaces the chain when given.
Schedule scheduleFromPrograms(std::vector<std::vector<Action>> programs, std::string name,
                              const std::vector<EdgeTuple>& edges) {
  Schedule s;
  s.name = std::move(name);
  s.programs = std::move(programs);
  inferShape(s);
  if (!edges.empty()) s.edges = checkedEdges(edges, s.num_stages);
  return s;
}

Schedule makeNamed(const std::string& name, int num_ranks, int stages_per_rank,
                   int num_microbatches) {
  return makeSchedule(name, ScheduleSpec{num_ranks, stages_per_rank, num_microbatches});
}

void bindScheduleClass(py::module_& m) {
  py::class_<Schedule>(m, "Schedule", "Per-rank action programs of one pipeline step.")
      .def(py::init<>())
      .def_readwrite("name", &Schedule::name)
      .def_readwrite("num_ranks", &Schedule::num_ranks)
      .def_readwrite("num_stages", &Schedule::num_stages)
      .def_readwrite("num_microbatches", &Schedule::num_microbatches)
      .def_readwrite("stage_to_rank", &Schedule::stage_to_rank)
      .def_readwrite("programs", &Schedule::programs)
      .def_readwrite("activation_bound", &Schedule::activation_bound)
      .def_property_readonly("edges", [](const Schedule& s) { return edgesToTuples(s.edges); })
      .def_property_readonly("stages_per_rank", &Schedule::stagesPerRank)
      .def_property_readonly("is_lowered", &Schedule::isLowered)
      .def_property_readonly("splits_backward", &Schedule::splitsBackward)
      .def_property_readonly("num_actions", &Schedule::numActions)
      .def("producers_of", &Schedule::producersOf)
      .def("consumers_of", &Schedule::consumersOf)
      .def("__copy__", [](const Schedule& s) { return Schedule(s); });
}

// One row of the schedule table as a dict (torch_mpmd.schedules.facts
// turns it into ScheduleFacts): the columns, and what the row derives.
py::dict factsDict(const ScheduleFacts& f) {
  py::dict d;
  d["name"] = std::string(f.name);
  d["min_stages_per_rank"] = f.min_stages_per_rank;
  d["max_stages_per_rank"] = f.max_stages_per_rank == 0 ? py::object(py::none()) : py::int_(f.max_stages_per_rank);
  d["placement"] = f.placement == Placement::V ? "v" : "loop";
  d["microbatches_per_rank"] = f.microbatches_per_rank;
  d["splits_backward"] = f.splits_backward;
  d["family"] = std::string(f.family());
  d["same_at_one_stage"] =
      f.same_at_one_stage.empty() ? py::object(py::none()) : py::str(std::string(f.same_at_one_stage));
  d["default_stages_per_rank"] = f.defaultStagesPerRank();
  d["typical_stages_per_rank"] = f.typicalStagesPerRank();
  return d;
}

void bindTable(py::module_& m) {
  m.def("schedule_table", [] {
    py::list rows;
    for (const ScheduleFacts& f : scheduleTable()) rows.append(factsDict(f));
    return rows;
  }, "Every row of the schedule table (core/schedules/table.h) as a dict, in its order.");
  m.def("schedule_facts", [](const std::string& name) { return factsDict(scheduleFacts(name)); },
        py::arg("name"), "One row; ScheduleError for an unknown name, listing the known ones.");
  m.def("min_microbatches", [](const std::string& name, int num_ranks) {
    return scheduleFacts(name).minMicrobatches(num_ranks);
  }, py::arg("name"), py::arg("num_ranks"));
  m.def("default_schedule", [](int stages_per_rank) { return std::string(defaultSchedule(stages_per_rank)); },
        py::arg("stages_per_rank") = 1);
  m.attr("DEFAULT_SCHEDULE") = std::string(kDefaultSchedule);
  m.attr("DEFAULT_MICROBATCHES") = kDefaultMicrobatches;
}

void bindFunctions(py::module_& m) {
  m.def("schedule_names", &scheduleNames);
  m.def("make_schedule", &makeNamed, py::arg("name"), py::kw_only(), py::arg("num_ranks"),
        py::arg("stages_per_rank"), py::arg("num_microbatches"), Released(),
        "Generate a compute-only schedule; runs validate_static. ScheduleError on bad input.");
  m.def("chain_edges", [](int n) { return edgesToTuples(chainEdges(n)); }, py::arg("num_stages"));
  m.def("loop_placement", &loopPlacement, py::arg("num_ranks"), py::arg("stages_per_rank"));
  m.def("v_placement", &vPlacement, py::arg("num_ranks"));
  m.def("with_edges", &withEdges, py::arg("schedule"), py::arg("edges"),
        "Copy with the edge list replaced; ScheduleError for an edge out of range.");
  m.def("schedule_from_programs", &scheduleFromPrograms, py::arg("programs"),
        py::arg("name") = "custom", py::arg("edges") = std::vector<EdgeTuple>{});

  m.def("insert_transfers", &insertTransfers, py::arg("schedule"), Released());
  m.def("order_channels", &orderChannels, py::arg("schedule"), Released());
  m.def("insert_grad_reduce", &insertGradReduce, py::arg("schedule"), Released());
  m.def(
      "insert_unshard_reshard",
      [](Schedule s, int unshard_prefetch, bool reshard_after_forward) {
        return insertUnshardReshard(std::move(s), ShardOptions{unshard_prefetch, reshard_after_forward});
      },
      py::arg("schedule"), py::kw_only(), py::arg("unshard_prefetch") = 1,
      py::arg("reshard_after_forward") = false, Released());
  m.def(
      "lower",
      [](const Schedule& s, bool grad_reduce, bool shard, int unshard_prefetch, bool reshard_after_forward) {
        return lower(s, LowerOptions{grad_reduce, shard, ShardOptions{unshard_prefetch, reshard_after_forward}});
      },
      py::arg("schedule"), py::kw_only(), py::arg("grad_reduce") = true, py::arg("shard") = false,
      py::arg("unshard_prefetch") = 1, py::arg("reshard_after_forward") = false, Released(),
      "All lowering passes; with shard, UNSHARD/RESHARD too (NOTE [Unshard placement]). "
      "ScheduleError for unshard_prefetch < 0.");

  m.def("validate_static", &validateStatic, py::arg("schedule"), Released());
  m.def("validate", &validate, py::arg("schedule"), Released(),
        "Static checks, then lower if needed and simulate; DeadlockError if it cannot finish.");
  m.def("peak_activations", &peakActivations, py::arg("schedule"), Released());

  m.def("to_text", &toText, py::arg("schedule"));
  m.def("to_csv", &toCsv, py::arg("schedule"));
  m.def("schedule_from_text", &scheduleFromText, py::arg("text"), Released());
  m.def("schedule_from_csv", &scheduleFromCsv, py::arg("csv"), Released());
}

}  // namespace

void bindSchedules(py::module_& m) {
  bindScheduleClass(m);
  bindTable(m);
  bindFunctions(m);
}

}  // namespace mpmd::python
