// Action and ActionKind (core/action.h). The text form ("2F0", "0SEND_F2->3")
// is the canonical Python representation: str(action) and Action.parse(text)
// are inverses.
#include "core/action.h"

#include <functional>
#include <string>

#include <pybind11/stl.h>

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

void bindActions(py::module_& m) {
  py::enum_<ActionKind>(m, "ActionKind", "Kind of an action; its text name is kind_name(kind).")
      .value("FORWARD", ActionKind::Forward)
      .value("FULL_BACKWARD", ActionKind::FullBackward)
      .value("BACKWARD_INPUT", ActionKind::BackwardInput)
      .value("BACKWARD_WEIGHT", ActionKind::BackwardWeight)
      .value("SEND_F", ActionKind::SendF)
      .value("RECV_F", ActionKind::RecvF)
      .value("SEND_B", ActionKind::SendB)
      .value("RECV_B", ActionKind::RecvB)
      .value("REDUCE_GRAD", ActionKind::ReduceGrad)
      .value("UNSHARD", ActionKind::Unshard)
      .value("RESHARD", ActionKind::Reshard);

  m.def("kind_name", [](ActionKind k) { return std::string(kindName(k)); }, py::arg("kind"),
        "Text name of a kind: 'F', 'SEND_B', 'REDUCE_GRAD'.");

  py::class_<Action>(m, "Action", "One (stage, kind, microbatch) step of a rank's program.")
      .def_readonly("stage", &Action::stage)
      .def_readonly("kind", &Action::kind)
      .def_readonly("microbatch", &Action::microbatch, "-1 for REDUCE_GRAD, UNSHARD and RESHARD")
      .def_readonly("peer_stage", &Action::peer_stage, "-1 for non-communication kinds")
      .def_property_readonly("is_compute", [](const Action& a) { return isCompute(a.kind); })
      .def_property_readonly("is_communication",
                             [](const Action& a) { return isCommunication(a.kind); })
      .def_property_readonly("is_stage_collective",
                             [](const Action& a) { return isStageCollective(a.kind); },
                             "REDUCE_GRAD, UNSHARD or RESHARD (no microbatch)")
      .def_static("parse", &parseAction, py::arg("text"),
                  "Parse one token; ParseError (a ValueError) names the token on bad input.")
      .def("__str__", [](const Action& a) { return toString(a); })
      .def("__repr__", [](const Action& a) { return "Action('" + toString(a) + "')"; })
      .def("__eq__", [](const Action& a, const Action& b) { return a == b; }, py::is_operator())
      .def("__hash__", [](const Action& a) { return std::hash<std::string>{}(toString(a)); });

  m.def("parse_action", &parseAction, py::arg("text"), "Same as Action.parse.");
}

}  // namespace mpmd::python
