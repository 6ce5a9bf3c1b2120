#include "server/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace indexer::server {
namespace {

prometheus::MetricFamily One(const char* name, const char* help, prometheus::MetricType type,
                             double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(m);
  return f;
}

std::string FirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The fields of /proc/self/stat after the command name (which may hold spaces and parentheses):
// fields[0] is field 3 of proc(5), "state".
std::vector<std::string> StatFields() {
  const std::string stat = FirstLine("/proc/self/stat");
  const size_t close = stat.rfind(')');
  std::vector<std::string> fields;
  if (close == std::string::npos) return fields;
  std::istringstream rest(stat.substr(close + 1));
  for (std::string f; rest >> f;) fields.push_back(f);
  return fields;
}

// Boot time plus the process's start in clock ticks after boot (proc(5): stat field 22).
std::optional<double> StartTimeSeconds() {
  const std::vector<std::string> fields = StatFields();
  constexpr size_t kStartTime = 22 - 3;
  const long ticks = sysconf(_SC_CLK_TCK);
  if (fields.size() <= kStartTime || ticks <= 0) return std::nullopt;
  std::ifstream in("/proc/stat");
  for (std::string key; in >> key;) {
    if (key == "btime") {
      double boot = 0;
      if (!(in >> boot)) return std::nullopt;
      return boot + std::strtod(fields[kStartTime].c_str(), nullptr) / static_cast<double>(ticks);
    }
    in.ignore(1 << 20, '\n');
  }
  return std::nullopt;
}

std::optional<int> OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  const std::string own = std::to_string(dirfd(dir));  // the listing's own descriptor
  int n = 0;
  while (const dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name != "." && name != ".." && name != own) ++n;
  }
  closedir(dir);
  return n;
}

}  // namespace

ProcessMetrics::ProcessMetrics() : start_time_seconds_(StartTimeSeconds()) {}

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) {
    const auto seconds = [](const timeval& t) {
      return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
    };
    out.push_back(One("process_cpu_seconds_total", "User and system CPU time spent, in seconds.",
                      MetricType::Counter, seconds(usage.ru_utime) + seconds(usage.ru_stime)));
  }
  std::istringstream statm(FirstLine("/proc/self/statm"));
  double size_pages = 0, resident_pages = 0;
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  if (statm >> size_pages >> resident_pages && page > 0) {
    out.push_back(One("process_resident_memory_bytes", "Resident memory size in bytes.",
                      MetricType::Gauge, resident_pages * page));
    out.push_back(One("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                      MetricType::Gauge, size_pages * page));
  }
  if (const std::optional<int> fds = OpenFds()) {
    out.push_back(One("process_open_fds", "Open file descriptors.", MetricType::Gauge, *fds));
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    out.push_back(One("process_max_fds", "The limit on open file descriptors.", MetricType::Gauge,
                      static_cast<double>(limit.rlim_cur)));
  }
  if (start_time_seconds_) {
    out.push_back(One("process_start_time_seconds",
                      "Start time of the process since the Unix epoch, in seconds.",
                      MetricType::Gauge, *start_time_seconds_));
  }
  return out;
}

}  // namespace indexer::server
