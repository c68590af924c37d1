// Action and ActionKind (core/action.h). Actions cross into Python as these
// typed values (torch_mpmd.schedules.Action): Python reads stage, kind,
// microbatch and peer_stage and never parses text; str(action) is the
// canonical text form ("2F0", "0SEND_F2->3") and Action.parse(text) its
// inverse, for text a user wrote.
#include "core/action.h"

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include <pybind11/stl.h>

#include "bindings.h"
#include "core/errors.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

// The action with these fields; ParseError (a ValueError) naming the values
// unless they are one the text form can spell (the round trip through
// toString/parseAction is the one definition of a valid action).
Action checkedAction(int32_t stage, ActionKind kind, int32_t microbatch,
                     std::optional<int32_t> peer_stage) {
  const Action action{stage, kind, microbatch,
                      peer_stage.value_or(defaultPeerStage(stage, kind))};
  const std::string text = toString(action);
  const auto invalid = [&](const std::string& why) {
    return ParseError("Action(stage=" + std::to_string(stage) + ", kind=" +
                      std::string(kindName(kind)) + ", microbatch=" + std::to_string(microbatch) +
                      ", peer_stage=" + std::to_string(action.peer_stage) +
                      ") is not an action: " + why);
  };
  Action back;
  try {
    back = parseAction(text);
  } catch (const ParseError& e) {
    throw invalid(e.what());
  }
  if (!(back == action)) {
    throw invalid("its text form '" + text + "' reads back as stage=" +
                  std::to_string(back.stage) + ", microbatch=" + std::to_string(back.microbatch) +
                  ", peer_stage=" + std::to_string(back.peer_stage) +
                  " (stage collectives take microbatch -1, only SEND/RECV take a peer)");
  }
  return action;
}

size_t hashAction(const Action& a) {
  size_t h = std::hash<int32_t>{}(a.stage);
  for (int32_t v : {static_cast<int32_t>(a.kind), a.microbatch, a.peer_stage}) {
    h = h * 1000003u ^ std::hash<int32_t>{}(v);
  }
  return h;
}

}  // namespace

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

  py::class_<Action>(m, "Action",
                     "One (stage, kind, microbatch) step of a rank's program; str() is its text "
                     "form.")
      .def(py::init(&checkedAction), py::arg("stage"), py::arg("kind"),
           py::arg("microbatch") = -1, py::arg("peer_stage") = py::none(),
           "ParseError (a ValueError) unless the values are an action; peer_stage defaults "
           "to the adjacent stage for SEND/RECV (NOTE [Peer stages]).")
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
      .def("__hash__", &hashAction)
      .def(py::pickle(
          [](const Action& a) {
            return py::make_tuple(a.stage, static_cast<int>(a.kind), a.microbatch, a.peer_stage);
          },
          [](const py::tuple& t) {
            const int kind = t.size() == 4 ? t[1].cast<int>() : -1;
            if (kind < 0 || kind >= kNumActionKinds) {
              throw ParseError("not a pickled Action: " + py::repr(t).cast<std::string>());
            }
            return checkedAction(t[0].cast<int32_t>(), static_cast<ActionKind>(kind),
                                 t[2].cast<int32_t>(), t[3].cast<int32_t>());
          }));

  m.def("parse_action", &parseAction, py::arg("text"), "Same as Action.parse.");
}

}  // namespace mpmd::python
