#include "server/server_options.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <iterator>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/status_macros.h"
#include "server/listen_address.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "gRPC listen address: host:port (port 0 picks one), or a Unix domain socket "
          "unix:/path/to/socket (e.g. unix:/run/indexer/indexer.sock, for a client on the same "
          "host or pod: no TCP stack in the way; the socket is made group-writable)");
ABSL_FLAG(std::string, health_listen, "",
          "Also serve grpc.health.v1, and nothing else, in plaintext on this host:port (e.g. "
          "0.0.0.0:50052), for probes that cannot speak TLS or send tokens: the kubelet's gRPC "
          "probe, Docker's HEALTHCHECK. It answers as the main listener does (SERVING, then "
          "NOT_SERVING from a drain or a failed device on). Empty: off");
ABSL_FLAG(std::string, device, "auto", "Backend: auto (CUDA if a GPU is usable, else CPU), cpu or cuda");
ABSL_FLAG(std::string, devices, "all",
          "GPUs the cuda backend drives: all (every visible GPU) or ordinals such as 0,1. Each gets "
          "its own --capacity pool; a sequence stays on the device it was created on (the one "
          "with the most free pages then)");
ABSL_FLAG(int32_t, cpu_devices, 1,
          "Simulated devices of the cpu backend (1 to 64), each with its own --capacity pool and "
          "a share of the threads: multi-device placement without GPUs");
ABSL_FLAG(int32_t, head_dim, 128, "Index key/query dimension: 64, 128 or 256");
ABSL_FLAG(int32_t, layers, 1, "Index-K caches (layers) sharing each sequence's block table");
ABSL_FLAG(std::string, key_dtype, "bf16",
          "Key storage: bf16, fp8 (e4m3, saturating, no scale) or fp4 (e2m1, an e4m3 scale per 16 "
          "values)");
ABSL_FLAG(std::string, capacity, "1GiB",
          "Key pool size per device: a page count (8192) or a size (4GiB, 512MiB); one page = 128 "
          "tokens x head_dim x layers keys");
ABSL_FLAG(int32_t, max_index_heads, 16, "Largest number of index heads H per request");
ABSL_FLAG(int32_t, max_topk, 256, "Largest topk per request");
ABSL_FLAG(int32_t, topk, 16, "Default topk when a request omits it");
ABSL_FLAG(int32_t, init_blocks, 0, "Default init_blocks (leading blocks always selected)");
ABSL_FLAG(int32_t, local_blocks, 1, "Default local_blocks (trailing blocks always selected)");
ABSL_FLAG(int32_t, pages_per_block, 8, "Attention pages per 128-token block in page-table rows");
ABSL_FLAG(int32_t, block_page_stride, 8, "Attention page id stride per block (16 when K and V share a block)");
ABSL_FLAG(int64_t, max_tokens_per_sequence, int64_t{1} << 20, "Longest sequence, in tokens per layer");
ABSL_FLAG(int32_t, max_query_tokens, 16384, "Most query tokens in one selection span");
ABSL_FLAG(int32_t, max_batch_items, 4096, "Most items in one Batch call");
ABSL_FLAG(int64_t, max_sequences, 65536,
          "Most sequences held at once, every tenant together (0 = no limit); a call that would "
          "create one more fails with RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, max_regions, 64,
          "Shared-memory regions a tenant may register at once for tensors passed by reference "
          "(RegisterSystemRegion, RegisterCudaRegion; 0: the server takes none). Any caller can make the server map "
          "a shared memory object its user can open: see docs/SECURITY.md");
ABSL_FLAG(int64_t, tenant_max_sequences, 0,
          "Most sequences one tenant holds at once (0 = no limit but --max_sequences); a call that "
          "would create one more fails with RESOURCE_EXHAUSTED naming tenant_max_sequences");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend compute threads (0 = all hardware threads)");
ABSL_FLAG(int32_t, handler_threads, 0,
          "Threads running the calls that may wait (ReleaseSequence, TruncateSequence, "
          "ForkSequence, GetSequence, ServerInfo, GetStats, Snapshot; 0 = auto: max(4, hardware "
          "threads)). Appends and selections hold no thread: they run on gRPC's threads and end "
          "on the device's");
