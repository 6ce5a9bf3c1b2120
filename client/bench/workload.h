// The workload model of indexer-bench: what sequences look like (prefill length and decode steps
// drawn from distributions), what each decode step sends (speculative tokens, heads, topk,
// layers, wire dtype, attention pages), the random values keys and queries are cut from, and the
// request builders. Pure data and pure functions: the scheduler (scheduler.h) decides when to
// send what.
//
// Threads: every type here is a value or is read-only once built (ValuePool), so any thread may
// use them.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "indexer/v1/indexer.pb.h"
#include "kernels/select_types.h"

namespace indexer::bench {

namespace v1 = indexer::v1;

// A distribution of non-negative integers (prefill lengths, decode steps) given as text:
//   "N" or "fixed:N"                       always N
//   "uniform:A-B"                          uniform on [A, B]
//   "lognormal:median=M,sigma=S[,min=A][,max=B]"  exp(N(ln M, S)), rounded and clipped
//   "file:PATH"                            the integers in PATH (one a line; '#' comments),
//                                          replayed in order: sequence i gets line i mod n
class LengthDistribution {
 public:
  LengthDistribution() = default;  // fixed:0
  static LengthDistribution Fixed(int64_t n);
  // INVALID_ARGUMENT naming the problem for malformed text or an unreadable file.
  static absl::StatusOr<LengthDistribution> Parse(absl::string_view spec);

  // The value for sequence `index` of a run seeded with `seed`: deterministic.
  int64_t ForSequence(uint64_t seed, int64_t index) const;
  // Mean (of the clipped distribution for lognormal, estimated from samples) and largest value.
  double Mean() const;
  int64_t Max() const;
  int64_t Min() const;
  // The canonical text (what Parse accepts), for reports.
  std::string ToString() const;

