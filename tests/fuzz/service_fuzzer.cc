// service_fuzzer: arbitrary requests, and sequences of requests, through the indexer's service
// layer on the CPU backend (or, with INDEXER_FUZZ_DEVICE=cuda, on the CUDA backend: the GPU
// check replays the corpus that way).
//
// An input is a small script: one configuration byte, then operations decoded from the bytes
// that follow (ScriptReader; bytes past the end read as zero). Every operation calls one of
// IndexerService's own handlers exactly as gRPC would, without a network: gRPC's test peer
// stands in for the call, so request translation, authentication, the handler threads, the
// engine and the answer are the server's own code. Some operations hand bytes to protobuf as a
// whole wire message instead, as any client could send them. The backend can be told to fail
// its next calls (INTERNAL), to exercise the engine's roll-backs.
//
// After every operation the fuzzer checks what must hold, whatever the input:
//  - the status is one a client may get for its request (INTERNAL only from an injected fault),
//    and an error says what was wrong (its message is not empty);
//  - a call that failed changed nothing: every sequence (lengths, pages, attention pages, the
//    stored bytes of every token) and the free page count are as before;
//  - a call changed only the sequences it names; appends keep every stored token and store
//    exactly the keys they carried; truncation keeps the prefix; a fork copies its source;
//  - answers have the shape they declare, and each selection row holds min(topk, visible)
//    distinct visible blocks, then -1;
//  - the page accounting is exact: pages in use = the distinct pages of the live sequences, and
//    each sequence's shared_pages = its pages that another sequence also holds;
//  - the server's reader of the step requests (ReadStepRequest) accepts a whole wire message
//    exactly when protobuf parses it.
// At the end every sequence is released and the pool must be whole again.
//
// Built by scripts/fuzz.sh as a libFuzzer binary (clang, -fsanitize=fuzzer,address,undefined);
// fuzz_corpus_test runs the committed corpus through the same function in every build.
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "google/protobuf/stubs/logging.h"
#include "engine/backend_factory.h"
#include "engine/engine.h"
#include "indexer/v1/indexer.pb.h"
#include "kernels/numeric.h"
#include "server/access_control.h"
#include "server/indexer_service.h"
#include "server/request_executor.h"
#include "server/step_request_reader.h"
#include "tests/testing/service_call.h"

