// indexer-cli: talks to an indexer-server from the command line, through indexer_client.
//
//   indexer-cli [--server=host:port | --server=unix:/path/to.sock] <command> [flags]
//
// Commands: info, stats, health, append, select, get, fork, truncate, release, snapshot, demo (a
// short decode workload that shows the service working and how fast it is). TLS and a bearer token
// come from --tls* and --token (or $INDEXER_TOKEN). `indexer-cli --help` documents
// every flag. Exit status: 0 ok, 1 an RPC failed (its status code name and message are
// printed) or a result was malformed, 2 a usage error.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/indexer_client.h"
#include "flags/command_line.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "Server address: host:port, or unix:/path/to/socket for a server listening on a Unix "
          "domain socket (default: $INDEXER_SERVER when set, else 127.0.0.1:50051)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call, e.g. 500ms, 30s");
ABSL_FLAG(std::string, sequence, "", "Sequence id (append, select, get, fork, truncate, release)");
ABSL_FLAG(int32_t, tokens, 0,
          "Tokens: keys to append (append, default 128), query tokens (select, default 1), "
          "prefill length per sequence (demo, default 8192)");
ABSL_FLAG(int32_t, layer, 0, "Layer to append to (append) or to score (select)");
ABSL_FLAG(bool, all_layers, false, "append: keys for every layer at once ([n][layers][head_dim])");
ABSL_FLAG(std::string, attention_pages, "",
          "append: attention page ids of the blocks the append opens, comma-separated (10,11,12), "
          "or 'auto' (id = block index)");
ABSL_FLAG(std::string, dtype, "bf16", "Wire dtype of keys and queries: bf16 or fp32");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random keys and queries");
ABSL_FLAG(int32_t, heads, 4, "Index heads H per query token (select, demo)");
ABSL_FLAG(int32_t, topk, -1, "Blocks per (token, head); -1: the server's default (demo: 16)");
ABSL_FLAG(int32_t, init_blocks, -1, "Leading blocks always selected; -1: the server's default");
ABSL_FLAG(int32_t, local_blocks, -1, "Trailing blocks always selected; -1: the server's default");
ABSL_FLAG(int64_t, start_position, -1,
          "select: position of the first query token; -1: the span ends at the last token");
ABSL_FLAG(std::string, target, "", "fork: id of the new sequence");
ABSL_FLAG(int64_t, length, -1, "truncate: new length (required); fork: tokens kept (-1: all)");
ABSL_FLAG(std::string, service, "", "health: service name ('' = the whole server)");
ABSL_FLAG(int32_t, sequences, 8, "demo: concurrent sequences");
ABSL_FLAG(int32_t, steps, 64, "demo: decode steps (one Batch call each)");
ABSL_FLAG(int32_t, chunk, 2048, "demo: prefill chunk, tokens per AppendKeys call");
ABSL_FLAG(std::string, name, "", "snapshot: file name in the server's --snapshot_dir ('' = timestamped)");
ABSL_FLAG(bool, tls, false, "Connect with TLS, trusting gRPC's default roots unless --tls_ca is given");
ABSL_FLAG(std::string, tls_ca, "", "TLS: PEM file of the CA that signed the server's certificate");
ABSL_FLAG(std::string, tls_cert, "", "Mutual TLS: PEM file of this client's certificate");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: PEM file of this client's private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: name to check the server's certificate against (default: the --server host)");
ABSL_FLAG(std::string, token, "",
          "Bearer token sent with every call (default: $INDEXER_TOKEN; the environment keeps it "
          "out of the process list)");

namespace {

using indexer::client::CallOptions;
using indexer::client::IndexerClient;
using indexer::client::Selection;
namespace v1 = indexer::v1;

constexpr int kOk = 0;
constexpr int kRpcError = 1;

constexpr char kUsage[] =
    R"(indexer-cli: a command-line client of the indexer gRPC service (sparse-attention block
selection, the MiniMax M3 lightning indexer).

Usage: indexer-cli [--server=host:port | --server=unix:/path/to/socket] <command> [flags]

