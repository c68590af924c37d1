// Action text form: round trips, torch compatibility, malformed tokens, fuzz.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/action.h"
#include "core/errors.h"

namespace mpmd {
namespace {

const std::vector<ActionKind> kAllKinds = {
    ActionKind::Forward, ActionKind::FullBackward, ActionKind::BackwardInput,
    ActionKind::BackwardWeight, ActionKind::SendF, ActionKind::RecvF,
    ActionKind::SendB, ActionKind::RecvB, ActionKind::ReduceGrad, ActionKind::Unshard,
    ActionKind::Reshard};

// An action of `kind` at `stage` built the way the library's builders do,
// with the default peer for communication.
Action makeAction(int32_t stage, ActionKind kind, int32_t microbatch) {
  if (isStageCollective(kind)) return stageCollectiveAction(stage, kind);
  if (isCommunication(kind)) return commAction(stage, kind, microbatch, defaultPeerStage(stage, kind));
  return computeAction(stage, kind, microbatch);
}

TEST(ActionText, RoundTripsEveryKind) {
  ASSERT_EQ(static_cast<int>(kAllKinds.size()), kNumActionKinds);
  for (ActionKind kind : kAllKinds) {
    for (int32_t stage : {1, 2, 7, 31}) {
      for (int32_t mb : {0, 3, 12345}) {
        const Action a = makeAction(stage, kind, mb);
        const std::string text = toString(a);
        EXPECT_EQ(parseAction(text), a) << text;
        EXPECT_EQ(toString(parseAction(text)), text);
      }
    }
  }
}

TEST(ActionText, PrintsTorchFormForEveryKind) {
  EXPECT_EQ(toString(makeAction(2, ActionKind::Forward, 0)), "2F0");
  EXPECT_EQ(toString(makeAction(2, ActionKind::FullBackward, 0)), "2B0");
  EXPECT_EQ(toString(makeAction(2, ActionKind::BackwardInput, 0)), "2I0");
  EXPECT_EQ(toString(makeAction(2, ActionKind::BackwardWeight, 0)), "2W0");
  EXPECT_EQ(toString(makeAction(2, ActionKind::SendF, 0)), "2SEND_F0");
  EXPECT_EQ(toString(makeAction(1, ActionKind::RecvF, 0)), "1RECV_F0");
  EXPECT_EQ(toString(makeAction(2, ActionKind::SendB, 0)), "2SEND_B0");
  EXPECT_EQ(toString(makeAction(1, ActionKind::RecvB, 0)), "1RECV_B0");
  EXPECT_EQ(toString(reduceGradAction(2)), "2REDUCE_GRAD");
  EXPECT_EQ(toString(unshardAction(0)), "0UNSHARD");
  EXPECT_EQ(toString(reshardAction(1)), "1RESHARD");
}

TEST(ActionText, StageCollectivesTakeNoMicrobatch) {
  EXPECT_EQ(parseAction("0UNSHARD"), unshardAction(0));
  EXPECT_EQ(parseAction("1RESHARD"), reshardAction(1));
  EXPECT_EQ(parseAction("1RESHARD").microbatch, -1);
  for (ActionKind kind : kAllKinds) {
    EXPECT_EQ(isStageCollective(kind), kind == ActionKind::ReduceGrad || kind == ActionKind::Unshard ||
                                           kind == ActionKind::Reshard);
    EXPECT_FALSE(isStageCollective(kind) && (isCompute(kind) || isCommunication(kind)));
  }
  for (const char* token : {"0UNSHARD3", "1RESHARD0", "0UNSHARD->1", "0UNSHARD 1"}) {
    try {
      parseAction(token);
      ADD_FAILURE() << "'" << token << "' parsed";
    } catch (const ParseError& e) {
      EXPECT_NE(std::string(e.what()).find("takes no microbatch"), std::string::npos) << e.what();
    }
  }
}

TEST(ActionText, PeerSuffixRoundTripsAndDefaultPeerIsOmitted) {
  const Action send = parseAction("0SEND_F2->3");
  EXPECT_EQ(send, commAction(0, ActionKind::SendF, 2, 3));
  EXPECT_EQ(toString(send), "0SEND_F2->3");

  const Action recv = parseAction("3RECV_F2<-0");
  EXPECT_EQ(recv, commAction(3, ActionKind::RecvF, 2, 0));
  EXPECT_EQ(toString(recv), "3RECV_F2<-0");

  EXPECT_EQ(toString(parseAction("3SEND_B1->0")), "3SEND_B1->0");
  EXPECT_EQ(toString(parseAction("0RECV_B1<-3")), "0RECV_B1<-3");

  // Spelling out the adjacent peer is accepted and printed in torch's form.
  EXPECT_EQ(parseAction("0SEND_F1->1"), parseAction("0SEND_F1"));
  EXPECT_EQ(toString(parseAction("0SEND_F1->1")), "0SEND_F1");
  EXPECT_EQ(toString(commAction(2, ActionKind::RecvF, 4, 1)), "2RECV_F4");
  EXPECT_EQ(toString(commAction(2, ActionKind::RecvB, 4, 3)), "2RECV_B4");
}

// Fields torch.distributed.pipelining's _Action.from_str gives: stage_index,
// computation_type, microbatch_index (None for REDUCE_GRAD); our peer is the
// adjacent stage torch implies.
TEST(ActionText, TorchStringsParseToTorchFields) {
  struct Case {
    const char* text;
    int32_t stage;
    ActionKind kind;
    int32_t microbatch;
    int32_t peer;
  };
  const std::vector<Case> cases = {
      {"2F0", 2, ActionKind::Forward, 0, -1},
      {"12B34", 12, ActionKind::FullBackward, 34, -1},
      {"0I7", 0, ActionKind::BackwardInput, 7, -1},
      {"3W1", 3, ActionKind::BackwardWeight, 1, -1},
      {"2SEND_F0", 2, ActionKind::SendF, 0, 3},
      {"1RECV_F0", 1, ActionKind::RecvF, 0, 0},
      {"2SEND_B5", 2, ActionKind::SendB, 5, 1},
      {"1RECV_B0", 1, ActionKind::RecvB, 0, 2},
      {"4REDUCE_GRAD", 4, ActionKind::ReduceGrad, -1, -1},
      {"4UNSHARD", 4, ActionKind::Unshard, -1, -1},
      {"0RESHARD", 0, ActionKind::Reshard, -1, -1},
      {" 2F0\t", 2, ActionKind::Forward, 0, -1},
      {"2147483647F2147483647", 2147483647, ActionKind::Forward, 2147483647, -1},
  };
  for (const Case& c : cases) {
    const Action a = parseAction(c.text);
    EXPECT_EQ(a.stage, c.stage) << c.text;
    EXPECT_EQ(a.kind, c.kind) << c.text;
    EXPECT_EQ(a.microbatch, c.microbatch) << c.text;
    EXPECT_EQ(a.peer_stage, c.peer) << c.text;
  }
}

TEST(ActionText, MalformedTokensThrowParseErrorNamingTheToken) {
  const std::vector<std::string> bad = {
      "", "F0", "0F", "0X1", "0F1x", "0REDUCE_GRAD3", "0UNSHARD3", "2RESHARD1", "99999999999F0", "2147483648F0",
      "0F99999999999", "0SEND_F1->0", "0RECV_F0", "0SEND_B0", "-1F0", "0F-1", "0F1->2",
      "0SEND_F1<-2", "0SEND_F1->", "1RECV_F1<-", "0send_f1", "0 F0", "0SEND_F"};
  for (const std::string& token : bad) {
    try {
      parseAction(token);
      ADD_FAILURE() << "'" << token << "' parsed";
    } catch (const ParseError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + token + "'"), std::string::npos)
          << "message '" << e.what() << "' does not name '" << token << "'";
    }
  }
}

