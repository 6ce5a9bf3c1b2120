// indexer-bench: the load tester of the indexer service. See `indexer-bench --help` and
// docs/BENCH.md. Exit status: 0 the run completed (no wrong answer, errors within --max_errors);
// 1 a wrong answer, too many errors, or the servers could not be reached; 2 a usage error;
// 128 + the signal when interrupted (the reports of what was measured are written first).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/bench/report.h"
#include "client/bench/request_region.h"
#include "client/bench/runner.h"
#include "client/bench/workload.h"
#include "client/cpp/sharded_client.h"
#include "flags/command_line.h"

// Servers and connections.
ABSL_FLAG(std::string, servers, "127.0.0.1:50051",
          "Server addresses, comma-separated: host:port, or unix:/path/to/socket for a server "
          "on a Unix domain socket (any gRPC target works); sequences are spread over them by "
          "consistent hashing of their ids (default: $INDEXER_SERVER when set)");
ABSL_FLAG(int32_t, connections, 1, "gRPC connections per server; workers use them round-robin");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30),
          "Deadline of each unary call (e.g. 500ms, 30s)");
ABSL_FLAG(absl::Duration, wait, absl::Seconds(10),
          "How long to wait at start for every server's health to be SERVING");
ABSL_FLAG(bool, tls, false,
          "Connect with TLS, trusting gRPC's default roots unless --tls_ca is given");
ABSL_FLAG(std::string, tls_ca, "", "TLS: PEM file of the CA that signed the servers' certificates");
ABSL_FLAG(std::string, tls_cert, "", "Mutual TLS: PEM file of this client's certificate");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: PEM file of this client's private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name to check the servers' certificates against (default: each target's host)");
ABSL_FLAG(std::string, token, "",
          "Bearer token sent with every call (default: $INDEXER_TOKEN; the environment keeps it "
          "out of the process list)");
ABSL_FLAG(int32_t, virtual_nodes, indexer::client::HashRing::kDefaultVirtualNodes,
          "Points per server on the consistent-hash ring (must match the schedulers' clients)");

// Workload.
ABSL_FLAG(std::string, prefill, "fixed:8192",
          "Prefill length per sequence, tokens: N, fixed:N, uniform:A-B, "
          "lognormal:median=M,sigma=S[,min=A][,max=B] or file:PATH (one length a line)");
ABSL_FLAG(int32_t, prefill_chunk, 2048, "Tokens per AppendKeys call of a prefill");
ABSL_FLAG(std::string, decode_steps, "uniform:32-512",
          "Decode steps per sequence before it is released (same forms as --prefill; >= 1). "
          "Varied by default, so that sequences end, and new ones are prefilled, at different "
          "steps");
ABSL_FLAG(int32_t, speculative, 1,
          "Tokens appended and queried per decode step (n > 1: speculative decoding)");
ABSL_FLAG(double, accept_rate, 0.7,
          "With --speculative > 1: chance each draft token is accepted; rejected tokens are "
          "rolled back with TruncateSequence");
ABSL_FLAG(int32_t, rewind, 0,
          "Every N decode steps, truncate each sequence back to its prefill length "
          "(TruncateSequence), so that a long timed run decodes at a steady length instead of a "
          "growing one; 0: never");
ABSL_FLAG(int32_t, heads, 4, "Index heads H per query token");
ABSL_FLAG(int32_t, topk, 16, "Blocks selected per (token, head)");
ABSL_FLAG(int32_t, init_blocks, -1, "Leading blocks always selected; -1: the server's default");
ABSL_FLAG(int32_t, local_blocks, -1, "Trailing blocks always selected; -1: the server's default");
ABSL_FLAG(int32_t, layers, 0,
          "Layers selected per decode step (one item each); 0: every layer of the server. "
          "Appends always carry every layer");
ABSL_FLAG(std::string, dtype, "bf16", "Wire dtype of keys and queries: bf16 or fp32");
ABSL_FLAG(bool, attention_pages, false,
          "Give sequences attention pages, so every answer carries a sparse page table");
ABSL_FLAG(std::string, values, "normal",
          "Key and query values: normal (N(0,1), rounded to bf16) or int (integers in [-4, 4]: "
          "exact dot products, so --check compares exactly)");
ABSL_FLAG(std::string, style, "batch",
          "Call style of decode requests: unary (one SelectBlocks per sequence and layer), batch "
          "(one Batch call per decode step of a worker's sequences) or stream (the same batches "
          "over one BatchStream per worker and server)");
ABSL_FLAG(int32_t, stream_inflight, 1,
          "With --style=stream: decode requests each worker keeps in flight on its stream, each "
          "for its own micro-batch of the worker's sequences (sequence slot i in micro-batch "
          "i mod N), as a scheduler overlapping micro-batches does; answers are matched by "
          "request_id and must come back in order");
ABSL_FLAG(std::string, shared_memory, "none",
          "Where decode requests' keys, queries and outputs travel: none (inline bytes), system "
          "(a POSIX shared memory region per worker, RegisterSystemRegion) or cuda (GPU memory "
          "per worker shared by its CUDA IPC handle, RegisterCudaRegion; bf16 values only). "
          "With a region every server must run on this host; requests carry references");
ABSL_FLAG(int32_t, cuda_device, 0,
          "With --shared_memory=cuda: the GPU of the workers' regions (the server must see it "
          "under the same ordinal)");
ABSL_FLAG(bool, stagger, true,
          "Start each stage's first sequences part-way through their decode steps (uniformly), "
          "so that they end, and their slots are prefilled again, one at a time instead of all "
          "together in the middle of the measurement");
ABSL_FLAG(std::string, trace, "",
          "Replay a request trace: a file of lines 'ARRIVAL_S PREFILL DECODE_STEPS' ('#' "
          "comments); sequence i arrives ARRIVAL_S seconds after the stage's load begins, waits "
          "for a free slot, and has those lengths (--prefill and --decode_steps are not used). "
          "The stage ends when the trace is done, or by --duration");
ABSL_FLAG(int32_t, batch, 8,
          "Live sequences per worker (one simulated scheduler's decode batch); finished "
          "sequences are released and replaced");
ABSL_FLAG(uint64_t, seed, 1, "Seed of every random choice (lengths, values, arrivals)");

// Load.
ABSL_FLAG(int32_t, concurrency, 0,
          "Workers (simulated schedulers), each with its own --batch sequences. Closed loop: "
          "requests in flight. Open loop: the most requests in flight. 0: 1 in closed loop, 8 in "
          "open loop");
ABSL_FLAG(double, rate, 0,
          "Open loop: decode requests per second across all workers (0: closed loop)");
ABSL_FLAG(std::string, arrivals, "constant",
          "Open-loop arrivals: constant, poisson, or file:PATH, the gaps between successive "
          "requests in microseconds, one a line, replayed in order and again from the top "
          "(perf_analyzer's --request-intervals; open loop without --rate)");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10),
          "Measured time of each stage, after the warm-up (0: no time limit)");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(1),
          "Warm-up of each stage: requests started in it are left out of the figures");
