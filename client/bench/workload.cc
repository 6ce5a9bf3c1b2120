#include "client/bench/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/numeric.h"

namespace indexer::bench {
namespace {

absl::StatusOr<int64_t> ParseCount(absl::string_view text, absl::string_view what) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", text, "' is not a non-negative integer"));
  }
  return v;
}

// A per-sequence generator: the same (seed, index, salt) always gives the same stream.
std::mt19937_64 SequenceRng(uint64_t seed, int64_t index, uint64_t salt) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                    static_cast<uint32_t>(salt)};
  return std::mt19937_64(seq);
}

}  // namespace

LengthDistribution LengthDistribution::Fixed(int64_t n) {
  LengthDistribution d;
  d.kind_ = Kind::kFixed;
  d.a_ = n;
  return d;
}

absl::StatusOr<LengthDistribution> LengthDistribution::Parse(absl::string_view spec) {
  spec = absl::StripAsciiWhitespace(spec);
  LengthDistribution d;
  absl::string_view body = spec;
  if (absl::ConsumePrefix(&body, "fixed:") || !absl::StrContains(spec, ':')) {
    absl::StatusOr<int64_t> n = ParseCount(body, "fixed length");
    if (!n.ok()) return n.status();
    return Fixed(*n);
  }
  if (absl::ConsumePrefix(&body, "uniform:")) {
    std::vector<absl::string_view> ab = absl::StrSplit(body, '-');
    if (ab.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("'", spec, "': uniform needs A-B"));
    }
    absl::StatusOr<int64_t> a = ParseCount(ab[0], "uniform low");
    if (!a.ok()) return a.status();
    absl::StatusOr<int64_t> b = ParseCount(ab[1], "uniform high");
    if (!b.ok()) return b.status();
    if (*b < *a) return absl::InvalidArgumentError(absl::StrCat("'", spec, "': B < A"));
    d.kind_ = Kind::kUniform;
    d.a_ = *a;
    d.b_ = *b;
    return d;
  }
  if (absl::ConsumePrefix(&body, "lognormal:")) {
    d.kind_ = Kind::kLognormal;
    d.a_ = 0;
    d.b_ = int64_t{1} << 40;
    bool have_median = false, have_sigma = false;
    for (absl::string_view part : absl::StrSplit(body, ',')) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
      const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
      const absl::string_view value = absl::StripAsciiWhitespace(kv.second);
      double x = 0;
      if (!absl::SimpleAtod(value, &x) || !(x >= 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", spec, "': '", part, "' is not key=non-negative number"));
      }
      if (key == "median") {
        d.median_ = x;
        have_median = true;
      } else if (key == "sigma") {
        d.sigma_ = x;
        have_sigma = true;
      } else if (key == "min") {
        d.a_ = static_cast<int64_t>(x);
      } else if (key == "max") {
        d.b_ = static_cast<int64_t>(x);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("'", spec, "': unknown key '", key, "' (median, sigma, min, max)"));
      }
    }
    if (!have_median || !have_sigma || d.median_ <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", spec, "': lognormal needs median=M (> 0) and sigma=S"));
    }
    if (d.b_ < d.a_) return absl::InvalidArgumentError(absl::StrCat("'", spec, "': max < min"));
    return d;
  }
  if (absl::ConsumePrefix(&body, "file:")) {
    d.kind_ = Kind::kFile;
    d.path_ = std::string(body);
    std::ifstream in(d.path_);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read '", d.path_, "'"));
    std::string line;
    int line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      absl::string_view l = line;
      if (const size_t hash = l.find('#'); hash != absl::string_view::npos) l = l.substr(0, hash);
      l = absl::StripAsciiWhitespace(l);
      if (l.empty()) continue;
      absl::StatusOr<int64_t> v = ParseCount(l, absl::StrCat(d.path_, ":", line_no));
      if (!v.ok()) return v.status();
      d.values_.push_back(*v);
    }
    if (d.values_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("'", d.path_, "' holds no lengths"));
    }
    return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", spec,
                   "' is not a distribution (N, fixed:N, uniform:A-B, "
                   "lognormal:median=M,sigma=S[,min=A,max=B], file:PATH)"));
}

