#include "graph_ir.h"

#include <stdexcept>

#include <fmt/format.h>

namespace mpmd {

void checkGraph(const Graph& graph) {
  const auto& nodes = graph.nodes;
  if (nodes.empty()) {
    throw std::invalid_argument("graph has no nodes: it needs at least its Output node");
  }
  const int32_t n = static_cast<int32_t>(nodes.size());
  int32_t first_output = -1;
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = nodes[i];
    if (node.id != i) {
      throw std::invalid_argument(fmt::format(
          "node '{}' at position {} has id {}: node ids must be 0..{} in order", node.name, i,
          node.id, n - 1));
    }
    for (int32_t in : node.inputs) {
      if (in < 0 || in >= i) {
        throw std::invalid_argument(fmt::format(
            "node '{}' (id {}) reads node id {}: inputs must be ids of earlier nodes (0..{})",
            node.name, i, in, i - 1));
      }
    }
    if (node.kind == NodeKind::Output) {
      if (first_output >= 0) {
        throw std::invalid_argument(fmt::format(
            "graph has more than one Output node: '{}' (id {}) and '{}' (id {})",
            nodes[first_output].name, first_output, node.name, i));
      }
      first_output = i;
    }
  }
  if (first_output < 0) {
    throw std::invalid_argument(
        fmt::format("graph has no Output node (last node is '{}', id {})", nodes.back().name,
                    n - 1));
  }
  if (first_output != n - 1) {
    throw std::invalid_argument(fmt::format(
        "Output node '{}' has id {} but must be the last node (id {})", nodes[first_output].name,
        first_output, n - 1));
  }
}

}  // namespace mpmd