ABSL_FLAG(int32_t, handler_spin_us, 0,
          "Microseconds up to two idle handler threads poll for the next call before they sleep "
          "(0 = never): a call that finds one starts without a thread wake-up (tens of "
          "microseconds on a large host), at the cost of up to two cores of polling");
ABSL_FLAG(bool, batching, true,
          "Merge the selections of concurrent calls (SelectBlocks, Batch, BatchStream) into one "
          "backend launch per step (false: each call launches its own)");
ABSL_FLAG(int32_t, batch_max_tasks, 256,
          "Batching: span selections one launch gathers; a launch starts once this many are "
          "queued or --batch_max_delay_us has passed (one call's larger wave still goes whole)");
ABSL_FLAG(int64_t, batch_max_delay_us, 0,
          "Batching: the longest a selection waits for others, in microseconds (0 = none: launch "
          "as soon as the backend is free; what arrives meanwhile forms the next launch)");
ABSL_FLAG(int64_t, batch_queue_bound, 8192,
          "Batching: most span selections waiting for a launch, per device; a call that would "
          "pass it fails at once with RESOURCE_EXHAUSTED, applying nothing");
ABSL_FLAG(int32_t, batch_max_inflight, 2,
          "Batching: backend launches running at once per device (2 lets one step's copies "
          "overlap the previous step's kernels; 1 = strictly one at a time)");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "Largest gRPC message received or sent, in bytes");
ABSL_FLAG(double, drain_seconds, 30, "On SIGINT/SIGTERM, how long in-flight calls may finish");
ABSL_FLAG(double, not_serving_seconds, 1,
          "On SIGINT/SIGTERM, how long health checks answer NOT_SERVING before new calls are refused");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, tls_cert, "",
          "TLS: PEM certificate (chain) of the server; with --tls_key the server accepts only TLS");
ABSL_FLAG(std::string, tls_key, "", "TLS: PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "Mutual TLS: PEM CA certificate(s); clients must present a certificate one of them signed");
ABSL_FLAG(std::string, token_file, "",
          "Bearer tokens, one '<token> <tenant> [admin] [quota=<pages or size>]' per line; every "
          "call then needs 'authorization: Bearer <token>' (docs/SECURITY.md). Empty: no auth");
ABSL_FLAG(std::string, tenant_quota, "0",
          "Pages each tenant may hold: a page count or a size (2GiB); 0 = no quota. A token file's "
          "quota=... overrides it per tenant");
ABSL_FLAG(std::string, snapshot_dir, "",
          "Folder where IndexerAdmin.Snapshot writes snapshot files (empty: the RPC is refused)");
ABSL_FLAG(std::string, snapshot_on_shutdown, "",
          "After a graceful shutdown (SIGINT/SIGTERM), write every sequence to this snapshot file");
ABSL_FLAG(std::string, restore, "",
          "At start, load this snapshot file (refused, and the server exits 1, if it does not match "
          "this server's head_dim, key_dtype and layers or is corrupt)");

ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus metrics (/metrics) on this host:port, e.g. 0.0.0.0:9090 (empty: off; "
          "the GetStats RPC answers either way)");
ABSL_FLAG(absl::Duration, idle_ttl, absl::ZeroDuration(),
          "Release sequences no call has named for this long, e.g. 30m, for schedulers that died "
          "without releasing them (0: never)");

namespace indexer::server {
namespace {

// The client tools' variables (indexer-cli, indexer-bench), often exported in the same shell.
const char* const kClientVariables[] = {"INDEXER_SERVER", "INDEXER_TOKEN"};

std::string VariableOf(absl::string_view flag) {
  return absl::StrCat("INDEXER_", absl::AsciiStrToUpper(flag));
}

bool IsServerFlagName(absl::string_view name) {
  for (const FlagSection& section : FlagSections()) {
    for (const char* flag : section.flags) {
      if (name == flag) return true;
    }
  }
  return false;
}

// Edit distance, for "did you mean" (names are short).
size_t Distance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string UnknownVariableWarning(absl::string_view variable) {
  std::string nearest;
  size_t best = 3;  // suggest only a name at most two edits away
  const auto consider = [&](const std::string& known) {
    const size_t d = Distance(variable, known);
    if (d < best) best = d, nearest = known;
  };
  for (const FlagSection& section : FlagSections()) {
    for (const char* flag : section.flags) consider(VariableOf(flag));
  }
  for (const EnvironmentSetting& e : EnvironmentSettings()) consider(e.variable);
  return absl::StrCat(variable, " is not a setting of indexer-server and is ignored",
                      nearest.empty() ? "" : absl::StrCat(" (did you mean ", nearest, "?)"),
                      "; indexer-server --help lists the variables it reads");
}

// The listening addresses parse; whether they can be bound is IndexerServer::Start's check.
absl::Status CheckListenSyntax(const ServerOptions& o) {
  absl::StatusOr<ListenAddress> listen = ParseListenAddress(o.listen, "listen", true);
  if (!listen.ok()) return listen.status();
  if (!o.health_listen.empty()) {
    absl::StatusOr<ListenAddress> a = ParseListenAddress(o.health_listen, "health_listen", true);
    if (!a.ok()) return a.status();
    const bool picks_a_port = !a->is_unix() && a->port == 0;
    if (o.health_listen == o.listen && !picks_a_port) {
      return absl::InvalidArgumentError(
          "--health_listen must differ from --listen (it is a second listener)");
    }
  }
  if (!o.metrics_listen.empty()) {
    absl::StatusOr<ListenAddress> a = ParseListenAddress(o.metrics_listen, "metrics_listen", false);
    if (!a.ok()) return a.status();
  }
  return absl::OkStatus();
}

// `text` folded into lines of at most `width` characters, each starting with `indent`.
std::string Wrap(absl::string_view text, size_t width, absl::string_view indent) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent.size() + line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, indent, line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, indent, line, "\n");
  return out;
}

}  // namespace