int64_t LengthDistribution::ForSequence(uint64_t seed, int64_t index) const {
  switch (kind_) {
    case Kind::kFixed:
      return a_;
    case Kind::kUniform: {
      std::mt19937_64 rng = SequenceRng(seed, index, 0x5eed);
      return std::uniform_int_distribution<int64_t>(a_, b_)(rng);
    }
    case Kind::kLognormal: {
      std::mt19937_64 rng = SequenceRng(seed, index, 0x109);
      const double x = std::lognormal_distribution<double>(std::log(median_), sigma_)(rng);
      return std::clamp<int64_t>(static_cast<int64_t>(std::llround(std::min(x, 1e15))), a_, b_);
    }
    case Kind::kFile:
      return values_[static_cast<size_t>(index) % values_.size()];
  }
  return 0;
}

double LengthDistribution::Mean() const {
  switch (kind_) {
    case Kind::kFixed:
      return static_cast<double>(a_);
    case Kind::kUniform:
      return (static_cast<double>(a_) + static_cast<double>(b_)) / 2;
    case Kind::kLognormal: {
      double sum = 0;
      constexpr int kSamples = 4096;
      for (int i = 0; i < kSamples; ++i) sum += static_cast<double>(ForSequence(7, i));
      return sum / kSamples;
    }
    case Kind::kFile: {
      double sum = 0;
      for (int64_t v : values_) sum += static_cast<double>(v);
      return sum / static_cast<double>(values_.size());
    }
  }
  return 0;
}

int64_t LengthDistribution::Max() const {
  switch (kind_) {
    case Kind::kFixed:
      return a_;
    case Kind::kUniform:
    case Kind::kLognormal:
      return b_;
    case Kind::kFile:
      return *std::max_element(values_.begin(), values_.end());
  }
  return 0;
}

int64_t LengthDistribution::Min() const {
  switch (kind_) {
    case Kind::kFixed:
    case Kind::kUniform:
    case Kind::kLognormal:
      return a_;
    case Kind::kFile:
      return *std::min_element(values_.begin(), values_.end());
  }
  return 0;
}

std::string LengthDistribution::ToString() const {
  switch (kind_) {
    case Kind::kFixed:
      return absl::StrCat("fixed:", a_);
    case Kind::kUniform:
      return absl::StrCat("uniform:", a_, "-", b_);
    case Kind::kLognormal: {
      std::string s = absl::StrCat("lognormal:median=", median_, ",sigma=", sigma_);
      if (a_ > 0) absl::StrAppend(&s, ",min=", a_);
      if (b_ < (int64_t{1} << 40)) absl::StrAppend(&s, ",max=", b_);
      return s;
    }
    case Kind::kFile:
      return absl::StrCat("file:", path_);
  }
  return "";
}

absl::StatusOr<SharedMemory> ParseSharedMemory(absl::string_view text) {
  if (text == "none") return SharedMemory::kNone;
  if (text == "system") return SharedMemory::kSystem;
  if (text == "cuda") return SharedMemory::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not none, system or cuda"));
}

const char* SharedMemoryName(SharedMemory s) {
  switch (s) {
    case SharedMemory::kSystem: return "system";
    case SharedMemory::kCuda: return "cuda";
    case SharedMemory::kNone: break;
  }
  return "none";
}

absl::StatusOr<CallStyle> ParseCallStyle(absl::string_view text) {
  if (text == "unary") return CallStyle::kUnary;
  if (text == "batch") return CallStyle::kBatch;
  if (text == "stream") return CallStyle::kStream;
  return absl::InvalidArgumentError(
      absl::StrCat("call style '", text, "' is not unary, batch or stream"));
}

const char* CallStyleName(CallStyle s) {
  switch (s) {
    case CallStyle::kUnary:
      return "unary";
    case CallStyle::kBatch:
      return "batch";
    case CallStyle::kStream:
      return "stream";
  }
  return "?";
}

absl::StatusOr<ValueKind> ParseValueKind(absl::string_view text) {
  if (text == "normal") return ValueKind::kNormal;
  if (text == "int") return ValueKind::kInteger;
  return absl::InvalidArgumentError(absl::StrCat("values '", text, "' is not normal or int"));
}

const char* ValueKindName(ValueKind v) { return v == ValueKind::kNormal ? "normal" : "int"; }