Commands:
  info       Print the server's configuration, capacity and backend (ServerInfo).
  stats      Print the server's metrics (GetStats): requests by RPC and status, latency,
             batch sizes, backend time, pages used and free, live and reclaimed sequences.
  health     Check grpc.health.v1 for --service; exit 1 unless SERVING.
  append     Append --tokens random keys to --sequence (creating it): --layer or --all_layers,
             optional --attention_pages.
  select     Select blocks for --tokens random query tokens of --sequence with --heads heads;
             prints the block ids per token and head (and page-table rows when the sequence
             has attention pages). --topk, --init_blocks, --local_blocks, --start_position.
  get        Describe --sequence: lengths, pages, attention pages.
  fork       Copy --sequence to --target (first --length tokens, or all).
  truncate   Shorten --sequence to --length tokens.
  release    Release --sequence and its pages.
  snapshot   Write every sequence to a snapshot file --name in the server's --snapshot_dir
             (IndexerAdmin.Snapshot; needs an admin token on servers that check tokens).
  demo       A short decode workload: --sequences sequences prefilled with --tokens tokens each
             (in --chunk token AppendKeys calls), then --steps decode steps, each ONE Batch call
             appending every sequence's new key and selecting (--heads, --topk); then releases
             everything. Prints throughput and step latency and checks every result.

Examples:
  indexer-cli info
  indexer-cli append --sequence=s1 --tokens=1000 --attention_pages=auto
  indexer-cli select --sequence=s1 --heads=2 --tokens=2 --topk=4
  indexer-cli demo --server=10.0.0.5:50051 --sequences=16 --steps=128
  indexer-cli --server=unix:/run/indexer/indexer.sock health     # a co-located server
  INDEXER_TOKEN=... indexer-cli --server=idx.example:50051 --tls_ca=ca.pem info

Exit status: 0 ok (health: SERVING); 1 an RPC failed (its status code and message are printed),
health is not SERVING, or a result was malformed; 2 a usage error (an unknown command or flag, a
flag value that does not parse or is missing, an unreadable TLS file, an invalid --server).
)";

int UsageError(const std::string& message) {
  return indexer::flags::ReportUsageError("indexer-cli", message);
}

int RpcError(absl::string_view what, const absl::Status& status) {
  std::fprintf(stderr, "indexer-cli: %s failed: %s: %s\n", std::string(what).c_str(),
               absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return kRpcError;
}

const indexer::flags::FlagFilter IsOurFlag = indexer::flags::FlagsDefinedIn("client/cpp/cli.cc");

void PrintHelp() {
  std::printf("%s\nFlags:\n%s", kUsage, indexer::flags::FlagList(IsOurFlag).c_str());
}

// Parses argv (flags/command_line.h): flags anywhere, one positional command.
struct CommandLine {
  std::string command;
  std::vector<std::string> set_flags;
  bool help = false;
  bool version = false;
};

absl::StatusOr<CommandLine> ParseArgs(int argc, char** argv) {
  absl::StatusOr<indexer::flags::CommandLine> parsed =
      indexer::flags::ParseCommandLine(argc, argv, IsOurFlag);
  if (!parsed.ok()) return parsed.status();
  CommandLine cl;
  cl.set_flags = parsed->set;
  cl.help = parsed->help;
  cl.version = parsed->version;
  const std::vector<std::string>& positional = parsed->positional;
  if (positional.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("one command expected, got: ", absl::StrJoin(positional, " ")));
  }
  if (!positional.empty()) cl.command = positional[0];
  if (cl.command == "help") cl.help = true;
  return cl;
}

// --- helpers ---------------------------------------------------------------------------------

std::vector<float> RandomValues(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

absl::StatusOr<v1::ValueDtype> DtypeFlag() {
  const std::string d = absl::GetFlag(FLAGS_dtype);
  if (d == "bf16") return v1::VALUE_DTYPE_BF16;
  if (d == "fp32") return v1::VALUE_DTYPE_FP32;
  return absl::InvalidArgumentError(absl::StrCat("--dtype is '", d, "'; it must be bf16 or fp32"));
}

absl::StatusOr<std::string> RequiredFlag(const std::string& value, const char* name) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  return value;
}

CallOptions Call() { return CallOptions::Timeout(absl::GetFlag(FLAGS_timeout)); }

std::string Lengths(const google::protobuf::RepeatedField<uint32_t>& lengths) {
  return absl::StrCat("[", absl::StrJoin(lengths, ", "), "]");
}

