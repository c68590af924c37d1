// Helpers shared by the core tests: build schedules from action strings and
// print them back, without going through the text/CSV readers under test.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/action.h"
#include "core/schedule.h"

namespace mpmd::testing {

// The message of the E that fn throws; "" when it throws nothing (another
// exception type propagates and fails the test).
template <typename E = std::exception>
std::string whatOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// rows[r] is rank r's program as space-separated actions, e.g. "0F0 0F1 0B0".
inline Schedule scheduleFromRows(std::vector<int> placement, int num_microbatches,
                                 const std::vector<std::string>& rows,
                                 std::vector<StageEdge> edges = {}) {
  Schedule s = makeEmptySchedule("test", static_cast<int>(rows.size()), num_microbatches,
                                 std::move(placement));
  if (!edges.empty()) s.edges = std::move(edges);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::istringstream in(rows[r]);
    std::string token;
    while (in >> token) s.programs[r].push_back(parseAction(token));
  }
  return s;
}

inline std::string rowOf(const Schedule& s, int rank) {
  std::string out;
  for (const Action& a : s.programs[rank]) {
    if (!out.empty()) out += ' ';
    out += toString(a);
  }
  return out;
}

inline std::vector<std::string> rowsOf(const Schedule& s) {
  std::vector<std::string> rows;
  for (int r = 0; r < s.num_ranks; ++r) rows.push_back(rowOf(s, r));
  return rows;
}

// Runs f, expects std::invalid_argument, returns its message.
template <class F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

}  // namespace mpmd::testing
