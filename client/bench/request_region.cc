#include "client/bench/request_region.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

// 16: CUDA regions take keys and queries at 16-byte aligned offsets.
constexpr size_t Aligned(size_t bytes) { return (bytes + 15) / 16 * 16; }

int WireBytes(v1::ValueDtype dtype) { return dtype == v1::VALUE_DTYPE_FP32 ? 4 : 2; }

}  // namespace

size_t SlabBytes(const WorkloadSpec& spec, const ServerShape& shape) {
  const size_t n = static_cast<size_t>(spec.speculative);
  const size_t rows = n * static_cast<size_t>(spec.heads);
  const size_t wire = static_cast<size_t>(WireBytes(spec.wire_dtype));
  const size_t ids = rows * static_cast<size_t>(spec.topk);
  size_t item = Aligned(rows * shape.head_dim * wire) +
                Aligned(n * static_cast<size_t>(shape.layers) * shape.head_dim * wire) +
                Aligned(ids * sizeof(int32_t));
  if (spec.attention_pages || spec.shared_memory == SharedMemory::kCuda) {
    item += Aligned(ids * static_cast<size_t>(shape.page_table.pages_per_block) * sizeof(int32_t)) +
            Aligned(rows * sizeof(int32_t));
  }
  const size_t layers = static_cast<size_t>(spec.layers > 0 ? spec.layers : shape.layers);
  return item * static_cast<size_t>(spec.batch) * layers;
}

absl::StatusOr<std::unique_ptr<RequestRegion>> RequestRegion::Create(
    client::ShardedClient& servers, size_t slab_bytes, int slabs, const client::CallOptions& call,
    SharedMemory kind, int cuda_device) {
  static std::atomic<int> made{0};
  const std::string name = absl::StrCat("indexer-bench-", ::getpid(), "-", made.fetch_add(1));
  const size_t bytes = slab_bytes * static_cast<size_t>(slabs);
  std::unique_ptr<RequestRegion> region(new RequestRegion(servers, name, slab_bytes));
  if (kind == SharedMemory::kCuda) {
    absl::StatusOr<std::unique_ptr<CudaAllocation>> gpu = CudaAllocation::Create(bytes, cuda_device);
    if (!gpu.ok()) return gpu.status();
    region->gpu_ = *std::move(gpu);
    region->mirror_ = std::make_unique<uint8_t[]>(bytes);
  } else {
    absl::StatusOr<std::unique_ptr<client::SharedMemoryRegion>> memory =
        client::SharedMemoryRegion::Create("/" + name, bytes);
    if (!memory.ok()) return memory.status();
    region->memory_ = *std::move(memory);
  }
  for (size_t s = 0; s < servers.size(); ++s) {
    const absl::Status registered =
        region->gpu_ != nullptr
            ? servers.client(s).RegisterCudaRegion(name, region->gpu_->ipc_handle(), cuda_device,
                                                   0, bytes, call)
            : servers.client(s).RegisterSystemRegion(name, region->memory_->key(), 0, bytes, call);
    if (!registered.ok()) {
      return absl::Status(registered.code(),
                          absl::StrCat(servers.targets()[s], " refused the ",
                                       SharedMemoryName(kind), " region (", bytes,
                                       " bytes): ", registered.message()));
    }
  }
  return region;
}

RequestRegion::~RequestRegion() {
  for (size_t s = 0; s < servers_.size(); ++s) {
    servers_.client(s).UnregisterRegion(name_).IgnoreError();
  }
}

void RequestRegion::Begin(int slab) {
  begin_ = static_cast<uint64_t>(slab) * slab_bytes_;
  next_ = begin_;
  end_ = begin_ + slab_bytes_;
}

absl::Status RequestRegion::Flush() {
  if (gpu_ == nullptr || next_ == begin_) return absl::OkStatus();
  return gpu_->Upload(begin_, mirror_.get() + begin_, next_ - begin_);
}

absl::Status RequestRegion::Fetch(int slab) {
  if (gpu_ == nullptr) return absl::OkStatus();
  const uint64_t at = static_cast<uint64_t>(slab) * slab_bytes_;
  return gpu_->Download(at, mirror_.get() + at, slab_bytes_);
}

std::optional<uint64_t> RequestRegion::Take(size_t bytes) {
  if (bytes > end_ - next_) return std::nullopt;
  const uint64_t at = next_;
  next_ += Aligned(bytes);
  if (next_ > end_) next_ = end_;
  return at;
}

std::optional<v1::RegionRef> RequestRegion::Put(absl::string_view bytes) {
  const std::optional<uint64_t> at = Take(bytes.size());
  if (!at) return std::nullopt;
  std::memcpy(host() + *at, bytes.data(), bytes.size());
  return client::SharedMemoryRegion::Ref(name_, *at, bytes.size());
}

std::optional<v1::RegionRef> RequestRegion::Room(size_t values) {
  const std::optional<uint64_t> at = Take(values * sizeof(int32_t));
  if (!at) return std::nullopt;
  return client::SharedMemoryRegion::Ref(name_, *at, values * sizeof(int32_t));
}

const int32_t* RequestRegion::At(const v1::RegionRef& ref) const {
  return reinterpret_cast<const int32_t*>(host() + ref.offset());
}

}  // namespace indexer::bench
