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

// A new list of the values' tensors. Called with the GIL held.
py::list listOf(const Values& values) {
  py::list out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* t = THPVariable_Wrap(tensorOf(values[i]));
    if (t == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), t);  // steals `t`
  }
  return out;
}

py::list toPython(const std::vector<Values>& groups) {
  py::list out(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), listOf(groups[i]).release().ptr());
  }
  return out;
}

std::string typeName(const py::handle& obj) {
  return py::str(py::type::of(obj).attr("__name__"));
}

std::runtime_error returnError(const char* method, int stage, const std::string& what) {
  return std::runtime_error(std::string("StageRunner.") + method + " of stage " +
                            std::to_string(stage) + " returned " + what);
}

// Appends the tensors of the list or tuple `seq` to `values`.
void appendTensors(const py::handle& seq, Values& values, const char* method, int stage) {
  if (!PyList_Check(seq.ptr()) && !PyTuple_Check(seq.ptr())) {
    throw returnError(method, stage,
                      "a " + typeName(seq) + " where a list of tensors was expected");
  }
  for (const py::handle& t : seq) {
    if (!THPVariable_Check(t.ptr())) {
      throw returnError(method, stage, "a " + typeName(t) + " where a tensor was expected");
    }
    values.push_back(tensorValue(THPVariable_Unpack(t.ptr())));
  }
}

std::vector<Values> fromPython(const py::handle& result, const char* method, int stage) {
  if (THPVariable_Check(result.ptr())) {
    throw returnError(method, stage, "a Tensor where a list of lists of tensors was expected");
  }
  std::vector<Values> groups;
  for (const py::handle& inner : result) {
    Values values;
    appendTensors(inner, values, method, stage);
    groups.push_back(std::move(values));
  }
  return groups;
}

// The two items of the 2-tuple a runner with returns_state returns.
std::pair<py::handle, py::handle> pairOf(const py::object& result, const char* method, int stage,
                                         const char* shape) {
  PyObject* r = result.ptr();
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
    throw returnError(method, stage,
                      "a " + typeName(result) +
                          (PyTuple_Check(r) ? " of " + std::to_string(PyTuple_GET_SIZE(r)) : "") +
                          "; a runner with returns_state=True returns a 2-tuple " + shape);
  }
  return {PyTuple_GET_ITEM(r, 0), PyTuple_GET_ITEM(r, 1)};
}

// Method names, interned once; leaked like the exception type below.
struct MethodNames {
  PyObject* forward = PyUnicode_InternFromString("forward");
  PyObject* backward = PyUnicode_InternFromString("backward");
  PyObject* backward_weight = PyUnicode_InternFromString("backward_weight");
  PyObject* reduce_grad = PyUnicode_InternFromString("reduce_grad");
  PyObject* unshard = PyUnicode_InternFromString("unshard");
  PyObject* reshard = PyUnicode_InternFromString("reshard");
};
const MethodNames& methodNames() {
  static const MethodNames* names = new MethodNames();
  return *names;
}

// Forwards StageRunner calls to a Python object with methods forward,
// backward, backward_weight and reduce_grad (torch_mpmd/runtime/runner.py). When one
// raises, the Python exception is kept in the runner's `error` attribute (the
// cause of the PipelineError, with its traceback) and its message goes on as
// a C++ exception.
//
// The runner's `returns_state` attribute (a bool, read once here; absent is
// False) picks the protocol (NOTE [Runner state] in runtime/executor.h):
//   False: the runner keeps its saved tensors itself.
//     forward(stage, mb, inputs) -> [[tensor, ...] per consumer]
//     backward(stage, mb, grads, input_only) -> [[tensor, ...] per producer]
//     backward_weight(stage, mb) -> None
//   True: the executor holds them per (stage, microbatch).
//     forward(stage, mb, inputs) -> (sends, state): sends as above, state a
//       list of tensors (or None: nothing) for this microbatch's B or I.
//     backward(stage, mb, grads, input_only, state) -> (input_grads, carry):
//       state is the forward's list, the executor's only reference (the
//       runner may clear it to free tensors early); carry is a list of tensors
//       for W, or None for nothing, and is ignored after a B (input_only False).
//     backward_weight(stage, mb, carry) -> None: carry is I's list, the
//       executor's only reference.
// reduce_grad(stage) is the same in both, and so are unshard(stage) and
// reshard(stage) (sharded data parallel: StageRunner::unshard/reshard), which
// a runner may lack: whether it has them is looked up once, here, and a
// missing one is a no-op, so replicated runners need neither. Methods are
// called by name on every call (a runner may replace them), through
// vectorcall: per call, no Python objects beyond the argument and result lists.
class PyStageRunner final : public StageRunner {
 public:
  explicit PyStageRunner(py::object runner)
      : runner_(std::move(runner)),
        returns_state_(readReturnsState(runner_)),
        has_unshard_(py::hasattr(runner_, methodNames().unshard)),
        has_reshard_(py::hasattr(runner_, methodNames().reshard)) {}
  ~PyStageRunner() override {
    py::gil_scoped_acquire gil;
    runner_ = py::object();
  }