namespace indexer::fuzz {
namespace {

namespace v1 = indexer::v1;
using kernels::kBlockSize;
using indexer::testing::CallHandler;

constexpr int kHeadDim = 64;
constexpr int kMaxOps = 48;
constexpr size_t kMaxTrackedIds = 24;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "service_fuzzer: invariant broken: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// ---------------------------------------------------------------------------------------------
// Reading the script.

class ScriptReader {
 public:
  ScriptReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool done() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{Byte()} << (8 * i);
    return v;
  }
  uint64_t U64() { return uint64_t{U32()} | (uint64_t{U32()} << 32); }
  // Up to `n` bytes (fewer at the end of the input).
  absl::string_view Bytes(size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    absl::string_view out(reinterpret_cast<const char*>(data_) + pos_, n);
    pos_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// SplitMix64: fills tensors from a seed the script gives.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  int Int(int lo, int hi) { return lo + static_cast<int>(Next() % static_cast<uint64_t>(hi - lo + 1)); }

 private:
  uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// A backend that fails on request.

class FaultyBackend final : public engine::KeyCacheBackend {
 public:
  explicit FaultyBackend(std::unique_ptr<engine::KeyCacheBackend> inner) : inner_(std::move(inner)) {}

  // The `n`-th backend call from now (1 = the next) fails with INTERNAL; 0 disarms.
  void FailCall(int n) { countdown_ = n; }
  bool armed() const { return countdown_ > 0; }

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  // A failed write has stored part of its keys (the first half), as a real failure might.
  absl::Status WriteKeys(const engine::KeyWrite& write) override {
    if (Trip()) {
      engine::KeyWrite half = write;
      half.num_tokens = write.num_tokens / 2;
      (void)inner_->WriteKeys(half);
      return Injected("WriteKeys");
    }
    return inner_->WriteKeys(write);
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    if (Trip()) return Injected("CopyPage");
    return inner_->CopyPage(src, dst);
  }
  absl::Status Select(std::span<const engine::SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override {
    if (Trip()) return Injected("Select");
    return inner_->Select(tasks, page_table);
  }
  // Reads are the fuzzer's own (never failed).
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    return inner_->ReadPages(pages, dst);
  }

 private:
  bool Trip() {
    if (countdown_ <= 0) return false;
    return --countdown_ == 0;
  }
  static absl::Status Injected(const char* what) {
    return absl::InternalError(absl::StrCat("injected fault in ", what));
  }

  std::unique_ptr<engine::KeyCacheBackend> inner_;
  std::atomic<int> countdown_{0};
};

// ---------------------------------------------------------------------------------------------
// What the engine holds, as the fuzzer sees it.

struct SeqState {
  std::vector<int64_t> lengths;
  std::vector<int32_t> pages;
  std::vector<int32_t> attn;
  int64_t shared_pages = 0;
  std::vector<std::vector<uint64_t>> tokens;  // per layer: a hash of each stored key row

  bool SameContents(const SeqState& o) const {
    return lengths == o.lengths && pages == o.pages && attn == o.attn && tokens == o.tokens;
  }
};

struct State {
  std::map<std::string, SeqState> seqs;
  int64_t free_pages = 0;
  int64_t live = 0;
};

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

// ---------------------------------------------------------------------------------------------
// The harness: one engine and service per input; the handler threads are shared.

server::RequestExecutor& Executor() {
  static server::RequestExecutor* executor = new server::RequestExecutor(1);
  return *executor;
}

// INDEXER_FUZZ_TRACE=1 prints every call's status (to see what an input does); otherwise the
// server's own log lines (injected faults are logged as errors) are silenced.
bool Tracing() {
  static const bool trace = [] {
    const char* v = std::getenv("INDEXER_FUZZ_TRACE");
    const bool on = v != nullptr && v[0] == '1';
    spdlog::set_level(on ? spdlog::level::debug : spdlog::level::off);
    // Raw wire messages with non-UTF-8 strings make protobuf log each refusal.
    if (!on) google::protobuf::SetLogHandler(nullptr);
    return on;
  }();
  return trace;
}

// The backend under the fault injector: INDEXER_FUZZ_DEVICE (cpu, cuda or auto; default cpu).
const char* Device() {
  static const char* device = [] {
    const char* v = std::getenv("INDEXER_FUZZ_DEVICE");
    return v != nullptr && v[0] != '\0' ? v : "cpu";
  }();
  return device;
}

class Harness {
 public:
  explicit Harness(uint8_t variant) {
    config_.head_dim = kHeadDim;
    config_.layers = (variant & 1) ? 2 : 1;
    config_.key_storage = (variant & 2) ? kernels::KeyStorage::kFp8E4M3 : kernels::KeyStorage::kBf16;
    config_.capacity_pages = 16;
    config_.max_index_heads = 3;
    config_.max_topk = 12;
    config_.defaults = kernels::SelectParams{4, (variant & 32) ? 1 : 0, (variant & 64) ? 0 : 1};
    config_.page_table = kernels::PageTableParams{2, (variant & 128) ? 4 : 2};
    config_.max_tokens_per_sequence = 1024;
    config_.max_query_tokens = 16;
    config_.max_batch_items = 6;
    config_.max_response_bytes = (variant & 4) ? 3000 : 0;
    if (variant & 4) config_.max_select_scores = 150;  // spans refused, waves split
    config_.max_sequences = (variant & 8) ? 4 : 0;
    config_.cpu_threads = (variant & 16) ? 2 : 1;
    if (!config_.Validate().ok()) Fail(absl::StrCat("config: ", config_.Validate().ToString()));
    auto inner = engine::MakeBackend(config_, Device());
    if (!inner.ok()) Fail(absl::StrCat("backend: ", inner.status().ToString()));
    auto backend = std::make_unique<FaultyBackend>(*std::move(inner));
    backend_ = backend.get();
    engine_ = std::make_unique<engine::Engine>(config_, std::move(backend));
    service_ = std::make_unique<server::IndexerService>(engine_.get(), &Executor(), &access_,
                                                        /*metrics=*/nullptr, "fuzz", 1 << 20);
  }

  const engine::EngineConfig& config() const { return config_; }
  server::IndexerService& service() { return *service_; }
  FaultyBackend& backend() { return *backend_; }

  void Track(const std::string& id) {
    if (ids_.size() < kMaxTrackedIds) ids_.insert(id);
  }

  State Capture() {
    State s;
    const engine::EngineStats stats = engine_->Stats();
    s.free_pages = stats.free_pages;
    s.live = stats.live_sequences;
    // Rows are contiguous in the storages the fuzzer runs (bf16 and fp8).
    const int64_t row = kernels::KeyBytes(config_.key_storage, kHeadDim);
    for (const std::string& id : ids_) {
      absl::StatusOr<engine::SequenceInfo> info = engine_->Get(id);
      if (!info.ok()) {
        if (info.status().code() != absl::StatusCode::kNotFound &&
            info.status().code() != absl::StatusCode::kInvalidArgument) {
          Fail(absl::StrCat("Get('", id, "'): ", info.status().ToString()));
        }
        continue;
      }
      SeqState q;
      q.lengths = info->lengths;
      q.pages = info->pages;
      q.attn = info->attention_pages;
      q.shared_pages = info->shared_pages;
      std::vector<uint8_t> bytes(q.pages.size() * config_.layers * kBlockSize * row);
      const absl::Status read = backend_->ReadPages(q.pages, bytes.data());
      if (!read.ok()) Fail(absl::StrCat("ReadPages: ", read.ToString()));
      q.tokens.resize(config_.layers);
      for (int l = 0; l < config_.layers; ++l) {
        for (int64_t t = 0; t < q.lengths[l]; ++t) {
          const int64_t page = t / kBlockSize;
          const int64_t offset = ((page * config_.layers + l) * kBlockSize + t % kBlockSize) * row;
          q.tokens[l].push_back(Fnv1a(bytes.data() + offset, static_cast<size_t>(row)));
        }
      }
      s.seqs.emplace(id, std::move(q));
    }
    return s;
  }

  // The engine's own invariants on a captured state.
  void CheckAccounting(const State& s) const {
    if (s.live != static_cast<int64_t>(s.seqs.size())) {
      Fail(absl::StrCat("live_sequences is ", s.live, " but ", s.seqs.size(),
                        " tracked sequences exist"));
    }
    std::map<int32_t, int> holders;
    for (const auto& [id, q] : s.seqs) {
      int64_t longest = 0;
      for (int64_t len : q.lengths) longest = std::max(longest, len);
      const size_t blocks = static_cast<size_t>((longest + kBlockSize - 1) / kBlockSize);
      if (q.pages.size() != blocks) {
        Fail(absl::StrCat("'", id, "' holds ", q.pages.size(), " pages for ", longest, " tokens"));
      }
      if (!q.attn.empty() && q.attn.size() != q.pages.size()) {
        Fail(absl::StrCat("'", id, "' has ", q.attn.size(), " attention pages for ",
                          q.pages.size(), " pages"));
      }
      std::set<int32_t> distinct(q.pages.begin(), q.pages.end());
      if (distinct.size() != q.pages.size()) Fail(absl::StrCat("'", id, "' holds a page twice"));
      for (int32_t p : q.pages) {
        if (p < 0 || p >= config_.capacity_pages) Fail(absl::StrCat("'", id, "' holds page ", p));
        ++holders[p];
      }
    }
    const int64_t used = config_.capacity_pages - s.free_pages;
    if (used != static_cast<int64_t>(holders.size())) {
      Fail(absl::StrCat(used, " pages are in use but the live sequences hold ", holders.size()));
    }
    for (const auto& [id, q] : s.seqs) {
      int64_t shared = 0;
      for (int32_t p : q.pages) shared += holders[p] > 1 ? 1 : 0;
      if (shared != q.shared_pages) {
        Fail(absl::StrCat("'", id, "' reports ", q.shared_pages, " shared pages; ", shared,
                          " of its pages are held by another sequence"));
      }
    }
  }

  // Releases everything; the pool must be whole again.
  void ReleaseAll() {
    for (const std::string& id : ids_) (void)engine_->Release(id);
    const engine::EngineStats stats = engine_->Stats();
    if (stats.live_sequences != 0 || stats.free_pages != stats.total_pages) {
      Fail(absl::StrCat("after releasing everything: ", stats.live_sequences, " sequences live, ",
                        stats.free_pages, " of ", stats.total_pages, " pages free"));
    }
  }

 private:
  engine::EngineConfig config_;
  server::AccessControl access_;
  FaultyBackend* backend_ = nullptr;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<server::IndexerService> service_;
  std::set<std::string> ids_;
};

// ---------------------------------------------------------------------------------------------
// Building requests from the script.

std::string PickId(ScriptReader& in) {
  const uint8_t b = in.Byte();
  if (b < 240) return absl::StrCat("s", b % 6);
  switch (b % 5) {
    case 0: return "";
    case 1: return std::string(257, 'x');
    case 2: return std::string("n\0ul", 4);
    case 3: return std::string(256, static_cast<char>('a' + b % 3));
    default: return std::string(in.Bytes(in.Byte() % 12));
  }
}

uint32_t PickSmall(ScriptReader& in, uint32_t typical_max) {
  const uint8_t b = in.Byte();
  if (b < 224) return b % (typical_max + 1);
  switch (b % 4) {
    case 0: return 0xffffffffu;
    case 1: return 0x80000000u;
    case 2: return typical_max + 1 + b % 3;
    default: return in.U32();
  }
}

v1::ValueDtype PickDtype(ScriptReader& in) {
  const uint8_t b = in.Byte();
  if (b < 120) return v1::VALUE_DTYPE_BF16;
  if (b < 240) return v1::VALUE_DTYPE_FP32;
  return b % 2 ? v1::VALUE_DTYPE_UNSPECIFIED : static_cast<v1::ValueDtype>(7 + b % 5);
}

// How many rows (tokens) a tensor gets: mostly a few, sometimes a block or more.
int64_t PickRows(ScriptReader& in, int64_t typical_max) {
  const uint8_t b = in.Byte();
  if (b < 200) return 1 + b % typical_max;
  if (b < 250) return (b - 199) * 23;
  return 0;
}

// `count` values packed as `dtype` (bf16 for anything but FP32), in a style the script picks:
// small integers, reals, raw script bytes (anything, NaN included), or small integers with one
// extreme value planted. Sometimes a byte too many or too few.
std::string Values(ScriptReader& in, int64_t count, v1::ValueDtype dtype) {
  const bool fp32 = dtype == v1::VALUE_DTYPE_FP32;
  const uint8_t style = in.Byte();
  Rng rng(in.U32());
  std::string out;
  const size_t width = fp32 ? 4 : 2;
  out.reserve(static_cast<size_t>(count) * width + 1);
  const auto put = [&](float f) {
    if (fp32) {
      out.append(reinterpret_cast<const char*>(&f), 4);
    } else {
      const uint16_t b = kernels::FloatToBf16(f);
      out.append(reinterpret_cast<const char*>(&b), 2);
    }
  };
  const int64_t planted = count > 0 ? static_cast<int64_t>(rng.Next() % count) : -1;
  const float extremes[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 3.4e38f, -3.39e38f, 448.0f,
                            -500.0f, 1e-40f, -0.0f};
  for (int64_t i = 0; i < count; ++i) {
    switch (style % 5) {
      case 0:
      case 1: put(static_cast<float>(rng.Int(-4, 4))); break;
      case 2: put(static_cast<float>(static_cast<int64_t>(rng.Next() % 20001) - 10000) / 997.0f); break;
      case 3: {
        const absl::string_view raw = in.Bytes(width);
        char bytes[4] = {0, 0, 0, 0};
        std::memcpy(bytes, raw.data(), raw.size());
        out.append(bytes, width);
        break;
      }
      default:
        put(i == planted ? extremes[style / 5 % 9] : static_cast<float>(rng.Int(-4, 4)));
        break;
    }
  }
  if (style >= 250) out.push_back('\x01');
  if (style >= 245 && style < 250 && !out.empty()) out.pop_back();
  return out;
}

void FillAppend(ScriptReader& in, const engine::EngineConfig& config, const std::string& id,
                v1::AppendKeysRequest* r) {
  r->set_sequence_id(id);
  const uint8_t flags = in.Byte();
  r->set_all_layers(flags & 1);
  r->set_layer(PickSmall(in, static_cast<uint32_t>(config.layers)));
  r->set_dtype(PickDtype(in));
  const int64_t rows = PickRows(in, 16);
  const int64_t row = int64_t{kHeadDim} * (r->all_layers() ? config.layers : 1);
  *r->mutable_keys() = Values(in, rows * row, r->dtype());
  if (flags & 2) {
    // Attention pages: one per block this append could open, or a wrong count, or bad ids.
    const int count = in.Byte() % 5;
    for (int i = 0; i < count; ++i) {
      const uint8_t b = in.Byte();
      r->add_attention_pages(b < 240 ? b : (b % 2 ? -1 - b : 0x7fffffff - b % 4));
    }
  }
}

void FillSelect(ScriptReader& in, const engine::EngineConfig& config, const std::string& id,
                v1::SelectBlocksRequest* r) {
  r->set_sequence_id(id);
  const uint8_t flags = in.Byte();
  r->set_layer(PickSmall(in, static_cast<uint32_t>(config.layers)));
  if (flags & 1) {
    // The append names the same sequence, or none, or (rarely) another one.
    const uint8_t which = in.Byte();
    FillAppend(in, config, which < 200 ? id : (which < 250 ? "" : PickId(in)), r->mutable_append());
  }
  if (flags & 2) {
    const uint8_t b = in.Byte();
    int64_t p = b;
    if (b >= 200) {
      const int64_t extremes[] = {-1, std::numeric_limits<int64_t>::max(),
                                  std::numeric_limits<int64_t>::min(), 1023, 1024, 127, 128};
      p = b < 230 ? static_cast<int64_t>(in.U64()) : extremes[b % 7];
    } else {
      p = int64_t{b} * (flags & 64 ? 5 : 1);
    }
    r->set_start_position(p);
  }
  r->set_num_heads(PickSmall(in, static_cast<uint32_t>(config.max_index_heads)));
  r->set_query_dtype(PickDtype(in));
  const int64_t tokens = (flags & 32) ? PickRows(in, config.max_query_tokens) : 1 + in.Byte() % 2;
  const int64_t heads = std::min<int64_t>(r->num_heads(), config.max_index_heads + 1);
  if (!(flags & 128)) *r->mutable_queries() = Values(in, tokens * heads * kHeadDim, r->query_dtype());
  if (flags & 4) r->set_topk(PickSmall(in, static_cast<uint32_t>(config.max_topk)));
  if (flags & 8) r->set_init_blocks(PickSmall(in, 9));
  if (flags & 16) r->set_local_blocks(PickSmall(in, 9));
}

// ---------------------------------------------------------------------------------------------
// Checking answers.

bool AllowedCode(grpc::StatusCode code, bool fault_armed) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
      return true;
    case grpc::StatusCode::INTERNAL:
      return fault_armed;
    default:
      return false;
  }
}

void CheckStatus(const char* rpc, int code, absl::string_view message, bool fault_armed) {
  if (Tracing()) std::fprintf(stderr, "  %s -> %d %s\n", rpc, code, std::string(message).c_str());
  if (!AllowedCode(static_cast<grpc::StatusCode>(code), fault_armed)) {
    Fail(absl::StrCat(rpc, " answered code ", code, ": ", message));
  }
  if (code != 0 && message.empty()) Fail(absl::StrCat(rpc, " failed (code ", code, ") saying nothing"));
}

std::vector<int32_t> Int32s(const std::string& bytes, const char* what) {
  if (bytes.size() % 4 != 0) Fail(absl::StrCat(what, " has ", bytes.size(), " bytes"));
  std::vector<int32_t> v(bytes.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

// A successful selection's answer against its own declared shape and SPEC.md's row rules.
void CheckSelection(const v1::SelectBlocksResponse& r, uint32_t layer, const engine::EngineConfig& c) {
  if (r.lengths_size() != c.layers) Fail(absl::StrCat("answer has ", r.lengths_size(), " lengths"));
  if (r.num_tokens() == 0) return;  // an append-only batch item
  const int64_t n = r.num_tokens(), h = r.num_heads(), k = r.topk();
  if (h < 1 || h > c.max_index_heads || k < 1 || k > c.max_topk || n > c.max_query_tokens) {
    Fail(absl::StrCat("answer shape n=", n, " h=", h, " topk=", k));
  }
  if (layer >= static_cast<uint32_t>(c.layers) || r.start_position() < 0 ||
      r.start_position() + n > static_cast<int64_t>(r.lengths(static_cast<int>(layer)))) {
    Fail(absl::StrCat("span of ", n, " tokens from ", r.start_position(), " answered on layer ",
                      layer));
  }
  const std::vector<int32_t> ids = Int32s(r.block_ids(), "block_ids");
  if (static_cast<int64_t>(ids.size()) != n * h * k) {
    Fail(absl::StrCat("block_ids holds ", ids.size(), " ids for ", n, "x", h, "x", k));
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t visible = kernels::VisibleBlocks(r.start_position() + t);
    const int64_t want = std::min<int64_t>(k, visible);
    for (int64_t hh = 0; hh < h; ++hh) {
      const int32_t* row = ids.data() + (t * h + hh) * k;
      std::set<int32_t> seen;
      for (int64_t j = 0; j < k; ++j) {
        const bool ok = j < want ? (row[j] >= 0 && row[j] < visible && seen.insert(row[j]).second)
                                 : row[j] == -1;
        if (!ok) {
          Fail(absl::StrCat("token ", t, " head ", hh, " entry ", j, " is ", row[j], " (", visible,
                            " visible blocks, topk ", k, ")"));
        }
      }
    }
  }
  if (!r.page_table().empty()) {
    const int64_t ppb = r.pages_per_block();
    if (ppb != c.page_table.pages_per_block) Fail("pages_per_block differs from the server's");
    if (static_cast<int64_t>(Int32s(r.page_table(), "page_table").size()) != n * h * k * ppb) {
      Fail("page_table has the wrong size");
    }
    const std::vector<int32_t> lens = Int32s(r.context_lens(), "context_lens");
    if (static_cast<int64_t>(lens.size()) != n * h) Fail("context_lens has the wrong size");
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t hh = 0; hh < h; ++hh) {
        const int32_t len = lens[t * h + hh];
        if (len < 0 || len > r.start_position() + t + 1) {
          Fail(absl::StrCat("context_len ", len, " at position ", r.start_position() + t));
        }
      }
    }
  }
}

// Hashes of the key rows an accepted append stores, per layer it writes.
std::vector<std::vector<uint64_t>> AppendedRows(const v1::AppendKeysRequest& r,
                                                const engine::EngineConfig& c) {
  const bool fp32 = r.dtype() == v1::VALUE_DTYPE_FP32;
  const int layer_count = r.all_layers() ? c.layers : 1;
  const size_t width = fp32 ? 4 : 2;
  const int64_t rows = static_cast<int64_t>(r.keys().size() / (width * kHeadDim * layer_count));
  std::vector<std::vector<uint64_t>> out(layer_count);
  std::vector<uint8_t> stored(kHeadDim * 2);
  for (int64_t t = 0; t < rows; ++t) {
    for (int l = 0; l < layer_count; ++l) {
      const char* src = r.keys().data() + ((t * layer_count + l) * kHeadDim) * width;
      size_t n = 0;
      for (int d = 0; d < kHeadDim; ++d) {
        uint16_t bits;
        if (fp32) {
          float f;
          std::memcpy(&f, src + d * 4, 4);
          bits = kernels::FloatToBf16(f);
        } else {
          std::memcpy(&bits, src + d * 2, 2);
        }
        if (c.key_storage == kernels::KeyStorage::kBf16) {
          std::memcpy(stored.data() + n, &bits, 2);
          n += 2;
        } else {
          stored[n++] = kernels::FloatToFp8E4M3(kernels::Bf16ToFloat(bits));
        }
      }
      out[l].push_back(Fnv1a(stored.data(), n));
    }
  }
  return out;
}

// Adds the rows an accepted `append` stored to `tokens` (per layer; empty: a new sequence).
void ApplyExpected(const v1::AppendKeysRequest& append, const engine::EngineConfig& c,
                   std::vector<std::vector<uint64_t>>* tokens) {
  if (tokens->empty()) tokens->resize(c.layers);
  const std::vector<std::vector<uint64_t>> rows = AppendedRows(append, c);
  const int first = append.all_layers() ? 0 : static_cast<int>(append.layer());
  for (size_t l = 0; l < rows.size(); ++l) {
    auto& dst = (*tokens)[first + l];
    dst.insert(dst.end(), rows[l].begin(), rows[l].end());
  }
}

std::string Describe(const std::string& id) {
  std::string out;
  for (char ch : id.substr(0, 24)) {
    out += (ch >= 32 && ch < 127) ? std::string(1, ch) : absl::StrCat("\\x", static_cast<int>(static_cast<uint8_t>(ch)));
  }
  return id.size() > 24 ? absl::StrCat(out, "... (", id.size(), " bytes)") : out;
}

// `after` against `before` for a call that named the sequences `named`. Sequences it did not
// name must be exactly as they were, and none may have appeared; when the call `failed` as a
// whole, that holds for every sequence and for the free page count too.
void CheckEffects(const State& before, const State& after, const std::set<std::string>& named,
                  bool failed, const char* rpc) {
  if (failed && after.free_pages != before.free_pages) {
    Fail(absl::StrCat(rpc, " failed but the free pages went from ", before.free_pages, " to ",
                      after.free_pages));
  }
  for (const auto& [id, q] : before.seqs) {
    if (!failed && named.count(id) > 0) continue;
    auto it = after.seqs.find(id);
    if (it == after.seqs.end()) {
      Fail(absl::StrCat(rpc, (failed ? " failed but" : ""), " removed '", Describe(id), "'"));
    }
    if (!it->second.SameContents(q)) {
      Fail(absl::StrCat(rpc, (failed ? " failed but" : ""), " changed '", Describe(id), "'"));
    }
  }
  for (const auto& [id, q] : after.seqs) {
    if (before.seqs.count(id) == 0 && (failed || named.count(id) == 0)) {
      Fail(absl::StrCat(rpc, (failed ? " failed but" : ""), " created '", Describe(id), "'"));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Operations.

void RunAppend(Harness& h, const v1::AppendKeysRequest& req) {
  h.Track(req.sequence_id());
  const State before = h.Capture();
  const bool armed = h.backend().armed();
  v1::AppendKeysResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::AppendKeys, req, &resp);
  CheckStatus("AppendKeys", s.error_code(), s.error_message(), armed);
  const State after = h.Capture();
  h.CheckAccounting(after);
  CheckEffects(before, after, {req.sequence_id()}, !s.ok(), "AppendKeys");
  if (!s.ok()) return;
  auto it = before.seqs.find(req.sequence_id());
  std::vector<std::vector<uint64_t>> want =
      it == before.seqs.end() ? std::vector<std::vector<uint64_t>>() : it->second.tokens;
  ApplyExpected(req, h.config(), &want);
  const SeqState& got = after.seqs.at(req.sequence_id());
  if (got.tokens != want) Fail("AppendKeys did not store exactly the keys it carried");
  if (resp.created() != (it == before.seqs.end())) Fail("AppendKeys' created flag is wrong");
  if (resp.lengths_size() != h.config().layers) Fail("AppendKeys answered the wrong lengths");
  for (int l = 0; l < h.config().layers; ++l) {
    if (static_cast<int64_t>(resp.lengths(l)) != got.lengths[l]) Fail("AppendKeys' lengths are wrong");
  }
  if (static_cast<int64_t>(resp.num_blocks()) != static_cast<int64_t>(got.pages.size())) {
    Fail("AppendKeys' num_blocks is wrong");
  }
}

// Batch (or a single SelectBlocks when `single`).
void RunSteps(Harness& h, const std::vector<v1::SelectBlocksRequest>& items, bool single,
              uint64_t request_id) {
  std::set<std::string> named;
  for (const auto& item : items) {
    h.Track(item.sequence_id());
    named.insert(item.sequence_id());
  }
  const State before = h.Capture();
  const bool armed = h.backend().armed();
  std::vector<int> codes;
  std::vector<const v1::SelectBlocksResponse*> answers;
  v1::SelectBlocksResponse single_resp;
  v1::BatchResponse batch_resp;
  if (single) {
    const grpc::Status s =
        CallHandler(h.service(), &server::IndexerService::SelectBlocks, items[0], &single_resp);
    CheckStatus("SelectBlocks", s.error_code(), s.error_message(), armed);
    codes.push_back(s.error_code());
    answers.push_back(&single_resp);
  } else {
    v1::BatchRequest req;
    req.set_request_id(request_id);
    for (const auto& item : items) *req.add_items() = item;
    const grpc::Status s = CallHandler(h.service(), &server::IndexerService::Batch, req, &batch_resp);
    if (!s.ok()) {
      // A Batch fails as a call only when its bytes do not parse (a non-UTF-8 string field) or
      // when its items' errors alone would not fit max_response_bytes; then nothing applies.
      const bool unparsable = s.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                              absl::StrContains(s.error_message(), "do not parse");
      if (!unparsable && s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
        Fail(absl::StrCat("Batch failed as a call: ", s.error_message()));
      }
      CheckStatus("Batch", s.error_code(), s.error_message(), armed);
      const State after = h.Capture();
      h.CheckAccounting(after);
      CheckEffects(before, after, named, /*all_failed=*/true, "Batch");
      return;
    }
    if (batch_resp.request_id() != request_id) Fail("Batch did not echo request_id");
    if (batch_resp.results_size() != static_cast<int>(items.size())) {
      Fail(absl::StrCat("Batch answered ", batch_resp.results_size(), " of ", items.size(), " items"));
    }
    for (const auto& r : batch_resp.results()) {
      CheckStatus("Batch item", r.code(), r.message(), armed);
      codes.push_back(r.code());
      answers.push_back(&r.result());
    }
  }
  const State after = h.Capture();
  h.CheckAccounting(after);
  bool all_failed = true;
  for (int c : codes) all_failed = all_failed && c != 0;
  CheckEffects(before, after, named, all_failed, single ? "SelectBlocks" : "Batch");

  // Expected contents: the items that succeeded, applied in order.
  std::map<std::string, std::vector<std::vector<uint64_t>>> want;
  for (const std::string& id : named) {
    auto it = before.seqs.find(id);
    if (it != before.seqs.end()) want[id] = it->second.tokens;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (codes[i] != 0) continue;
    CheckSelection(*answers[i], items[i].layer(), h.config());
    if (items[i].has_append()) ApplyExpected(items[i].append(), h.config(), &want[items[i].sequence_id()]);
  }
  for (const std::string& id : named) {
    auto got = after.seqs.find(id);
    auto exp = want.find(id);
    const bool exists = got != after.seqs.end();
    if (exists != (exp != want.end())) {
      Fail(absl::StrCat("'", Describe(id), "' ", exists ? "exists" : "is missing",
                        " after its steps"));
    }
    if (exists && got->second.tokens != exp->second) {
      Fail(absl::StrCat("'", Describe(id), "' does not hold what its accepted appends carried"));
    }
  }
}

void RunRelease(Harness& h, const std::string& id) {
  h.Track(id);
  const State before = h.Capture();
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(id);
  v1::ReleaseSequenceResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::ReleaseSequence, req, &resp);
  CheckStatus("ReleaseSequence", s.error_code(), s.error_message(), false);
  const State after = h.Capture();
  h.CheckAccounting(after);
  CheckEffects(before, after, {id}, !s.ok(), "ReleaseSequence");
  if (s.ok()) {
    if (after.seqs.count(id) > 0) Fail("a released sequence is still there");
    if (static_cast<int64_t>(resp.pages_freed()) != after.free_pages - before.free_pages) {
      Fail("ReleaseSequence's pages_freed is wrong");
    }
  }
}

void RunTruncate(Harness& h, const std::string& id, uint32_t length) {
  h.Track(id);
  const State before = h.Capture();
  v1::TruncateSequenceRequest req;
  req.set_sequence_id(id);
  req.set_length(length);
  v1::TruncateSequenceResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::TruncateSequence, req, &resp);
  CheckStatus("TruncateSequence", s.error_code(), s.error_message(), false);
  const State after = h.Capture();
  h.CheckAccounting(after);
  CheckEffects(before, after, {id}, !s.ok(), "TruncateSequence");
  if (!s.ok()) return;
  std::vector<std::vector<uint64_t>> want = before.seqs.at(id).tokens;
  for (auto& layer : want) {
    if (layer.size() > length) layer.resize(length);
  }
  if (after.seqs.at(id).tokens != want) Fail("TruncateSequence did not keep exactly the prefix");
}

void RunFork(Harness& h, const std::string& source, const std::string& target,
             std::optional<uint32_t> length) {
  h.Track(source);
  h.Track(target);
  const State before = h.Capture();
  v1::ForkSequenceRequest req;
  req.set_source_id(source);
  req.set_target_id(target);
  if (length) req.set_length(*length);
  v1::ForkSequenceResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::ForkSequence, req, &resp);
  CheckStatus("ForkSequence", s.error_code(), s.error_message(), false);
  const State after = h.Capture();
  h.CheckAccounting(after);
  // Only the target may change, and only by appearing.
  CheckEffects(before, after, {target}, !s.ok(), "ForkSequence");
  if (!s.ok()) return;
  if (before.seqs.count(target) > 0) Fail("ForkSequence replaced an existing sequence");
  std::vector<std::vector<uint64_t>> want = before.seqs.at(source).tokens;
  for (auto& layer : want) {
    if (length && layer.size() > *length) layer.resize(*length);
  }
  if (after.seqs.at(target).tokens != want) Fail("the fork does not hold its source's prefix");
  if (static_cast<int64_t>(resp.pages_shared()) != static_cast<int64_t>(after.seqs.at(target).pages.size())) {
    Fail("ForkSequence's pages_shared is wrong");
  }
}

