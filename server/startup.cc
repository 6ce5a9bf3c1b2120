#include "server/startup.h"

#include <pthread.h>

#include <utility>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace indexer::server {

ShutdownSignals::ShutdownSignals() {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
}

int ShutdownSignals::Wait() {
  int sig = 0;
  sigwait(&signals_, &sig);
  return sig;
}

void SetCommandLineUsage(absl::string_view flag_files, absl::string_view message,
                         std::function<std::string()> version) {
  absl::FlagsUsageConfig usage;
  const auto ours = [files = std::string(flag_files)](absl::string_view file) {
    return absl::StrContains(file, files);
  };
  usage.contains_help_flags = ours;
  usage.contains_helpshort_flags = ours;
  // "Flags from server/main.cc:", not the build machine's path to it.
  usage.normalize_filename = [files = std::string(flag_files)](absl::string_view file) {
    const size_t at = file.find(files);
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  if (version) usage.version_string = std::move(version);
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(message);
}

}  // namespace indexer::server