// Rows of a selection, one line per (token, head), and the page-table rows when present.
void PrintSelection(const Selection& s) {
  std::printf("selection: %d tokens x %d heads, topk %d, start_position %lld%s\n", s.num_tokens,
              s.num_heads, s.topk, static_cast<long long>(s.start_position),
              s.has_page_table() ? absl::StrCat(", pages_per_block ", s.pages_per_block).c_str()
                                 : "");
  for (int t = 0; t < s.num_tokens; ++t) {
    for (int h = 0; h < s.num_heads; ++h) {
      std::printf("  token %d (position %lld) head %d: blocks [%s]\n", t,
                  static_cast<long long>(s.position(t)), h,
                  absl::StrJoin(s.blocks(t, h), " ").c_str());
      if (s.has_page_table()) {
        std::printf("    page table [%s] context_len %d\n",
                    absl::StrJoin(s.page_row(t, h), " ").c_str(), s.context_len(t, h));
      }
    }
  }
}

// Checks one (token, head) row of a selection answered at position `pos` (SPEC.md "Select"):
// ids in [0, V), distinct, -1 padding after exactly min(topk, V) ids, and the local block
// V - 1 present when local_blocks >= 1. Empty string when the row is well formed.
std::string CheckRow(std::span<const int32_t> ids, int64_t pos, int local_blocks) {
  const int64_t v = pos / 128 + 1;
  const int64_t k = std::min<int64_t>(static_cast<int64_t>(ids.size()), v);
  std::vector<int32_t> seen;
  for (int64_t j = 0; j < static_cast<int64_t>(ids.size()); ++j) {
    const int32_t b = ids[j];
    if (j >= k) {
      if (b != -1) return absl::StrCat("entry ", j, " is ", b, "; expected -1 padding");
      continue;
    }
    if (b < 0 || b >= v) return absl::StrCat("entry ", j, " is ", b, "; visible blocks are [0, ", v, ")");
    if (std::find(seen.begin(), seen.end(), b) != seen.end()) {
      return absl::StrCat("block ", b, " appears twice");
    }
    seen.push_back(b);
  }
  if (local_blocks >= 1 && std::find(seen.begin(), seen.end(), v - 1) == seen.end()) {
    return absl::StrCat("the local block ", v - 1, " is missing");
  }
  return "";
}

double Percentile(std::vector<double> sorted, double q) {
  if (sorted.empty()) return 0;
  std::sort(sorted.begin(), sorted.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(i, sorted.size() - 1)];
}

void ApplySelectFlags(v1::SelectBlocksRequest* r) {
  if (absl::GetFlag(FLAGS_topk) >= 0) r->set_topk(absl::GetFlag(FLAGS_topk));
  if (absl::GetFlag(FLAGS_init_blocks) >= 0) r->set_init_blocks(absl::GetFlag(FLAGS_init_blocks));
  if (absl::GetFlag(FLAGS_local_blocks) >= 0) r->set_local_blocks(absl::GetFlag(FLAGS_local_blocks));
}

// --- commands --------------------------------------------------------------------------------

const char* KeyStorageName(v1::KeyStorage s) {
  switch (s) {
    case v1::KEY_STORAGE_BF16: return "bf16";
    case v1::KEY_STORAGE_FP8_E4M3: return "fp8_e4m3";
    case v1::KEY_STORAGE_FP4_E2M1: return "fp4_e2m1";
    default: return "unspecified";
  }
}

// Every metric family the server keeps (GetStats), one line per metric.
int Stats(IndexerClient& client) {
  absl::StatusOr<v1::GetStatsResponse> stats = client.GetStats(Call());
  if (!stats.ok()) return RpcError("GetStats", stats.status());
  for (const v1::MetricFamily& f : stats->families()) {
    for (const v1::Metric& m : f.metrics()) {
      std::string labels;
      std::map<std::string, std::string> sorted(m.labels().begin(), m.labels().end());
      for (const auto& [k, v] : sorted) absl::StrAppend(&labels, labels.empty() ? "{" : ",", k, "=", v);
      if (!labels.empty()) labels += "}";
      if (f.type() == "histogram") {
        std::printf("%s%s count %llu sum %g\n", f.name().c_str(), labels.c_str(),
                    static_cast<unsigned long long>(m.count()), m.sum());
      } else {
        std::printf("%s%s %g\n", f.name().c_str(), labels.c_str(), m.value());
      }
    }
  }
  return kOk;
}

