// The command-line parsing every indexer program shares (indexer-server, indexer-cli,
// indexer-bench, indexer-echo-server), so that they agree on what a usage error is and how it
// ends: flags as --name=value, --name value, --bool or --nobool anywhere on the line, "--" ends
// the flags, and an unknown flag, a value that does not parse or a stray argument is a usage
// error, exit status kUsageExit. (absl::ParseCommandLine would exit 1, the status the programs
// give to failures at run time, and print the build's paths in its help.)
//
// Call from the main thread before other threads read the flags.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::flags {

// Every indexer program's exit status for a usage error: an unknown flag or argument, a value
// that does not parse, or one its checks refuse.
inline constexpr int kUsageExit = 2;

// Which flags a program accepts (absl registers every linked library's flags).
using FlagFilter = std::function<bool(const absl::CommandLineFlag&)>;

struct CommandLine {
  std::vector<std::string> set;         // the flags set, in order (a flag given twice: twice)
  std::vector<std::string> positional;  // arguments that are not flags, and all after "--"
  bool help = false;                    // -h, --help, --helpfull or --helpshort was given
  bool version = false;                 // --version was given
};

// Sets every flag of argv[1..argc) that `is_ours` accepts. INVALID_ARGUMENT naming the flag and
// the problem for an unknown flag, a missing value or one that does not parse.
absl::StatusOr<CommandLine> ParseCommandLine(int argc, char** argv, const FlagFilter& is_ours);

// Prints "program: message" and where to find the usage to stderr; returns kUsageExit.
int ReportUsageError(absl::string_view program, absl::string_view message);

// The flags `is_ours` accepts, sorted by name, as --help lists them: "  --name (default: v)"
// and the flag's help on the next line, indented.
std::string FlagList(const FlagFilter& is_ours);

// The project's version (CMake's PROJECT_VERSION), what every program's --version prints.
const char* ProgramVersion();

// A flag accepted when it is defined in a file whose path contains `file_part`
// ("client/bench/", "server/").
FlagFilter FlagsDefinedIn(std::string file_part);

}  // namespace indexer::flags
