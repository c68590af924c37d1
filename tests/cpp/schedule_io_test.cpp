// Text and CSV forms of schedules: round trips, torch-style tables, errors
// naming their position, fuzzed tables, and the memory a 20,000-rank text
// takes to load and lower (counted by the global operator new below).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/action.h"
#include "core/errors.h"
#include "core/schedule.h"
#include "core/schedule_io.h"
#include "core/lowering.h"
#include "core/transfer_index.h"
#include "core/validate.h"

// NOTE [Counted allocations]: this test binary replaces the global (not
// over-aligned) operator new/delete with ones that keep the number of bytes
// live and its peak, so a test can bound the memory a call allocates
// portably. Each block carries its size in a header of the default new
// alignment, which the returned pointer keeps. Over-aligned new/delete are
// left to the library (they pair with each other).
namespace mpmd::testing {

std::atomic<int64_t> live_bytes{0}, peak_bytes{0};

void* countedNew(std::size_t n) {
  constexpr std::size_t kHeader = __STDCPP_DEFAULT_NEW_ALIGNMENT__;
  void* block = std::malloc(n + kHeader);
  if (block == nullptr) throw std::bad_alloc();
  *static_cast<std::size_t*>(block) = n;
  const int64_t now = live_bytes.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return static_cast<char*>(block) + kHeader;
}

void countedDelete(void* p) noexcept {
  if (p == nullptr) return;
  constexpr std::size_t kHeader = __STDCPP_DEFAULT_NEW_ALIGNMENT__;
  char* block = static_cast<char*>(p) - kHeader;
  live_bytes.fetch_sub(static_cast<int64_t>(*reinterpret_cast<std::size_t*>(block)));
  std::free(block);
}

// The peak of live bytes while f runs, above what was live when it began.
template <typename F>
int64_t peakBytesOf(F&& f) {
  const int64_t before = live_bytes.load();
  peak_bytes.store(before);
  f();
  return peak_bytes.load() - before;
}

}  // namespace mpmd::testing