int Info(IndexerClient& client) {
  absl::StatusOr<v1::ServerInfoResponse> info = client.ServerInfo(Call());
  if (!info.ok()) return RpcError("ServerInfo", info.status());
  const v1::ServerInfoResponse& i = *info;
  std::printf("version               %s\n", i.version().c_str());
  std::printf("backend               %s (%s)\n", i.backend().c_str(), i.device().c_str());
  std::printf("head_dim              %u\n", i.head_dim());
  std::printf("layers                %u\n", i.layers());
  std::printf("key_storage           %s\n", KeyStorageName(i.key_storage()));
  std::printf("block_size            %u\n", i.block_size());
  std::printf("max_index_heads       %u\n", i.max_index_heads());
  std::printf("max_topk              %u\n", i.max_topk());
  std::printf("defaults              topk %u, init_blocks %u, local_blocks %u\n", i.default_topk(),
              i.default_init_blocks(), i.default_local_blocks());
  std::printf("page table            pages_per_block %u, block_page_stride %u\n",
              i.pages_per_block(), i.block_page_stride());
  std::printf("pages                 %llu free of %llu (%llu bytes each, %.2f GiB in all)\n",
              static_cast<unsigned long long>(i.free_pages()),
              static_cast<unsigned long long>(i.total_pages()),
              static_cast<unsigned long long>(i.bytes_per_page()),
              static_cast<double>(i.total_pages() * i.bytes_per_page()) / (1 << 30));
  std::printf("live_sequences        %llu\n", static_cast<unsigned long long>(i.live_sequences()));
  std::printf("max_tokens_per_seq    %u\n", i.max_tokens_per_sequence());
  std::printf("max_message_bytes     %llu\n", static_cast<unsigned long long>(i.max_message_bytes()));
  std::printf("max_query_tokens      %u\n", i.max_query_tokens());
  std::printf("max_batch_items       %u\n", i.max_batch_items());
  std::printf("max_sequences         %s\n",
              i.max_sequences() == 0 ? "none" : absl::StrCat(i.max_sequences()).c_str());
  std::printf("tenant sequences      %llu held, limit %s\n",
              static_cast<unsigned long long>(i.tenant_sequences()),
              i.tenant_max_sequences() == 0 ? "none"
                                            : absl::StrCat(i.tenant_max_sequences()).c_str());
  if (!i.tenant().empty()) {
    std::printf("tenant                %s: %llu pages held, quota %s\n", i.tenant().c_str(),
                static_cast<unsigned long long>(i.tenant_pages()),
                i.tenant_page_quota() == 0 ? "none"
                                           : absl::StrCat(i.tenant_page_quota(), " pages").c_str());
  }
  return kOk;
}

int Health(IndexerClient& client) {
  const std::string service = absl::GetFlag(FLAGS_service);
  absl::StatusOr<indexer::client::HealthStatus> health = client.Health(service, Call());
  if (!health.ok()) return RpcError("Health", health.status());
  std::printf("%s\n", indexer::client::HealthStatusName(*health));
  return *health == indexer::client::HealthStatus::kServing ? kOk : kRpcError;
}

int Append(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  absl::StatusOr<v1::ValueDtype> dtype = DtypeFlag();
  if (!dtype.ok()) return UsageError(std::string(dtype.status().message()));
  const int tokens = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : 128;
  if (absl::GetFlag(FLAGS_tokens) < 0) return UsageError("--tokens must be >= 1");
  const bool all_layers = absl::GetFlag(FLAGS_all_layers);
  absl::StatusOr<v1::ServerInfoResponse> info = client.ServerInfo(Call());
  if (!info.ok()) return RpcError("ServerInfo", info.status());
  const size_t row = static_cast<size_t>(info->head_dim()) * (all_layers ? info->layers() : 1);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const std::vector<float> keys = RandomValues(rng, row * tokens);
  v1::AppendKeysRequest request =
      all_layers ? indexer::client::MakeAppendAllLayers(*id, tokens, keys, *dtype)
                 : indexer::client::MakeAppend(*id, absl::GetFlag(FLAGS_layer), tokens, keys,
                                               *dtype);

  const std::string pages = absl::GetFlag(FLAGS_attention_pages);
  if (pages == "auto") {
    // Ids for the blocks this append opens: the block indexes themselves.
    int64_t blocks = 0;
    int64_t longest = 0;
    absl::StatusOr<v1::GetSequenceResponse> seq = client.GetSequence(*id, Call());
    if (seq.ok()) {
      blocks = seq->pages_size();
      for (uint32_t l : seq->lengths()) longest = std::max<int64_t>(longest, l);
    } else if (seq.status().code() != absl::StatusCode::kNotFound) {
      return RpcError("GetSequence", seq.status());
    }
    int64_t after = longest;
    if (all_layers) {
      after = longest + tokens;
    } else if (seq.ok() && absl::GetFlag(FLAGS_layer) < seq->lengths_size()) {
      after = std::max<int64_t>(longest, seq->lengths(absl::GetFlag(FLAGS_layer)) + tokens);
    } else {
      after = std::max<int64_t>(longest, tokens);
    }
    const int64_t needed = (after + info->block_size() - 1) / info->block_size();
    for (int64_t b = blocks; b < needed; ++b) request.add_attention_pages(static_cast<int32_t>(b));
  } else if (!pages.empty()) {
    for (absl::string_view part : absl::StrSplit(pages, ',', absl::SkipWhitespace())) {
      int32_t v = 0;
      if (!absl::SimpleAtoi(part, &v)) {
        return UsageError(absl::StrCat("--attention_pages: '", part, "' is not an integer"));
      }
      request.add_attention_pages(v);
    }
  }
  absl::StatusOr<v1::AppendKeysResponse> r = client.AppendKeys(request, Call());
  if (!r.ok()) return RpcError("AppendKeys", r.status());
  std::printf("appended %d tokens to '%s'%s: lengths %s, %u blocks%s\n", tokens, id->c_str(),
              all_layers ? " (all layers)" : absl::StrCat(" (layer ", request.layer(), ")").c_str(),
              Lengths(r->lengths()).c_str(), r->num_blocks(), r->created() ? ", created" : "");
  return kOk;
}

