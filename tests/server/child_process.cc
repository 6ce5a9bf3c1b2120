#include "tests/server/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "absl/time/clock.h"

extern char** environ;

namespace indexer::testing {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Child::Child(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
  char name[] = "/tmp/indexer-sec-child-XXXXXX";
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

}  // namespace indexer::testing
