#include "engine/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "engine/cuda/cuda_errors.h"
#include "engine/cuda/cuda_resources.h"
#include "engine/cuda/select_graph.h"
#include "engine/device_failure.h"
#include "engine/status_macros.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/select_batch.h"
#include "kernels/cuda/span_plan.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;
using kernels::cuda::SpanDesc;

// Device memory left free beside the pool for scratch, staging and the CUDA context.
constexpr int64_t kHeadroomBytes = int64_t{1} << 30;
// ReadPages/WritePages move pages through a lane's pinned staging this many bytes at a time, so
// a snapshot of the whole cache does not grow every lane's pinned buffers to its size.
constexpr int64_t kPageStagingBytes = int64_t{16} << 20;
constexpr int kMaxLanes = 8;
// A lane whose graphs failed this many times (built or updated) runs its steps without graphs.
constexpr int kMaxGraphFailures = 3;

int64_t Align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// One concurrent call's resources. Used only by the call holding the lane (LaneLease).
struct Lane {
  explicit Lane(int graphs_capacity) : graphs(static_cast<size_t>(graphs_capacity)) {}

  // Buffer::Reserve, counting reallocations: graphs hold the buffers' addresses.
  template <typename Buffer>
  absl::Status Reserve(Buffer& buffer, size_t bytes) {
    const void* before = buffer.get();
    const size_t before_bytes = buffer.bytes();
    const absl::Status status = buffer.Reserve(bytes);
    if (buffer.get() != before || buffer.bytes() != before_bytes) ++generation;
    return status;
  }

  // Waits for the stream; on failure also clears state a broken launch may have left behind
  // (not after a sticky error: the device is lost, and the backend will not touch it again).
  absl::Status Finish(const char* what) {
    const cudaError_t err = cudaStreamSynchronize(stream.get());
    const absl::Status status = CudaStatus(err, what);
    if (!status.ok() && !IsStickyCudaError(err) && d_counters.get() != nullptr) {
      // A failed decode launch can leave span counters set; later launches need them at zero.
      (void)cudaGetLastError();
      if (cudaMemsetAsync(d_counters.get(), 0, d_counters.bytes(), stream.get()) == cudaSuccess) {
        (void)cudaStreamSynchronize(stream.get());
      }
      (void)cudaGetLastError();
    }
    return status;
  }

  CudaStream stream;
  PinnedBuffer h_in, h_out;
  DeviceBuffer d_in, d_out, d_scores, d_counters;
  SelectGraphCache graphs;
  uint64_t generation = 0;         // bumped whenever a buffer above is reallocated
  uint64_t graphs_generation = 0;  // the generation the cached graphs were built on
  int graph_failures = 0;
};

// A fixed set of lanes, each held by one call at a time.
struct LanePool {
  std::vector<std::unique_ptr<Lane>> lanes;  // fixed after Init
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Lane*> free;  // guarded by mu
  int busy = 0;             // guarded by mu
  std::atomic<int> peak_busy{0};

  // Waits while every lane is busy; the most recently released lane first (a lone caller keeps
  // one lane, whose graphs stay warm).
  Lane* Acquire() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !free.empty(); });
    Lane* lane = free.back();
    free.pop_back();
    ++busy;
    if (busy > peak_busy.load(std::memory_order_relaxed)) peak_busy.store(busy, std::memory_order_relaxed);
    return lane;
  }
  void Release(Lane* lane) {
    {
      std::lock_guard<std::mutex> lock(mu);
      free.push_back(lane);
      --busy;
    }
    cv.notify_one();
  }
  absl::Status Add(int graphs_capacity, int stream_priority) {
    auto lane = std::make_unique<Lane>(graphs_capacity);
    INDEXER_RETURN_IF_ERROR(lane->stream.Create(stream_priority));
    free.push_back(lane.get());
    lanes.push_back(std::move(lane));
    return absl::OkStatus();
  }
};