 private:
  enum class Kind { kFixed, kUniform, kLognormal, kFile };
  Kind kind_ = Kind::kFixed;
  int64_t a_ = 0;  // fixed value, uniform low, lognormal min
  int64_t b_ = 0;  // uniform high, lognormal max
  double median_ = 0;
  double sigma_ = 0;
  std::string path_;
  std::vector<int64_t> values_;  // file
};

// A request trace: one sequence a line, when it arrives (seconds after the stage's load begins)
// and how long it is (prefill tokens, decode steps), so that a run replays the arrivals and the
// lengths a real deployment saw (as ghz's -D data file and perf_analyzer's --request-intervals
// replay theirs).
struct TraceEntry {
  double at_s = 0;
  int64_t prefill = 0;
  int64_t decode_steps = 1;
};
// Reads a trace file: lines "AT_S PREFILL DECODE_STEPS" (spaces, tabs or commas between; '#'
// comments and blank lines skipped), arrival times non-decreasing, decode steps >= 1.
// INVALID_ARGUMENT naming the file and line otherwise, or for an empty file.
absl::StatusOr<std::vector<TraceEntry>> ReadTrace(const std::string& path);

enum class CallStyle { kUnary, kBatch, kStream };
absl::StatusOr<CallStyle> ParseCallStyle(absl::string_view text);
const char* CallStyleName(CallStyle s);

// Where a decode request's keys, queries and outputs travel: inline bytes, or a region beside the
// server (RequestRegion): POSIX shared memory, or GPU memory shared by CUDA IPC.
enum class SharedMemory { kNone, kSystem, kCuda };
absl::StatusOr<SharedMemory> ParseSharedMemory(absl::string_view text);
const char* SharedMemoryName(SharedMemory s);

enum class ValueKind { kNormal, kInteger };
absl::StatusOr<ValueKind> ParseValueKind(absl::string_view text);
const char* ValueKindName(ValueKind v);

// What the workload does. Validated by Validate() against the server it runs on.
struct WorkloadSpec {
  LengthDistribution prefill = LengthDistribution::Fixed(8192);     // tokens per sequence
  LengthDistribution decode_steps = LengthDistribution::Fixed(64);  // steps per sequence (>= 1)
  int prefill_chunk = 2048;  // tokens per AppendKeys call of a prefill
  int speculative = 1;       // tokens appended and queried per decode step (n)
  double accept_rate = 0.7;  // speculative > 1: chance that each draft token is accepted
  // Every `rewind` decode steps a sequence is truncated back to its prefill length (0: never),
  // so that a long timed run decodes at a steady length instead of a growing one.
  int rewind = 0;
  int heads = 4;             // index heads H per query token
  int topk = 16;
  int init_blocks = -1;   // -1: the server's default
  int local_blocks = -1;  // -1: the server's default
  int layers = 0;         // layers selected per decode step (0 = every layer of the server)
  v1::ValueDtype wire_dtype = v1::VALUE_DTYPE_BF16;
  bool attention_pages = false;
  ValueKind values = ValueKind::kNormal;
  CallStyle style = CallStyle::kBatch;
  // kStream: requests a worker keeps in flight on its stream, each for its own micro-batch of
  // sequences (slot i belongs to micro-batch i % stream_inflight).
  int stream_inflight = 1;
  int batch = 8;  // live sequences per worker (one scheduler's decode batch)
  SharedMemory shared_memory = SharedMemory::kNone;
  int cuda_device = 0;  // --shared_memory=cuda: the GPU the regions are on
  // The stage's first sequences start part-way through their decode steps (uniformly), so that
  // they finish, and are replaced by fresh prefills, one at a time instead of all at once.
  bool stagger = true;
  // When set, sequence i arrives and has the lengths of entry i (the distributions above are not
  // used for them, and there is no stagger).
  std::shared_ptr<const std::vector<TraceEntry>> trace;
  uint64_t seed = 1;
  std::string id_prefix = "bench-";  // sequence ids are id_prefix + index
};

// The facts of the servers a workload runs on (from ServerInfo; every server must agree).
struct ServerShape {
  int head_dim = 128;
  int layers = 1;  // the server's layers (appends carry all of them)
  kernels::KeyStorage key_storage = kernels::KeyStorage::kBf16;
  kernels::SelectParams defaults;
  kernels::PageTableParams page_table;
  int max_topk = 256;
  int max_heads = 16;
  int64_t max_tokens_per_sequence = 1 << 20;
  int64_t total_pages = 0;
};
ServerShape ShapeFromInfo(const v1::ServerInfoResponse& info);

// Checks `spec` against the server: heads, topk, layers, lengths. INVALID_ARGUMENT naming the
// setting. `layers` of 0 is resolved to the server's.
absl::Status Validate(WorkloadSpec* spec, const ServerShape& shape);

// The selection parameters a decode step asks for (server defaults filled in).
kernels::SelectParams EffectiveParams(const WorkloadSpec& spec, const ServerShape& shape);

// One sequence's life: id, prefill length, decode steps.
struct SequencePlan {
  int64_t index = 0;
  std::string id;
  int64_t prefill_tokens = 0;
  int decode_steps = 1;
  // Steps taken as done before its first request (a staggered first sequence), in
  // [0, decode_steps).
  int start_step = 0;
  double arrival_s = 0;  // a trace's arrival time
};
// Sequence `index`'s plan; `staggered`: one of the stage's first sequences (spec.stagger applies).
SequencePlan PlanSequence(const WorkloadSpec& spec, int64_t index, bool staggered = false);

// Random values that keys and queries are cut from: every value is exactly representable in
// bf16 (so bf16 and fp32 wire formats carry the same numbers), kept both as floats and as bf16
// bits. kNormal: N(0, 1); kInteger: integers in [-4, 4] (dot products exact in fp32, so the
// CPU reference must match any backend exactly).
class ValuePool {
 public:
  ValuePool(ValueKind kind, size_t size, uint64_t seed);

  // n consecutive values from a random offset (n <= size()).
  struct Slice {
    const float* values;
    const uint16_t* bits;
    size_t n;
  };
  Slice Take(size_t n, std::mt19937_64& rng) const;
  size_t size() const { return values_.size(); }

 private:
  std::vector<float> values_;
  std::vector<uint16_t> bits_;
};

// The wire bytes of a slice in `dtype` (bf16: its bits; fp32: its floats).
std::string PackSlice(const ValuePool::Slice& slice, v1::ValueDtype dtype);

// The most tokens a sequence of `spec` reaches: its longest prefill plus the decode steps it
// takes before it is released or rewound, times the speculative tokens of each.
int64_t LongestSequence(const WorkloadSpec& spec);

// Blocks a sequence of `tokens` tokens occupies.
inline int64_t BlocksFor(int64_t tokens) {
  return (tokens + kernels::kBlockSize - 1) / kernels::kBlockSize;
}

}  // namespace indexer::bench