std::string HelpText() {
  constexpr size_t kWidth = 100;
  std::string out = Wrap(
      "indexer-server: serves sparse-attention block selection (the MiniMax M3 lightning "
      "indexer) over gRPC (proto/indexer/v1/indexer.proto).",
      kWidth, "");
  absl::StrAppend(&out, "\nUsage: indexer-server [flags]\n\n");
  absl::StrAppend(&out, Wrap("Every flag can also be set by an environment variable "
                             "INDEXER_<FLAG>, e.g. INDEXER_CAPACITY=4GiB; a flag on the command "
                             "line wins. An INDEXER_ variable the server does not read is "
                             "reported at start.",
                             kWidth, ""));
  for (const FlagSection& section : FlagSections()) {
    absl::StrAppend(&out, "\n", section.title, ":\n");
    for (const char* name : section.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr) continue;
      const std::string value = flag->DefaultValue();
      absl::StrAppend(&out, "  --", name, " (default: ", value.empty() ? "''" : value, ")\n",
                      Wrap(flag->Help(), kWidth, "      "));
    }
  }
  absl::StrAppend(&out, "\nEnvironment only (read by the CUDA backend at start):\n");
  for (const EnvironmentSetting& e : EnvironmentSettings()) {
    absl::StrAppend(&out, "  ", e.variable, " (default: ", e.default_value, "; ", e.min, " to ",
                    e.max, ")\n", Wrap(e.help, kWidth, "      "));
  }
  absl::StrAppend(
      &out, "\n",
      Wrap("Signals: SIGINT or SIGTERM drain the server (health NOT_SERVING for "
           "--not_serving_seconds, then in-flight calls finish for up to --drain_seconds) and "
           "it exits.",
           kWidth, ""),
      Wrap("Exit status: 0 after a graceful shutdown; 1 the server could not start (an address "
           "in use, a backend, TLS, token file or restore failure) or the snapshot on shutdown "
           "failed; 2 a usage error: an unknown flag or argument, or a flag or INDEXER_ variable "
           "whose value does not parse or is refused (out of range, or flags that do not go "
           "together; the message names the flag or its variable).",
           kWidth, ""));
  return out;
}

