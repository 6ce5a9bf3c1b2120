#include "engine/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_format.h"
#include "engine/cuda/cuda_resources.h"
#include "engine/status_macros.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/select_batch.h"
#include "kernels/cuda/span_desc.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;
using kernels::cuda::SpanDesc;

constexpr int kDevice = 0;
// Device memory left free beside the pool for scratch, staging and the CUDA context.
constexpr int64_t kHeadroomBytes = int64_t{1} << 30;

int64_t Align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

class CudaBackend final : public KeyCacheBackend {
 public:
  explicit CudaBackend(const EngineConfig& config)
      : config_(config),
        layer_bytes_(config.capacity_pages * kBlockSize * config.head_dim *
                     kernels::KeyStorageBytes(config.key_storage)) {}

  absl::Status Init();
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  absl::Status WriteKeys(const KeyWrite& write) override;
  absl::Status CopyPage(int32_t src, int32_t dst) override;
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override;
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override;
  absl::Status Select(std::span<const SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override;

 private:
  // Waits for the stream; on failure also clears state a broken launch may have left behind.
  absl::Status Finish(const char* what);

  const EngineConfig config_;
  const int64_t layer_bytes_;
  int num_sms_ = 0;
  std::string device_name_;

  std::mutex mu_;  // serialises every use of the members below
  CudaStream stream_;
  DeviceBuffer pool_;
  // Largest |key| ever written per layer: decides when selections need the exact path.
  std::vector<float> key_max_abs_ = std::vector<float>(config_.layers, 0.0f);
  DeviceBuffer d_in_, d_out_, d_scores_, d_counters_;
  PinnedBuffer h_in_, h_out_;
};

absl::Status CudaBackend::Init() {
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  cudaDeviceProp prop{};
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, kDevice), "cudaGetDeviceProperties"));
  num_sms_ = prop.multiProcessorCount;
  const int64_t topk_smem = kernels::cuda::TopkSharedBytes(
      static_cast<int32_t>(std::min<int64_t>(config_.MaxBlocksPerSequence(), 1 << 30)));
  const int64_t prefill_smem = kernels::cuda::PrefillSharedBytes(config_.head_dim, config_.key_storage);
  if (std::max(topk_smem, prefill_smem) > static_cast<int64_t>(prop.sharedMemPerBlockOptin)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_tokens_per_sequence %d needs %d bytes of shared memory per block for top-k; %s offers "
        "%d; lower max_tokens_per_sequence (2097152 fits an H100/H200)",
        config_.max_tokens_per_sequence, topk_smem, prop.name, prop.sharedMemPerBlockOptin));
  }
  size_t free_bytes = 0, total_bytes = 0;
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  const int64_t pool_bytes = layer_bytes_ * config_.layers;
  if (pool_bytes + kHeadroomBytes > static_cast<int64_t>(free_bytes)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "capacity of %d pages needs %.2f GiB of GPU memory plus %.2f GiB headroom, but %s has "
        "%.2f GiB free of %.2f GiB; lower --capacity",
        config_.capacity_pages, pool_bytes / 1073741824.0, kHeadroomBytes / 1073741824.0, prop.name,
        free_bytes / 1073741824.0, total_bytes / 1073741824.0));
  }
  INDEXER_RETURN_IF_ERROR(pool_.Allocate(static_cast<size_t>(pool_bytes)));
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaMemset(pool_.get(), 0, pool_bytes), "cudaMemset(pool)"));
  INDEXER_RETURN_IF_ERROR(stream_.Create());
  device_name_ = absl::StrFormat("%s (sm_%d%d, %d SMs, %.0f GiB, pool %.2f GiB)", prop.name,
                                 prop.major, prop.minor, prop.multiProcessorCount,
                                 total_bytes / 1073741824.0, pool_bytes / 1073741824.0);
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

absl::Status CudaBackend::Finish(const char* what) {
  const absl::Status status = CudaStatus(cudaStreamSynchronize(stream_.get()), what);
  if (!status.ok() && d_counters_.get() != nullptr) {
    // A failed decode launch can leave span counters set; later launches need them at zero.
    (void)cudaMemset(d_counters_.get(), 0, d_counters_.bytes());
  }
  return status;
}

