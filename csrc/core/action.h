// Actions: the unit of a per-rank pipeline program.
//
// An action is (stage, kind, microbatch). Its one text form is compatible with
// torch.distributed.pipelining: `2F0`, `2B0`, `2I0`, `2W0`, `2SEND_F0`,
// `1RECV_F0`, `2SEND_B0`, `1RECV_B0`, and the stage collectives, which take no
// microbatch: `2REDUCE_GRAD`, `2UNSHARD`, `2RESHARD` (isStageCollective).
//
// NOTE [Peer stages]: torch's form implies the stage at the other end of a
// transfer: SEND_F goes to stage+1, RECV_F comes from stage-1, SEND_B goes to
// stage-1, RECV_B comes from stage+1. Values that skip stages (stage 0 feeding
// stage 3) need the peer spelled out, which we do with an arrow suffix:
// `0SEND_F2->3` and `3RECV_F2<-0`. The suffix is printed only when the peer
// is not the adjacent default, so every torch schedule round-trips unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mpmd {

enum class ActionKind : uint8_t {
  Forward,         // F: stage forward of one microbatch
  FullBackward,    // B: input and weight gradients together
  BackwardInput,   // I: input gradient only (zero-bubble schedules)
  BackwardWeight,  // W: weight gradient only, after the same microbatch's I
  SendF,           // SEND_F: send forward activations to peer_stage
  RecvF,           // RECV_F: receive forward activations from peer_stage
  SendB,           // SEND_B: send input gradients to peer_stage
  RecvB,           // RECV_B: receive output gradients from peer_stage
  ReduceGrad,      // REDUCE_GRAD: reduce this stage's gradients (dp, tied)
  Unshard,         // UNSHARD: post the all-gather of this stage's sharded parameters
  Reshard,         // RESHARD: free this stage's gathered parameters
};

inline constexpr int kNumActionKinds = 11;

struct Action {
  int32_t stage = 0;
  ActionKind kind = ActionKind::Forward;
  int32_t microbatch = -1;  // -1 only for the stage collectives
  int32_t peer_stage = -1;  // communication kinds only; always explicit after parse

  friend bool operator==(const Action&, const Action&) = default;
};

// Short name of a kind as it appears in text: "F", "SEND_B", "REDUCE_GRAD".
std::string_view kindName(ActionKind kind);

// Kind predicates; inline because every pass calls them per action.
constexpr bool isCompute(ActionKind kind) {  // F, B, I, W
  return kind == ActionKind::Forward || kind == ActionKind::FullBackward ||
         kind == ActionKind::BackwardInput || kind == ActionKind::BackwardWeight;
}
constexpr bool isSend(ActionKind kind) { return kind == ActionKind::SendF || kind == ActionKind::SendB; }
constexpr bool isRecv(ActionKind kind) { return kind == ActionKind::RecvF || kind == ActionKind::RecvB; }
constexpr bool isCommunication(ActionKind kind) { return isSend(kind) || isRecv(kind); }
// REDUCE_GRAD, UNSHARD, RESHARD: per-stage actions of the whole step, with no
// microbatch (microbatch -1, no number in the text form).
constexpr bool isStageCollective(ActionKind kind) {
  return kind == ActionKind::ReduceGrad || kind == ActionKind::Unshard || kind == ActionKind::Reshard;
}
// B or I: the backward that frees the forward's activations.
constexpr bool isBackward(ActionKind kind) {
  return kind == ActionKind::FullBackward || kind == ActionKind::BackwardInput;
}

// The peer a transfer has when the text omits it (see NOTE [Peer stages]).
int32_t defaultPeerStage(int32_t stage, ActionKind kind);

// Builders that fill peer_stage correctly.
Action computeAction(int32_t stage, ActionKind kind, int32_t microbatch);
Action commAction(int32_t stage, ActionKind kind, int32_t microbatch, int32_t peer_stage);
Action reduceGradAction(int32_t stage);
Action unshardAction(int32_t stage);
Action reshardAction(int32_t stage);
// Any stage collective; `kind` must satisfy isStageCollective.
Action stageCollectiveAction(int32_t stage, ActionKind kind);

// Text form; inverse of parseAction.
std::string toString(const Action& action);

// Parses one token (surrounding blanks allowed). Throws ParseError naming the
// token and the character position where it went wrong. Never crashes, on any
// input: numbers too large for int32, empty text, unknown kinds, a missing or
// extra microbatch, a peer suffix on a compute action or equal to the stage.
Action parseAction(std::string_view text);

}  // namespace mpmd