const std::vector<FlagSection>& FlagSections() {
  static const std::vector<FlagSection> sections = {
      {"Listening", {"listen", "health_listen", "metrics_listen", "max_message_bytes"}},
      {"Devices and the key pool",
       {"device", "devices", "cpu_devices", "capacity", "head_dim", "layers", "key_dtype",
        "cpu_threads"}},
      {"Selection defaults and limits",
       {"max_index_heads", "max_topk", "topk", "init_blocks", "local_blocks", "pages_per_block",
        "block_page_stride", "max_tokens_per_sequence", "max_query_tokens", "max_batch_items",
        "max_sequences", "tenant_max_sequences"}},
      {"Batching and threads",
       {"batching", "batch_max_tasks", "batch_max_delay_us", "batch_queue_bound",
        "batch_max_inflight", "handler_threads", "handler_spin_us"}},
      {"Security and snapshots (docs/SECURITY.md)",
       {"tls_cert", "tls_key", "tls_client_ca", "token_file", "tenant_quota", "max_regions",
        "snapshot_dir", "snapshot_on_shutdown", "restore"}},
      {"Operations", {"idle_ttl", "drain_seconds", "not_serving_seconds", "log_level"}},
  };
  return sections;
}

const std::vector<EnvironmentSetting>& EnvironmentSettings() {
  static const std::vector<EnvironmentSetting> settings = {
      {"INDEXER_CUDA_LANES", "2", 1, 8,
       "CUDA backend: calls that run on a device at once (each lane has a stream and its own "
       "staging buffers), and as many key-write lanes"},
      {"INDEXER_CUDA_GRAPHS", "1", 0, 1,
       "CUDA backend: 1 runs each selection step as one CUDA graph launch, 0 as plain launches"},
  };
  return settings;
}

bool IsServerFlag(const absl::CommandLineFlag& flag) { return IsServerFlagName(flag.Name()); }

absl::StatusOr<EnvironmentFlags> ApplyEnvironment(char** environment) {
  EnvironmentFlags out;
  for (char** entry = environment; entry != nullptr && *entry != nullptr; ++entry) {
    const absl::string_view text = *entry;
    const size_t eq = text.find('=');
    if (!absl::StartsWith(text, "INDEXER_") || eq == absl::string_view::npos) continue;
    const std::string variable(text.substr(0, eq));
    const std::string value(text.substr(eq + 1));
    const std::string flag = absl::AsciiStrToLower(variable.substr(std::strlen("INDEXER_")));
    const bool known_other =
        std::any_of(std::begin(kClientVariables), std::end(kClientVariables),
                    [&](const char* v) { return variable == v; }) ||
        std::any_of(EnvironmentSettings().begin(), EnvironmentSettings().end(),
                    [&](const EnvironmentSetting& e) { return variable == e.variable; });
    if (known_other) continue;
    absl::CommandLineFlag* f = IsServerFlagName(flag) ? absl::FindCommandLineFlag(flag) : nullptr;
    if (f == nullptr) {
      out.warnings.push_back(UnknownVariableWarning(variable));
      continue;
    }
    std::string error;
    if (!f->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(variable, "='", value, "' (the variable of --", flag, "): ", error));
    }
    out.flags.push_back(flag);
  }
  return out;
}

absl::Status CheckEnvironmentSettings(char** environment) {
  for (char** entry = environment; entry != nullptr && *entry != nullptr; ++entry) {
    const absl::string_view text = *entry;
    for (const EnvironmentSetting& e : EnvironmentSettings()) {
      const std::string prefix = absl::StrCat(e.variable, "=");
      if (!absl::StartsWith(text, prefix)) continue;
      const absl::string_view value = text.substr(prefix.size());
      int n = 0;
      if (!absl::SimpleAtoi(value, &n) || n < e.min || n > e.max) {
        return absl::InvalidArgumentError(absl::StrCat(e.variable, " is '", value,
                                                       "'; it must be an integer in [", e.min,
                                                       ", ", e.max, "]"));
      }
    }
  }
  return absl::OkStatus();
}

std::string NameTheVariable(absl::string_view message, const EnvironmentFlags& environment,
                            const std::vector<std::string>& command_line_flags) {
  absl::string_view rest = message;
  if (!absl::ConsumePrefix(&rest, "--")) return std::string(message);
  const size_t end = rest.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_");
  const std::string flag(rest.substr(0, end));
  const auto names = [&](const std::vector<std::string>& flags) {
    return std::find(flags.begin(), flags.end(), flag) != flags.end();
  };
  if (!names(environment.flags) || names(command_line_flags)) return std::string(message);
  return absl::StrCat(message, " (set by ", VariableOf(flag), ")");
}