int Select(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  absl::StatusOr<v1::ValueDtype> dtype = DtypeFlag();
  if (!dtype.ok()) return UsageError(std::string(dtype.status().message()));
  if (absl::GetFlag(FLAGS_tokens) < 0) return UsageError("--tokens must be >= 1");
  const int tokens = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : 1;
  const int heads = absl::GetFlag(FLAGS_heads);
  if (heads < 1) return UsageError("--heads must be >= 1");
  absl::StatusOr<v1::ServerInfoResponse> info = client.ServerInfo(Call());
  if (!info.ok()) return RpcError("ServerInfo", info.status());
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const std::vector<float> queries =
      RandomValues(rng, static_cast<size_t>(tokens) * heads * info->head_dim());
  v1::SelectBlocksRequest request =
      indexer::client::MakeSelect(*id, absl::GetFlag(FLAGS_layer), heads, tokens, queries,
                                  *dtype);
  ApplySelectFlags(&request);
  if (absl::GetFlag(FLAGS_start_position) >= 0) {
    request.set_start_position(absl::GetFlag(FLAGS_start_position));
  }
  absl::StatusOr<Selection> s = client.Select(request, Call());
  if (!s.ok()) return RpcError("SelectBlocks", s.status());
  PrintSelection(*s);
  return kOk;
}

int Get(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  absl::StatusOr<v1::GetSequenceResponse> r = client.GetSequence(*id, Call());
  if (!r.ok()) return RpcError("GetSequence", r.status());
  std::printf("sequence '%s': lengths %s\n", r->sequence_id().c_str(), Lengths(r->lengths()).c_str());
  std::printf("  pages (%d) [%s], %u shared\n", r->pages_size(), absl::StrJoin(r->pages(), " ").c_str(),
              r->shared_pages());
  if (r->attention_pages_size() > 0) {
    std::printf("  attention pages [%s]\n", absl::StrJoin(r->attention_pages(), " ").c_str());
  }
  return kOk;
}

int Fork(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  absl::StatusOr<std::string> target = RequiredFlag(absl::GetFlag(FLAGS_target), "target");
  if (!target.ok()) return UsageError(std::string(target.status().message()));
  std::optional<uint32_t> length;
  if (absl::GetFlag(FLAGS_length) >= 0) length = static_cast<uint32_t>(absl::GetFlag(FLAGS_length));
  absl::StatusOr<v1::ForkSequenceResponse> r = client.ForkSequence(*id, *target, length, Call());
  if (!r.ok()) return RpcError("ForkSequence", r.status());
  std::printf("forked '%s' -> '%s': lengths %s, %u blocks, %u shared\n", id->c_str(),
              target->c_str(), Lengths(r->lengths()).c_str(), r->num_blocks(), r->pages_shared());
  return kOk;
}

int Truncate(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  const int64_t length = absl::GetFlag(FLAGS_length);
  if (length < 0 || length > UINT32_MAX) return UsageError("truncate needs --length >= 0");
  absl::StatusOr<v1::TruncateSequenceResponse> r =
      client.TruncateSequence(*id, static_cast<uint32_t>(length), Call());
  if (!r.ok()) return RpcError("TruncateSequence", r.status());
  std::printf("truncated '%s': lengths %s, %u blocks, %u pages freed\n", id->c_str(),
              Lengths(r->lengths()).c_str(), r->num_blocks(), r->pages_freed());
  return kOk;
}

