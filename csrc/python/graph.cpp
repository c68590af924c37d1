// Graph IR and partitioner (core/graph_ir.h, core/partition.h). Python builds
// a Graph node by node with Graph.add_node (torch_mpmd/graph/fx_to_ir.py) and hands
// it to a partition_* function; the PartitionPlan comes back read-only.
// std::invalid_argument from the core arrives as ValueError.
#include "core/graph_ir.h"
#include "core/partition.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"

namespace py = pybind11;

namespace mpmd::python {

namespace {

// No fmt here: torch/include (first on this target's include path) carries
// its own fmt headers, which do not match the libfmt that mpmd_core links.
std::string joinInts(const std::vector<int32_t>& v) {
  std::string out;
  for (int32_t x : v) {
    if (!out.empty()) out += ", ";
    out += std::to_string(x);
  }
  return out;
}

std::string hex16(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

const char* nodeKindName(NodeKind kind) {
  switch (kind) {
    case NodeKind::Input: return "INPUT";
    case NodeKind::Parameter: return "PARAMETER";
    case NodeKind::Buffer: return "BUFFER";
    case NodeKind::Constant: return "CONSTANT";
    case NodeKind::Compute: return "COMPUTE";
    case NodeKind::Marker: return "MARKER";
    case NodeKind::Output: return "OUTPUT";
  }
  return "?";
}

const Node& nodeAt(const Graph& g, int64_t i) {
  const auto n = static_cast<int64_t>(g.nodes.size());
  if (i < 0) i += n;
  if (i < 0 || i >= n) {
    throw py::index_error("node index " + std::to_string(i) + " out of range for a graph of " +
                          std::to_string(n) + " nodes");
  }
  return g.nodes[static_cast<size_t>(i)];
}

// Appends a node whose id is its position; returns the id.
int32_t addNode(Graph& g, NodeKind kind, std::string name, std::string target,
                std::string module_fqn, std::string fqn, std::vector<int32_t> inputs, double cost,
                int64_t output_bytes) {
  Node node;
  node.id = static_cast<int32_t>(g.nodes.size());
  node.kind = kind;
  node.name = std::move(name);
  node.target = std::move(target);
  node.module_fqn = std::move(module_fqn);
  node.fqn = std::move(fqn);
  node.inputs = std::move(inputs);
  node.cost = cost;
  node.output_bytes = output_bytes;
  g.nodes.push_back(std::move(node));
  return g.nodes.back().id;
}

}  // namespace

void bindGraph(py::module_& m) {
  py::enum_<NodeKind>(m, "NodeKind", "Kind of a graph IR node (core/graph_ir.h).")
      .value("INPUT", NodeKind::Input)
      .value("PARAMETER", NodeKind::Parameter)
      .value("BUFFER", NodeKind::Buffer)
      .value("CONSTANT", NodeKind::Constant)
      .value("COMPUTE", NodeKind::Compute)
      .value("MARKER", NodeKind::Marker)
      .value("OUTPUT", NodeKind::Output);

  py::class_<Node>(m, "Node", "One node of the graph IR; `id` is its position in the graph.")
      .def(py::init<>())
      .def_readwrite("id", &Node::id)
      .def_readwrite("kind", &Node::kind)
      .def_readwrite("name", &Node::name)
      .def_readwrite("target", &Node::target)
      .def_readwrite("module_fqn", &Node::module_fqn)
      .def_readwrite("fqn", &Node::fqn)
      .def_readwrite("inputs", &Node::inputs)
      .def_readwrite("cost", &Node::cost)
      .def_readwrite("output_bytes", &Node::output_bytes)
      .def("__repr__", [](const Node& n) {
        return "Node(id=" + std::to_string(n.id) + ", kind=" + nodeKindName(n.kind) + ", name='" +
               n.name + "', target='" + n.target + "', module_fqn='" + n.module_fqn + "')";
      });

  py::class_<Graph>(m, "Graph",
                    "The torch-free picture of a captured model. Build it with add_node; "
                    "`nodes` returns a copy.")
      .def(py::init<>())
      .def("add_node", &addNode, py::arg("kind"), py::arg("name"), py::arg("target") = "",
           py::arg("module_fqn") = "", py::arg("fqn") = "",
           py::arg("inputs") = std::vector<int32_t>{}, py::arg("cost") = 0.0,
           py::arg("output_bytes") = 0,
           "Append a node with id = its position; returns the id. Checked by check_graph.")
      .def_property_readonly("nodes", [](const Graph& g) { return g.nodes; },
                             "A copy of the nodes, in id order.")
      .def("node", &nodeAt, py::arg("index"), py::return_value_policy::copy,
           "A copy of node `index` (negative counts from the end).")
      .def("__len__", [](const Graph& g) { return g.nodes.size(); })
      .def("__repr__",
           [](const Graph& g) { return "Graph(" + std::to_string(g.nodes.size()) + " nodes)"; });

  m.def("check_graph", &checkGraph, py::arg("graph"),
        "ValueError naming the node unless ids are 0..n-1 in order, inputs point to earlier "
        "nodes, and exactly one Output node comes last.");

  py::class_<CrossStageValue>(m, "CrossStageValue",
                              "A value produced on one stage and read by later stages.")
      .def_readonly("node", &CrossStageValue::node)
      .def_readonly("producer_stage", &CrossStageValue::producer_stage)
      .def_readonly("consumer_stages", &CrossStageValue::consumer_stages)
      .def_readonly("bytes", &CrossStageValue::bytes)
      .def("__repr__", [](const CrossStageValue& v) {
        return "CrossStageValue(node=" + std::to_string(v.node) +
               ", producer_stage=" + std::to_string(v.producer_stage) + ", consumer_stages=[" +
               joinInts(v.consumer_stages) + "], bytes=" + std::to_string(v.bytes) + ")";
      });

  py::class_<ParameterPlacement>(m, "ParameterPlacement",
                                 "The stages that read a Parameter or Buffer node.")
      .def_readonly("node", &ParameterPlacement::node)
      .def_readonly("fqn", &ParameterPlacement::fqn)
      .def_readonly("stages", &ParameterPlacement::stages)
      .def_property_readonly("shared", &ParameterPlacement::shared,
                             "Read by more than one stage (tied weights).")
      .def("__repr__", [](const ParameterPlacement& p) {
        return "ParameterPlacement(node=" + std::to_string(p.node) + ", fqn='" + p.fqn +
               "', stages=[" + joinInts(p.stages) + "])";
      });

  py::class_<PartitionPlan>(m, "PartitionPlan",
                            "Which stage computes each node, what crosses stages, where each "
                            "parameter lives. Read-only; `hash` compares plans across ranks.")
      .def_readonly("num_stages", &PartitionPlan::num_stages)
      .def_readonly("node_stage", &PartitionPlan::node_stage)
      .def_readonly("constant_stages", &PartitionPlan::constant_stages)
      .def_readonly("cross_stage_values", &PartitionPlan::cross_stage_values)
      .def_readonly("parameters", &PartitionPlan::parameters)
      .def_readonly("stage_cost", &PartitionPlan::stage_cost)
      .def_readonly("stage_parameter_bytes", &PartitionPlan::stage_parameter_bytes)
      .def_readonly("hash", &PartitionPlan::hash)
      .def("__repr__", [](const PartitionPlan& p) {
        return "PartitionPlan(num_stages=" + std::to_string(p.num_stages) +
               ", cross_stage_values=" + std::to_string(p.cross_stage_values.size()) + ", hash=" +
               hex16(p.hash) + ")";
      });

  // NOTE [GIL in bindings] (bindings.h): the partitioners are pure C++.
  m.def("partition_by_markers", &partitionByMarkers, py::arg("graph"),
        py::call_guard<py::gil_scoped_release>(),
        "A stage ends at each Marker node. ValueError for an empty stage or a boundary no "
        "value crosses.");
  m.def("partition_at_nodes", &partitionAtNodes, py::arg("graph"), py::arg("stage_starts"),
        py::call_guard<py::gil_scoped_release>(),
        "Stages 1..n-1 begin at the Compute node ids in `stage_starts` (ascending). Same errors "
        "as partition_by_markers.");
  m.attr("DEFAULT_BYTES_COST") = kDefaultBytesCost;
  m.def("partition_balanced", &partitionBalanced, py::arg("graph"), py::arg("num_stages"),
        py::arg("max_stage_parameter_bytes") = 0, py::arg("bytes_cost") = kDefaultBytesCost,
        py::call_guard<py::gil_scoped_release>(),
        "`num_stages` contiguous runs of Compute nodes minimizing the largest stage cost: its "
        "Compute costs plus `bytes_cost` (cost units per byte; default DEFAULT_BYTES_COST, see "
        "NOTE [Bytes cost] in core/partition.h) times the bytes crossing its boundaries; at "
        "equal cost, boundaries between shallower modules. Optionally caps each stage's "
        "parameter bytes (0 = no cap).");
  m.def("describe_plan", &describePlan, py::arg("graph"), py::arg("plan"),
        "Text summary: per-stage cost, nodes, parameters, cross-stage values.");
}

}  // namespace mpmd::python