class CudaBackend final : public KeyCacheBackend {
 public:
  CudaBackend(const EngineConfig& config, const DeviceSlot& slot, const CudaBackendOptions& options)
      : config_(config),
        slot_(slot),
        options_(Normalized(options)),
        pages_(slot.num_pages > 0 ? slot.num_pages : config.capacity_pages),
        page_bytes_(int64_t{kBlockSize} * config.head_dim * kernels::KeyStorageBytes(config.key_storage)),
        layer_bytes_(pages_ * page_bytes_),
        key_max_abs_(new std::atomic<float>[static_cast<size_t>(std::max(config.layers, 1))]) {
    for (int l = 0; l < std::max(config.layers, 1); ++l) key_max_abs_[l].store(0.0f);
  }
  ~CudaBackend() override {
    // A backend whose Init refused its slot never touched a device: setting an invalid ordinal
    // here would leave an error in this thread's CUDA error state for an unrelated later call.
    if (!entered_device_) return;
    // Free the streams, staging, graphs and pool on this backend's device.
    (void)cudaSetDevice(slot_.ordinal);
    lanes_.lanes.clear();
    write_lanes_.lanes.clear();
    pool_.Reset();
    (void)cudaGetLastError();
  }

  absl::Status Init();
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_name_; }
  absl::Status Health() const override { return failure_.Check(); }
  // Each call runs through Guarded: it fails fast once the device has failed, and a sticky CUDA
  // error in it marks the device failed.
  absl::Status WriteKeys(const KeyWrite& write) override {
    return Guarded([&] { return WriteKeysOnDevice(write); });
  }
  absl::Status WriteKeysBatch(std::span<const KeyWrite> writes) override {
    return Guarded([&] { return WriteKeysBatchOnDevice(writes); });
  }
  absl::Status CopyPage(int32_t src, int32_t dst) override {
    return Guarded([&] { return CopyPageOnDevice(src, dst); });
  }
  absl::Status ReadPages(std::span<const int32_t> pages, uint8_t* dst) override {
    return Guarded([&] { return TransferPages(pages, dst); });
  }
  absl::Status WritePages(std::span<const int32_t> pages, const uint8_t* src) override {
    return Guarded([&] { return WritePagesOnDevice(pages, src); });
  }
  absl::Status Select(std::span<const SelectTask> tasks,
                      const kernels::PageTableParams& page_table) override {
    return Guarded([&] { return SelectOnDevice(tasks, page_table); });
  }

  CudaBackendCounters counters() const;

 private:
  // Holds one lane of `pool` for a scope, waiting while every lane is busy.
  class LaneLease {
   public:
    explicit LaneLease(LanePool& pool) : pool_(pool), lane_(pool.Acquire()) {}
    ~LaneLease() { pool_.Release(lane_); }
    LaneLease(const LaneLease&) = delete;
    LaneLease& operator=(const LaneLease&) = delete;
    Lane& lane() const { return *lane_; }

   private:
    LanePool& pool_;
    Lane* lane_;
  };

  static CudaBackendOptions Normalized(CudaBackendOptions o) {
    o.lanes = std::clamp(o.lanes, 1, kMaxLanes);
    o.graphs_per_lane = std::max(o.graphs_per_lane, 1);
    return o;
  }

  // Runs one call's `body`: refuses at once (the latched UNAVAILABLE status) once the device has
  // failed; when the body fails with a sticky CUDA error, latches failure_ and returns its status.
  template <typename Body>
  absl::Status Guarded(Body body) {
    INDEXER_RETURN_IF_ERROR(failure_.Check());
    absl::Status status = body();
    if (!status.ok() && IsStickyCudaError(CudaErrorOf(status))) {
      status = failure_.Fail(absl::StrFormat("CUDA device %d (%s)", slot_.ordinal, gpu_name_), status);
    }
    return status;
  }
  // Callers' threads vary: every call makes this backend's device current before its first CUDA
  // call, once it holds its lane; a call that waited for a lane while the device failed stops
  // here without touching it.
  absl::Status EnterDevice() const {
    INDEXER_RETURN_IF_ERROR(failure_.Check());
    return CudaStatus(cudaSetDevice(slot_.ordinal), "cudaSetDevice");
  }
  absl::Status WriteKeysOnDevice(const KeyWrite& write);
  absl::Status WriteKeysBatchOnDevice(std::span<const KeyWrite> writes);
  absl::Status CopyPageOnDevice(int32_t src, int32_t dst);
  absl::Status WritePagesOnDevice(std::span<const int32_t> pages, const uint8_t* src);
  absl::Status SelectOnDevice(std::span<const SelectTask> tasks,
                              const kernels::PageTableParams& page_table);
  // Writes the `n` global page ids at `ids` to `dst` as this pool's page indices; INTERNAL
  // (naming the id) at the first one outside the slot.
  absl::Status ToLocal(const int32_t* ids, int64_t n, int32_t* dst, const char* what) const;
  absl::Status ToLocal(int32_t id, int64_t* local, const char* what) const;
  // Largest |key| ever written to a layer: decides when selections need the exact path.
  float KeyMax(int layer) const { return key_max_abs_[layer].load(std::memory_order_acquire); }
  void RaiseKeyMax(int layer, float m);
  // ReadPages (HostByte = uint8_t: pool to host) and WritePages (HostByte = const uint8_t: host
  // to pool): moves `pages` (global ids), every layer, between the pool and `host`, laid out
  // [pages][layers][page_bytes_], through the lane's pinned staging kPageStagingBytes at a time.
  template <typename HostByte>
  absl::Status TransferPages(std::span<const int32_t> pages, HostByte* host);

  const EngineConfig config_;
  const DeviceSlot slot_;
  const CudaBackendOptions options_;
  const int64_t pages_;
  const int64_t page_bytes_;  // one page of one layer
  const int64_t layer_bytes_;
  bool entered_device_ = false;  // Init made the device current (the slot is usable)
  int num_sms_ = 0;
  std::string gpu_name_;     // the product name (cudaDeviceProp::name)
  std::string device_name_;
  DeviceFailure failure_;    // set by the first sticky CUDA error (Guarded)
  DeviceBuffer pool_;  // allocated in Init, then only read and written through lanes' streams
  std::unique_ptr<std::atomic<float>[]> key_max_abs_;  // [layers]

  // Selections, page copies and transfers take a lane of lanes_. Key writes take one of
  // write_lanes_, whose streams have the device's highest priority: a step's selections wait for
  // its key writes, which must not wait for a lane that another call's selection holds, nor
  // behind that selection's thread blocks on the GPU (docs/PERF.md, the two-GPU service runs).
  LanePool lanes_;
  LanePool write_lanes_;

  std::atomic<int64_t> selects_{0}, graph_launches_{0}, graph_builds_{0}, graph_node_updates_{0},
      graph_fallbacks_{0}, buffer_growths_{0};
};

