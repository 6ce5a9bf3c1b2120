// indexer-step-path-bench: what one decode step costs the server's host path per item, with
// neither the transport nor the selections: the BatchRequest's bytes read in place
// (ReadStepRequest), the engine's work for the call (checks, sequence locks, appends, page
// bookkeeping, commit) on a backend that stores and computes nothing, and the answer written as
// bytes (StepAnswer). That is the part of a step that grows with its items and that no kernel
// hides; on the GPU backend the staging of the selections comes on top.
//
// The reference, measured in the same run on the same messages: protobuf parsing the request
// and serializing an answer of the same shape, which is what the echo server does per call.
//
//   indexer-step-path-bench [--items=256] [--prefill=128] [--steps=3000] [--evict_bytes=0]
//                           [--idle_us=0]
//
// Each step appends one key to every sequence and selects for it (the shape indexer-bench's
// decode steps have), so sequences grow and open a block every 128 steps as in serving.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/key_cache_backend.h"
#include "flags/command_line.h"
#include "indexer/v1/indexer.pb.h"
#include "kernels/numeric.h"
#include "server/startup.h"
#include "server/step_answer.h"
#include "server/step_request_reader.h"

ABSL_FLAG(int32_t, items, 256, "Items (sequences) per Batch call");
ABSL_FLAG(int32_t, prefill, 128, "Tokens each sequence holds before the decode steps");
ABSL_FLAG(int32_t, steps, 3000, "Decode steps measured (after --warmup_steps)");
ABSL_FLAG(int32_t, warmup_steps, 300, "Decode steps run first and not measured");
ABSL_FLAG(int32_t, head_dim, 128, "Values per key and per query head");
ABSL_FLAG(int32_t, heads, 1, "Query heads per item");
ABSL_FLAG(int32_t, topk, 16, "Blocks each selection asks for");
ABSL_FLAG(int64_t, evict_bytes, 0,
          "Bytes of other memory written before each step and before its reference, as a server "
          "serving other calls does between one caller's steps; 0: every step runs from a warm "
          "cache");
ABSL_FLAG(int32_t, idle_us, 0,
          "Microseconds the thread sleeps before each step (and before its reference), as a "
          "server's thread waits for one caller's next step: its core may slow down or sleep "
          "meanwhile; 0: steps run back to back");

namespace indexer::bench {
namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = ::indexer::v1;

// Stores nothing and selects nothing: the engine's bookkeeping runs in full, the device's work
// not at all (outputs keep the zeros StepAnswer gives them).
class NoComputeBackend final : public engine::KeyCacheBackend {
 public:
  std::string name() const override { return "none"; }
  std::string device() const override { return "host path only"; }
  // Run does everything before it returns, which is what an asynchronous backend may do: the
  // engine then stages and launches on the calling thread, as it does for the CUDA backend.
  bool RunsAsync() const override { return true; }
  absl::Status WriteKeys(const engine::KeyWrite&) override { return absl::OkStatus(); }
  absl::Status CopyPage(int32_t, int32_t) override { return absl::OkStatus(); }
  absl::Status Select(std::span<const engine::SelectTask>,
                      const kernels::PageTableParams&) override {
    return absl::OkStatus();
  }
};

// Keeps the phases of the last call the engine ran.
class PhaseKeeper final : public engine::EngineObserver {
 public:
  void OnBackendSelect(int64_t, absl::Duration) override {}
  void OnCallPhases(const engine::CallPhases& phases) override { last = phases; }
  engine::CallPhases last;
};

// Answers a call's selections into its StepAnswer, as the server's StepCall does.
class AnswerSink final : public engine::OutputSink {
 public:
  explicit AnswerSink(server::StepAnswer* answer) : answer_(answer) {}
  engine::SelectOutputs Allocate(size_t item, const engine::SelectShape& shape) override {
    return answer_->Allocate(item, shape);
  }
  bool KeepLengths(size_t item, std::span<const int64_t> lengths) override {
    answer_->KeepLengths(item, lengths);
    return true;
  }

