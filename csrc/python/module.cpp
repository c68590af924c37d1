// torch_mpmd._C: the pybind11 module over the C++ core (csrc/core).
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "C++ core of torch_mpmd: actions, schedules, lowering, simulation, graph IR, partitioner, "
      "backward split.";
  // Errors first: the other areas' docstrings and translators may refer to them.
  mpmd::python::bindErrors(m);
  mpmd::python::bindActions(m);
  mpmd::python::bindSchedules(m);
  mpmd::python::bindSimulator(m);
  mpmd::python::bindGraph(m);
  mpmd::python::bindBackwardSplit(m);
  mpmd::python::bindPlanner(m);
}