absl::Status CudaBackend::Init() {
  const int count = CudaDeviceCount();
  if (slot_.ordinal < 0 || slot_.ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CUDA device %d was asked for, but %d CUDA devices are visible", slot_.ordinal, count));
  }
  if (slot_.first_page < 0 || pages_ <= 0 || slot_.first_page + pages_ > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "device slot of pages [%d, %d) is not usable: page ids are non-negative int32",
        slot_.first_page, slot_.first_page + pages_));
  }
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  entered_device_ = true;
  cudaDeviceProp prop{};
  INDEXER_RETURN_IF_ERROR(
      CudaStatus(cudaGetDeviceProperties(&prop, slot_.ordinal), "cudaGetDeviceProperties"));
  num_sms_ = prop.multiProcessorCount;
  gpu_name_ = prop.name;
  const int64_t topk_smem = kernels::cuda::TopkSharedBytes(
      static_cast<int32_t>(std::min<int64_t>(config_.MaxBlocksPerSequence(), 1 << 30)));
  const int64_t prefill_smem = kernels::cuda::PrefillSharedBytes(config_.head_dim, config_.key_storage);
  if (prefill_smem > static_cast<int64_t>(prop.sharedMemPerBlockOptin)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_dim %d with %s keys needs %d bytes of shared memory per block for the prefill scorer; "
        "%s offers %d (an H100/H200 offers 232448)",
        config_.head_dim, config_.key_storage == kernels::KeyStorage::kBf16 ? "bf16" : "fp8", prefill_smem, prop.name,
        prop.sharedMemPerBlockOptin));
  }
  if (topk_smem > static_cast<int64_t>(prop.sharedMemPerBlockOptin)) {
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
        "%d pages need %.2f GiB of GPU memory plus %.2f GiB headroom, but %s (device %d) has "
        "%.2f GiB free of %.2f GiB; lower --capacity",
        pages_, pool_bytes / 1073741824.0, kHeadroomBytes / 1073741824.0, prop.name, slot_.ordinal,
        free_bytes / 1073741824.0, total_bytes / 1073741824.0));
  }
  INDEXER_RETURN_IF_ERROR(pool_.Allocate(static_cast<size_t>(pool_bytes)));
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaMemset(pool_.get(), 0, pool_bytes), "cudaMemset(pool)"));
  int least_priority = 0, greatest_priority = 0;
  INDEXER_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
                                     "cudaDeviceGetStreamPriorityRange"));
  for (int i = 0; i < options_.lanes; ++i) {
    INDEXER_RETURN_IF_ERROR(lanes_.Add(options_.graphs_per_lane, least_priority));
    INDEXER_RETURN_IF_ERROR(write_lanes_.Add(1, greatest_priority));
  }
  device_name_ = absl::StrFormat(
      "%s (device %d, sm_%d%d, %d SMs, %.0f GiB, pool %.2f GiB of pages [%d, %d), %d lanes + %d "
      "key-write lanes, graphs %s)",
      prop.name, slot_.ordinal, prop.major, prop.minor, prop.multiProcessorCount,
      total_bytes / 1073741824.0, pool_bytes / 1073741824.0, slot_.first_page,
      slot_.first_page + pages_, options_.lanes, options_.lanes, options_.use_graphs ? "on" : "off");
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