 private:
  server::StepAnswer* answer_;
};

struct Shape {
  int items, prefill, steps, warmup, head_dim, heads, topk;
  int64_t evict_bytes;
  int idle_us;
};

// Memory written to push a step's working set out of the CPU caches.
class CacheEvictor {
 public:
  explicit CacheEvictor(int64_t bytes) : lines_(static_cast<size_t>(bytes / 64)) {}
  void Evict() {
    ++round_;
    for (Line& line : lines_) line.word = round_;
  }

 private:
  struct alignas(64) Line {
    volatile int64_t word = 0;
  };
  std::vector<Line> lines_;
  int64_t round_ = 0;
};

std::string Bf16Bytes(int64_t values, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string bytes(static_cast<size_t>(values) * 2, '\0');
  for (int64_t i = 0; i < values; ++i) {
    const uint16_t v = kernels::FloatToBf16(normal(rng));
    std::memcpy(bytes.data() + i * 2, &v, 2);
  }
  return bytes;
}

std::string SequenceId(int i) { return absl::StrCat("bench-seq-", i); }

// One decode step's BatchRequest: per sequence one key appended and one token selected.
std::string DecodeRequest(const Shape& s, std::mt19937_64& rng) {
  v1::BatchRequest request;
  request.set_request_id(1);
  for (int i = 0; i < s.items; ++i) {
    v1::SelectBlocksRequest* item = request.add_items();
    item->set_sequence_id(SequenceId(i));
    item->mutable_append()->set_dtype(v1::VALUE_DTYPE_BF16);
    item->mutable_append()->set_keys(Bf16Bytes(s.head_dim, rng));
    item->set_num_heads(static_cast<uint32_t>(s.heads));
    item->set_query_dtype(v1::VALUE_DTYPE_BF16);
    item->set_queries(Bf16Bytes(int64_t{s.heads} * s.head_dim, rng));
    item->set_topk(static_cast<uint32_t>(s.topk));
    item->set_init_blocks(0);
    item->set_local_blocks(1);
  }
  return request.SerializeAsString();
}

absl::Status Prefill(engine::Engine& engine, const Shape& s, std::mt19937_64& rng) {
  for (int i = 0; i < s.items; ++i) {
    const std::string id = SequenceId(i);
    engine::AppendRequest a;
    a.sequence_id = id;
    a.dtype = engine::WireDtype::kBf16;
    const std::string keys = Bf16Bytes(int64_t{s.prefill} * s.head_dim, rng);
    a.keys = keys;
    absl::StatusOr<engine::StepResult> r = engine.Append(a);
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

// What the echo server does per call: parse the request into messages and serialize an answer of
// the same shape (lengths, block count, topk block ids per head).
size_t ProtobufEcho(const std::string& request_bytes, const Shape& s) {
  v1::BatchRequest request;
  if (!request.ParseFromString(request_bytes)) return 0;
  v1::BatchResponse response;
  response.set_request_id(request.request_id());
  const std::string block_ids(static_cast<size_t>(s.heads) * s.topk * 4, '\0');
  for (const v1::SelectBlocksRequest& item : request.items()) {
    v1::SelectBlocksResponse* r = response.add_results()->mutable_result();
    r->set_num_tokens(1);
    r->set_num_heads(item.num_heads());
    r->set_topk(item.topk());
    r->set_start_position(s.prefill);
    r->set_block_ids(block_ids);
    r->add_lengths(static_cast<uint32_t>(s.prefill + 1));
  }
  return response.SerializeAsString().size();
}

struct Sample {
  double read = 0, engine = 0, answer = 0, echo = 0;
  engine::CallPhases phases;
};

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
double Us(absl::Duration d) { return absl::ToDoubleMicroseconds(d); }

void Idle(const Shape& s) {
  if (s.idle_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(s.idle_us));
}

// One decode step through the host path; false (with a message printed) when it failed.
bool Step(engine::Engine& engine, PhaseKeeper& keeper, const std::string& bytes, const Shape& s,
          CacheEvictor& evictor, Sample* out) {
  evictor.Evict();
  Idle(s);
  const Clock::time_point t0 = Clock::now();
  server::StepRequestWire wire;
  const absl::Status read = server::ReadStepRequest(server::StepMessage::kBatch, bytes,
                                                    engine::kDefaultTenant, &wire);
  const Clock::time_point t1 = Clock::now();
  if (!read.ok()) {
    std::fprintf(stderr, "indexer-step-path-bench: %s\n", std::string(read.message()).c_str());
    return false;
  }
  // The answer's memory is made before the engine runs, as StepCall makes it, and counts with
  // the engine: the engine's outputs are written there.
  server::StepAnswer answer(server::StepMessage::kBatch, wire.items.size(), wire.request_id,
                            bytes.size() / 2 + 4096);
  AnswerSink sink(&answer);
  engine::CallControl control;
  bool ended = false;
  absl::Status failed;
  std::vector<absl::StatusOr<engine::StepResult>> results;
  engine.BatchAsync(wire.items, control, &sink,
                    [&](absl::Status call, std::vector<absl::StatusOr<engine::StepResult>> r) {
                      failed = std::move(call);
                      results = std::move(r);
                      ended = true;
                    });
  const Clock::time_point t2 = Clock::now();
  // The backend runs on the calling thread, so the call has ended here.
  if (!ended || !failed.ok()) {
    std::fprintf(stderr, "indexer-step-path-bench: the call %s\n",
                 ended ? std::string(failed.message()).c_str() : "did not end on this thread");
    return false;
  }
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      std::fprintf(stderr, "indexer-step-path-bench: item %zu: %s\n", i,
                   std::string(results[i].status().message()).c_str());
      return false;
    }
    answer.Succeeded(i, *results[i], engine.config().page_table.pages_per_block);
  }
  grpc::ByteBuffer written;
  answer.Write(&written);
  const Clock::time_point t3 = Clock::now();
  evictor.Evict();
  Idle(s);
  const Clock::time_point t3e = Clock::now();
  const size_t echo_bytes = ProtobufEcho(bytes, s);
  const Clock::time_point t4 = Clock::now();
  if (echo_bytes == 0) {
    std::fprintf(stderr, "indexer-step-path-bench: protobuf could not parse the request\n");
    return false;
  }
  *out = Sample{Us(t1 - t0), Us(t2 - t1), Us(t3 - t2), Us(t4 - t3e), keeper.last};
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(const Shape& s) {
  engine::EngineConfig config;
  config.head_dim = s.head_dim;
  config.max_index_heads = std::max(config.max_index_heads, s.heads);
  config.max_batch_items = std::max(config.max_batch_items, s.items);
  config.max_topk = std::max(config.max_topk, s.topk);
  const int64_t tokens = int64_t{s.prefill} + s.warmup + s.steps;
  config.capacity_pages = int64_t{s.items} * ((tokens + kernels::kBlockSize - 1) / kernels::kBlockSize);
  if (const absl::Status valid = config.Validate(); !valid.ok()) {
    return flags::ReportUsageError("indexer-step-path-bench", valid.message());
  }
  engine::Engine engine(config, std::make_unique<NoComputeBackend>());
  PhaseKeeper keeper;
  engine.SetObserver(&keeper);
  std::mt19937_64 rng(1);
  if (const absl::Status filled = Prefill(engine, s, rng); !filled.ok()) {
    std::fprintf(stderr, "indexer-step-path-bench: prefill: %s\n",
                 std::string(filled.message()).c_str());
    return 1;
  }
  const std::string bytes = DecodeRequest(s, rng);
  std::vector<Sample> samples;
  samples.reserve(static_cast<size_t>(s.steps));
  CacheEvictor evictor(s.evict_bytes);
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    Sample sample;
    if (!Step(engine, keeper, bytes, s, evictor, &sample)) return 1;
    if (i >= s.warmup) samples.push_back(sample);
  }
  const auto median = [&](auto field) {
    std::vector<double> v;
    for (const Sample& x : samples) v.push_back(field(x));
    return Median(v);
  };
  const double per_item = 1000.0 / s.items;
  const auto row = [&](const char* what, double us) {
    std::printf("  %-34s %9.1f us %8.0f ns/item\n", what, us, us * per_item);
  };
  std::printf("indexer-step-path-bench %s: %d items of %d key + %d x %d-value queries, topk %d, "
              "%d steps (median per step), %lld bytes evicted and %d us idle before each\n",
              flags::ProgramVersion(), s.items, 1, s.heads, s.head_dim, s.topk, s.steps,
              static_cast<long long>(s.evict_bytes), s.idle_us);
  const double read = median([](const Sample& x) { return x.read; });
  const double eng = median([](const Sample& x) { return x.engine; });
  const double answer = median([](const Sample& x) { return x.answer; });
  const double total = median([](const Sample& x) { return x.read + x.engine + x.answer; });
  const double echo = median([](const Sample& x) { return x.echo; });
  row("read (ReadStepRequest)", read);
  row("engine (no selections computed)", eng);
  row("  validate", median([](const Sample& x) { return Us(x.phases.validate); }));
  row("  wave", median([](const Sample& x) { return Us(x.phases.wave); }));
  row("  lock", median([](const Sample& x) { return Us(x.phases.lock); }));
  row("  apply", median([](const Sample& x) { return Us(x.phases.apply); }));
  row("  complete", median([](const Sample& x) { return Us(x.phases.complete); }));
  row("answer (StepAnswer)", answer);
  row("host path in all", total);
  row("reference: protobuf parse+serialize", echo);
  std::printf("  host path / reference: %.2fx\n", echo > 0 ? total / echo : 0.0);
  return 0;
}

constexpr char kUsage[] =
    "indexer-step-path-bench: the server's host cost of one decode step per item, without the\n"
    "transport and without computing selections (a backend that stores nothing): the request\n"
    "read in place, the engine's checks, locks, appends and commit, and the answer written.\n"
    "The reference is protobuf parsing the same request and serializing an answer of the same\n"
    "shape, measured in the same run. Prints the median per step of each part.\n"
    "\n"
    "Usage: indexer-step-path-bench [flags]\n"
    "\n"
    "Exit status: 0 measured; 1 a step failed; 2 a usage error.\n";

}  // namespace
}  // namespace indexer::bench