absl::StatusOr<int64_t> ParseCapacity(absl::string_view text, int64_t bytes_per_page) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  int64_t pages = 0;
  if (absl::SimpleAtoi(t, &pages)) {
    if (pages < 1) return absl::InvalidArgumentError(absl::StrCat("capacity is ", t, " pages; it must be >= 1"));
    return pages;
  }
  struct Unit {
    const char* suffix;
    double bytes;
  };
  const Unit units[] = {{"gib", 1024.0 * 1024 * 1024}, {"mib", 1024.0 * 1024}, {"kib", 1024.0},
                        {"gb", 1e9}, {"mb", 1e6}, {"kb", 1e3}, {"g", 1024.0 * 1024 * 1024},
                        {"m", 1024.0 * 1024}};
  for (const Unit& u : units) {
    if (!absl::EndsWith(t, u.suffix)) continue;
    double amount = 0;
    if (!absl::SimpleAtod(t.substr(0, t.size() - strlen(u.suffix)), &amount) || !(amount > 0)) break;
    const int64_t n = static_cast<int64_t>(amount * u.bytes / static_cast<double>(bytes_per_page));
    if (n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("capacity ", text, " is less than one page (",
                                                     bytes_per_page, " bytes)"));
    }
    return n;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "capacity is '", text, "'; give a page count (8192) or a size such as 4GiB or 512MiB"));
}

absl::StatusOr<std::vector<int>> ParseDevices(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  std::vector<int> out;
  if (t == "all") return out;
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--devices is '", text, "'; ", why, ": give all or GPU ordinals such as 0,1"));
  };
  for (absl::string_view part : absl::StrSplit(t, ',')) {
    int ordinal = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &ordinal) || ordinal < 0 || ordinal > 1023) {
      return refuse(absl::StrCat("'", part, "' is not an ordinal in [0, 1023]"));
    }
    if (std::find(out.begin(), out.end(), ordinal) != out.end()) {
      return refuse(absl::StrCat("GPU ", ordinal, " is named twice"));
    }
    out.push_back(ordinal);
  }
  if (out.size() > 64) return refuse("at most 64 devices");
  return out;
}

namespace {

template <typename T>
absl::Status OutOfRange(absl::string_view flag, T value, absl::string_view range) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " is ", value, "; it must be in ", range));
}

absl::StatusOr<kernels::KeyStorage> ParseKeyStorage(std::string dtype) {
  dtype = absl::AsciiStrToLower(dtype);
  if (dtype == "bf16") return kernels::KeyStorage::kBf16;
  if (dtype == "fp8" || dtype == "fp8_e4m3" || dtype == "e4m3") {
    return kernels::KeyStorage::kFp8E4M3;
  }
  if (dtype == "fp4" || dtype == "fp4_e2m1" || dtype == "e2m1") {
    return kernels::KeyStorage::kFp4E2M1;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--key_dtype is '", dtype, "'; it must be bf16, fp8 or fp4"));
}

// The listening addresses, the devices and the serving threads' flags, checked.
absl::Status ReadProcessFlags(ServerOptions& o) {
  o.listen = absl::GetFlag(FLAGS_listen);
  o.health_listen = absl::GetFlag(FLAGS_health_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  INDEXER_RETURN_IF_ERROR(CheckListenSyntax(o));
  o.device = absl::GetFlag(FLAGS_device);
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device is '", o.device, "'; it must be auto, cpu or cuda"));
  }
  absl::StatusOr<std::vector<int>> devices = ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) return devices.status();
  o.devices = *std::move(devices);
  o.cpu_devices = absl::GetFlag(FLAGS_cpu_devices);
  if (o.cpu_devices < 1 || o.cpu_devices > 64) {
    return OutOfRange("cpu_devices", o.cpu_devices, "[1, 64]");
  }
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (o.max_message_bytes < (1 << 16) || o.max_message_bytes > (int64_t{1} << 31) - 1) {
    return OutOfRange("max_message_bytes", o.max_message_bytes, "[65536, 2147483647]");
  }
  o.handler_threads = absl::GetFlag(FLAGS_handler_threads);
  if (o.handler_threads < 0 || o.handler_threads > 4096) {
    return OutOfRange("handler_threads", o.handler_threads, "[0, 4096]");
  }
  o.handler_spin_us = absl::GetFlag(FLAGS_handler_spin_us);
  if (o.handler_spin_us < 0 || o.handler_spin_us > 10000) {
    return OutOfRange("handler_spin_us", o.handler_spin_us, "[0, 10000]");
  }
  o.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  if (!(o.drain_seconds >= 0) || o.drain_seconds > 3600) {
    return OutOfRange("drain_seconds", o.drain_seconds, "[0, 3600]");
  }
  o.not_serving_seconds = absl::GetFlag(FLAGS_not_serving_seconds);
  if (!(o.not_serving_seconds >= 0) || o.not_serving_seconds > 60) {
    return OutOfRange("not_serving_seconds", o.not_serving_seconds, "[0, 60]");
  }
  return absl::OkStatus();
}

