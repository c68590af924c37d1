#include "action.h"

#include <array>
#include <charconv>
#include <limits>

#include <fmt/format.h>

#include "errors.h"

namespace mpmd {

namespace {

constexpr std::array<std::string_view, kNumActionKinds> kKindNames = {
    "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD", "UNSHARD", "RESHARD"};

[[noreturn]] void fail(std::string_view text, size_t pos, std::string_view why) {
  throw ParseError(fmt::format("invalid action '{}' at character {}: {} "
                               "(expected e.g. 2F0, 1SEND_B3, 0SEND_F1->3, 2REDUCE_GRAD)",
                               text, pos, why));
}

// Reads a non-negative decimal int32 at `pos`; advances `pos`.
int32_t readNumber(std::string_view text, size_t& pos, std::string_view what) {
  size_t end = pos;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  if (end == pos) fail(text, pos, fmt::format("expected {} (a number)", what));
  int64_t value = 0;
  for (size_t i = pos; i < end; ++i) {
    value = value * 10 + (text[i] - '0');
    if (value > std::numeric_limits<int32_t>::max()) fail(text, pos, fmt::format("{} is too large", what));
  }
  pos = end;
  return static_cast<int32_t>(value);
}

}  // namespace

std::string_view kindName(ActionKind kind) { return kKindNames[static_cast<size_t>(kind)]; }

int32_t defaultPeerStage(int32_t stage, ActionKind kind) {
  switch (kind) {
    case ActionKind::SendF:
    case ActionKind::RecvB:
      return stage + 1;
    case ActionKind::RecvF:
    case ActionKind::SendB:
      return stage - 1;
    default:
      return -1;
  }
}

Action computeAction(int32_t stage, ActionKind kind, int32_t microbatch) {
  return Action{stage, kind, microbatch, -1};
}

Action commAction(int32_t stage, ActionKind kind, int32_t microbatch, int32_t peer_stage) {
  return Action{stage, kind, microbatch, peer_stage};
}

Action stageCollectiveAction(int32_t stage, ActionKind kind) { return Action{stage, kind, -1, -1}; }
Action reduceGradAction(int32_t stage) { return stageCollectiveAction(stage, ActionKind::ReduceGrad); }
Action unshardAction(int32_t stage) { return stageCollectiveAction(stage, ActionKind::Unshard); }
Action reshardAction(int32_t stage) { return stageCollectiveAction(stage, ActionKind::Reshard); }

std::string toString(const Action& action) {
  std::string out = fmt::format("{}{}", action.stage, kindName(action.kind));
  if (!isStageCollective(action.kind)) out += fmt::format("{}", action.microbatch);
  if (isCommunication(action.kind) &&
      action.peer_stage != defaultPeerStage(action.stage, action.kind)) {
    out += fmt::format("{}{}", isSend(action.kind) ? "->" : "<-", action.peer_stage);
  }
  return out;
}

Action parseAction(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end && (text[begin] == ' ' || text[begin] == '\t')) ++begin;
  while (end > begin && (text[end - 1] == ' ' || text[end - 1] == '\t' || text[end - 1] == '\r')) --end;
  std::string_view token = text.substr(begin, end - begin);
  if (token.empty()) fail(text, 0, "empty action");

  size_t pos = 0;
  Action action;
  action.stage = readNumber(token, pos, "stage index");

  // Longest kind name that matches at pos ("SEND_F" before nothing shorter
  // shares a prefix, but keep the rule general).
  int best = -1;
  size_t best_len = 0;
  for (int k = 0; k < kNumActionKinds; ++k) {
    std::string_view name = kKindNames[k];
    if (token.substr(pos, name.size()) == name && name.size() > best_len) {
      best = k;
      best_len = name.size();
    }
  }
  if (best < 0) fail(token, pos, "unknown action kind (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD, "
                               "UNSHARD, RESHARD)");
  action.kind = static_cast<ActionKind>(best);
  pos += best_len;

  if (isStageCollective(action.kind)) {
    if (pos != token.size()) fail(token, pos, fmt::format("{} takes no microbatch", kindName(action.kind)));
    return action;
  }
  action.microbatch = readNumber(token, pos, "microbatch index");

  if (isCommunication(action.kind)) {
    if (action.stage == std::numeric_limits<int32_t>::max()) fail(token, 0, "stage index is too large");
    action.peer_stage = defaultPeerStage(action.stage, action.kind);
    if (pos < token.size()) {
      std::string_view arrow = isSend(action.kind) ? "->" : "<-";
      if (token.substr(pos, 2) != arrow) fail(token, pos, fmt::format("expected '{}' and a peer stage", arrow));
      pos += 2;
      action.peer_stage = readNumber(token, pos, "peer stage");
      if (action.peer_stage == action.stage) fail(token, pos, "peer stage equals the stage itself");
    }
    if (action.peer_stage < 0) fail(token, pos, "stage 0 has no previous stage; name the peer with '->N'/'<-N'");
  }
  if (pos != token.size()) fail(token, pos, "unexpected trailing characters");
  return action;
}

}  // namespace mpmd
