// Child processes for the tests that run the real binaries (indexer-server, indexer-cli,
// indexer-bench, indexer-echo-server): started with fork/execve, stdout and stderr in one log
// file, killed if still running when the Child goes away; and the server binary started on a
// loopback port. Test-only code.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/testing/files.h"

namespace indexer::testing {

// A child process whose stdout and stderr go to a log file.
class Child {
 public:
  // `env` is added to this process's environment. The child starts with no signal blocked.
  explicit Child(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ~Child();  // SIGKILLs the child if it still runs
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // The exit code once it exits within `timeout` (-signal when killed by one); nullopt if not.
  std::optional<int> Wait(absl::Duration timeout);
  std::string Log() const;
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> status_;
};

// The port a server child (indexer-server or indexer-echo-server started with
// --listen=127.0.0.1:0) prints in its "serving on port N" line, once it does within `timeout`;
// nullopt if it exits or times out first (its Log() says why).
std::optional<int> WaitForServingPort(Child& child, absl::Duration timeout);

// Runs a binary to its end (at most a minute): exit code (-1000 if it did not end) and output.
struct RunResult {
  int code = -1;
  std::string output;
};
RunResult RunToEnd(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});

// Starts indexer-server ($INDEXER_SERVER_BINARY) with --listen=127.0.0.1:0 --device=cpu and
// `flags`, and waits for its "serving on port" line; nullptr (and a test failure) when it does
// not start.
std::unique_ptr<Child> StartServerBinary(const std::vector<std::string>& flags, int* port);

}  // namespace indexer::testing