// The engine's flags: shapes, storage, defaults, limits and batching; then the pool, whose page
// size depends on head_dim, dtype and layers (checked first).
absl::Status ReadEngineFlags(engine::EngineConfig& e) {
  e.head_dim = absl::GetFlag(FLAGS_head_dim);
  e.layers = absl::GetFlag(FLAGS_layers);
  absl::StatusOr<kernels::KeyStorage> storage = ParseKeyStorage(absl::GetFlag(FLAGS_key_dtype));
  if (!storage.ok()) return storage.status();
  e.key_storage = *storage;
  e.max_index_heads = absl::GetFlag(FLAGS_max_index_heads);
  e.max_topk = absl::GetFlag(FLAGS_max_topk);
  e.defaults.topk = absl::GetFlag(FLAGS_topk);
  e.defaults.init_blocks = absl::GetFlag(FLAGS_init_blocks);
  e.defaults.local_blocks = absl::GetFlag(FLAGS_local_blocks);
  e.page_table.pages_per_block = absl::GetFlag(FLAGS_pages_per_block);
  e.page_table.block_page_stride = absl::GetFlag(FLAGS_block_page_stride);
  e.max_tokens_per_sequence = absl::GetFlag(FLAGS_max_tokens_per_sequence);
  e.max_query_tokens = absl::GetFlag(FLAGS_max_query_tokens);
  e.max_batch_items = absl::GetFlag(FLAGS_max_batch_items);
  e.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  e.tenant_max_sequences = absl::GetFlag(FLAGS_tenant_max_sequences);
  e.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  e.batching.enabled = absl::GetFlag(FLAGS_batching);
  e.batching.max_tasks = absl::GetFlag(FLAGS_batch_max_tasks);
  e.batching.max_delay_us = absl::GetFlag(FLAGS_batch_max_delay_us);
  e.batching.queue_bound = absl::GetFlag(FLAGS_batch_queue_bound);
  e.batching.max_inflight = absl::GetFlag(FLAGS_batch_max_inflight);
  const auto as_flag_error = [](const absl::Status& s) {
    return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
  };
  e.capacity_pages = 1;
  if (absl::Status s = e.Validate(); !s.ok()) return as_flag_error(s);
  absl::StatusOr<int64_t> pages = ParseCapacity(absl::GetFlag(FLAGS_capacity), e.BytesPerPage());
  if (!pages.ok()) return as_flag_error(pages.status());
  e.capacity_pages = *pages;
  if (absl::Status s = e.Validate(); !s.ok()) return as_flag_error(s);
  return absl::OkStatus();
}

// TLS, tokens and the tenants' page quota.
absl::Status ReadSecurityFlags(ServerOptions& o) {
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: give both or neither");
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS)");
  }
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.max_regions = absl::GetFlag(FLAGS_max_regions);
  if (o.max_regions < 0 || o.max_regions > 4096) {
    return OutOfRange("max_regions", o.max_regions, "[0, 4096]");
  }
  const std::string quota = absl::GetFlag(FLAGS_tenant_quota);
  if (quota != "0" && !quota.empty()) {
    absl::StatusOr<int64_t> pages = ParseCapacity(quota, o.engine.BytesPerPage());
    if (!pages.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tenant_quota is '", quota,
                                                     "'; give 0 (no quota), a page count (1024) "
                                                     "or a size (2GiB)"));
    }
    o.tenant_quota_pages = *pages;
  }
  return absl::OkStatus();
}