ABSL_FLAG(int64_t, requests, 0, "Measured decode requests per stage (0: no limit)");
ABSL_FLAG(int64_t, sequences, 0,
          "Sequences per stage: the stage ends when this many have been created, decoded and "
          "released (0: no limit; new sequences replace finished ones)");
ABSL_FLAG(std::string, sweep, "",
          "A sweep of stages: concurrency:VALUES or rate:VALUES, VALUES being a list (1,2,4,8) or "
          "a geometric range START..END*FACTOR (100..3200*2). Each stage runs --duration");
ABSL_FLAG(absl::Duration, sweep_max_latency, absl::ZeroDuration(),
          "Stop the sweep after the first stage whose --sweep_percentile latency exceeds this "
          "(0: run every stage)");
ABSL_FLAG(double, sweep_percentile, 99, "The percentile --sweep_max_latency applies to");
ABSL_FLAG(double, sweep_max_error_rate, 0.01,
          "Stop the sweep after a stage whose failed fraction of decode requests exceeds this");
ABSL_FLAG(double, stability, 10,
          "Stability check: each stage's measured window is cut into --stability_windows "
          "windows, and a stage whose windows' throughput or p50 latency differ from their mean "
          "by more than this percentage is reported unstable (a warning); identical sweep stages "
          "that differ by more than it are warned about too. 0: no check");
ABSL_FLAG(int32_t, stability_windows, 3, "Windows of the stability check (>= 2)");
ABSL_FLAG(absl::Duration, max_duration, absl::ZeroDuration(),
          "Longer than --duration: an unstable timed stage is extended one window at a time, up "
          "to this much measured time, until its last --stability_windows windows agree (0: "
          "never extend)");
ABSL_FLAG(absl::Duration, unreachable_timeout, absl::Seconds(10),
          "End the run with a reason when every call has failed with UNAVAILABLE for this long "
          "(the servers are down; workers back off from 10 ms to 1 s between attempts "
          "meanwhile). 0: never");
ABSL_FLAG(absl::Duration, interval, absl::ZeroDuration(),
          "Resolution of the timeline (latency over time); 0: about a fiftieth of a stage, "
          "0.1s to 5s");

// Correctness.
ABSL_FLAG(bool, check, false,
          "Check every answer against the CPU reference recomputed in the tester (keeps a host "
          "copy of every key; costs tester CPU)");
ABSL_FLAG(double, tolerance, 0.01,
          "--check with --values=normal: a different block may be chosen when its score is "
          "within this relative distance of the reference's k-th score");

// Output.
ABSL_FLAG(std::string, progress, "auto",
          "Live progress line on stderr: auto (when stderr is a terminal), on or off");
ABSL_FLAG(std::string, summary, "full",
          "Final summary on stdout: full, brief (one line per stage) or off");
ABSL_FLAG(std::string, json, "",
          "Write the JSON report here ('-': stdout, alone: the summary then goes to stderr)");
ABSL_FLAG(std::string, csv, "",
          "Write the CSV report (one row per stage) here ('-': stdout, alone: the summary then "
          "goes to stderr)");
ABSL_FLAG(std::string, html, "", "Write the HTML report (charts; opens offline) here");
ABSL_FLAG(bool, server_stats, true,
          "Read every server's GetStats when each stage's warm-up ends and when it ends, and "
          "report the difference: backend selections and their time (the kernels), spans per "
          "selection, handler queue time, server-side latency by RPC and the time of each phase "
          "of a step (indexer_step_phase_seconds, from servers that export it)");
ABSL_FLAG(int64_t, max_errors, 0,
          "Exit status 1 when more decode requests than this failed (-1: never)");

