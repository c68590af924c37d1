#include "schedule_io.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "errors.h"

namespace mpmd {

namespace {

// No valid action is anywhere near this long (three int32s and a kind name);
// longer tokens are rejected before parseAction so messages stay short.
constexpr size_t kMaxTokenLength = 256;

bool isBlank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }
bool isPrintable(char c) { return c >= 0x20 && c < 0x7f; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && isBlank(s.front())) s.remove_prefix(1);
  while (!s.empty() && isBlank(s.back())) s.remove_suffix(1);
  return s;
}

// Renders user text for an error message: non-printable bytes as \xNN (a NUL
// would otherwise cut what() short) and long text shortened.
std::string quoted(std::string_view s) {
  std::string out = "'";
  const size_t shown = std::min<size_t>(s.size(), 64);
  for (size_t i = 0; i < shown; ++i) {
    const char c = s[i];
    if (isPrintable(c)) {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    }
  }
  out += "'";
  if (shown < s.size()) out += fmt::format(" ({} characters, shown in part)", s.size());
  return out;
}

// Parses one action token; `where` ("line 3, column 12") prefixes any error.
Action parseToken(std::string_view token, const std::string& where) {
  if (token.size() > kMaxTokenLength) {
    throw ParseError(fmt::format("{}: invalid action {}: longer than any valid action", where,
                                 quoted(token)));
  }
  for (char c : token) {
    if (!isPrintable(c)) {
      throw ParseError(fmt::format("{}: invalid action {}: contains byte 0x{:02x}", where,
                                   quoted(token), static_cast<unsigned char>(c)));
    }
  }
  try {
    return parseAction(token);
  } catch (const ParseError& e) {
    throw ParseError(fmt::format("{}: {}", where, e.what()));
  }
}

// Reads a non-negative decimal number of at most 9 digits (so it fits int32)
// starting at `pos`; advances `pos`. Returns nullopt when there is none or it
// is too large.
std::optional<int> readSmallNumber(std::string_view s, size_t& pos) {
  size_t end = pos;
  while (end < s.size() && s[end] >= '0' && s[end] <= '9') ++end;
  if (end == pos || end - pos > 9) return std::nullopt;
  int value = 0;
  for (size_t i = pos; i < end; ++i) value = value * 10 + (s[i] - '0');
  pos = end;
  return value;
}

// Splits text into lines on '\n'; a final line without '\n' still counts, an
// empty remainder after the last '\n' does not.
std::vector<std::string_view> splitLines(std::string_view text) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string_view::npos) nl = text.size();
    lines.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

struct EdgeLine {
  StageEdge edge;
  size_t line;
};

// Handles a '#' line: `# schedule <name>`, `# edge <p> <c>`, else ignored.
void parseComment(std::string_view line, size_t line_no, std::string& name,
                  std::vector<EdgeLine>& edges) {
  std::string_view body = trim(line.substr(line.find('#') + 1));
  size_t word_end = 0;
  while (word_end < body.size() && !isBlank(body[word_end])) ++word_end;
  const std::string_view word = body.substr(0, word_end);
  const std::string_view rest = trim(body.substr(word_end));
  if (word == "schedule") {
    if (!rest.empty()) name = std::string(rest);
    return;
  }
  if (word != "edge") return;
  // Strict: a mistyped edge silently dropped would change the schedule.
  size_t pos = 0;
  std::optional<int> producer = readSmallNumber(rest, pos);
  const size_t after_producer = pos;
  while (pos < rest.size() && isBlank(rest[pos])) ++pos;
  std::optional<int> consumer =
      (pos > after_producer) ? readSmallNumber(rest, pos) : std::nullopt;
  if (!producer || !consumer || pos != rest.size()) {
    throw ParseError(fmt::format(
        "line {}: invalid edge line {}: expected '# edge <producer> <consumer>' with two stage "
        "indices",
        line_no, quoted(line)));
  }
  edges.push_back({{*producer, *consumer}, line_no});
}

// Checks the extra edges against the inferred stage count and installs the
// chain plus those edges (duplicates of chain edges dropped).
void applyEdges(Schedule& schedule, const std::vector<EdgeLine>& extra) {
  if (extra.empty()) return;
  std::vector<StageEdge> edges = chainEdges(schedule.num_stages);
  for (const EdgeLine& e : extra) {
    const auto [p, c] = e.edge;
    if (p >= schedule.num_stages || c >= schedule.num_stages) {
      throw ScheduleError(fmt::format("line {}: edge {} -> {} references stage {}, outside 0..{}",
                                      e.line, p, c, std::max(p, c), schedule.num_stages - 1));
    }
    if (p >= c) {
      throw ScheduleError(fmt::format(
          "line {}: edge {} -> {} must go from a lower stage to a higher one", e.line, p, c));
    }
    if (std::find(edges.begin(), edges.end(), e.edge) == edges.end()) edges.push_back(e.edge);
  }
  schedule.edges = std::move(edges);
}

// Names may not span lines in the text form.
std::string oneLine(const std::string& name) {
  std::string out = name;
  for (char& c : out)
    if (c == '\n' || c == '\r') c = ' ';
  return out;
}

bool needsQuoting(std::string_view cell) {
  return cell.find_first_of(",\"\r\n") != std::string_view::npos;
}

