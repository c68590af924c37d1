// torch_mpmd._runtime: the executor and the c10d transport for Python.
//
// A separate extension from torch_mpmd._C: it links libtorch and must be
// imported after torch, while _C (schedules, partitioner) stays torch-free so
// the schedules CLI runs without importing torch.
//
// NOTE [GIL in the executor]: Executor.run releases the GIL for the whole
// step; the Python StageRunner is called back under a re-acquired GIL, and
// every transport wait happens without it. Python exceptions raised by the
// runner are converted to C++ exceptions (message only) while the GIL is
// held, so no Python object crosses a GIL-free region. Tensors (TensorPayload)
// are safe to hold and drop without the GIL.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/utils/pybind.h>

#include "core/schedule_io.h"
#include "runtime/c10d_transport.h"
#include "runtime/executor.h"
#include "runtime/tensor_payload.h"

namespace py = pybind11;

namespace mpmd::runtime {
namespace {

py::list toPython(const std::vector<Values>& groups) {
  py::list out;
  for (const Values& values : groups) {
    py::list inner;
    for (const Value& v : values) inner.append(tensorOf(v));
    out.append(inner);
  }
  return out;
}

std::vector<Values> fromPython(const py::handle& result, const char* method, int stage) {
  std::vector<Values> groups;
  for (const py::handle& inner : result) {
    Values values;
    for (const py::handle& t : inner) {
      if (!THPVariable_Check(t.ptr())) {
        throw std::runtime_error(std::string("StageRunner.") + method + " of stage " +
                                 std::to_string(stage) + " returned a " +
                                 std::string(py::str(py::type::of(t).attr("__name__"))) +
                                 " where a tensor was expected");
      }
      values.push_back(tensorValue(THPVariable_Unpack(t.ptr())));
    }
    groups.push_back(std::move(values));
  }
  return groups;
}

// Forwards StageRunner calls to a Python object with methods forward,
// backward, backward_weight and reduce_grad (torch_mpmd/runner.py). When one
// raises, the Python exception is kept in the runner's `error` attribute (the
// cause of the PipelineError, with its traceback) and its message goes on as
// a C++ exception.
class PyStageRunner final : public StageRunner {
 public:
  explicit PyStageRunner(py::object runner) : runner_(std::move(runner)) {}
  ~PyStageRunner() override {
    py::gil_scoped_acquire gil;
    runner_ = py::object();
  }

