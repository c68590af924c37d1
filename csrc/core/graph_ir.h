// Graph IR: the compact, torch-free picture of a captured model that the
// partitioner works on. Built from an FX graph by torch_mpmd/graph/fx_to_ir.py (the
// only module that knows FX); node ids are positions in FX order, which is a
// topological order and, for compute nodes, the program order of forward().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mpmd {

enum class NodeKind : uint8_t {
  Input,      // a user input of forward() (positional or keyword); every rank has it
  Parameter,  // a parameter lifted to a placeholder; `fqn` names it
  Buffer,     // a buffer lifted to a placeholder; `fqn` names it
  Constant,   // a value that depends on no Input and no Compute node (e.g. arange)
  Compute,    // an operation on values
  Marker,     // torch_mpmd.stage_boundary(): a stage ends here
  Output,     // the graph's output node (one, last)
};

struct Node {
  int32_t id = 0;
  NodeKind kind = NodeKind::Compute;
  std::string name;           // FX node name, for messages
  std::string target;         // op name, e.g. "aten.mm" or "torch.nn.functional.linear"
  std::string module_fqn;     // innermost user module the node was traced in ("" = root)
  std::string fqn;            // Parameter/Buffer: the original FQN
  std::vector<int32_t> inputs;  // ids of nodes this node reads; all < id
  double cost = 0.0;          // estimated time units (FLOPs for matmul-like ops, bytes moved otherwise)
  int64_t output_bytes = 0;   // size of the value it produces
};

struct Graph {
  std::vector<Node> nodes;
};

// Throws std::invalid_argument naming the node when ids are not 0..n-1 in
// order, an input id is not smaller than the node's id, or there is not
// exactly one Output node and it is last.
void checkGraph(const Graph& graph);

}  // namespace mpmd