// RFC 4180 cell: quoted, with inner quotes doubled.
std::string csvCell(const std::string& cell) {
  if (!needsQuoting(cell)) return cell;
  std::string out = "\"";
  for (char c : cell) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string toText(const Schedule& schedule) {
  std::string out = fmt::format("# schedule {}\n", oneLine(schedule.name));
  const std::vector<StageEdge> chain = chainEdges(schedule.num_stages);
  for (const StageEdge& e : schedule.edges) {
    if (std::find(chain.begin(), chain.end(), e) == chain.end()) {
      out += fmt::format("# edge {} {}\n", e.producer, e.consumer);
    }
  }
  for (size_t r = 0; r < schedule.programs.size(); ++r) {
    out += fmt::format("{}:", r);
    for (const Action& a : schedule.programs[r]) {
      out += ' ';
      out += toString(a);
    }
    out += '\n';
  }
  return out;
}

std::string toCsv(const Schedule& schedule) {
  std::string out;
  for (const auto& program : schedule.programs) {
    for (size_t i = 0; i < program.size(); ++i) {
      if (i) out += ',';
      out += csvCell(toString(program[i]));
    }
    out += '\n';
  }
  return out;
}

Schedule scheduleFromText(std::string_view text) {
  Schedule schedule;
  std::vector<EdgeLine> extra_edges;
  std::vector<size_t> rank_lines;  // line number of each rank's row, for messages
  const std::vector<std::string_view> lines = splitLines(text);
  for (size_t i = 0; i < lines.size(); ++i) {
    const size_t line_no = i + 1;
    const std::string_view line = lines[i];
    const std::string_view content = trim(line);
    if (content.empty()) continue;
    if (content.front() == '#') {
      parseComment(line, line_no, schedule.name, extra_edges);
      continue;
    }

    // Rank prefix `<rank>:`.
    size_t pos = 0;
    while (pos < line.size() && isBlank(line[pos])) ++pos;
    const size_t prefix_col = pos + 1;
    std::optional<int> rank = readSmallNumber(line, pos);
    if (!rank || pos >= line.size() || line[pos] != ':') {
      throw ParseError(fmt::format(
          "line {}, column {}: expected a rank prefix '<rank>:' (e.g. '{}: 0F0 0B0'), got {}",
          line_no, prefix_col, rank_lines.size(), quoted(content)));
    }
    const size_t expected = rank_lines.size();
    if (static_cast<size_t>(*rank) != expected) {
      const std::string previous =
          expected == 0 ? std::string("it is the first rank line")
                        : fmt::format("rank {} was on line {}", expected - 1, rank_lines.back());
      throw ParseError(fmt::format(
          "line {}, column {}: rank {} where rank {} was expected (rank lines must be 0, 1, 2, "
          "... in order; {})",
          line_no, prefix_col, *rank, expected, previous));
    }
    ++pos;  // ':'
    rank_lines.push_back(line_no);

    std::vector<Action> program;
    while (pos < line.size()) {
      while (pos < line.size() && isBlank(line[pos])) ++pos;
      if (pos >= line.size()) break;
      const size_t start = pos;
      while (pos < line.size() && !isBlank(line[pos])) ++pos;
      program.push_back(parseToken(line.substr(start, pos - start),
                                   fmt::format("line {}, column {}", line_no, start + 1)));
    }
    schedule.programs.push_back(std::move(program));
  }
  if (schedule.programs.empty()) {
    throw ParseError("schedule text has no rank lines ('<rank>: <action> ...')");
  }
  inferShape(schedule);
  applyEdges(schedule, extra_edges);
  return schedule;
}

Schedule scheduleFromCsv(std::string_view csv) {
  Schedule schedule;
  std::vector<Action> row;
  size_t row_index = 0;  // 0-based, equal to the rank
  size_t column = 0;     // 0-based cell index within the row
  size_t pos = 0;
  size_t row_start = 0;  // byte where the current row began
  std::string cell;

  auto finishCell = [&] {
    const std::string_view content = trim(cell);
    // Empty cells are torch's idle slots (None); skip them.
    if (!content.empty()) {
      row.push_back(parseToken(content, fmt::format("row {} (rank {}), column {}", row_index + 1,
                                                    row_index, column + 1)));
    }
    cell.clear();
    ++column;
  };
  auto finishRow = [&] {
    finishCell();
    schedule.programs.push_back(std::move(row));
    row.clear();
    ++row_index;
    column = 0;
    row_start = pos;
  };

  while (pos < csv.size()) {
    const char c = csv[pos];
    if (c == '"' && trim(cell).empty()) {
      // Quoted cell (RFC 4180): runs to the closing quote, "" is a literal quote.
      const size_t open = pos++;
      cell.clear();
      bool closed = false;
      while (pos < csv.size()) {
        if (csv[pos] == '"') {
          if (pos + 1 < csv.size() && csv[pos + 1] == '"') {
            cell += '"';
            pos += 2;
            continue;
          }
          ++pos;
          closed = true;
          break;
        }
        cell += csv[pos++];
      }
      if (!closed) {
        throw ParseError(fmt::format(
            "row {} (rank {}), column {}: quoted cell opened at byte {} is never closed",
            row_index + 1, row_index, column + 1, open));
      }
      // Only blanks may follow the closing quote before the separator.
      while (pos < csv.size() && isBlank(csv[pos])) ++pos;
      if (pos < csv.size() && csv[pos] != ',' && csv[pos] != '\n') {
        throw ParseError(fmt::format(
            "row {} (rank {}), column {}: unexpected {} after a quoted cell", row_index + 1,
            row_index, column + 1, quoted(csv.substr(pos, 1))));
      }
      continue;
    }
    ++pos;
    if (c == ',') {
      finishCell();
    } else if (c == '\n') {
      finishRow();  // '\r' of "\r\n" is trimmed as a blank
    } else {
      cell += c;
    }
  }
  // A last row without its newline; an empty remainder after the final
  // newline is no row (torch's csv.reader agrees).
  if (row_start < csv.size()) finishRow();

  if (schedule.programs.empty()) throw ParseError("schedule CSV has no rows");
  inferShape(schedule);
  return schedule;
}

}  // namespace mpmd
