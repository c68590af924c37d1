// Text and CSV forms of a schedule.
//
// Text form: one line per rank, `<rank>: <action> <action> ...`; blank lines
// and lines starting with '#' are ignored. A header comment
// `# schedule <name>` carries the name, and `# edge <producer> <consumer>`
// lines carry non-chain stage edges; both are written by toText.
//
// CSV form (torch.distributed.pipelining's): row r holds rank r's actions,
// one per cell; empty cells (idle slots in torch's tables) are skipped.
// Skip edges cannot be expressed in CSV: the chain is assumed.
#pragma once

#include <string>
#include <string_view>

#include "schedule.h"

namespace mpmd {

std::string toText(const Schedule& schedule);
std::string toCsv(const Schedule& schedule);

// Parse and infer the shape (see inferShape). Throw ParseError naming the
// token with its line and column on malformed input, never crash.
Schedule scheduleFromText(std::string_view text);
Schedule scheduleFromCsv(std::string_view csv);

}  // namespace mpmd