absl::Status CudaBackend::ToLocal(int32_t id, int64_t* local, const char* what) const {
  *local = int64_t{id} - slot_.first_page;
  if (*local >= 0 && *local < pages_) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "%s: page id %d is outside this backend's slot (pages [%d, %d) on CUDA device %d)", what, id,
      slot_.first_page, slot_.first_page + pages_, slot_.ordinal));
}

absl::Status CudaBackend::ToLocal(const int32_t* ids, int64_t n, int32_t* dst, const char* what) const {
  const int64_t first = slot_.first_page;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = int64_t{ids[i]} - first;
    if (local < 0 || local >= pages_) {
      int64_t ignored = 0;
      return ToLocal(ids[i], &ignored, what);
    }
    dst[i] = static_cast<int32_t>(local);
  }
  return absl::OkStatus();
}

void CudaBackend::RaiseKeyMax(int layer, float m) {
  std::atomic<float>& a = key_max_abs_[layer];
  float cur = a.load(std::memory_order_relaxed);
  while (m > cur && !a.compare_exchange_weak(cur, m, std::memory_order_acq_rel)) {
  }
}

CudaBackendCounters CudaBackend::counters() const {
  CudaBackendCounters c;
  c.lanes = options_.lanes;
  c.peak_busy_lanes = lanes_.peak_busy.load();
  c.selects = selects_.load();
  c.graph_launches = graph_launches_.load();
  c.graph_builds = graph_builds_.load();
  c.graph_node_updates = graph_node_updates_.load();
  c.graph_fallbacks = graph_fallbacks_.load();
  c.buffer_growths = buffer_growths_.load();
  return c;
}