// Snapshots, the idle-sequence TTL and the log level.
absl::Status ReadLifecycleFlags(ServerOptions& o) {
  o.snapshot_dir = absl::GetFlag(FLAGS_snapshot_dir);
  o.snapshot_on_shutdown = absl::GetFlag(FLAGS_snapshot_on_shutdown);
  o.restore = absl::GetFlag(FLAGS_restore);
  o.idle_ttl = absl::GetFlag(FLAGS_idle_ttl);
  if (o.idle_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--idle_ttl is ", absl::FormatDuration(o.idle_ttl), "; it must be 0 (off) or positive"));
  }
  if (o.idle_ttl > absl::ZeroDuration() && o.idle_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--idle_ttl is ", absl::FormatDuration(o.idle_ttl), "; it must be 0 (off) or at least 1s"));
  }
  o.log_level = absl::GetFlag(FLAGS_log_level);
  static const char* const kLevels[] = {"trace", "debug", "info", "warn", "error", "off"};
  bool level_ok = false;
  for (const char* l : kLevels) level_ok = level_ok || o.log_level == l;
  if (!level_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level is '", o.log_level, "'; it must be trace, debug, info, warn, error or off"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions o;
  INDEXER_RETURN_IF_ERROR(ReadProcessFlags(o));
  INDEXER_RETURN_IF_ERROR(ReadEngineFlags(o.engine));
  INDEXER_RETURN_IF_ERROR(ReadSecurityFlags(o));
  INDEXER_RETURN_IF_ERROR(ReadLifecycleFlags(o));
  return o;
}

int HandlerThreads(const ServerOptions& o) {
  if (o.handler_threads > 0) return o.handler_threads;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(4, hw);
}

std::string Summary(const ServerOptions& o) {
  const engine::EngineConfig& e = o.engine;
  return absl::StrFormat(
      "listen=%s health_listen=%s device=%s devices=%s cpu_devices=%d head_dim=%d layers=%d "
      "key_dtype=%s "
      "capacity=%d pages (%.2f GiB) per device "
      "max_index_heads=%d max_topk=%d topk=%d init_blocks=%d local_blocks=%d pages_per_block=%d "
      "block_page_stride=%d max_tokens_per_sequence=%d max_query_tokens=%d max_batch_items=%d "
      "max_sequences=%d tenant_max_sequences=%d batching=%s batch_max_tasks=%d "
      "batch_max_delay_us=%d batch_queue_bound=%d batch_max_inflight=%d handler_threads=%d "
      "handler_spin_us=%d max_message_bytes=%d tls=%s token_file=%s tenant_quota=%d pages "
      "max_regions=%d snapshot_dir=%s "
      "snapshot_on_shutdown=%s restore=%s metrics_listen=%s idle_ttl=%s",
      o.listen, o.health_listen.empty() ? "off" : o.health_listen, o.device,
      o.devices.empty() ? "all" : absl::StrJoin(o.devices, ","),
      o.cpu_devices, e.head_dim, e.layers, engine::KeyStorageName(e.key_storage),
      e.capacity_pages, static_cast<double>(e.capacity_pages * e.BytesPerPage()) / (1 << 30),
      e.max_index_heads, e.max_topk, e.defaults.topk, e.defaults.init_blocks,
      e.defaults.local_blocks, e.page_table.pages_per_block, e.page_table.block_page_stride,
      e.max_tokens_per_sequence, e.max_query_tokens, e.max_batch_items, e.max_sequences,
      e.tenant_max_sequences, e.batching.enabled ? "on" : "off", e.batching.max_tasks,
      e.batching.max_delay_us,
      e.batching.queue_bound, e.batching.max_inflight, HandlerThreads(o), o.handler_spin_us,
      o.max_message_bytes,
      o.tls_cert.empty() ? "off" : (o.tls_client_ca.empty() ? "on" : "mutual"),
      o.token_file.empty() ? "none" : o.token_file, o.tenant_quota_pages, o.max_regions,
      o.snapshot_dir.empty() ? "none" : o.snapshot_dir,
      o.snapshot_on_shutdown.empty() ? "none" : o.snapshot_on_shutdown,
      o.restore.empty() ? "none" : o.restore, o.metrics_listen.empty() ? "off" : o.metrics_listen,
      o.idle_ttl > absl::ZeroDuration() ? absl::FormatDuration(o.idle_ttl) : "off");
}

}  // namespace indexer::server