void RunGet(Harness& h, const std::string& id) {
  h.Track(id);
  const State before = h.Capture();
  v1::GetSequenceRequest req;
  req.set_sequence_id(id);
  v1::GetSequenceResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::GetSequence, req, &resp);
  CheckStatus("GetSequence", s.error_code(), s.error_message(), false);
  const State after = h.Capture();
  CheckEffects(before, after, {}, true, "GetSequence");
  if (s.ok() != (before.seqs.count(id) > 0)) Fail("GetSequence disagrees with the engine");
  if (s.ok() && resp.pages_size() != static_cast<int>(before.seqs.at(id).pages.size())) {
    Fail("GetSequence's pages differ from the engine's");
  }
}

void RunServerInfo(Harness& h) {
  v1::ServerInfoRequest req;
  v1::ServerInfoResponse resp;
  const grpc::Status s = CallHandler(h.service(), &server::IndexerService::ServerInfo, req, &resp);
  if (!s.ok()) Fail(absl::StrCat("ServerInfo failed: ", s.error_message()));
  if (resp.total_pages() != static_cast<uint64_t>(h.config().capacity_pages) ||
      resp.free_pages() > resp.total_pages()) {
    Fail("ServerInfo's page counts are wrong");
  }
}

// The server's own reader of the step requests must accept exactly the bytes protobuf parses.
void CheckStepReader(server::StepMessage message, absl::string_view wire, bool protobuf_parsed) {
  server::StepRequestWire read;
  const bool ours = server::ReadStepRequest(message, wire, "", &read).ok();
  if (ours != protobuf_parsed) {
    Fail(absl::StrCat("ReadStepRequest ", ours ? "reads" : "refuses", " ", wire.size(),
                      " bytes of ", server::StepMessageName(message), " that protobuf ",
                      protobuf_parsed ? "parses" : "refuses"));
  }
}