absl::Status CudaBackend::WriteKeysOnDevice(const KeyWrite& w) {
  LaneLease lease(write_lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  int64_t end = 0;
  for (int l = 0; l < w.layer_count; ++l) end = std::max(end, w.layer_start[l] + w.num_tokens);
  const int64_t blocks = (end + kBlockSize - 1) / kBlockSize;
  const int64_t key_bytes = w.num_tokens * w.layer_count * config_.head_dim * 2;
  const int64_t bt_off = Align(key_bytes, 256);
  const int64_t start_off = Align(bt_off + blocks * 4, 256);
  const int64_t total = start_off + w.layer_count * 8;
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_in, total));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_in, total));
  char* h = lane.h_in.get<char>();
  INDEXER_RETURN_IF_ERROR(
      ToLocal(w.block_table, blocks, reinterpret_cast<int32_t*>(h + bt_off), "key write"));
  std::memcpy(h, w.keys, key_bytes);
  const float written_max =
      kernels::cuda::ScanBf16(w.keys, w.num_tokens * w.layer_count * config_.head_dim).max_abs;
  std::memcpy(h + start_off, w.layer_start, w.layer_count * 8);
  char* d = lane.d_in.get<char>();
  cudaStream_t st = lane.stream.get();
  absl::Status status =
      CudaStatus(cudaMemcpyAsync(d, h, total, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync(keys)");
  if (status.ok()) {
    kernels::cuda::AppendArgs args;
    args.pool = pool_.get();
    args.layer_bytes = layer_bytes_;
    args.block_table = reinterpret_cast<const int32_t*>(d + bt_off);
    args.layer_start = reinterpret_cast<const int64_t*>(d + start_off);
    args.layer_begin = w.layer_begin;
    args.layer_count = w.layer_count;
    args.num_tokens = w.num_tokens;
    args.keys = reinterpret_cast<const uint16_t*>(d);
    status = CudaStatus(kernels::cuda::LaunchAppendKeys(args, config_.key_storage, config_.head_dim, st),
                        "append kernel launch");
  }
  // Wait even after a failed enqueue: a copy already queued still reads the staging buffer.
  // Waiting also makes the keys visible to every later call, whatever lane (stream) it takes.
  const absl::Status finished = lane.Finish("append");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  for (int l = 0; l < w.layer_count; ++l) RaiseKeyMax(w.layer_begin + l, written_max);
  return absl::OkStatus();
}

// The writes of one wave in one round trip: one staging copy, one launch, one wait.
absl::Status CudaBackend::WriteKeysBatchOnDevice(std::span<const KeyWrite> writes) {
  if (writes.empty()) return absl::OkStatus();
  if (writes.size() == 1) return WriteKeysOnDevice(writes[0]);
  LaneLease lease(write_lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  const size_t n = writes.size();
  // [AppendArgs x n][per write: keys | local block table | layer starts]
  struct Place {
    int64_t keys, bt, starts, blocks, key_bytes;
  };
  std::vector<Place> place(n);
  int64_t off = Align(static_cast<int64_t>(n * sizeof(kernels::cuda::AppendArgs)), 256);
  int64_t max_rows = 0;
  for (size_t i = 0; i < n; ++i) {
    const KeyWrite& w = writes[i];
    int64_t end = 0;
    for (int l = 0; l < w.layer_count; ++l) end = std::max(end, w.layer_start[l] + w.num_tokens);
    Place& p = place[i];
    p.blocks = (end + kBlockSize - 1) / kBlockSize;
    p.key_bytes = w.num_tokens * w.layer_count * config_.head_dim * 2;
    p.keys = off;
    off = Align(off + p.key_bytes, 16);
    p.bt = off;
    off = Align(off + p.blocks * 4, 16);
    p.starts = off;
    off = Align(off + w.layer_count * 8, 16);
    max_rows = std::max(max_rows, w.num_tokens * w.layer_count);
  }
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_in, off));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_in, off));
  char* h = lane.h_in.get<char>();
  char* d = lane.d_in.get<char>();
  std::vector<float> written_max(n);
  for (size_t i = 0; i < n; ++i) {
    const KeyWrite& w = writes[i];
    const Place& p = place[i];
    INDEXER_RETURN_IF_ERROR(
        ToLocal(w.block_table, p.blocks, reinterpret_cast<int32_t*>(h + p.bt), "key write"));
    std::memcpy(h + p.keys, w.keys, p.key_bytes);
    std::memcpy(h + p.starts, w.layer_start, w.layer_count * 8);
    written_max[i] =
        kernels::cuda::ScanBf16(w.keys, w.num_tokens * w.layer_count * config_.head_dim).max_abs;
    kernels::cuda::AppendArgs args;
    args.pool = pool_.get();
    args.layer_bytes = layer_bytes_;
    args.block_table = reinterpret_cast<const int32_t*>(d + p.bt);
    args.layer_start = reinterpret_cast<const int64_t*>(d + p.starts);
    args.layer_begin = w.layer_begin;
    args.layer_count = w.layer_count;
    args.num_tokens = w.num_tokens;
    args.keys = reinterpret_cast<const uint16_t*>(d + p.keys);
    std::memcpy(h + i * sizeof(args), &args, sizeof(args));
  }
  cudaStream_t st = lane.stream.get();
  absl::Status status =
      CudaStatus(cudaMemcpyAsync(d, h, off, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync(keys)");
  if (status.ok()) {
    status = CudaStatus(kernels::cuda::LaunchAppendKeysBatch(
                            reinterpret_cast<const kernels::cuda::AppendArgs*>(d), static_cast<int>(n),
                            max_rows, config_.key_storage, config_.head_dim, st),
                        "append kernel launch");
  }
  // Wait even after a failed enqueue (the copy reads the staging buffer); waiting also makes
  // the keys visible to every later call, whatever lane it takes.
  const absl::Status finished = lane.Finish("append");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  for (size_t i = 0; i < n; ++i) {
    for (int l = 0; l < writes[i].layer_count; ++l) {
      RaiseKeyMax(writes[i].layer_begin + l, written_max[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyPageOnDevice(int32_t src, int32_t dst) {
  int64_t s = 0, t = 0;
  INDEXER_RETURN_IF_ERROR(ToLocal(src, &s, "page copy"));
  INDEXER_RETURN_IF_ERROR(ToLocal(dst, &t, "page copy"));
  LaneLease lease(lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  char* base = pool_.get<char>();
  absl::Status status;
  for (int l = 0; l < config_.layers && status.ok(); ++l) {
    char* layer = base + l * layer_bytes_;
    status = CudaStatus(cudaMemcpyAsync(layer + t * page_bytes_, layer + s * page_bytes_, page_bytes_,
                                        cudaMemcpyDeviceToDevice, lane.stream.get()),
                        "cudaMemcpyAsync(page copy)");
  }
  const absl::Status finished = lane.Finish("page copy");
  INDEXER_RETURN_IF_ERROR(status);
  return finished;
}

template <typename HostByte>
absl::Status CudaBackend::TransferPages(std::span<const int32_t> pages, HostByte* host) {
  constexpr bool kToHost = !std::is_const_v<HostByte>;
  constexpr cudaMemcpyKind kKind = kToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  const char* const what = kToHost ? "read pages" : "write pages";
  const char* const copy_what = kToHost ? "cudaMemcpyAsync(read page)" : "cudaMemcpyAsync(write page)";
  if (pages.empty()) return absl::OkStatus();
  std::vector<int32_t> local(pages.size());
  INDEXER_RETURN_IF_ERROR(ToLocal(pages.data(), static_cast<int64_t>(pages.size()), local.data(), what));
  LaneLease lease(lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  const int64_t bytes_per_page = config_.layers * page_bytes_;
  const int64_t chunk = std::max<int64_t>(1, kPageStagingBytes / bytes_per_page);
  PinnedBuffer& staging = kToHost ? lane.h_out : lane.h_in;
  INDEXER_RETURN_IF_ERROR(
      lane.Reserve(staging, std::min<int64_t>(chunk, static_cast<int64_t>(pages.size())) * bytes_per_page));
  char* h = staging.get<char>();
  char* pool = pool_.get<char>();
  for (size_t first = 0; first < local.size(); first += chunk) {
    const size_t n = std::min<size_t>(chunk, local.size() - first);
    HostByte* host_chunk = host + static_cast<int64_t>(first) * bytes_per_page;
    if constexpr (!kToHost) std::memcpy(h, host_chunk, n * bytes_per_page);
    absl::Status status;
    for (size_t i = 0; i < n && status.ok(); ++i) {
      for (int l = 0; l < config_.layers && status.ok(); ++l) {
        char* staged = h + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes_;
        char* page = pool + l * layer_bytes_ + local[first + i] * page_bytes_;
        status = CudaStatus(cudaMemcpyAsync(kToHost ? staged : page, kToHost ? page : staged,
                                            page_bytes_, kKind, lane.stream.get()),
                            copy_what);
      }
    }
    // Wait even after a failed enqueue: copies already queued still use the staging buffer.
    const absl::Status finished = lane.Finish(what);
    INDEXER_RETURN_IF_ERROR(status);
    INDEXER_RETURN_IF_ERROR(finished);
    if constexpr (kToHost) std::memcpy(host_chunk, h, n * bytes_per_page);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WritePagesOnDevice(std::span<const int32_t> pages, const uint8_t* src) {
  INDEXER_RETURN_IF_ERROR(TransferPages(pages, src));
  // Selections pick their path from the largest key written (see KeyMax).
  const int64_t elems = page_bytes_ / kernels::KeyStorageBytes(config_.key_storage);
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int l = 0; l < config_.layers; ++l) {
      const uint8_t* page = src + (static_cast<int64_t>(i) * config_.layers + l) * page_bytes_;
      float m = 0.0f;
      if (config_.key_storage == kernels::KeyStorage::kBf16) {
        m = kernels::cuda::ScanBf16(reinterpret_cast<const uint16_t*>(page), elems).max_abs;
      } else {
        for (int64_t e = 0; e < elems; ++e) {
          m = std::max(m, std::fabs(kernels::Fp8E4M3ToFloat(page[e])));
        }
      }
      RaiseKeyMax(l, m);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectOnDevice(std::span<const SelectTask> tasks,
                                         const kernels::PageTableParams& pt) {
  if (tasks.empty()) return absl::OkStatus();
  LaneLease lease(lanes_);
  INDEXER_RETURN_IF_ERROR(EnterDevice());
  Lane& lane = lease.lane();
  const int d = config_.head_dim;
  const size_t m = tasks.size();

  // One upload: [descriptors and decode index][block tables][attention pages][queries]; one
  // download: results.
  struct Offsets {
    int64_t bt, attn, q, ids, table, ctx;
    int64_t v;
  };
  std::vector<Offsets> off(m);
  int64_t in = Align(static_cast<int64_t>(kernels::cuda::SelectBatchDeviceBytes(m)), 256);
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
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_in, in));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_in, in));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.h_out, std::max<int64_t>(out, 4)));
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_out, std::max<int64_t>(out, 4)));
  char* h = lane.h_in.get<char>();
  char* din = lane.d_in.get<char>();
  char* dout = lane.d_out.get<char>();
  std::vector<SpanDesc> descs(m);
  std::vector<kernels::cuda::SpanPath> paths(m);
  for (size_t i = 0; i < m; ++i) {
    const kernels::SpanSelect& s = tasks[i].span;
    const Offsets& o = off[i];
    const int64_t rows = int64_t{s.num_tokens} * s.num_heads;
    // Global page ids become this pool's indices here, in the one copy into pinned staging.
    INDEXER_RETURN_IF_ERROR(
        ToLocal(s.block_table, o.v, reinterpret_cast<int32_t*>(h + o.bt), "select block table"));
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
                                         KeyMax(tasks[i].layer));
  }
  const kernels::cuda::SelectBatch batch =
      kernels::cuda::PlanSelectBatch(descs, paths, num_sms_, d, config_.key_storage);
  batch.WriteDevice(h);
  INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_scores, batch.ScoreFloats() * 4));
  cudaStream_t st = lane.stream.get();
  const size_t counter_bytes = std::max<size_t>(batch.n_decode, 1) * sizeof(int);
  if (lane.d_counters.bytes() < counter_bytes) {
    INDEXER_RETURN_IF_ERROR(lane.Reserve(lane.d_counters, counter_bytes));
    const absl::Status zeroed = CudaStatus(
        cudaMemsetAsync(lane.d_counters.get(), 0, lane.d_counters.bytes(), st), "cudaMemsetAsync");
    if (!zeroed.ok()) {
      // Counters that were never zeroed must not be used: the next call allocates them again.
      lane.d_counters.Reset();
      return zeroed;
    }
  }
  kernels::cuda::LaunchList launches;
  absl::Status status = CudaStatus(
      kernels::cuda::DescribeSelectBatch(batch, reinterpret_cast<const SpanDesc*>(din),
                                         config_.key_storage, d, pt, lane.d_scores.get<float>(),
                                         lane.d_counters.get<int>(), &launches),
      "select launch");
  bool enqueued = false;
  if (lane.graphs_generation != lane.generation) {
    // A buffer (this step's or an earlier call's on this lane) was allocated anew: cached graphs
    // point into the old one.
    buffer_growths_.fetch_add(1, std::memory_order_relaxed);
    lane.graphs.Clear();
    lane.graphs_generation = lane.generation;
  }
  if (status.ok() && options_.use_graphs && lane.graph_failures < kMaxGraphFailures && out > 0) {
    const SelectStep step{din, h, static_cast<size_t>(in), &launches,
                          lane.h_out.get(), dout, static_cast<size_t>(out)};
    const GraphLaunchResult r = lane.graphs.Launch(step, st);
    graph_builds_.fetch_add(r.built ? 1 : 0, std::memory_order_relaxed);
    graph_node_updates_.fetch_add(r.updated_nodes, std::memory_order_relaxed);
    if (r.enqueued) {
      enqueued = true;
      graph_launches_.fetch_add(1, std::memory_order_relaxed);
      status = CudaStatus(r.error, "select graph launch");
    } else {
      // Nothing of this step was enqueued: run it without a graph below.
      ++lane.graph_failures;
      graph_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (status.ok() && !enqueued) {
    status = CudaStatus(cudaMemcpyAsync(din, h, in, cudaMemcpyHostToDevice, st),
                        "cudaMemcpyAsync(select inputs)");
    if (status.ok()) status = CudaStatus(launches.Enqueue(st), "select launch");
    if (status.ok() && out > 0) {
      status = CudaStatus(cudaMemcpyAsync(lane.h_out.get(), dout, out, cudaMemcpyDeviceToHost, st),
                          "cudaMemcpyAsync(select results)");
    }
  }
  const absl::Status finished = lane.Finish("select");
  INDEXER_RETURN_IF_ERROR(status);
  INDEXER_RETURN_IF_ERROR(finished);
  selects_.fetch_add(1, std::memory_order_relaxed);
  const char* ho = lane.h_out.get<char>();
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

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return std::max(count, 0);
}

CudaBackendOptions ParseCudaBackendOptions(const char* graphs, const char* lanes) {
  CudaBackendOptions o;
  if (graphs != nullptr) {
    const absl::string_view g(graphs);
    if (g == "0") o.use_graphs = false;
    if (g == "1") o.use_graphs = true;
  }
  int n = 0;
  if (lanes != nullptr && absl::SimpleAtoi(lanes, &n) && n >= 1 && n <= kMaxLanes) o.lanes = n;
  return o;
}

CudaBackendOptions CudaBackendOptions::FromEnvironment() {
  static const CudaBackendOptions options =
      ParseCudaBackendOptions(std::getenv("INDEXER_CUDA_GRAPHS"), std::getenv("INDEXER_CUDA_LANES"));
  return options;
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot,
                                                                 const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(config, slot, options);
  INDEXER_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<KeyCacheBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<KeyCacheBackend>> MakeCudaBackend(const EngineConfig& config,
                                                                 const DeviceSlot& slot) {
  return MakeCudaBackend(config, slot, CudaBackendOptions::FromEnvironment());
}

std::optional<CudaBackendCounters> GetCudaBackendCounters(const KeyCacheBackend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (cuda == nullptr) return std::nullopt;
  return cuda->counters();
}

}  // namespace indexer::engine