absl::Status CudaBackend::WriteKeys(const KeyWrite& w) {
  std::lock_guard<std::mutex> lock(mu_);
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  int64_t end = 0;
  for (int l = 0; l < w.layer_count; ++l) end = std::max(end, w.layer_start[l] + w.num_tokens);
  const int64_t blocks = (end + kBlockSize - 1) / kBlockSize;
  const int64_t key_bytes = w.num_tokens * w.layer_count * config_.head_dim * 2;
  const int64_t bt_off = Align(key_bytes, 256);
  const int64_t start_off = Align(bt_off + blocks * 4, 256);
  const int64_t total = start_off + w.layer_count * 8;
  INDEXER_RETURN_IF_ERROR(h_in_.Reserve(total));
  INDEXER_RETURN_IF_ERROR(d_in_.Reserve(total));
  char* h = h_in_.get<char>();
  std::memcpy(h, w.keys, key_bytes);
  const float written_max =
      kernels::cuda::ScanBf16(w.keys, w.num_tokens * w.layer_count * config_.head_dim).max_abs;
  std::memcpy(h + bt_off, w.block_table, blocks * 4);
  std::memcpy(h + start_off, w.layer_start, w.layer_count * 8);
  char* d = d_in_.get<char>();
  INDEXER_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(d, h, total, cudaMemcpyHostToDevice, stream_.get()), "cudaMemcpyAsync(keys)"));
  kernels::cuda::AppendArgs args;
  args.pool = pool_.get();
  args.layer_bytes = layer_bytes_;
  args.block_table = reinterpret_cast<const int32_t*>(d + bt_off);
  args.layer_start = reinterpret_cast<const int64_t*>(d + start_off);
  args.layer_begin = w.layer_begin;
  args.layer_count = w.layer_count;
  args.num_tokens = w.num_tokens;
  args.keys = reinterpret_cast<const uint16_t*>(d);
  INDEXER_RETURN_IF_ERROR(CudaStatus(
      kernels::cuda::LaunchAppendKeys(args, config_.key_storage, config_.head_dim, stream_.get()),
      "append kernel launch"));
  INDEXER_RETURN_IF_ERROR(Finish("append"));
  for (int l = 0; l < w.layer_count; ++l) {
    float& m = key_max_abs_[w.layer_begin + l];
    m = std::max(m, written_max);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyPage(int32_t src, int32_t dst) {
  std::lock_guard<std::mutex> lock(mu_);
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  const int64_t page_bytes = layer_bytes_ / config_.capacity_pages;
  char* base = pool_.get<char>();
  for (int l = 0; l < config_.layers; ++l) {
    char* layer = base + l * layer_bytes_;
    INDEXER_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(layer + dst * page_bytes, layer + src * page_bytes, page_bytes,
                        cudaMemcpyDeviceToDevice, stream_.get()),
        "cudaMemcpyAsync(page copy)"));
  }
  return Finish("page copy");
}

