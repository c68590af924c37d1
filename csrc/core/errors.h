// Error types of the core library.
//
// NOTE [Error mapping]: the pybind layer relies on the standard hierarchy:
// std::invalid_argument (ParseError, ScheduleError) surfaces in Python as
// ValueError, std::runtime_error (DeadlockError) as RuntimeError. Every message
// names the offending values so a user can fix the input without a debugger.
#pragma once

#include <stdexcept>
#include <string>

namespace mpmd {

// Malformed text: an action token, a schedule table or a CSV cell. The
// message names the token and its position (rank row / column or offset).
class ParseError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Parameters that no schedule can satisfy (num_microbatches=3 < num_ranks=4),
// or a schedule that breaks a schedule invariant (validate.h).
class ScheduleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The simulator found ranks that wait on each other forever. The message
// lists every blocked rank with the action it is stuck on.
class DeadlockError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace mpmd
