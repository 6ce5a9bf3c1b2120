// ParseFlagArgument: one "--name=value" / "--name value" / "--bool" / "--nobool" argument of a
// command line, set into its absl flag. Shared by indexer-cli and indexer-bench, which parse
// their own command lines so that usage errors exit with status 2 (absl::ParseCommandLine exits
// with 1). Call from the main thread before other threads read the flags.
#pragma once

#include <functional>
#include <string>

#include "absl/flags/reflection.h"
#include "absl/status/statusor.h"

namespace indexer::client {

// argv[*i] starts with '-'. Finds the flag (accepted only when `is_ours` says so), takes its
// value from the argument or, for a non-bool flag without '=', from argv[*i + 1] (advancing *i),
// and sets it. Returns the flag's name, or INVALID_ARGUMENT naming the flag and the problem.
absl::StatusOr<std::string> ParseFlagArgument(
    int argc, char** argv, int* i,
    const std::function<bool(const absl::CommandLineFlag&)>& is_ours);

}  // namespace indexer::client