int Snapshot(IndexerClient& client) {
  absl::StatusOr<v1::SnapshotResponse> r = client.Snapshot(absl::GetFlag(FLAGS_name), Call());
  if (!r.ok()) return RpcError("Snapshot", r.status());
  std::printf("snapshot %s: %llu sequences, %llu pages, %llu bytes in %.3f s\n", r->path().c_str(),
              static_cast<unsigned long long>(r->sequences()),
              static_cast<unsigned long long>(r->pages()),
              static_cast<unsigned long long>(r->bytes()), r->seconds());
  return kOk;
}

// TLS and token options from the flags (files read here); a usage error when a file is missing.
absl::StatusOr<indexer::client::ClientOptions> SecurityOptions(const CommandLine& cl) {
  indexer::client::ClientOptions options;
  options.tls = absl::GetFlag(FLAGS_tls);
  const std::pair<std::string, std::string*> files[] = {
      {absl::GetFlag(FLAGS_tls_ca), &options.tls_root_ca_pem},
      {absl::GetFlag(FLAGS_tls_cert), &options.tls_cert_chain_pem},
      {absl::GetFlag(FLAGS_tls_key), &options.tls_private_key_pem}};
  for (const auto& [path, pem] : files) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> contents = indexer::client::ReadPemFile(path);
    if (!contents.ok()) return contents.status();
    *pem = *std::move(contents);
  }
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.bearer_token = absl::GetFlag(FLAGS_token);
  const bool token_on_command_line =
      std::find(cl.set_flags.begin(), cl.set_flags.end(), "token") != cl.set_flags.end();
  if (const char* env = std::getenv("INDEXER_TOKEN"); env != nullptr && !token_on_command_line) {
    options.bearer_token = env;
  }
  return options;
}

int Release(IndexerClient& client) {
  absl::StatusOr<std::string> id = RequiredFlag(absl::GetFlag(FLAGS_sequence), "sequence");
  if (!id.ok()) return UsageError(std::string(id.status().message()));
  absl::StatusOr<v1::ReleaseSequenceResponse> r = client.ReleaseSequence(*id, Call());
  if (!r.ok()) return RpcError("ReleaseSequence", r.status());
  std::printf("released '%s': %u pages freed\n", id->c_str(), r->pages_freed());
  return kOk;
}

// The demo workload. Every sequence it creates is released before it returns, whatever fails.
class Demo {
 public:
  explicit Demo(IndexerClient& client) : client_(client) {}
  ~Demo() { ReleaseAll(); }

