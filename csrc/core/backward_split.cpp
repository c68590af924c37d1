#include "backward_split.h"

#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mpmd {

namespace {

void checkInputs(const std::vector<std::vector<int32_t>>& inputs,
                 const std::vector<bool>& is_placeholder) {
  if (inputs.size() != is_placeholder.size()) {
    throw std::invalid_argument(fmt::format(
        "backward graph: inputs has {} entries but is_placeholder has {}: both need one per node",
        inputs.size(), is_placeholder.size()));
  }
  const auto n = static_cast<int64_t>(inputs.size());
  for (int64_t v = 0; v < n; ++v) {
    const auto& reads = inputs[static_cast<size_t>(v)];
    if (is_placeholder[static_cast<size_t>(v)] && !reads.empty()) {
      throw std::invalid_argument(fmt::format(
          "backward graph: placeholder node {} reads [{}]: placeholders read nothing", v,
          fmt::join(reads, ", ")));
    }
    for (int32_t u : reads) {
      if (u < 0 || u >= v) {
        throw std::invalid_argument(fmt::format(
            "backward graph: node {} reads node id {}: inputs must be ids of earlier nodes "
            "(0..{})",
            v, u, v - 1));
      }
    }
  }
}

void checkOutputs(const char* what, const std::vector<int32_t>& outputs, int64_t n) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i] < 0 || outputs[i] >= n) {
      throw std::invalid_argument(fmt::format(
          "backward graph: {}[{}] = {} is not a node id of a graph of {} nodes{}", what, i,
          outputs[i], n, n > 0 ? fmt::format(" (0..{})", n - 1) : std::string()));
    }
  }
}

// Marks every node reachable backwards from the marked ones without passing
// through a placeholder or a node in `stop` (those are marked, not entered).
// Ids are topological, so one descending sweep suffices.
void markAncestors(const std::vector<std::vector<int32_t>>& inputs,
                   const std::vector<bool>& is_placeholder, const std::vector<bool>* stop,
                   std::vector<bool>& marked) {
  for (size_t v = inputs.size(); v-- > 0;) {
    if (!marked[v] || is_placeholder[v] || (stop && (*stop)[v])) continue;
    for (int32_t u : inputs[v]) marked[static_cast<size_t>(u)] = true;
  }
}

}  // namespace

BackwardSplit splitBackward(const std::vector<std::vector<int32_t>>& inputs,
                            const std::vector<bool>& is_placeholder,
                            const std::vector<int32_t>& input_grad_outputs,
                            const std::vector<int32_t>& weight_grad_outputs,
                            const std::vector<bool>& is_projection) {
  checkInputs(inputs, is_placeholder);
  const size_t n = inputs.size();
  if (!is_projection.empty()) {
    if (is_projection.size() != n) {
      throw std::invalid_argument(fmt::format(
          "backward graph: is_projection has {} entries for a graph of {} nodes",
          is_projection.size(), n));
    }
    for (size_t v = 0; v < n; ++v) {
      if (is_projection[v] && inputs[v].size() != 1) {
        throw std::invalid_argument(fmt::format(
            "backward graph: projection node {} reads [{}]: a projection reads one node", v,
            fmt::join(inputs[v], ", ")));
      }
    }
  }
  checkOutputs("input_grad_outputs", input_grad_outputs, static_cast<int64_t>(n));
  checkOutputs("weight_grad_outputs", weight_grad_outputs, static_cast<int64_t>(n));

  BackwardSplit split;
  // needed_by_i[v]: I computes v or reads it (v an I node, an input-gradient
  // output, or a placeholder an I node reads). Likewise needed_by_w for W,
  // whose sweep stops at I nodes: W reads those from carry.
  std::vector<bool> needed_by_i(n, false);
  for (int32_t o : input_grad_outputs) needed_by_i[static_cast<size_t>(o)] = true;
  markAncestors(inputs, is_placeholder, nullptr, needed_by_i);
  split.input_part.assign(n, false);
  for (size_t v = 0; v < n; ++v) {
    split.input_part[v] = needed_by_i[v] && !is_placeholder[v];
    // An element of a tuple computed in I is taken there too (ids are
    // topological: the source's flag is final when v is reached).
    if (!is_projection.empty() && is_projection[v] &&
        split.input_part[static_cast<size_t>(inputs[v][0])]) {
      split.input_part[v] = needed_by_i[v] = true;
    }
  }

  std::vector<bool> needed_by_w(n, false);
  for (int32_t o : weight_grad_outputs) needed_by_w[static_cast<size_t>(o)] = true;
  markAncestors(inputs, is_placeholder, &split.input_part, needed_by_w);
  split.weight_part.assign(n, false);
  for (size_t v = 0; v < n; ++v) {
    const bool outside_w = is_placeholder[v] || split.input_part[v];
    split.weight_part[v] = needed_by_w[v] && !outside_w;
    if (needed_by_w[v] && outside_w) {
      split.carry.push_back(static_cast<int32_t>(v));
      if (is_placeholder[v]) split.weight_reads_saved.push_back(static_cast<int32_t>(v));
    }
    if (needed_by_i[v] && is_placeholder[v]) split.input_reads.push_back(static_cast<int32_t>(v));
  }
  return split;
}

}  // namespace mpmd