int main(int argc, char** argv) {
  indexer::server::KeepFreedMemory();  // the server's allocator settings
  namespace f = indexer::flags;
  const f::FlagFilter ours = f::FlagsDefinedIn("server/bench/step_path_bench.cc");
  absl::StatusOr<f::CommandLine> cl = f::ParseCommandLine(argc, argv, ours);
  if (cl.ok() && !cl->positional.empty()) {
    cl = absl::InvalidArgumentError("unexpected argument '" + cl->positional[0] + "'");
  }
  if (!cl.ok()) return f::ReportUsageError("indexer-step-path-bench", cl.status().message());
  if (cl->help) {
    std::printf("%s\nFlags:\n%s", indexer::bench::kUsage, f::FlagList(ours).c_str());
    return 0;
  }
  if (cl->version) {
    std::printf("indexer-step-path-bench %s\n", f::ProgramVersion());
    return 0;
  }
  const indexer::bench::Shape shape{absl::GetFlag(FLAGS_items),    absl::GetFlag(FLAGS_prefill),
                                    absl::GetFlag(FLAGS_steps),    absl::GetFlag(FLAGS_warmup_steps),
                                    absl::GetFlag(FLAGS_head_dim), absl::GetFlag(FLAGS_heads),
                                    absl::GetFlag(FLAGS_topk),     absl::GetFlag(FLAGS_evict_bytes),
                                    absl::GetFlag(FLAGS_idle_us)};
  if (shape.items < 1 || shape.prefill < 1 || shape.steps < 1 || shape.warmup < 0 ||
      shape.heads < 1 || shape.topk < 1 || shape.evict_bytes < 0 || shape.idle_us < 0) {
    return f::ReportUsageError("indexer-step-path-bench",
                               "--items, --prefill, --steps, --heads and --topk must be >= 1, "
                               "--warmup_steps, --evict_bytes and --idle_us >= 0");
  }
  return indexer::bench::Run(shape);
}
