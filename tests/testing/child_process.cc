#include "tests/testing/child_process.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>

#include "absl/time/clock.h"

extern char** environ;

namespace indexer::testing {

Child::Child(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
  char name[] = "/tmp/indexer-test-child-XXXXXX";
  const int fd = mkstemp(name);
  log_path_ = name;
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& e : extra_env) env.push_back(e);
  std::vector<char*> args, envp;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(fd);
}

Child::~Child() {
  if (pid_ > 0 && !status_) {
    kill(pid_, SIGKILL);
    int s = 0;
    waitpid(pid_, &s, 0);
  }
  unlink(log_path_.c_str());
}

std::optional<int> Child::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!status_) {
    int s = 0;
    if (waitpid(pid_, &s, WNOHANG) == pid_) {
      status_ = WIFEXITED(s) ? WEXITSTATUS(s) : -WTERMSIG(s);
      break;
    }
    if (absl::Now() > deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return status_;
}

std::string Child::Log() const { return ReadFile(log_path_); }

std::optional<int> WaitForServingPort(Child& child, absl::Duration timeout) {
  const std::regex serving("serving on port ([0-9]+)");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const std::string log = child.Log();
    std::smatch m;
    if (std::regex_search(log, m, serving)) return std::stoi(m[1]);
    if (child.Wait(absl::ZeroDuration()) || absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

RunResult RunToEnd(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  Child child(argv, env);
  RunResult r;
  r.code = child.Wait(absl::Seconds(60)).value_or(-1000);
  r.output = child.Log();
  return r;
}

std::unique_ptr<Child> StartServerBinary(const std::vector<std::string>& flags, int* port) {
  const char* binary = std::getenv("INDEXER_SERVER_BINARY");
  if (binary == nullptr) {
    ADD_FAILURE() << "INDEXER_SERVER_BINARY is not set (run through ctest)";
    return nullptr;
  }
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--device=cpu"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto child = std::make_unique<Child>(argv);
  const std::optional<int> serving = WaitForServingPort(*child, absl::Seconds(20));
  if (!serving.has_value()) {
    ADD_FAILURE() << "indexer-server did not start; its output:\n" << child->Log();
    return nullptr;
  }
  *port = *serving;
  return child;
}

}  // namespace indexer::testing