namespace {

namespace bench = indexer::bench;
namespace client = indexer::client;
namespace v1 = indexer::v1;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kUsage = indexer::flags::kUsageExit;
// Interrupted by a signal: 128 + its number (130 for Ctrl-C), after writing the reports.
volatile sig_atomic_t interrupted_by = 0;

constexpr char kUsageText[] =
    R"(indexer-bench: the load tester of the indexer service (sparse-attention block selection).

It plays one or more LLM schedulers against indexer servers: sequences are created, prefilled
(AppendKeys of every layer, in chunks), decoded step by step (each step appends the new tokens'
keys and selects blocks for their queries on each layer, as one RPC per sequence and layer, one
Batch call per step, or one BatchStream message per step) and released, and replaced by new ones.
It measures decode requests in closed loop (--concurrency workers, each sending its next request
when the last one answered) or open loop (--rate requests/s, constant or Poisson; latency counts
from the intended send time, so a server that falls behind shows as latency), optionally sweeping
concurrency or rate until a latency threshold, and reports throughput, latency percentiles, a
histogram and status codes, as text, JSON, CSV and an HTML report with charts. --check verifies
every answer against the CPU reference.

Usage: indexer-bench [flags]

Examples:
  indexer-bench --servers=127.0.0.1:50051 --duration=20s --concurrency=4
  indexer-bench --servers=unix:/run/indexer/indexer.sock --style=stream --stream_inflight=2
  indexer-bench --rate=500 --arrivals=poisson --duration=30s --html=report.html
  indexer-bench --sweep=concurrency:1,2,4,8,16 --sweep_max_latency=20ms --json=sweep.json
  indexer-bench --sweep=rate:100..3200*2 --duration=10s --html=sweep.html
  indexer-bench --values=int --check --prefill=uniform:1000-9000 --decode_steps=32 --sequences=64
  indexer-bench --servers=indexer-0:50051,indexer-1:50051 --style=stream --speculative=4
  indexer-bench --trace=arrivals.txt --batch=32 --json=- | jq .stages[0].latency_ms

Exit status: 0 the run completed with no wrong answer and at most --max_errors failed requests;
1 a wrong answer, more failed requests, a stage ended early because the servers could not be
reached, or they could not be reached at the start; 2 a flag that could not be parsed or a
refused value; 128 + the signal (130 for Ctrl-C) when interrupted, after writing the reports of
what was measured.
)";

// Flags in the order --help lists them, by section.
const std::vector<std::pair<const char*, std::vector<const char*>>>& FlagSections() {
  static const auto* sections = new std::vector<std::pair<const char*, std::vector<const char*>>>{
      {"Servers",
       {"servers", "connections", "timeout", "wait", "tls", "tls_ca", "tls_cert", "tls_key",
        "tls_server_name", "token", "virtual_nodes"}},
      {"Workload",
       {"prefill", "prefill_chunk", "decode_steps", "speculative", "accept_rate", "rewind",
        "heads", "topk", "init_blocks", "local_blocks", "layers", "dtype", "attention_pages",
        "values", "style", "stream_inflight", "shared_memory", "cuda_device", "batch", "stagger", "trace",
        "seed"}},
      {"Load",
       {"concurrency", "rate", "arrivals", "duration", "warmup", "requests", "sequences", "sweep",
        "sweep_max_latency", "sweep_percentile", "sweep_max_error_rate", "stability",
        "stability_windows", "max_duration", "unreachable_timeout", "interval"}},
      {"Correctness", {"check", "tolerance"}},
      {"Output", {"progress", "summary", "json", "csv", "html", "server_stats", "max_errors"}},
  };
  return *sections;
}

const indexer::flags::FlagFilter IsOurFlag = indexer::flags::FlagsDefinedIn("client/bench/");

// `text` as lines of at most `width` columns, each indented by `indent` spaces.
std::string Wrap(const std::string& text, int indent, int width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && static_cast<int>(line.size() + 1 + word.size()) + indent > width) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

void PrintHelp() {
  std::printf("%s\nFlags (--name=value; booleans also --name and --noname):\n", kUsageText);
  for (const auto& [section, names] : FlagSections()) {
    std::printf("\n%s:\n", section);
    for (const char* name : names) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr) continue;
      const std::string def = flag->DefaultValue();
      std::printf("  --%s (default: %s)\n%s", name, def.empty() ? "''" : def.c_str(),
                  Wrap(flag->Help(), 6, 96).c_str());
    }
  }
}

int UsageError(const std::string& message) {
  return indexer::flags::ReportUsageError("indexer-bench", message);
}