// Bytes from the script parsed as one wire message of the type the script picks, then served.
void RunRaw(Harness& h, ScriptReader& in) {
  const uint8_t kind = in.Byte();
  const absl::string_view wire = in.Bytes(in.Byte() + (kind & 0x80 ? 256 : 0));
  switch (kind % 6) {
    case 0: {
      v1::AppendKeysRequest req;
      const bool parsed = req.ParseFromArray(wire.data(), static_cast<int>(wire.size()));
      CheckStepReader(server::StepMessage::kAppendKeys, wire, parsed);
      if (parsed) RunAppend(h, req);
      break;
    }
    case 1: {
      v1::SelectBlocksRequest req;
      const bool parsed = req.ParseFromArray(wire.data(), static_cast<int>(wire.size()));
      CheckStepReader(server::StepMessage::kSelectBlocks, wire, parsed);
      if (parsed) RunSteps(h, {req}, true, 0);
      break;
    }
    case 2: {
      v1::BatchRequest req;
      const bool parsed = req.ParseFromArray(wire.data(), static_cast<int>(wire.size()));
      CheckStepReader(server::StepMessage::kBatch, wire, parsed);
      if (parsed && req.items_size() > 0 && req.items_size() <= 8) {
        RunSteps(h, std::vector<v1::SelectBlocksRequest>(req.items().begin(), req.items().end()),
                 false, req.request_id());
      }
      break;
    }
    case 3: {
      v1::ForkSequenceRequest req;
      if (req.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) {
        RunFork(h, req.source_id(), req.target_id(),
                req.has_length() ? std::optional<uint32_t>(req.length()) : std::nullopt);
      }
      break;
    }
    case 4: {
      v1::TruncateSequenceRequest req;
      if (req.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) {
        RunTruncate(h, req.sequence_id(), req.length());
      }
      break;
    }
    default: {
      v1::ReleaseSequenceRequest req;
      if (req.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) RunRelease(h, req.sequence_id());
      break;
    }
  }
}