  std::vector<Values> forward(int stage, int mb, std::vector<Values> inputs) override {
    py::gil_scoped_acquire gil;
    try {
      py::object out = runner_.attr("forward")(stage, mb, toPython(inputs));
      return fromPython(out, "forward", stage);
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  std::vector<Values> backward(int stage, int mb, std::vector<Values> grads,
                               bool input_only) override {
    py::gil_scoped_acquire gil;
    try {
      py::object out = runner_.attr("backward")(stage, mb, toPython(grads), input_only);
      return fromPython(out, "backward", stage);
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  void backwardWeight(int stage, int mb) override {
    py::gil_scoped_acquire gil;
    try {
      runner_.attr("backward_weight")(stage, mb);
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  void reduceGrad(int stage) override {
    py::gil_scoped_acquire gil;
    try {
      runner_.attr("reduce_grad")(stage);
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

 private:
  // Called with the GIL held, inside the catch of `e`.
  std::runtime_error failure(py::error_already_set& e) {
    std::string message = e.what();
    try {
      // Before Python 3.12 the traceback is held apart from the exception
      // object: attach it, so the PipelineError's cause shows where it rose.
      PyObject* value = e.value().ptr();
      PyObject* held = PyException_GetTraceback(value);  // new reference or null
      if (held == nullptr && e.trace()) PyException_SetTraceback(value, e.trace().ptr());
      Py_XDECREF(held);
      runner_.attr("error") = e.value();
    } catch (py::error_already_set&) {
      // The message still travels; only the cause is lost.
    }
    return std::runtime_error(message);
  }

  py::object runner_;
};

// The transport of a program without SEND/RECV (one rank): never used.
class NoTransport final : public Transport {
 public:
  std::unique_ptr<PendingTransfer> send(int peer, const TransferKey& key, Values) override {
    throw TransportError(peer, "no transport for the send of " + describe(key));
  }
  std::unique_ptr<PendingTransfer> recv(int peer, const TransferKey& key) override {
    throw TransportError(peer, "no transport for the receive of " + describe(key));
  }
};

// Owns the runner trampoline next to the executor that refers to it.
struct PyExecutor {
  PyExecutor(const std::string& schedule_text, int rank, py::object runner,
             std::shared_ptr<Transport> transport, ExecutorOptions options)
      : runner(std::make_unique<PyStageRunner>(std::move(runner))),
        transport(transport ? std::move(transport) : std::make_shared<NoTransport>()),
        executor(std::make_unique<Executor>(scheduleFromText(schedule_text), rank, *this->runner,
                                            *this->transport, options)) {}
  std::unique_ptr<PyStageRunner> runner;
  std::shared_ptr<Transport> transport;
  std::unique_ptr<Executor> executor;
};

c10::intrusive_ptr<c10d::ProcessGroup> groupNamed(const std::string& name) {
  return c10d::resolve_process_group(name);
}

}  // namespace
}  // namespace mpmd::runtime

PYBIND11_MODULE(_runtime, m) {
  using namespace mpmd::runtime;
  m.doc() = "Executor and c10d transport of torch_mpmd (links libtorch; import after torch).";

  // Leaked on purpose: a static py::object would be destroyed after the
  // interpreter is finalized.
  static auto* executor_error =
      new py::exception<ExecutorError>(m, "ExecutorError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ExecutorError& e) {
      py::object type = py::reinterpret_borrow<py::object>(executor_error->ptr());
      py::object err = type(e.what());
      err.attr("rank") = e.rank();
      err.attr("action") = e.action();
      err.attr("peer") = e.peer();
      PyErr_SetObject(executor_error->ptr(), err.ptr());
    }
  });

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport");
  py::class_<C10dTransport, Transport, std::shared_ptr<C10dTransport>>(m, "C10dTransport")
      .def(py::init([](const std::string& up, const std::string& down, const py::dict& specs,
                       const std::string& device, int tag) {
             EdgeSpecs edge_specs;
             for (const auto& [key, tensors] : specs) {
               auto k = key.cast<std::tuple<int, int, bool>>();
               edge_specs[k] = tensors.cast<std::vector<at::Tensor>>();
             }
             return std::make_shared<C10dTransport>(groupNamed(up), groupNamed(down),
                                                    std::move(edge_specs), at::Device(device), tag);
           }),
           py::arg("up_group"), py::arg("down_group"), py::arg("specs"), py::arg("device"),
           py::arg("tag") = 0,
           "Transport over the process groups named `up_group`/`down_group` (group_name; the "
           "same name twice for gloo). specs: {(producer, consumer, backward): [tensor, ...]} "
           "giving the shape and dtype of each transferred tensor (meta tensors are fine).")
      .def_property_readonly("rank", &C10dTransport::rank);

  py::class_<PyExecutor>(m, "Executor")
      .def(py::init([](const std::string& schedule_text, int rank, py::object runner,
                       std::shared_ptr<Transport> transport, int lookahead, double timeout_s,
                       bool trace) {
             ExecutorOptions options;
             options.lookahead = lookahead;
             options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             options.trace = trace;
             return std::make_unique<PyExecutor>(schedule_text, rank, std::move(runner),
                                                 std::move(transport), options);
           }),
           py::arg("schedule_text"), py::arg("rank"), py::arg("runner"), py::arg("transport"),
           py::arg("lookahead") = 2, py::arg("timeout_s") = 60.0, py::arg("trace") = false,
           "Executor of rank `rank`'s program of a lowered schedule (text form). `transport` "
           "may be None only when the program has no SEND/RECV.")
      .def("run", [](PyExecutor& self) {
             py::gil_scoped_release nogil;
             self.executor->run();
           },
           "Runs the program once (one step), without the GIL; raises ExecutorError.")
      .def("format_program", [](PyExecutor& self, int64_t mark) {
             return self.executor->formatProgram(mark);
           }, py::arg("mark") = -1)
      .def_property_readonly("program", [](PyExecutor& self) {
        std::vector<std::string> out;
        for (const auto& a : self.executor->program()) out.push_back(mpmd::toString(a));
        return out;
      })
      .def_property_readonly("stats", [](PyExecutor& self) {
        const ExecutorStats& s = self.executor->stats();
        py::dict d;
        d["steps"] = s.steps;
        d["peak_live_forwards"] = s.peak_live_forwards;
        d["peak_buffered"] = s.peak_buffered;
        py::list trace;
        for (const TraceEvent& e : s.trace) trace.append(py::make_tuple(e.action_index, e.begin_ns, e.end_ns));
        d["trace"] = trace;
        return d;
      });
}