void* operator new(std::size_t n) { return mpmd::testing::countedNew(n); }
void* operator new[](std::size_t n) { return mpmd::testing::countedNew(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return mpmd::testing::countedNew(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return operator new(n, std::nothrow);
}
void operator delete(void* p) noexcept { mpmd::testing::countedDelete(p); }
void operator delete[](void* p) noexcept { mpmd::testing::countedDelete(p); }
void operator delete(void* p, std::size_t) noexcept { mpmd::testing::countedDelete(p); }
void operator delete[](void* p, std::size_t) noexcept { mpmd::testing::countedDelete(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { mpmd::testing::countedDelete(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  mpmd::testing::countedDelete(p);
}

namespace mpmd {
namespace {

using K = ActionKind;

void expectSameSchedule(const Schedule& a, const Schedule& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.num_ranks, b.num_ranks);
  EXPECT_EQ(a.num_stages, b.num_stages);
  EXPECT_EQ(a.num_microbatches, b.num_microbatches);
  EXPECT_EQ(a.stage_to_rank, b.stage_to_rank);
  EXPECT_EQ(a.edges, b.edges);
  EXPECT_EQ(a.programs, b.programs);
}

// GPipe on 2 ranks, 2 microbatches, one stage per rank, compute only.
Schedule gpipe2x2() {
  Schedule s = makeEmptySchedule("gpipe", 2, 2, {0, 1});
  for (int r = 0; r < 2; ++r) {
    for (int mb = 0; mb < 2; ++mb) s.programs[r].push_back(computeAction(r, K::Forward, mb));
    for (int mb = 0; mb < 2; ++mb) s.programs[r].push_back(computeAction(r, K::FullBackward, mb));
  }
  return s;
}

// Lowered-looking: 4 stages looped over 2 ranks, one microbatch, a skip edge
// 0->3 with its own transfers, REDUCE_GRAD per stage.
Schedule loweredWithSkip() {
  Schedule s = makeEmptySchedule("lowered-skip", 2, 1, {0, 1, 0, 1});
  s.edges.push_back({0, 3});
  auto& r0 = s.programs[0];
  r0 = {computeAction(0, K::Forward, 0),     commAction(0, K::SendF, 0, 1),
        commAction(0, K::SendF, 0, 3),       commAction(2, K::RecvF, 0, 1),
        computeAction(2, K::Forward, 0),     commAction(2, K::SendF, 0, 3),
        commAction(2, K::RecvB, 0, 3),       computeAction(2, K::BackwardInput, 0),
        commAction(2, K::SendB, 0, 1),       computeAction(2, K::BackwardWeight, 0),
        reduceGradAction(2),                 commAction(0, K::RecvB, 0, 1),
        commAction(0, K::RecvB, 0, 3),       computeAction(0, K::FullBackward, 0),
        reduceGradAction(0)};
  auto& r1 = s.programs[1];
  r1 = {commAction(1, K::RecvF, 0, 0),       computeAction(1, K::Forward, 0),
        commAction(1, K::SendF, 0, 2),       commAction(3, K::RecvF, 0, 2),
        commAction(3, K::RecvF, 0, 0),       computeAction(3, K::Forward, 0),
        computeAction(3, K::FullBackward, 0), commAction(3, K::SendB, 0, 2),
        commAction(3, K::SendB, 0, 0),       reduceGradAction(3),
        commAction(1, K::RecvB, 0, 2),       computeAction(1, K::FullBackward, 0),
        commAction(1, K::SendB, 0, 0),       reduceGradAction(1)};
  return s;
}

// Runs f and returns the message of the E it throws ("" and a failure if none).
template <typename E, typename F>
std::string messageOf(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(ScheduleText, RoundTripsComputeOnlySchedule) {
  const Schedule s = gpipe2x2();
  expectSameSchedule(scheduleFromText(toText(s)), s);
}

TEST(ScheduleText, RoundTripsLoweredScheduleWithSkipEdge) {
  const Schedule s = loweredWithSkip();
  const std::string text = toText(s);
  EXPECT_TRUE(contains(text, "# edge 0 3\n")) << text;
  EXPECT_TRUE(contains(text, " 0SEND_F0->3 ")) << text;
  EXPECT_TRUE(contains(text, " 3RECV_F0<-0 ")) << text;
  const Schedule back = scheduleFromText(text);
  expectSameSchedule(back, s);
  EXPECT_TRUE(back.isLowered());
}

TEST(ScheduleText, WritesHeaderChainFreeEdgesAndEmptyRankLines) {
  Schedule s = makeEmptySchedule("tiny", 3, 1, {0, 1, 2});
  s.programs[0] = {computeAction(0, K::Forward, 0), computeAction(0, K::FullBackward, 0)};
  EXPECT_EQ(toText(s), "# schedule tiny\n0: 0F0 0B0\n1:\n2:\n");
}

TEST(ScheduleText, LoadsHandWrittenTableWithCommentsAndBlankLines) {
  const Schedule s = scheduleFromText(
      "# schedule interleaved\r\n"
      "# any other comment is ignored\n"
      "\n"
      "0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\r\n"
      "  1:\t1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1   \n");
  EXPECT_EQ(s.name, "interleaved");
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.num_stages, 4);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(s.edges, chainEdges(4));
  EXPECT_EQ(s.programs[1].front(), computeAction(1, K::Forward, 0));
}

TEST(ScheduleText, NameDefaultsToCustom) {
  EXPECT_EQ(scheduleFromText("0: 0F0 0B0\n").name, "custom");
}

TEST(ScheduleText, MalformedActionNamesLineAndColumn) {
  const std::string msg =
      messageOf<ParseError>([] { scheduleFromText("# schedule x\n0: 0F0\n1: 1F0 0X1\n"); });
  EXPECT_TRUE(contains(msg, "line 3, column 8")) << msg;
  EXPECT_TRUE(contains(msg, "'0X1'")) << msg;
}

TEST(ScheduleText, RanksOutOfOrderNameTheLines) {
  const std::string msg = messageOf<ParseError>([] { scheduleFromText("0: 0F0\n\n2: 1F0\n"); });
  EXPECT_TRUE(contains(msg, "line 3")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 was expected")) << msg;
  EXPECT_TRUE(contains(msg, "line 1")) << msg;
  EXPECT_TRUE(contains(messageOf<ParseError>([] { scheduleFromText("1: 0F0\n"); }), "line 1"));
}

TEST(ScheduleText, MissingRankPrefixIsParseError) {
  for (const char* text : {"0F0 0B0\n", "0 0F0\n", ":0F0\n", "99999999999: 0F0\n"}) {
    const std::string msg = messageOf<ParseError>([&] { scheduleFromText(text); });
    EXPECT_TRUE(contains(msg, "line 1, column 1")) << msg;
  }
}

TEST(ScheduleText, BadEdgeLinesAreRejected) {
  EXPECT_TRUE(contains(messageOf<ParseError>([] { scheduleFromText("# edge 0\n0: 0F0 1F0\n"); }),
                       "line 1"));
  EXPECT_TRUE(contains(
      messageOf<ParseError>([] { scheduleFromText("# edge 0 x\n0: 0F0 1F0\n"); }), "line 1"));
  std::string msg =
      messageOf<ScheduleError>([] { scheduleFromText("# edge 0 9\n0: 0F0\n1: 1F0\n"); });
  EXPECT_TRUE(contains(msg, "edge 0 -> 9")) << msg;
  msg = messageOf<ScheduleError>([] { scheduleFromText("# edge 1 0\n0: 0F0\n1: 1F0\n"); });
  EXPECT_TRUE(contains(msg, "edge 1 -> 0")) << msg;
  msg = messageOf<ScheduleError>([] { scheduleFromText("# edge 1 1\n0: 0F0\n1: 1F0\n"); });
  EXPECT_TRUE(contains(msg, "edge 1 -> 1")) << msg;
}

TEST(ScheduleText, ChainEdgeLinesAreNotDuplicated) {
  const Schedule s = scheduleFromText("# edge 0 1\n# edge 0 2\n0: 0F0 2F0\n1: 1F0\n");
  EXPECT_EQ(s.edges, (std::vector<StageEdge>{{0, 1}, {1, 2}, {0, 2}}));
}

TEST(ScheduleCsv, RoundTripsComputeOnlyAndLoweredSchedules) {
  const Schedule gpipe = gpipe2x2();
  EXPECT_EQ(toCsv(gpipe), "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n");
  Schedule back = scheduleFromCsv(toCsv(gpipe));
  back.name = gpipe.name;  // CSV carries no name
  expectSameSchedule(back, gpipe);

  // CSV has no edges: the chain is assumed, everything else round-trips.
  const Schedule lowered = loweredWithSkip();
  back = scheduleFromCsv(toCsv(lowered));
  EXPECT_EQ(back.programs, lowered.programs);
  EXPECT_EQ(back.stage_to_rank, lowered.stage_to_rank);
  EXPECT_EQ(back.edges, chainEdges(4));
}

TEST(ScheduleCsv, RoundTripsShardedSchedulesInTorchsNames) {
  LowerOptions options;
  options.shard = true;
  const Schedule sharded = lower(gpipe2x2(), options);
  const std::string csv = toCsv(sharded);
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0RESHARD,0REDUCE_GRAD");
  Schedule back = scheduleFromCsv(csv);
  back.name = sharded.name;
  expectSameSchedule(back, sharded);
  back = scheduleFromText(toText(sharded));
  expectSameSchedule(back, sharded);
  // A stage known only from its collectives still has its rank.
  EXPECT_EQ(scheduleFromCsv("0UNSHARD,0F0,0B0,0RESHARD\n1UNSHARD,1F0,1B0,1RESHARD\n").stage_to_rank,
            (std::vector<int>{0, 1}));
}

TEST(ScheduleCsv, SkipsEmptyCells) {
  const Schedule s = scheduleFromCsv("0F0,,0B0,\n,1F0,1B0\n");
  EXPECT_EQ(s.programs[0], (std::vector<Action>{computeAction(0, K::Forward, 0),
                                                computeAction(0, K::FullBackward, 0)}));
  EXPECT_EQ(s.programs[1].size(), 2u);
}

// What torch's _dump_csv writes (csv.writer: "\r\n" rows, None as an empty
// cell) for interleaved 1F1B, 2 ranks, 4 stages, 2 microbatches.
TEST(ScheduleCsv, LoadsTorchStyleTable) {
  const Schedule s = scheduleFromCsv(
      "0F0,0F1,2F0,,2F1,2B0,,2B1,0B0,,0B1\r\n"
      ",1F0,1F1,3F0,3B0,3F1,3B1,,1B0,1B1,\r\n");
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.num_stages, 4);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(s.programs[0].size(), 8u);
  EXPECT_EQ(s.programs[1].size(), 8u);
  EXPECT_EQ(s.programs[1][2], computeAction(3, K::Forward, 0));
}

TEST(ScheduleCsv, ReadsQuotedCellsAndRowsWithoutFinalNewline) {
  const Schedule s = scheduleFromCsv("\"0F0\",\"0B0\"\n1F0,\"1B0\"");
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.programs[1].back(), computeAction(1, K::FullBackward, 0));
}

TEST(ScheduleCsv, EmptyRowIsARankWithoutActions) {
  const Schedule s = scheduleFromCsv("0F0,1F0,1B0,0B0\n\n");
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_TRUE(s.programs[1].empty());
}

TEST(ScheduleCsv, MalformedCellNamesRowAndColumn) {
  std::string msg = messageOf<ParseError>([] { scheduleFromCsv("0F0,0B0\n1F0,,junk\n"); });
  EXPECT_TRUE(contains(msg, "row 2 (rank 1), column 3")) << msg;
  EXPECT_TRUE(contains(msg, "'junk'")) << msg;
  msg = messageOf<ParseError>([] { scheduleFromCsv("0F0,\"0B0\n"); });
  EXPECT_TRUE(contains(msg, "row 1 (rank 0), column 2")) << msg;
  msg = messageOf<ParseError>([] { scheduleFromCsv("0F0,\"0B0\"x\n"); });
  EXPECT_TRUE(contains(msg, "row 1 (rank 0), column 2")) << msg;
}

TEST(ScheduleIo, StageComputedOnTwoRanksIsScheduleError) {
  std::string msg = messageOf<ScheduleError>([] { scheduleFromText("0: 0F0 1F0\n1: 1B0\n"); });
  EXPECT_TRUE(contains(msg, "stage 1")) << msg;
  msg = messageOf<ScheduleError>([] { scheduleFromCsv("0F0,1F0\n1B0\n"); });
  EXPECT_TRUE(contains(msg, "stage 1")) << msg;
}

TEST(ScheduleIo, EmptyInputIsRejected) {
  EXPECT_THROW(scheduleFromText(""), ParseError);
  EXPECT_THROW(scheduleFromText("# schedule nothing\n\n"), ParseError);
  EXPECT_THROW(scheduleFromCsv(""), ParseError);
  EXPECT_THROW(scheduleFromText("0:\n1:\n"), ScheduleError);
  EXPECT_THROW(scheduleFromCsv(",,\n\n"), ScheduleError);
}

TEST(ScheduleIo, AbsurdIndicesNulBytesAndLongLinesAreHandled) {
  EXPECT_THROW(scheduleFromText("0: 0F0 0F2000000000\n"), ScheduleError);
  EXPECT_THROW(scheduleFromCsv("0F0,2000000000F0\n"), ScheduleError);
  EXPECT_THROW(scheduleFromText("0: 0F99999999999\n"), ParseError);

  const std::string with_nul("0: 0F0 0B\0 0B0\n", 15);
  const std::string msg = messageOf<ParseError>([&] { scheduleFromText(with_nul); });
  EXPECT_TRUE(contains(msg, "line 1, column 8")) << msg;
  EXPECT_TRUE(contains(msg, "\\x00")) << msg;
  EXPECT_THROW(scheduleFromCsv(std::string("0F0,\0\n", 6)), ParseError);

  const std::string long_token = "0: 0F" + std::string(100000, '1') + "\n";
  EXPECT_THROW(scheduleFromText(long_token), ParseError);
  std::string long_line = "0:";
  for (int i = 0; i < 50000; ++i) long_line += " 0F0";
  EXPECT_EQ(scheduleFromText(long_line).programs[0].size(), 50000u);
}

// Random tables of valid and invalid tokens, in both forms: each either loads
// (and then round-trips) or throws std::invalid_argument; never anything else.
TEST(ScheduleIo, FuzzedTablesLoadOrThrowInvalidArgument) {
  std::mt19937 rng(7);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const std::vector<std::string> kinds = {"F", "B", "I", "W", "SEND_F", "RECV_F",
                                          "SEND_B", "RECV_B", "REDUCE_GRAD", "UNSHARD", "RESHARD"};
  const std::string noise = "0123456789FB,:#\"\n\r\t -<>x";
  auto token = [&]() -> std::string {
    switch (pick(10)) {
      case 0: {
        std::string s;
        for (size_t i = 0, n = pick(6); i < n; ++i) s += noise[pick(noise.size())];
        return s;
      }
      case 1: return std::string(1, static_cast<char>(pick(256)));
      case 2: return "";
      default: {
        const size_t kind = pick(3) ? pick(2) : pick(kinds.size());  // mostly F and B
        std::string s = std::to_string(pick(4)) + kinds[kind];
        if (kind < 8) s += std::to_string(pick(3));  // the stage collectives take no microbatch
        if (kind >= 4 && pick(4) == 0) s += (kind % 2 ? "<-" : "->") + std::to_string(pick(4));
        return s;
      }
    }
  };

  int loaded = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const size_t rows = pick(5);
    std::string text = pick(4) == 0 ? "# schedule fuzz\n# edge " + std::to_string(pick(4)) + " " +
                                          std::to_string(pick(5)) + "\n"
                                    : "";
    std::string csv;
    for (size_t r = 0; r < rows; ++r) {
      text += std::to_string(pick(8) == 0 ? pick(5) : r) + ":";
      for (size_t c = 0, n = pick(8); c < n; ++c) {
        const std::string t = token();
        text += " " + t;
        csv += (c ? "," : "") + t;
      }
      text += "\n";
      csv += "\n";
    }
    try {
      const Schedule s = scheduleFromText(text);
      ++loaded;
      expectSameSchedule(scheduleFromText(toText(s)), s);
    } catch (const std::invalid_argument&) {
    }
    try {
      const Schedule s = scheduleFromCsv(csv);
      ++loaded;
      EXPECT_EQ(scheduleFromCsv(toCsv(s)).programs, s.programs);
    } catch (const std::invalid_argument&) {
    }
    if (HasFailure()) FAIL() << "text:\n" << text << "\ncsv:\n" << csv;
  }
  EXPECT_GT(loaded, 50);
}

// A chain of `ranks` stages, one per rank, one microbatch: each rank's line
// holds its F and B and, when `lowered`, the transfers to its neighbours.
Schedule wideChain(int ranks, bool lowered) {
  std::vector<int> placement(ranks);
  for (int r = 0; r < ranks; ++r) placement[r] = r;
  Schedule s = makeEmptySchedule("wide", ranks, 1, placement);
  for (int r = 0; r < ranks; ++r) {
    auto& p = s.programs[r];
    if (lowered && r > 0) p.push_back(commAction(r, K::RecvF, 0, r - 1));
    p.push_back(computeAction(r, K::Forward, 0));
    if (lowered && r + 1 < ranks) p.push_back(commAction(r, K::SendF, 0, r + 1));
    if (lowered && r + 1 < ranks) p.push_back(commAction(r, K::RecvB, 0, r + 1));
    p.push_back(computeAction(r, K::FullBackward, 0));
    if (lowered && r > 0) p.push_back(commAction(r, K::SendB, 0, r - 1));
  }
  return s;
}

// Loading (parse, then the static checks Schedule.from_text runs) a text of
// 20,000 one-line ranks allocates memory linear in the text: two dense
// rank x rank tables of transfer counters in validation once made it 3.2 GB
// for 430 KB. The bound, 64 bytes per byte of text, holds the parsed
// programs (16-byte actions for 5-10 text bytes each), the per-stage and
// per-transfer tables of validation, and vector slack; the quadratic tables
// would be ~7,000 bytes per byte of text here.
TEST(ScheduleIo, LoadingTwentyThousandOneLineRanksTakesMemoryLinearInTheText) {
  constexpr int kRanks = 20000;
  constexpr int64_t kBytesPerTextByte = 64;
  for (bool lowered : {false, true}) {
    SCOPED_TRACE(lowered ? "lowered" : "compute only");
    const std::string text = toText(wideChain(kRanks, lowered));
    Schedule loaded;
    const int64_t peak = testing::peakBytesOf([&] {
      loaded = scheduleFromText(text);
      validateStatic(loaded);
    });
    EXPECT_EQ(loaded.num_ranks, kRanks);
    EXPECT_EQ(loaded.num_stages, kRanks);
    EXPECT_EQ(loaded.programs.back().size(), lowered ? 4u : 2u);
    EXPECT_LE(peak, kBytesPerTextByte * static_cast<int64_t>(text.size()))
        << peak << " bytes at peak for " << text.size() << " bytes of text";
    // Each rank's program holds its own actions only.
    size_t capacity = 0;
    for (const auto& program : loaded.programs) capacity += program.capacity();
    EXPECT_LE(capacity, 2 * loaded.numActions());
  }
}

// One line per rank, two microbatches: rank r runs "rF0 rF1 rB0 rB1", or,
// when `swapped` holds for it, its forwards in the other order. A swapped
// rank next to an unswapped one makes orderChannels rewrite the sends
// between them (the path that builds the receive order).
std::string twoMicrobatchChainText(int ranks, bool (*swapped)(int)) {
  std::string text;
  for (int r = 0; r < ranks; ++r) {
    const std::string st = std::to_string(r);
    const bool swap = swapped(r);
    text += st + ": " + st + (swap ? "F1 " : "F0 ") + st + (swap ? "F0 " : "F1 ") + st + "B0 " + st + "B1\n";
  }
  return text;
}

// Loading, lowering and fully validating (static checks, lowering again,
// simulation) 20,000 one-line ranks allocates memory linear in the text.
// Lowering's receive order and its per-channel counters were once dense
// rank x rank tables (3.2 GB and 6.4 GB at peak here, NOTE [Sparse
// channels]); the bound, 64 bytes per byte of text (23 and 33 measured),
// holds the lowered programs (13 actions of 16 bytes per 36-byte line), the
// transfer tables and vector slack.
TEST(ScheduleIo, LoweringTwentyThousandOneLineRanksTakesMemoryLinearInTheText) {
  constexpr int kRanks = 20000;
  constexpr int64_t kBytesPerTextByte = 64;
  const std::pair<const char*, bool (*)(int)> cases[] = {
      {"channels already in order", [](int) { return false; }},
      {"every other rank swaps its forwards", [](int r) { return r % 2 == 0; }},
  };
  for (const auto& [label, swapped] : cases) {
    SCOPED_TRACE(label);
    const std::string text = twoMicrobatchChainText(kRanks, swapped);
    Schedule lowered;
    const int64_t peak = testing::peakBytesOf([&] {
      const Schedule loaded = scheduleFromText(text);
      validateStatic(loaded);
      lowered = lower(loaded);
      validate(loaded);
    });
    EXPECT_NO_THROW(validateStatic(lowered));
    EXPECT_EQ(lowered.num_ranks, kRanks);
    // RECV_F, F, F, SEND_F x2, RECV_B, B, RECV_B, B, SEND_B x2, REDUCE_GRAD in the middle.
    EXPECT_EQ(lowered.programs[kRanks / 2].size(), 13u);
    EXPECT_LE(peak, kBytesPerTextByte * static_cast<int64_t>(text.size()))
        << peak << " bytes at peak for " << text.size() << " bytes of text";
  }
}

TEST(ScheduleIo, ReceiveOrderStoresOnlyTheChannelsThatOccur) {
  // A chain of 20,000 ranks has 2 x 19,999 directed channels with traffic,
  // out of 400 million rank pairs.
  constexpr int kRanks = 20000;
  const Schedule lowered = lower(scheduleFromText(twoMicrobatchChainText(kRanks, [](int r) {
    return r % 2 == 0;
  })));
  const TransferIndex index(lowered);
  const ChannelOrder order = receiveOrder(lowered, index);
  EXPECT_EQ(order.numChannels(), 2u * (kRanks - 1));
  EXPECT_EQ(order.first_channel.size(), static_cast<size_t>(kRanks) + 1);
  EXPECT_EQ(order.offsets.size(), order.numChannels() + 1);
  EXPECT_EQ(order.slots.size(), 4u * (kRanks - 1));  // 2 microbatches x (activation + gradient)
  // Rank 7 receives activations from 6 in its own order (microbatch 0 first,
  // though 6 produces 1 first) and gradients from 8; nothing from 9.
  const size_t from6 = order.channel(6, 7), from8 = order.channel(8, 7);
  ASSERT_NE(from6, ChannelOrder::kNoChannel);
  ASSERT_NE(from8, ChannelOrder::kNoChannel);
  EXPECT_EQ(order.channel(9, 7), ChannelOrder::kNoChannel);
  EXPECT_EQ(order.channel(7, 7), ChannelOrder::kNoChannel);
  EXPECT_EQ(index.recvOf(order.slots[order.offsets[from6]]), commAction(7, ActionKind::RecvF, 0, 6));
  EXPECT_EQ(order.offsets[from8 + 1] - order.offsets[from8], 2);
}

TEST(ScheduleIo, CountedAllocationsSeeAQuadraticTable) {
  // The measurement itself: a rank x rank table of 4-byte counters for 2,000
  // ranks shows as at least its 16 MB.
  const int64_t peak = testing::peakBytesOf([] {
    std::vector<uint32_t> table(size_t{2000} * 2000, 0);
    EXPECT_EQ(table.size(), 4000000u);
  });
  EXPECT_GE(peak, int64_t{16000000});
}

}  // namespace
}  // namespace mpmd
