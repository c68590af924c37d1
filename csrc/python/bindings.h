// One bind function per area of the core library; module.cpp calls them in
// order. Bindings only: no logic beyond argument conversion lives here.
//
// NOTE [GIL in bindings]: every core function bound here is pure C++ that
// touches no Python object, so the long-running ones (makeSchedule, lower,
// validate, simulate) run under py::gil_scoped_release. Arguments are
// converted before the release and results after it is reacquired.
#pragma once

#include <pybind11/pybind11.h>

namespace mpmd::python {

void bindErrors(pybind11::module_& m);     // errors.cpp
void bindActions(pybind11::module_& m);    // actions.cpp
void bindSchedules(pybind11::module_& m);  // schedules.cpp
void bindSimulator(pybind11::module_& m);  // simulator.cpp
void bindGraph(pybind11::module_& m);      // graph.cpp
void bindBackwardSplit(pybind11::module_& m);  // backward_split.cpp
void bindPlanner(pybind11::module_& m);        // planner.cpp

}  // namespace mpmd::python