  std::vector<Values> forward(int stage, int mb, std::vector<Values> inputs,
                              Values& state) override {
    py::gil_scoped_acquire gil;
    try {
      py::list args = toPython(inputs);
      inputs.clear();
      py::object out = call(methodNames().forward, stage, mb, {args.ptr()});
      if (!returns_state_) return fromPython(out, "forward", stage);
      auto [sends, saved] = pairOf(out, "forward", stage, "(sends, state)");
      std::vector<Values> groups = fromPython(sends, "forward", stage);
      if (!saved.is_none()) appendTensors(saved, state, "forward", stage);
      return groups;
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  std::vector<Values> backward(int stage, int mb, std::vector<Values> grads, bool input_only,
                               Values& state) override {
    py::gil_scoped_acquire gil;
    try {
      py::list args = toPython(grads);
      grads.clear();
      PyObject* flag = input_only ? Py_True : Py_False;
      if (!returns_state_) {
        py::object out = call(methodNames().backward, stage, mb, {args.ptr(), flag});
        return fromPython(out, "backward", stage);
      }
      py::list saved = listOf(state);
      state.clear();  // the list holds the only references: the runner may free them
      py::object out = call(methodNames().backward, stage, mb, {args.ptr(), flag, saved.ptr()});
      auto [input_grads, carry] = pairOf(out, "backward", stage, "(input_grads, carry)");
      std::vector<Values> groups = fromPython(input_grads, "backward", stage);
      if (input_only && !carry.is_none()) appendTensors(carry, state, "backward", stage);
      return groups;
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  void backwardWeight(int stage, int mb, Values state) override {
    py::gil_scoped_acquire gil;
    try {
      if (!returns_state_) {
        call(methodNames().backward_weight, stage, mb, {});
        return;
      }
      py::list carry = listOf(state);
      state.clear();  // the list holds the only references: the runner may free them
      call(methodNames().backward_weight, stage, mb, {carry.ptr()});
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  void reduceGrad(int stage) override { callStage(methodNames().reduce_grad, stage); }

  void unshard(int stage) override {
    if (has_unshard_) callStage(methodNames().unshard, stage);
  }

  void reshard(int stage) override {
    if (has_reshard_) callStage(methodNames().reshard, stage);
  }

 private:
  // Called with the GIL held, at construction.
  static bool readReturnsState(const py::object& runner) {
    py::object flag = py::getattr(runner, "returns_state", py::bool_(false));
    if (!PyBool_Check(flag.ptr())) {
      throw py::type_error("the StageRunner's returns_state must be a bool, got a " +
                           typeName(flag));
    }
    return flag.ptr() == Py_True;
  }

  // runner.<name>(stage), under the GIL; a Python exception becomes failure().
  void callStage(PyObject* name, int stage) {
    py::gil_scoped_acquire gil;
    try {
      py::int_ s(stage);
      PyObject* args[] = {nullptr, runner_.ptr(), s.ptr()};
      callWith(name, args, 2);
    } catch (py::error_already_set& e) {
      throw failure(e);
    }
  }

  // runner.<name>(stage, mb, *rest) with borrowed `rest` (at most 3).
  // Throws py::error_already_set.
  py::object call(PyObject* name, int stage, int mb, std::initializer_list<PyObject*> rest) {
    py::int_ s(stage), m(mb);
    PyObject* args[7] = {nullptr, runner_.ptr(), s.ptr(), m.ptr()};
    size_t n = 3;
    for (PyObject* a : rest) args[1 + n++] = a;
    return callWith(name, args, n);
  }

  // args[0] is scratch space (PY_VECTORCALL_ARGUMENTS_OFFSET), args[1] self.
  static py::object callWith(PyObject* name, PyObject** args, size_t n) {
    PyObject* out = PyObject_VectorcallMethod(name, args + 1, n | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              nullptr);
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }

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
  bool returns_state_;
  bool has_unshard_;  // looked up once: a runner without them is replicated
  bool has_reshard_;
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
      err.attr("drained") = e.drained();
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
      .def(
          "set_specs",
          [](C10dTransport& self, const py::dict& specs) {
            EdgeSpecs edge_specs;
            for (const auto& [key, tensors] : specs) {
              edge_specs[key.cast<std::tuple<int, int, bool>>()] =
                  tensors.cast<std::vector<at::Tensor>>();
            }
            self.setSpecs(std::move(edge_specs));
          },
          py::arg("specs"),
          "Replace the edge specs (same form as the constructor's), between runs: a step whose "
          "sizes differ from the last (NOTE [Microbatch specs] in c10d_transport.h).")
      .def(
          "set_microbatch_specs",
          [](C10dTransport& self, const py::dict& specs) {
            MicrobatchSpecs mb_specs;
            for (const auto& [key, tensors] : specs) {
              mb_specs[key.cast<std::tuple<int, int, bool, int>>()] =
                  tensors.cast<std::vector<at::Tensor>>();
            }
            self.setMicrobatchSpecs(std::move(mb_specs));
          },
          py::arg("specs"),
          "Per-microbatch specs {(producer, consumer, backward, microbatch): [tensor, ...]} "
          "overriding the edge's for those microbatches until the next call ({} clears them), "
          "set between runs (NOTE [Microbatch specs] in c10d_transport.h).")
      .def_property_readonly("rank", &C10dTransport::rank);

  m.def("keep_until_exit", [](const std::string& group_name) {
          // Leaked on purpose (see the docstring): destroyed at exit it would join
          // its worker threads, which wait out their work first.
          static auto* kept = new std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>();
          kept->push_back(groupNamed(group_name));
        },
        py::arg("group_name"),
        "Keep the process group named `group_name` alive until the process exits, never "
        "destroying it: a gloo group's destructor waits for the collectives still running on "
        "its worker threads, up to the group's own timeout (30 min by default), and gloo has "
        "no abort. For a group left with such work after a failure (NOTE [Abandoned "
        "groups] in torch_mpmd/parallel/bounded.py).");

  py::class_<PyExecutor>(m, "Executor")
      .def(py::init([](const std::string& schedule_text, int rank, py::object runner,
                       std::shared_ptr<Transport> transport, int lookahead, double timeout_s,
                       bool trace, bool drain) {
             ExecutorOptions options;
             options.lookahead = lookahead;
             options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             options.trace = trace;
             options.drain = drain;
             return std::make_unique<PyExecutor>(schedule_text, rank, std::move(runner),
                                                 std::move(transport), options);
           }),
           py::arg("schedule_text"), py::arg("rank"), py::arg("runner"), py::arg("transport"),
           py::arg("lookahead") = 2, py::arg("timeout_s") = 60.0, py::arg("trace") = false,
           py::arg("drain") = false,
           "Executor of rank `rank`'s program of a lowered schedule (text form). `transport` "
           "may be None only when the program has no SEND/RECV. `runner` has methods forward, "
           "backward, backward_weight and reduce_grad, and may have unshard(stage) and "
           "reshard(stage) (UNSHARD/RESHARD actions; a no-op when absent); with `runner.returns_state` True the "
           "executor holds the forward's saved tensors and I's carry for W: forward returns "
           "(sends, state), backward takes the state and returns (input_grads, carry), "
           "backward_weight takes the carry. With `drain`, a failure of this rank's own code "
           "is raised only after the program's transfers were finished with stand-in values "
           "(ExecutorError.drained is then True; NOTE [Draining a failed step]).")
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
      .def_property_readonly("trace_array", [](PyExecutor& self) {
             // One copy into an int64 tensor [n, 3] of (action index, begin ns,
             // end ns): cheap enough to keep every step's (no tuple per action).
             const auto& trace = self.executor->stats().trace;
             at::Tensor out = at::empty({static_cast<int64_t>(trace.size()), 3}, at::kLong);
             int64_t* row = out.data_ptr<int64_t>();
             for (const TraceEvent& e : trace) {
               *row++ = e.action_index;
               *row++ = e.begin_ns;
               *row++ = e.end_ns;
             }
             return out;
           },
           "The last run's trace as an int64 tensor of rows (action index, begin ns, end ns).")
      .def_property_readonly("counters", [](PyExecutor& self) {
             const ExecutorStats& s = self.executor->stats();
             py::dict d;
             d["steps"] = s.steps;
             d["peak_live_forwards"] = s.peak_live_forwards;
             d["peak_buffered"] = s.peak_buffered;
             d["peak_state_values"] = s.peak_state_values;
             return d;
           },
           "`stats` without the trace: runs completed, and the last run's peaks.")
      .def_property_readonly("stats", [](PyExecutor& self) {
        const ExecutorStats& s = self.executor->stats();
        py::dict d;
        d["steps"] = s.steps;
        d["peak_live_forwards"] = s.peak_live_forwards;
        d["peak_buffered"] = s.peak_buffered;
        d["peak_state_values"] = s.peak_state_values;
        py::list trace;
        for (const TraceEvent& e : s.trace) trace.append(py::make_tuple(e.action_index, e.begin_ns, e.end_ns));
        d["trace"] = trace;
        return d;
      });
}