absl::Status CudaBackend::ReadPages(std::span<const int32_t> pages, uint8_t* dst) {
  if (pages.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  const int64_t page_bytes = layer_bytes_ / config_.capacity_pages;
  const int64_t total = static_cast<int64_t>(pages.size()) * config_.layers * page_bytes;
  INDEXER_RETURN_IF_ERROR(h_out_.Reserve(total));
  char* h = h_out_.get<char>();
  const char* pool = pool_.get<char>();
  absl::Status status;
  for (size_t i = 0; i < pages.size() && status.ok(); ++i) {
    for (int l = 0; l < config_.layers && status.ok(); ++l) {
      status = CudaStatus(
          cudaMemcpyAsync(h + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes,
                          pool + l * layer_bytes_ + pages[i] * page_bytes, page_bytes,
                          cudaMemcpyDeviceToHost, stream_.get()),
          "cudaMemcpyAsync(read page)");
    }
  }
  // Wait even after a failed enqueue: copies already queued still use the staging buffer.
  const absl::Status finished = Finish("read pages");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  std::memcpy(dst, h, total);
  return absl::OkStatus();
}

absl::Status CudaBackend::WritePages(std::span<const int32_t> pages, const uint8_t* src) {
  if (pages.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  const int64_t page_bytes = layer_bytes_ / config_.capacity_pages;
  const int64_t total = static_cast<int64_t>(pages.size()) * config_.layers * page_bytes;
  INDEXER_RETURN_IF_ERROR(h_in_.Reserve(total));
  char* h = h_in_.get<char>();
  std::memcpy(h, src, total);
  char* pool = pool_.get<char>();
  absl::Status status;
  for (size_t i = 0; i < pages.size() && status.ok(); ++i) {
    for (int l = 0; l < config_.layers && status.ok(); ++l) {
      status = CudaStatus(
          cudaMemcpyAsync(pool + l * layer_bytes_ + pages[i] * page_bytes,
                          h + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes,
                          page_bytes, cudaMemcpyHostToDevice, stream_.get()),
          "cudaMemcpyAsync(write page)");
    }
  }
  const absl::Status finished = Finish("write pages");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  // Selections pick their path from the largest key written (see key_max_abs_).
  const int64_t elems = page_bytes / kernels::KeyStorageBytes(config_.key_storage);
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int l = 0; l < config_.layers; ++l) {
      const uint8_t* page = src + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes;
      float m = 0.0f;
      if (config_.key_storage == kernels::KeyStorage::kBf16) {
        m = kernels::cuda::ScanBf16(reinterpret_cast<const uint16_t*>(page), elems).max_abs;
      } else {
        for (int64_t e = 0; e < elems; ++e) {
          m = std::max(m, std::fabs(kernels::Fp8E4M3ToFloat(page[e])));
        }
      }
      key_max_abs_[l] = std::max(key_max_abs_[l], m);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Select(std::span<const SelectTask> tasks,
                                 const kernels::PageTableParams& pt) {
  if (tasks.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(kDevice), "cudaSetDevice"));
  const int d = config_.head_dim;
  const size_t m = tasks.size();

  // One upload: [descriptors][block tables][attention pages][queries]; one download: results.
  struct Offsets {
    int64_t bt, attn, q, ids, table, ctx;
    int64_t v;
  };
  std::vector<Offsets> off(m);
  int64_t in = Align(static_cast<int64_t>(m * sizeof(SpanDesc)), 256);
  int64_t out = 0;
  for (size_t i = 0; i < m; ++i) {
    const kernels::SpanSelect& s = tasks[i].span;
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    Offsets& o = off[i];
    o.v = kernels::VisibleBlocks(s.start_pos + s.num_tokens - 1);
    o.bt = in;
    in = Align(in + o.v * 4, 16);
    o.attn = in;
    if (s.attn_pages != nullptr) in = Align(in + o.v * 4, 16);
    o.q = in;
    in = Align(in + rows * d * 2, 16);
    o.ids = out;
    out += rows * s.params.topk * 4;
    o.table = out;
    o.ctx = out;
    if (s.attn_pages != nullptr) {
      out += rows * s.params.topk * pt.pages_per_block * 4;
      o.ctx = out;
      out += rows * 4;
    }
  }
  INDEXER_RETURN_IF_ERROR(h_in_.Reserve(in));
  INDEXER_RETURN_IF_ERROR(d_in_.Reserve(in));
  INDEXER_RETURN_IF_ERROR(h_out_.Reserve(std::max<int64_t>(out, 4)));
  INDEXER_RETURN_IF_ERROR(d_out_.Reserve(std::max<int64_t>(out, 4)));
  char* h = h_in_.get<char>();
  char* din = d_in_.get<char>();
  char* dout = d_out_.get<char>();
  std::vector<SpanDesc> descs(m);
  std::vector<kernels::cuda::SpanPath> paths(m);
  for (size_t i = 0; i < m; ++i) {
    const kernels::SpanSelect& s = tasks[i].span;
    const Offsets& o = off[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    std::memcpy(h + o.bt, s.block_table, o.v * 4);
    if (s.attn_pages != nullptr) std::memcpy(h + o.attn, s.attn_pages, o.v * 4);
    std::memcpy(h + o.q, s.queries, rows * d * 2);
    SpanDesc& desc = descs[i];
    desc.keys = pool_.get<char>() + tasks[i].layer * layer_bytes_;
    desc.block_table = reinterpret_cast<const int32_t*>(din + o.bt);
    desc.attn_pages = s.attn_pages != nullptr ? reinterpret_cast<const int32_t*>(din + o.attn) : nullptr;
    desc.queries = reinterpret_cast<const uint16_t*>(din + o.q);
    desc.block_ids = reinterpret_cast<int32_t*>(dout + o.ids);
    desc.page_table = s.attn_pages != nullptr ? reinterpret_cast<int32_t*>(dout + o.table) : nullptr;
    desc.context_lens = s.attn_pages != nullptr ? reinterpret_cast<int32_t*>(dout + o.ctx) : nullptr;
    desc.start_pos = s.start_pos;
    desc.num_tokens = s.num_tokens;
    desc.num_heads = s.num_heads;
    desc.topk = s.params.topk;
    desc.init_blocks = s.params.init_blocks;
    desc.local_blocks = s.params.local_blocks;
    paths[i] = kernels::cuda::ChoosePath(static_cast<int>(rows), d, config_.key_storage,
                                         kernels::cuda::ScanBf16(s.queries, rows * d),
                                         key_max_abs_[tasks[i].layer]);
  }
  const kernels::cuda::SelectBatch batch = kernels::cuda::PlanSelectBatch(descs, paths, num_sms_, d);
  std::memcpy(h, batch.descs.data(), m * sizeof(SpanDesc));
  INDEXER_RETURN_IF_ERROR(d_scores_.Reserve(batch.ScoreFloats() * 4));
  if (d_counters_.bytes() < std::max<size_t>(batch.n_decode, 1) * sizeof(int)) {
    INDEXER_RETURN_IF_ERROR(d_counters_.Reserve(std::max<size_t>(batch.n_decode, 1) * sizeof(int)));
    INDEXER_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(d_counters_.get(), 0, d_counters_.bytes(), stream_.get()), "cudaMemsetAsync"));
  }
  cudaStream_t st = stream_.get();
  absl::Status status = CudaStatus(cudaMemcpyAsync(din, h, in, cudaMemcpyHostToDevice, st),
                                   "cudaMemcpyAsync(select inputs)");
  if (status.ok()) {
    status = CudaStatus(
        kernels::cuda::LaunchSelectBatch(batch, reinterpret_cast<const SpanDesc*>(din),
                                         config_.key_storage, d, pt, d_scores_.get<float>(),
                                         d_counters_.get<int>(), st),
        "select launch");
  }
  if (status.ok()) {
    status = CudaStatus(cudaMemcpyAsync(h_out_.get(), dout, out, cudaMemcpyDeviceToHost, st),
                        "cudaMemcpyAsync(select results)");
  }
  const absl::Status finished = Finish("select");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  const char* ho = h_out_.get<char>();
  for (size_t i = 0; i < m; ++i) {
    const kernels::SpanSelect& s = tasks[i].span;
    const Offsets& o = off[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    std::memcpy(s.block_ids, ho + o.ids, rows * s.params.topk * 4);
    if (s.attn_pages != nullptr) {
      std::memcpy(s.page_table, ho + o.table, rows * s.params.topk * pt.pages_per_block * 4);
      std::memcpy(s.context_lens, ho + o.ctx, rows * 4);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaStatus(err, "cudaGetDeviceCount");
  }
  if (count == 0) return absl::NotFoundError("no CUDA device is visible");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config) {
  auto backend = std::make_unique<CudaBackend>(config);
  INDEXER_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<KeyCacheBackend>(std::move(backend));
}

}  // namespace indexer::engine