  int Run() {
    const int n = absl::GetFlag(FLAGS_sequences);
    const int prefill = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : 8192;
    const int steps = absl::GetFlag(FLAGS_steps);
    const int heads = absl::GetFlag(FLAGS_heads);
    const int topk = absl::GetFlag(FLAGS_topk) >= 0 ? absl::GetFlag(FLAGS_topk) : 16;
    const int chunk = absl::GetFlag(FLAGS_chunk);
    if (n < 1 || steps < 0 || heads < 1 || topk < 1 || chunk < 1 || absl::GetFlag(FLAGS_tokens) < 0) {
      return UsageError("demo needs --sequences >= 1, --steps >= 0, --heads >= 1, --topk >= 1, --chunk >= 1");
    }
    absl::StatusOr<v1::ValueDtype> dtype = DtypeFlag();
    if (!dtype.ok()) return UsageError(std::string(dtype.status().message()));

    absl::StatusOr<v1::ServerInfoResponse> info = client_.ServerInfo(Call());
    if (!info.ok()) return RpcError("ServerInfo", info.status());
    const int d = static_cast<int>(info->head_dim());
    const int layers = static_cast<int>(info->layers());
    std::printf("server %s: %s backend (%s), head_dim %d, %d layer(s), %s keys, %llu of %llu pages free\n",
                info->version().c_str(), info->backend().c_str(), info->device().c_str(), d, layers,
                KeyStorageName(info->key_storage()),
                static_cast<unsigned long long>(info->free_pages()),
                static_cast<unsigned long long>(info->total_pages()));
    std::printf("demo: %d sequences x %d prefill tokens (chunks of %d), then %d decode steps "
                "(one Batch each: append 1 token + select %d heads, topk %d)\n",
                n, prefill, chunk, steps, heads, topk);

    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
    const std::string prefix = absl::StrCat("demo-", getpid(), "-", absl::ToUnixMicros(absl::Now()), "-");
    for (int s = 0; s < n; ++s) ids_.push_back(absl::StrCat(prefix, s));
    live_ = ids_;  // released at the end, or by the destructor when a step fails

    // Prefill: every layer's keys at once, as after a prefill chunk. Payloads are built before
    // the clock starts so that the numbers measure the service, not the random generator.
    std::vector<v1::AppendKeysRequest> chunks;
    int64_t payload_bytes = 0;
    for (int s = 0; s < n; ++s) {
      for (int done = 0; done < prefill; done += chunk) {
        const int len = std::min(chunk, prefill - done);
        const std::vector<float> keys = RandomValues(rng, static_cast<size_t>(len) * layers * d);
        chunks.push_back(indexer::client::MakeAppendAllLayers(ids_[s], len, keys, *dtype));
        payload_bytes += static_cast<int64_t>(chunks.back().keys().size());
      }
    }
    const absl::Time prefill_start = absl::Now();
    for (const v1::AppendKeysRequest& c : chunks) {
      absl::StatusOr<v1::AppendKeysResponse> r = client_.AppendKeys(c, Call());
      if (!r.ok()) return RpcError("AppendKeys (prefill)", r.status());
    }
    const double prefill_s = absl::ToDoubleSeconds(absl::Now() - prefill_start);
    const double prefill_tokens = static_cast<double>(n) * prefill;
    if (prefill > 0) {
      std::printf("prefill: %.0f tokens in %d AppendKeys calls, %.3f s: %.0f tokens/s, %.1f MB/s\n",
                  prefill_tokens, static_cast<int>(chunks.size()), prefill_s,
                  prefill_tokens / prefill_s, static_cast<double>(payload_bytes) / 1e6 / prefill_s);
    }

    // Decode: one Batch per step, one item per sequence.
    std::vector<double> latencies_ms;
    int64_t rows_checked = 0;
    const absl::Time decode_start = absl::Now();
    for (int step = 0; step < steps; ++step) {
      v1::BatchRequest batch;
      batch.set_request_id(static_cast<uint64_t>(step));
      for (int s = 0; s < n; ++s) {
        const std::vector<float> queries = RandomValues(rng, static_cast<size_t>(heads) * d);
        v1::SelectBlocksRequest* item = batch.add_items();
        *item = indexer::client::MakeSelect(ids_[s], 0, heads, 1, queries, *dtype);
        item->set_topk(topk);
        item->set_local_blocks(1);
        const std::vector<float> key = RandomValues(rng, static_cast<size_t>(layers) * d);
        *item->mutable_append() = indexer::client::MakeAppendAllLayers("", 1, key, *dtype);
      }
      const absl::Time t0 = absl::Now();
      absl::StatusOr<v1::BatchResponse> r = client_.Batch(batch, Call());
      latencies_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      if (!r.ok()) return RpcError(absl::StrCat("Batch (decode step ", step, ")"), r.status());
      if (r->results_size() != n || r->request_id() != batch.request_id()) {
        std::fprintf(stderr, "indexer-cli: decode step %d: %d results for %d items\n", step,
                     r->results_size(), n);
        return kRpcError;
      }
      for (int s = 0; s < n; ++s) {
        absl::Status item = indexer::client::ItemStatus(r->results(s));
        if (!item.ok()) return RpcError(absl::StrCat("decode step ", step, " item ", s), item);
        absl::StatusOr<Selection> sel = indexer::client::ParseSelection(r->results(s).result());
        if (!sel.ok()) return RpcError("decode step result", sel.status());
        const int64_t expected_pos = static_cast<int64_t>(prefill) + step;
        if (sel->num_tokens != 1 || sel->num_heads != heads || sel->topk != topk ||
            sel->start_position != expected_pos) {
          std::fprintf(stderr, "indexer-cli: decode step %d sequence %d: shape %dx%dx%d at %lld, "
                       "expected 1x%dx%d at %lld\n", step, s, sel->num_tokens, sel->num_heads,
                       sel->topk, static_cast<long long>(sel->start_position), heads, topk,
                       static_cast<long long>(expected_pos));
          return kRpcError;
        }
        for (int h = 0; h < heads; ++h) {
          const std::string problem = CheckRow(sel->blocks(0, h), sel->position(0), 1);
          if (!problem.empty()) {
            std::fprintf(stderr, "indexer-cli: decode step %d sequence %d head %d: %s\n", step, s,
                         h, problem.c_str());
            return kRpcError;
          }
          ++rows_checked;
        }
      }
    }
    const double decode_s = absl::ToDoubleSeconds(absl::Now() - decode_start);
    if (steps > 0) {
      std::printf("decode: %d steps x %d sequences in %.3f s: %.1f steps/s, %.0f selections/s "
                  "(sequence x head), %.0f tokens/s appended\n",
                  steps, n, decode_s, steps / decode_s, static_cast<double>(rows_checked) / decode_s,
                  static_cast<double>(steps) * n / decode_s);
      std::printf("step latency (ms): p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n",
                  Percentile(latencies_ms, 0.50), Percentile(latencies_ms, 0.90),
                  Percentile(latencies_ms, 0.99), Percentile(latencies_ms, 1.0));
      std::printf("check: %lld selection rows well formed (ids in range, distinct, -1 padded, "
                  "local block present)\n", static_cast<long long>(rows_checked));
    }
    // Every sequence should now hold prefill + steps tokens in every layer.
    for (const std::string& id : ids_) {
      absl::StatusOr<v1::GetSequenceResponse> g = client_.GetSequence(id, Call());
      if (!g.ok()) return RpcError("GetSequence", g.status());
      for (uint32_t len : g->lengths()) {
        if (len != static_cast<uint32_t>(prefill + steps)) {
          std::fprintf(stderr, "indexer-cli: sequence %s has length %u, expected %d\n", id.c_str(),
                       len, prefill + steps);
          return kRpcError;
        }
      }
    }
    const int64_t freed = ReleaseAll();
    if (freed < 0) return kRpcError;
    std::printf("released %d sequences, %lld pages freed\n", n, static_cast<long long>(freed));
    return kOk;
  }

