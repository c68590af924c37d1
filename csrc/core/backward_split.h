// Backward split: a stage's backward graph -> an I program (input gradients,
// on the critical path to the previous stage) and a W program (weight
// gradients, deferrable). Torch-free: the graph arrives
// as plain read lists; torch_mpmd builds them from the backward FX graph.
//
// NOTE [Backward split]: I = the non-placeholder ancestors (inclusive) of the
// input-gradient outputs; W = the non-placeholder ancestors of the
// weight-gradient outputs that are not in I. A node both sides need is
// computed once, in I, and handed to W through `carry`; W never recomputes
// it. Recompute nodes of activation checkpointing follow the same rule.
// Nodes in neither part are dead: no output needs them, nothing computes them.
// A projection (an element of a tuple-valued node, FX's getitem) whose source
// is in I is computed in I too, whoever needs it: the tuple itself cannot be
// carried, its elements can.
#pragma once

#include <cstdint>
#include <vector>

namespace mpmd {

struct BackwardSplit {
  // Per node: computed in I (a non-placeholder ancestor, inclusive, of an
  // input-gradient output).
  std::vector<bool> input_part;
  // Per node: computed in W (a non-placeholder ancestor, inclusive, of a
  // weight-gradient output, and not in I). Disjoint from input_part.
  std::vector<bool> weight_part;
  // Ascending ids of the values W reads from outside W: I nodes and
  // placeholders that a W node reads or that are weight-gradient outputs
  // themselves. What I hands to W.
  std::vector<int32_t> carry;
  // Ascending ids of the placeholders I reads: read by an I node or an
  // input-gradient output themselves.
  std::vector<int32_t> input_reads;
  // Ascending ids of the placeholders in `carry`: what W needs directly from
  // the forward's saved values and the incoming gradients.
  std::vector<int32_t> weight_reads_saved;
};

// Splits a backward graph of n = inputs.size() nodes, ids 0..n-1 in
// topological order. `inputs[v]` lists the ids node v reads (all < v);
// `is_placeholder[v]` marks graph inputs (saved activations, incoming
// gradients), which read nothing. `input_grad_outputs` and
// `weight_grad_outputs` list the output node ids; an id may repeat, appear in
// both lists, or be a placeholder. O(n + edges); pure, no allocation beyond
// the result and two flag vectors. `is_projection` (empty: none) marks nodes
// that select an element of their one input's tuple value.
//
// Throws std::invalid_argument, naming the values, for: inputs and
// is_placeholder (or a non-empty is_projection) of different lengths, an
// input id negative or not smaller than the reading node's id, a placeholder
// with inputs, a projection that does not read exactly one node, an output id
// outside 0..n-1.
BackwardSplit splitBackward(const std::vector<std::vector<int32_t>>& inputs,
                            const std::vector<bool>& is_placeholder,
                            const std::vector<int32_t>& input_grad_outputs,
                            const std::vector<int32_t>& weight_grad_outputs,
                            const std::vector<bool>& is_projection = {});

}  // namespace mpmd