ServerShape ShapeFromInfo(const v1::ServerInfoResponse& info) {
  ServerShape s;
  s.head_dim = static_cast<int>(info.head_dim());
  s.layers = static_cast<int>(info.layers());
  s.key_storage = info.key_storage() == v1::KEY_STORAGE_FP8_E4M3   ? kernels::KeyStorage::kFp8E4M3
                  : info.key_storage() == v1::KEY_STORAGE_FP4_E2M1 ? kernels::KeyStorage::kFp4E2M1
                                                                   : kernels::KeyStorage::kBf16;
  s.defaults = kernels::SelectParams{static_cast<int>(info.default_topk()),
                                     static_cast<int>(info.default_init_blocks()),
                                     static_cast<int>(info.default_local_blocks())};
  s.page_table = kernels::PageTableParams{static_cast<int>(info.pages_per_block()),
                                          static_cast<int>(info.block_page_stride())};
  s.max_topk = static_cast<int>(info.max_topk());
  s.max_heads = static_cast<int>(info.max_index_heads());
  s.max_tokens_per_sequence = info.max_tokens_per_sequence();
  s.total_pages = static_cast<int64_t>(info.total_pages());
  return s;
}

absl::Status Validate(WorkloadSpec* spec, const ServerShape& shape) {
  if (spec->layers == 0) spec->layers = shape.layers;
  if (spec->layers < 1 || spec->layers > shape.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layers is ", spec->layers, "; the server has ", shape.layers));
  }
  if (spec->heads < 1 || spec->heads > shape.max_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heads is ", spec->heads, "; the server allows 1 to ", shape.max_heads));
  }
  if (spec->topk < 1 || spec->topk > shape.max_topk) {
    return absl::InvalidArgumentError(
        absl::StrCat("--topk is ", spec->topk, "; the server allows 1 to ", shape.max_topk));
  }
  if (spec->speculative < 1) return absl::InvalidArgumentError("--speculative must be >= 1");
  if (!(spec->accept_rate >= 0 && spec->accept_rate <= 1)) {
    return absl::InvalidArgumentError("--accept_rate must be in [0, 1]");
  }
  if (spec->prefill_chunk < 1) return absl::InvalidArgumentError("--prefill_chunk must be >= 1");
  if (spec->batch < 1) return absl::InvalidArgumentError("--batch must be >= 1");
  if (spec->stream_inflight < 1) {
    return absl::InvalidArgumentError("--stream_inflight must be >= 1");
  }
  if (spec->stream_inflight > 1 && spec->style != CallStyle::kStream) {
    return absl::InvalidArgumentError("--stream_inflight above 1 needs --style=stream");
  }
  if (spec->shared_memory == SharedMemory::kCuda && spec->wire_dtype != v1::VALUE_DTYPE_BF16) {
    return absl::InvalidArgumentError(
        "--shared_memory=cuda needs bf16 values: CUDA regions take BF16 keys and queries only");
  }
  if (spec->stream_inflight > spec->batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream_inflight is ", spec->stream_inflight, ": each request in flight "
                     "needs sequences of its own, and --batch is ", spec->batch));
  }
  if (spec->decode_steps.Min() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode_steps (", spec->decode_steps.ToString(), ") must be >= 1"));
  }
  if (spec->rewind < 0) return absl::InvalidArgumentError("--rewind must be >= 0");
  const int64_t longest = LongestSequence(*spec);
  if (longest > shape.max_tokens_per_sequence) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a sequence may reach ", longest, " tokens (prefill ", spec->prefill.ToString(),
        " + decode steps (or --rewind) x speculative); the server's max_tokens_per_sequence is ",
        shape.max_tokens_per_sequence, ": lower --decode_steps or set --rewind"));
  }
  return absl::OkStatus();
}

int64_t LongestSequence(const WorkloadSpec& spec) {
  const auto longest = [&](int64_t prefill, int64_t steps) {
    if (spec.rewind > 0) steps = std::min<int64_t>(steps, spec.rewind);
    return prefill + steps * spec.speculative;
  };
  if (spec.trace == nullptr) return longest(spec.prefill.Max(), spec.decode_steps.Max());
  int64_t most = 0;
  for (const TraceEntry& e : *spec.trace) most = std::max(most, longest(e.prefill, e.decode_steps));
  return most;
}