TEST(ActionText, ParseErrorIsInvalidArgument) {
  EXPECT_THROW(parseAction("0X1"), std::invalid_argument);
}

// Random tokens either parse to an action that round-trips through its text,
// or throw ParseError; nothing else (no crash, no other exception).
TEST(ActionText, FuzzedTokensRoundTripOrThrowParseError) {
  std::mt19937 rng(20240601);
  const std::string alphabet = "0123456789FBIWSENDRCVUG_AFBW-><  \t";
  const std::vector<std::string> kinds = {"F", "B", "I", "W", "SEND_F", "RECV_F",
                                          "SEND_B", "RECV_B", "REDUCE_GRAD", "UNSHARD",
                                          "RESHARD"};
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto digits = [&](size_t max_len) {
    std::string s;
    for (size_t i = 0, n = pick(max_len + 1); i < n; ++i) s += static_cast<char>('0' + pick(10));
    return s;
  };

  int parsed = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string token;
    switch (iter % 4) {
      case 0:  // characters of the grammar, shuffled
        for (size_t i = 0, n = pick(16); i < n; ++i) token += alphabet[pick(alphabet.size())];
        break;
      case 1:  // random bytes, NUL included
        for (size_t i = 0, n = pick(16); i < n; ++i) token += static_cast<char>(pick(256));
        break;
      default: {  // near-valid: stage, kind, microbatch, maybe a peer, then a mutation
        token = digits(3) + kinds[pick(kinds.size())] + digits(3);
        if (pick(3) == 0) token += (pick(2) ? "->" : "<-") + digits(2);
        if (pick(2) == 0 && !token.empty()) {
          const size_t at = pick(token.size());
          token[at] = alphabet[pick(alphabet.size())];
        }
        if (pick(8) == 0) token = digits(12) + "F" + digits(12);  // int32 overflow
      }
    }
    try {
      const Action a = parseAction(token);
      ++parsed;
      const std::string text = toString(a);
      ASSERT_EQ(parseAction(text), a) << "token '" << token << "' printed as '" << text << "'";
    } catch (const ParseError&) {
      // Expected for malformed tokens.
    }
  }
  // The generator must exercise the success path, not only the errors.
  EXPECT_GT(parsed, 1000);
}

}  // namespace
}  // namespace mpmd