// Parses argv (flags/command_line.h); "help" is accepted as the one positional argument.
absl::StatusOr<indexer::flags::CommandLine> ParseFlags(int argc, char** argv) {
  absl::StatusOr<indexer::flags::CommandLine> cl =
      indexer::flags::ParseCommandLine(argc, argv, IsOurFlag);
  if (!cl.ok()) return cl.status();
  for (const std::string& arg : cl->positional) {
    if (arg != "help") {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    cl->help = true;
  }
  return cl;
}

const char* KeyStorageName(v1::KeyStorage s) {
  switch (s) {
    case v1::KEY_STORAGE_FP8_E4M3: return "fp8_e4m3";
    case v1::KEY_STORAGE_FP4_E2M1: return "fp4_e2m1";
    default: return "bf16";
  }
}

std::string DurationText(absl::Duration d) { return absl::FormatDuration(d); }

void OnSignal(int signal_number) {
  interrupted_by = signal_number;
  bench::RequestStop();
  signal(SIGINT, SIG_DFL);  // a second Ctrl-C ends the process at once
  signal(SIGTERM, SIG_DFL);
}

struct Plan {
  client::ClientOptions client;
  bench::WorkloadSpec spec;
  bench::SweepPlan sweep;
  bench::LoadOptions load;
  std::vector<std::string> servers;
};

// Reads every flag into a Plan (before the servers are known). Errors name the flag.
absl::StatusOr<Plan> PlanFromFlags() {
  Plan p;
  for (absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipWhitespace())) {
    p.servers.emplace_back(absl::StripAsciiWhitespace(s));
  }
  if (p.servers.empty()) return absl::InvalidArgumentError("--servers is empty");
  if (absl::GetFlag(FLAGS_connections) < 1)
    return absl::InvalidArgumentError("--connections must be >= 1");
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration())
    return absl::InvalidArgumentError("--timeout must be > 0");
  if (absl::GetFlag(FLAGS_virtual_nodes) < 1)
    return absl::InvalidArgumentError("--virtual_nodes must be >= 1");
  p.client.default_timeout = absl::GetFlag(FLAGS_timeout);
  p.client.tls = absl::GetFlag(FLAGS_tls);
  p.client.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  for (const auto& [flag, pem] : {std::pair{"tls_ca", &p.client.tls_root_ca_pem},
                                  std::pair{"tls_cert", &p.client.tls_cert_chain_pem},
                                  std::pair{"tls_key", &p.client.tls_private_key_pem}}) {
    absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag);
    const std::string path = f->CurrentValue();
    if (path.empty()) continue;
    absl::StatusOr<std::string> contents = client::ReadPemFile(path);
    if (!contents.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": ", contents.status().message()));
    *pem = *contents;
  }
  p.client.bearer_token = absl::GetFlag(FLAGS_token);

  bench::WorkloadSpec& w = p.spec;
  absl::StatusOr<bench::LengthDistribution> prefill =
      bench::LengthDistribution::Parse(absl::GetFlag(FLAGS_prefill));
  if (!prefill.ok())
    return absl::InvalidArgumentError(absl::StrCat("--prefill: ", prefill.status().message()));
  w.prefill = *prefill;
  absl::StatusOr<bench::LengthDistribution> steps =
      bench::LengthDistribution::Parse(absl::GetFlag(FLAGS_decode_steps));
  if (!steps.ok())
    return absl::InvalidArgumentError(absl::StrCat("--decode_steps: ", steps.status().message()));
  w.decode_steps = *steps;
  w.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  w.speculative = absl::GetFlag(FLAGS_speculative);
  w.accept_rate = absl::GetFlag(FLAGS_accept_rate);
  w.rewind = absl::GetFlag(FLAGS_rewind);
  w.heads = absl::GetFlag(FLAGS_heads);
  w.topk = absl::GetFlag(FLAGS_topk);
  w.init_blocks = absl::GetFlag(FLAGS_init_blocks);
  w.local_blocks = absl::GetFlag(FLAGS_local_blocks);
  w.layers = absl::GetFlag(FLAGS_layers);
  if (w.layers < 0) return absl::InvalidArgumentError("--layers must be >= 0");
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    w.wire_dtype = v1::VALUE_DTYPE_BF16;
  } else if (dtype == "fp32") {
    w.wire_dtype = v1::VALUE_DTYPE_FP32;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype is '", dtype, "'; it must be bf16 or fp32"));
  }
  w.attention_pages = absl::GetFlag(FLAGS_attention_pages);
  absl::StatusOr<bench::ValueKind> values = bench::ParseValueKind(absl::GetFlag(FLAGS_values));
  if (!values.ok())
    return absl::InvalidArgumentError(absl::StrCat("--values: ", values.status().message()));
  w.values = *values;
  absl::StatusOr<bench::CallStyle> style = bench::ParseCallStyle(absl::GetFlag(FLAGS_style));
  if (!style.ok())
    return absl::InvalidArgumentError(absl::StrCat("--style: ", style.status().message()));
  w.style = *style;
  w.stream_inflight = absl::GetFlag(FLAGS_stream_inflight);
  absl::StatusOr<bench::SharedMemory> shared =
      bench::ParseSharedMemory(absl::GetFlag(FLAGS_shared_memory));
  if (!shared.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared_memory: ", shared.status().message()));
  }
  w.shared_memory = *shared;
  w.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  w.batch = absl::GetFlag(FLAGS_batch);
  w.stagger = absl::GetFlag(FLAGS_stagger);
  if (const std::string trace = absl::GetFlag(FLAGS_trace); !trace.empty()) {
    absl::StatusOr<std::vector<bench::TraceEntry>> entries = bench::ReadTrace(trace);
    if (!entries.ok())
      return absl::InvalidArgumentError(absl::StrCat("--trace: ", entries.status().message()));
    w.trace = std::make_shared<const std::vector<bench::TraceEntry>>(std::move(*entries));
  }
  w.seed = absl::GetFlag(FLAGS_seed);
  w.id_prefix = absl::StrCat("bench-", getpid(), "-", absl::ToUnixMillis(absl::Now()), "-");

  bench::StageSetup base;
  const double rate = absl::GetFlag(FLAGS_rate);
  if (!(rate >= 0)) return absl::InvalidArgumentError("--rate must be >= 0");
  const std::string arrivals_flag = absl::GetFlag(FLAGS_arrivals);
  absl::string_view intervals_path = arrivals_flag;
  const bool replay = absl::ConsumePrefix(&intervals_path, "file:");
  if (replay) {
    if (rate > 0 || absl::StartsWith(absl::GetFlag(FLAGS_sweep), "rate:")) {
      return absl::InvalidArgumentError(
          "--arrivals=file:PATH sets the request times itself: drop --rate and --sweep=rate");
    }
    absl::StatusOr<std::vector<double>> gaps =
        bench::ReadRequestIntervals(std::string(intervals_path));
    if (!gaps.ok())
      return absl::InvalidArgumentError(absl::StrCat("--arrivals: ", gaps.status().message()));
    double total = 0;
    for (double g : *gaps) total += g;
    base.target_rate = static_cast<double>(gaps->size()) / total;
    base.gaps_s = std::make_shared<const std::vector<double>>(std::move(*gaps));
    base.arrivals = bench::Arrivals::kReplay;
  } else {
    absl::StatusOr<bench::Arrivals> arrivals = bench::ParseArrivals(arrivals_flag);
    if (!arrivals.ok())
      return absl::InvalidArgumentError(absl::StrCat("--arrivals: ", arrivals.status().message()));
    base.arrivals = *arrivals;
    base.target_rate = rate;
  }
  const bool open_loop =
      rate > 0 || replay || absl::StartsWith(absl::GetFlag(FLAGS_sweep), "rate:");
  base.concurrency = absl::GetFlag(FLAGS_concurrency);
  if (base.concurrency < 0) return absl::InvalidArgumentError("--concurrency must be >= 0");
  if (base.concurrency == 0) base.concurrency = open_loop ? 8 : 1;
  base.open_loop = rate > 0 || replay;
  base.duration_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_duration));
  base.warmup_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_warmup));
  base.max_requests = absl::GetFlag(FLAGS_requests);
  base.max_sequences = absl::GetFlag(FLAGS_sequences);
  if (base.duration_s < 0 || base.warmup_s < 0 || base.max_requests < 0 || base.max_sequences < 0) {
    return absl::InvalidArgumentError(
        "--duration, --warmup, --requests and --sequences must be >= 0");
  }
  if (base.duration_s == 0 && base.max_requests == 0 && base.max_sequences == 0 &&
      w.trace == nullptr) {
    return absl::InvalidArgumentError(
        "give a limit: --duration, --requests, --sequences or --trace");
  }

  const std::string sweep = absl::GetFlag(FLAGS_sweep);
  p.sweep.max_latency_ms = absl::ToDoubleMilliseconds(absl::GetFlag(FLAGS_sweep_max_latency));
  p.sweep.percentile = absl::GetFlag(FLAGS_sweep_percentile) / 100.0;
  if (!(p.sweep.percentile > 0 && p.sweep.percentile <= 1)) {
    return absl::InvalidArgumentError("--sweep_percentile must be in (0, 100]");
  }
  p.sweep.max_error_rate = absl::GetFlag(FLAGS_sweep_max_error_rate);
  const auto label = [](const bench::StageSetup& s) {
    if (s.arrivals == bench::Arrivals::kReplay) {
      return absl::StrFormat("replayed intervals (%.4g/s)", s.target_rate);
    }
    return s.open_loop ? absl::StrFormat("rate %g/s", s.target_rate)
                       : absl::StrCat("concurrency ", s.concurrency);
  };
  if (sweep.empty()) {
    base.label = label(base);
    p.sweep.stages.push_back(base);
  } else {
    const size_t colon = sweep.find(':');
    const std::string kind = sweep.substr(0, colon);
    if (colon == std::string::npos || (kind != "concurrency" && kind != "rate")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sweep is '", sweep, "'; it must be concurrency:VALUES or rate:VALUES"));
    }
    absl::StatusOr<std::vector<double>> values = bench::ParseSweepValues(sweep.substr(colon + 1));
    if (!values.ok())
      return absl::InvalidArgumentError(absl::StrCat("--sweep: ", values.status().message()));
    p.sweep.kind = kind;
    for (double v : *values) {
      bench::StageSetup s = base;
      if (kind == "concurrency") {
        s.concurrency = static_cast<int>(v);
        if (s.concurrency < 1)
          return absl::InvalidArgumentError("--sweep: concurrency must be >= 1");
      } else {
        s.open_loop = true;
        s.target_rate = v;
      }
      s.label = label(s);
      p.sweep.stages.push_back(s);
    }
  }
  p.load.interval_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_interval));
  if (p.load.interval_s < 0) return absl::InvalidArgumentError("--interval must be >= 0");
  if (p.load.interval_s == 0) {
    // About 50 points per stage, on a 1-2-5 grid.
    const double want = base.duration_s > 0 ? (base.duration_s + base.warmup_s) / 50 : 0.5;
    p.load.interval_s = 5;
    for (double nice : {0.1, 0.2, 0.5, 1.0, 2.0, 5.0}) {
      if (nice >= want) {
        p.load.interval_s = nice;
        break;
      }
    }
  }
  p.load.timeout = absl::GetFlag(FLAGS_timeout);
  p.load.check = absl::GetFlag(FLAGS_check);
  p.load.tolerance = absl::GetFlag(FLAGS_tolerance);
  if (!(p.load.tolerance >= 0)) return absl::InvalidArgumentError("--tolerance must be >= 0");
  p.load.seed = w.seed;
  p.load.server_stats = absl::GetFlag(FLAGS_server_stats);
  p.load.stability_percent = absl::GetFlag(FLAGS_stability);
  p.load.stability_windows = absl::GetFlag(FLAGS_stability_windows);
  p.load.max_duration_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_max_duration));
  p.load.unreachable_timeout_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_unreachable_timeout));
  if (!(p.load.stability_percent >= 0)) {
    return absl::InvalidArgumentError("--stability must be >= 0 (percent)");
  }
  if (p.load.stability_windows < 2) {
    return absl::InvalidArgumentError("--stability_windows must be >= 2");
  }
  if (p.load.max_duration_s < 0 || p.load.unreachable_timeout_s < 0) {
    return absl::InvalidArgumentError("--max_duration and --unreachable_timeout must be >= 0");
  }
  if (p.load.max_duration_s > 0 && p.load.max_duration_s < base.duration_s) {
    return absl::InvalidArgumentError("--max_duration must be at least --duration (or 0)");
  }
  if (absl::GetFlag(FLAGS_json) == "-" && absl::GetFlag(FLAGS_csv) == "-") {
    return absl::InvalidArgumentError("--json and --csv cannot both write to stdout ('-')");
  }
  const std::string summary = absl::GetFlag(FLAGS_summary);
  if (summary != "full" && summary != "brief" && summary != "off") {
    return absl::InvalidArgumentError("--summary must be full, brief or off");
  }
  const std::string progress = absl::GetFlag(FLAGS_progress);
  if (progress != "auto" && progress != "on" && progress != "off") {
    return absl::InvalidArgumentError("--progress must be auto, on or off");
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<indexer::flags::CommandLine> cl = ParseFlags(argc, argv);
  if (!cl.ok()) return UsageError(std::string(cl.status().message()));
  if (cl->help) {
    PrintHelp();
    return kOk;
  }
  if (cl->version) {
    std::printf("indexer-bench %s\n", indexer::flags::ProgramVersion());
    return kOk;
  }
  const std::vector<std::string>& set = cl->set;
  const bool servers_given = std::find(set.begin(), set.end(), "servers") != set.end();
  if (const char* env = std::getenv("INDEXER_SERVER"); env != nullptr && *env && !servers_given) {
    absl::SetFlag(&FLAGS_servers, std::string(env));
  }
  const bool token_given = std::find(set.begin(), set.end(), "token") != set.end();
  if (const char* env = std::getenv("INDEXER_TOKEN"); env != nullptr && *env && !token_given) {
    absl::SetFlag(&FLAGS_token, std::string(env));
  }
  absl::StatusOr<Plan> plan = PlanFromFlags();
  if (!plan.ok()) return UsageError(std::string(plan.status().message()));

  // Connections: one ShardedClient per --connections, each with its own TCP connections.
  std::vector<std::unique_ptr<client::ShardedClient>> owned;
  std::vector<client::ShardedClient*> connections;
  for (int c = 0; c < absl::GetFlag(FLAGS_connections); ++c) {
    client::ShardedClientOptions options;
    options.client = plan->client;
    options.virtual_nodes = absl::GetFlag(FLAGS_virtual_nodes);
    absl::StatusOr<std::unique_ptr<client::ShardedClient>> sc =
        client::ShardedClient::Connect(plan->servers, options);
    if (!sc.ok()) return UsageError(std::string(sc.status().message()));
    connections.push_back(sc->get());
    owned.push_back(std::move(*sc));
  }
  if (absl::Status st = connections[0]->WaitUntilServing(absl::GetFlag(FLAGS_wait)); !st.ok()) {
    std::fprintf(stderr, "indexer-bench: the servers are not serving: %s\n", st.ToString().c_str());
    return kFailed;
  }
  absl::StatusOr<std::vector<v1::ServerInfoResponse>> infos =
      connections[0]->ServerInfoAll(client::CallOptions::Timeout(plan->load.timeout));
  if (!infos.ok()) {
    std::fprintf(stderr, "indexer-bench: ServerInfo failed: %s\n",
                 infos.status().ToString().c_str());
    return kFailed;
  }
  const bench::ServerShape shape = bench::ShapeFromInfo((*infos)[0]);
  for (size_t s = 1; s < infos->size(); ++s) {
    const v1::ServerInfoResponse& i = (*infos)[s];
    if (static_cast<int>(i.head_dim()) != shape.head_dim ||
        static_cast<int>(i.layers()) != shape.layers ||
        i.key_storage() != (*infos)[0].key_storage()) {
      std::fprintf(stderr, "indexer-bench: %s differs from %s in head_dim, layers or key storage\n",
                   plan->servers[s].c_str(), plan->servers[0].c_str());
      return kUsage;
    }
  }
  if (absl::Status st = bench::Validate(&plan->spec, shape); !st.ok()) {
    return UsageError(std::string(st.message()));
  }
  const bench::WorkloadSpec& spec = plan->spec;
  if (spec.shared_memory != bench::SharedMemory::kNone) {
    // Every server must take a region of this host's before any worker relies on one.
    absl::StatusOr<std::unique_ptr<bench::RequestRegion>> probe = bench::RequestRegion::Create(
        *connections[0], bench::SlabBytes(spec, shape), 1,
        client::CallOptions::Timeout(plan->load.timeout), spec.shared_memory, spec.cuda_device);
    if (!probe.ok()) {
      std::fprintf(stderr, "indexer-bench: --shared_memory=%s: %s\n",
                   bench::SharedMemoryName(spec.shared_memory), probe.status().ToString().c_str());
      return kFailed;
    }
  }

  // A sequence at its longest, times the live sequences, against the pool.
  int max_workers = 0;
  for (const bench::StageSetup& s : plan->sweep.stages)
    max_workers = std::max(max_workers, s.concurrency);
  const int64_t pages_each = bench::BlocksFor(bench::LongestSequence(spec));
  const int64_t pages_needed = pages_each * spec.batch * max_workers;
  int64_t pages_total = 0;
  for (const v1::ServerInfoResponse& i : *infos)
    pages_total += static_cast<int64_t>(i.free_pages());
  if (pages_needed > pages_total) {
    std::fprintf(stderr,
                 "indexer-bench: warning: up to %lld live sequences of up to %lld pages each may "
                 "need %lld pages; the servers have %lld free: expect RESOURCE_EXHAUSTED\n",
                 static_cast<long long>(spec.batch) * max_workers,
                 static_cast<long long>(pages_each), static_cast<long long>(pages_needed),
                 static_cast<long long>(pages_total));
  }

  const size_t row = static_cast<size_t>(shape.layers) * shape.head_dim;
  const size_t largest = std::max(
      {static_cast<size_t>(spec.prefill_chunk) * row, static_cast<size_t>(spec.speculative) * row,
       static_cast<size_t>(spec.speculative) * spec.heads * shape.head_dim});
  const bench::ValuePool pool(spec.values, std::max<size_t>(size_t{1} << 20, 2 * largest),
                              spec.seed);

  bench::BenchReport report;
  report.version = indexer::flags::ProgramVersion();
  report.started_at = absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    // The command line goes into reports: never a token.
    args.push_back(absl::StartsWith(argv[i], "--token") ? "--token=(hidden)" : argv[i]);
  }
  args.insert(args.begin(), "indexer-bench");
  report.command_line = absl::StrJoin(args, " ");
  for (size_t s = 0; s < infos->size(); ++s) {
    const v1::ServerInfoResponse& i = (*infos)[s];
    report.servers.push_back(bench::ServerSummary{
        plan->servers[s], i.version(), i.backend(), i.device(), static_cast<int>(i.head_dim()),
        static_cast<int>(i.layers()), KeyStorageName(i.key_storage()),
        static_cast<int64_t>(i.total_pages()), static_cast<int64_t>(i.free_pages())});
  }
  const indexer::kernels::SelectParams params = bench::EffectiveParams(spec, shape);
  const std::string rewind_text =
      spec.rewind > 0 ? absl::StrCat(", back to the prefill every ", spec.rewind) : "";
  report.workload = {
      {"prefill", absl::StrCat(spec.trace != nullptr ? "from the trace" : spec.prefill.ToString(),
                               " tokens (chunks of ", spec.prefill_chunk, ")")},
      {"decode steps",
       absl::StrCat(spec.trace != nullptr ? "from the trace" : spec.decode_steps.ToString(),
                    rewind_text,
                    spec.trace == nullptr && spec.stagger ? " (first sequences staggered)" : "")},
      {"speculative",
       spec.speculative > 1
           ? absl::StrCat(spec.speculative, " tokens/step, accept rate ", spec.accept_rate)
           : "1 token/step"},
      {"heads", absl::StrCat(spec.heads)},
      {"topk", absl::StrCat(spec.topk, " (init ", params.init_blocks, ", local ",
                            params.local_blocks, ")")},
      {"layers", absl::StrCat(spec.layers, " selected of ", shape.layers)},
      {"wire dtype", spec.wire_dtype == v1::VALUE_DTYPE_FP32 ? "fp32" : "bf16"},
      {"attention pages", spec.attention_pages ? "on" : "off"},
      {"values", bench::ValueKindName(spec.values)},
      {"call style",
       spec.stream_inflight > 1
           ? absl::StrCat(bench::CallStyleName(spec.style), ", ", spec.stream_inflight,
                          " requests in flight per stream (one micro-batch each)")
           : bench::CallStyleName(spec.style)},
      {"tensors", spec.shared_memory == bench::SharedMemory::kSystem ? "by reference (system shared memory)"
                  : spec.shared_memory == bench::SharedMemory::kCuda ? "by reference (CUDA regions)"
                                                                     : "inline"},
      {"sequences per worker", absl::StrCat(spec.batch)},
      {"seed", absl::StrCat(spec.seed)},
  };
  if (spec.trace != nullptr) {
    report.workload.emplace_back(
        "trace", absl::StrFormat("%s: %d sequences arriving over %.3g s", absl::GetFlag(FLAGS_trace),
                                 spec.trace->size(), spec.trace->back().at_s));
  }
  const bench::StageSetup& base = plan->sweep.stages.front();
  report.load = {
      {"mode", plan->sweep.kind.empty() ? (base.open_loop ? "open loop" : "closed loop")
                                        : absl::StrCat("sweep over ", plan->sweep.kind)},
      {"concurrency", plan->sweep.kind == "concurrency" ? absl::GetFlag(FLAGS_sweep)
                                                        : absl::StrCat(base.concurrency)},
      {"duration", absl::StrCat(DurationText(absl::GetFlag(FLAGS_duration)), " after ",
                                DurationText(absl::GetFlag(FLAGS_warmup)), " warm-up")},
      {"connections", absl::StrCat(absl::GetFlag(FLAGS_connections), " per server")},
      {"servers", absl::StrJoin(plan->servers, ",")},
  };
  if (base.open_loop || plan->sweep.kind == "rate") {
    report.load.emplace_back("rate", plan->sweep.kind == "rate"
                                         ? absl::GetFlag(FLAGS_sweep)
                                         : absl::StrFormat("%g/s", base.target_rate));
    report.load.emplace_back("arrivals", base.arrivals == bench::Arrivals::kReplay
                                             ? absl::GetFlag(FLAGS_arrivals)
                                             : bench::ArrivalsName(base.arrivals));
  }
  if (base.max_requests > 0) report.load.emplace_back("requests", absl::StrCat(base.max_requests));
  if (base.max_sequences > 0)
    report.load.emplace_back("sequences", absl::StrCat(base.max_sequences));
  if (plan->load.stability_percent > 0) {
    report.load.emplace_back(
        "stability", absl::StrCat(plan->load.stability_windows, " windows within ",
                                  plan->load.stability_percent, "%",
                                  plan->load.max_duration_s > 0
                                      ? absl::StrCat(", extended up to ",
                                                     DurationText(absl::GetFlag(FLAGS_max_duration)))
                                      : ""));
  }
  if (!plan->sweep.kind.empty() && plan->sweep.max_latency_ms > 0) {
    report.load.emplace_back("sweep stop", absl::StrCat("p", plan->sweep.percentile * 100, " > ",
                                                        plan->sweep.max_latency_ms, " ms"));
  }
  report.sweep_kind = plan->sweep.kind;
  report.sweep_max_latency_ms = plan->sweep.max_latency_ms;
  report.sweep_percentile = plan->sweep.percentile;
  report.check = plan->load.check;
  report.exact_check = spec.values == bench::ValueKind::kInteger;
  report.interval_s = plan->load.interval_s;

  const std::string progress_flag = absl::GetFlag(FLAGS_progress);
  const bool progress = progress_flag == "on" || (progress_flag == "auto" && isatty(2));
  bench::ProgressFn on_progress;
  if (progress) {
    on_progress = [](const bench::StageSetup& setup, int stage, int stages,
                     const bench::ProgressSnapshot& snapshot) {
      std::fprintf(stderr, "\r\033[K%s",
                   bench::ProgressLine(setup, stage, stages, snapshot).c_str());
      std::fflush(stderr);
    };
  }
  std::fprintf(stderr,
               "indexer-bench: %zu stage(s) against %zu server(s), %s style, %d sequences per "
               "worker%s\n",
               plan->sweep.stages.size(), plan->servers.size(), bench::CallStyleName(spec.style),
               spec.batch, plan->load.check ? ", checking every answer" : "");
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  absl::StatusOr<bench::SweepOutcome> outcome =
      bench::RunSweep(plan->sweep, spec, shape, pool, connections, plan->load, on_progress);
  if (progress) std::fprintf(stderr, "\r\033[K");
  if (!outcome.ok()) {
    std::fprintf(stderr, "indexer-bench: %s\n", outcome.status().ToString().c_str());
    return kFailed;
  }
  report.stages = std::move(outcome->stages);
  report.stop_reason = outcome->stop_reason;
  if (interrupted_by != 0) {
    report.stop_reason = absl::StrCat("interrupted by ", interrupted_by == SIGINT ? "SIGINT (Ctrl-C)"
                                                                                  : "SIGTERM");
  }
  report.warnings = bench::RunWarnings(report.stages, plan->load.stability_percent);

  // A report written to stdout is alone there: the summary goes to stderr then.
  const bool stdout_taken = absl::GetFlag(FLAGS_json) == "-" || absl::GetFlag(FLAGS_csv) == "-";
  const std::string summary = absl::GetFlag(FLAGS_summary);
  if (summary != "off") {
    FILE* to = stdout_taken ? stderr : stdout;
    std::fputs(summary == "brief" ? bench::BriefSummary(report).c_str()
                                  : bench::TextSummary(report).c_str(),
               to);
    std::fflush(to);
  } else {
    for (const std::string& w : report.warnings) {
      std::fprintf(stderr, "indexer-bench: warning: %s\n", w.c_str());
    }
    if (!report.stop_reason.empty()) {
      std::fprintf(stderr, "indexer-bench: stopped: %s\n", report.stop_reason.c_str());
    }
  }
  int status = kOk;
  const std::pair<std::string, std::string (*)(const bench::BenchReport&)> exports[] = {
      {absl::GetFlag(FLAGS_json), bench::JsonReport},
      {absl::GetFlag(FLAGS_csv), bench::CsvReport},
      {absl::GetFlag(FLAGS_html), bench::HtmlReport}};
  for (const auto& [path, render] : exports) {
    if (path.empty()) continue;
    if (absl::Status st = bench::WriteTextFile(path, render(report)); !st.ok()) {
      std::fprintf(stderr, "indexer-bench: %s\n", std::string(st.message()).c_str());
      status = kFailed;
    } else if (path != "-") {
      std::fprintf(stderr, "indexer-bench: wrote %s\n", path.c_str());
    }
  }
  int64_t errors = 0, mismatches = 0;
  for (const bench::StageResult& r : report.stages) {
    errors += r.decode().errors;
    mismatches += r.check.mismatches;
    if (!r.stop_reason.empty() && interrupted_by == 0) {
      std::fprintf(stderr, "indexer-bench: FAILED: stage '%s' ended early: %s\n",
                   r.setup.label.c_str(), r.stop_reason.c_str());
      status = kFailed;
    }
  }
  if (mismatches > 0) {
    std::fprintf(stderr, "indexer-bench: FAILED: %lld answers differ from the CPU reference\n",
                 static_cast<long long>(mismatches));
    status = kFailed;
  }
  const int64_t max_errors = absl::GetFlag(FLAGS_max_errors);
  if (max_errors >= 0 && errors > max_errors) {
    std::fprintf(stderr, "indexer-bench: FAILED: %lld decode requests failed (--max_errors=%lld)\n",
                 static_cast<long long>(errors), static_cast<long long>(max_errors));
    status = kFailed;
  }
  if (interrupted_by != 0) {
    std::fprintf(stderr, "indexer-bench: interrupted; the reports hold what was measured\n");
    return 128 + interrupted_by;
  }
  return status;
}
