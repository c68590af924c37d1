// Exception classes of the core as Python exceptions (NOTE [Error mapping] in
// core/errors.h). ParseError and ScheduleError subclass ValueError, so code
// catching ValueError keeps working; DeadlockError subclasses RuntimeError.
#include "core/errors.h"

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

void bindErrors(py::module_& m) {
  py::register_exception<ParseError>(m, "ParseError", PyExc_ValueError);
  py::register_exception<ScheduleError>(m, "ScheduleError", PyExc_ValueError);
  py::register_exception<DeadlockError>(m, "DeadlockError", PyExc_RuntimeError);
}

}  // namespace mpmd::python