kernels::SelectParams EffectiveParams(const WorkloadSpec& spec, const ServerShape& shape) {
  kernels::SelectParams p;
  p.topk = spec.topk;
  p.init_blocks = spec.init_blocks >= 0 ? spec.init_blocks : shape.defaults.init_blocks;
  p.local_blocks = spec.local_blocks >= 0 ? spec.local_blocks : shape.defaults.local_blocks;
  return p;
}

SequencePlan PlanSequence(const WorkloadSpec& spec, int64_t index, bool staggered) {
  SequencePlan plan;
  plan.index = index;
  plan.id = absl::StrCat(spec.id_prefix, index);
  if (spec.trace != nullptr && !spec.trace->empty()) {
    const TraceEntry& e = (*spec.trace)[static_cast<size_t>(index) % spec.trace->size()];
    plan.prefill_tokens = e.prefill;
    plan.decode_steps = static_cast<int>(std::clamp<int64_t>(e.decode_steps, 1, INT32_MAX));
    plan.arrival_s = e.at_s;
    return plan;
  }
  plan.prefill_tokens = spec.prefill.ForSequence(spec.seed, index);
  plan.decode_steps = static_cast<int>(std::clamp<int64_t>(
      spec.decode_steps.ForSequence(spec.seed ^ 0x9e3779b97f4a7c15ull, index), 1, INT32_MAX));
  if (staggered && spec.stagger) {
    std::mt19937_64 rng = SequenceRng(spec.seed, index, 0x57a6);
    plan.start_step = std::uniform_int_distribution<int>(0, plan.decode_steps - 1)(rng);
  }
  return plan;
}

absl::StatusOr<std::vector<TraceEntry>> ReadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read '", path, "'"));
  std::vector<TraceEntry> trace;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    absl::string_view l = line;
    if (const size_t hash = l.find('#'); hash != absl::string_view::npos) l = l.substr(0, hash);
    const std::vector<absl::string_view> fields =
        absl::StrSplit(l, absl::ByAnyChar(" \t,"), absl::SkipWhitespace());
    if (fields.empty()) continue;
    const std::string where = absl::StrCat(path, ":", line_no);
    TraceEntry e;
    if (fields.size() != 3 || !absl::SimpleAtod(fields[0], &e.at_s) || !(e.at_s >= 0) ||
        !std::isfinite(e.at_s) || !absl::SimpleAtoi(fields[1], &e.prefill) || e.prefill < 0 ||
        !absl::SimpleAtoi(fields[2], &e.decode_steps) || e.decode_steps < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": '", absl::StripAsciiWhitespace(l),
          "' is not ARRIVAL_S PREFILL_TOKENS DECODE_STEPS (seconds >= 0, tokens >= 0, steps >= 1)"));
    }
    if (!trace.empty() && e.at_s < trace.back().at_s) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": arrival ", e.at_s, " s is before the previous line's ",
                       trace.back().at_s, " s (arrivals must not decrease)"));
    }
    trace.push_back(e);
  }
  if (trace.empty()) return absl::InvalidArgumentError(absl::StrCat("'", path, "' holds no sequence"));
  return trace;
}

ValuePool::ValuePool(ValueKind kind, size_t size, uint64_t seed) : values_(size), bits_(size) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> ints(-4, 4);
  for (size_t i = 0; i < size; ++i) {
    const float x = kind == ValueKind::kNormal ? normal(rng) : static_cast<float>(ints(rng));
    bits_[i] = kernels::FloatToBf16(x);
    values_[i] = kernels::Bf16ToFloat(bits_[i]);
  }
}

ValuePool::Slice ValuePool::Take(size_t n, std::mt19937_64& rng) const {
  n = std::min(n, values_.size());
  const size_t offset = std::uniform_int_distribution<size_t>(0, values_.size() - n)(rng);
  return Slice{values_.data() + offset, bits_.data() + offset, n};
}

std::string PackSlice(const ValuePool::Slice& slice, v1::ValueDtype dtype) {
  if (dtype == v1::VALUE_DTYPE_FP32) {
    return std::string(reinterpret_cast<const char*>(slice.values), slice.n * sizeof(float));
  }
  return std::string(reinterpret_cast<const char*>(slice.bits), slice.n * sizeof(uint16_t));
}

}  // namespace indexer::bench