void RunScript(const uint8_t* data, size_t size) {
  Tracing();
  ScriptReader in(data, size);
  Harness h(in.Byte());
  for (int op = 0; op < kMaxOps && !in.done(); ++op) {
    const uint8_t kind = in.Byte();
    switch (kind % 12) {
      case 0:
      case 1: {
        v1::AppendKeysRequest req;
        FillAppend(in, h.config(), PickId(in), &req);
        RunAppend(h, req);
        break;
      }
      case 2:
      case 3: {
        v1::SelectBlocksRequest req;
        FillSelect(in, h.config(), PickId(in), &req);
        RunSteps(h, {req}, true, 0);
        break;
      }
      case 4:
      case 5: {
        const int count = 1 + in.Byte() % (h.config().max_batch_items + 1);
        std::vector<v1::SelectBlocksRequest> items(count);
        for (auto& item : items) FillSelect(in, h.config(), PickId(in), &item);
        RunSteps(h, items, false, in.U64());
        break;
      }
      case 6: RunRelease(h, PickId(in)); break;
      case 7: {
        const std::string id = PickId(in);
        const uint8_t b = in.Byte();
        RunTruncate(h, id, b < 250 ? b * 3u : in.U32());
        break;
      }
      case 8: {
        const std::string source = PickId(in);
        const std::string target = PickId(in);
        const uint8_t b = in.Byte();
        std::optional<uint32_t> length;
        if (b < 128) length = b * 3u;
        if (b >= 250) length = in.U32();
        RunFork(h, source, target, length);
        break;
      }
      case 9: {
        if (kind & 0x10) {
          RunGet(h, PickId(in));
        } else {
          RunServerInfo(h);
        }
        break;
      }
      case 10: RunRaw(h, in); break;
      default: h.backend().FailCall(1 + in.Byte() % 3); break;
    }
  }
  h.backend().FailCall(0);
  h.CheckAccounting(h.Capture());
  h.ReleaseAll();
}

}  // namespace
}  // namespace indexer::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  indexer::fuzz::RunScript(data, size);
  return 0;
}