 private:
  // Releases what the demo may have created (NOT_FOUND is fine: never created); -1 when a
  // release fails (reported).
  int64_t ReleaseAll() {
    int64_t freed = 0;
    bool failed = false;
    for (const std::string& id : live_) {
      absl::StatusOr<v1::ReleaseSequenceResponse> r = client_.ReleaseSequence(id, Call());
      if (r.ok()) {
        freed += r->pages_freed();
      } else if (r.status().code() != absl::StatusCode::kNotFound) {
        RpcError("ReleaseSequence", r.status());
        failed = true;
      }
    }
    live_.clear();
    return failed ? -1 : freed;
  }

  IndexerClient& client_;
  std::vector<std::string> ids_;
  std::vector<std::string> live_;  // ids that may exist on the server
};

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<CommandLine> cl = ParseArgs(argc, argv);
  if (!cl.ok()) return UsageError(std::string(cl.status().message()));
  if (cl->help) {
    PrintHelp();
    return kOk;
  }
  if (cl->version) {
    std::printf("indexer-cli %s\n", indexer::flags::ProgramVersion());
    return kOk;
  }
  if (cl->command.empty()) return UsageError("no command given");

  std::string server = absl::GetFlag(FLAGS_server);
  const bool server_on_command_line =
      std::find(cl->set_flags.begin(), cl->set_flags.end(), "server") != cl->set_flags.end();
  if (const char* env = std::getenv("INDEXER_SERVER"); env != nullptr && *env && !server_on_command_line) {
    server = env;
  }
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration()) return UsageError("--timeout must be > 0");

  const std::map<std::string, int (*)(IndexerClient&)> commands = {
      {"info", Info},   {"health", Health},     {"append", Append},   {"select", Select},
      {"get", Get},     {"fork", Fork},         {"truncate", Truncate}, {"release", Release},
      {"snapshot", Snapshot}, {"stats", Stats},
      {"demo", [](IndexerClient& c) { return Demo(c).Run(); }}};
  const auto command = commands.find(cl->command);
  if (command == commands.end()) return UsageError(absl::StrCat("unknown command '", cl->command, "'"));

  absl::StatusOr<indexer::client::ClientOptions> options = SecurityOptions(*cl);
  if (!options.ok()) return UsageError(std::string(options.status().message()));
  absl::StatusOr<std::unique_ptr<IndexerClient>> client = IndexerClient::Connect(server, *options);
  if (!client.ok()) return UsageError(std::string(client.status().message()));
  return command->second(**client);
}
