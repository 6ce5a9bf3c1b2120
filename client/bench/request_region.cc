#include "client/bench/request_region.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace indexer::bench {
namespace {

constexpr size_t Aligned(size_t bytes) { return (bytes + 3) / 4 * 4; }

int WireBytes(v1::ValueDtype dtype) { return dtype == v1::VALUE_DTYPE_FP32 ? 4 : 2; }

}  // namespace

size_t SlabBytes(const WorkloadSpec& spec, const ServerShape& shape) {
  const size_t n = static_cast<size_t>(spec.speculative);
  const size_t rows = n * static_cast<size_t>(spec.heads);
  const size_t wire = static_cast<size_t>(WireBytes(spec.wire_dtype));
  const size_t ids = rows * static_cast<size_t>(spec.topk);
  size_t item = Aligned(rows * shape.head_dim * wire) +
                Aligned(n * static_cast<size_t>(shape.layers) * shape.head_dim * wire) +
                ids * sizeof(int32_t);
  if (spec.attention_pages) {
    item += (ids * static_cast<size_t>(shape.page_table.pages_per_block) + rows) * sizeof(int32_t);
  }
  const size_t layers = static_cast<size_t>(spec.layers > 0 ? spec.layers : shape.layers);
  return item * static_cast<size_t>(spec.batch) * layers;
}

absl::StatusOr<std::unique_ptr<RequestRegion>> RequestRegion::Create(
    client::ShardedClient& servers, size_t slab_bytes, int slabs, const client::CallOptions& call) {
  static std::atomic<int> made{0};
  const std::string name = absl::StrCat("indexer-bench-", ::getpid(), "-", made.fetch_add(1));
  const size_t bytes = slab_bytes * static_cast<size_t>(slabs);
  absl::StatusOr<std::unique_ptr<client::SharedMemoryRegion>> memory =
      client::SharedMemoryRegion::Create("/" + name, bytes);
  if (!memory.ok()) return memory.status();
  std::unique_ptr<RequestRegion> region(
      new RequestRegion(servers, name, *std::move(memory), slab_bytes));
  for (size_t s = 0; s < servers.size(); ++s) {
    const absl::Status registered =
        servers.client(s).RegisterSystemRegion(name, region->memory_->key(), 0, bytes, call);
    if (!registered.ok()) {
      return absl::Status(registered.code(),
                          absl::StrCat(servers.targets()[s], " refused the shared memory region (",
                                       bytes, " bytes): ", registered.message()));
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
  next_ = static_cast<uint64_t>(slab) * slab_bytes_;
  end_ = next_ + slab_bytes_;
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
  std::memcpy(memory_->data() + *at, bytes.data(), bytes.size());
  return client::SharedMemoryRegion::Ref(name_, *at, bytes.size());
}

std::optional<v1::RegionRef> RequestRegion::Room(size_t values) {
  const std::optional<uint64_t> at = Take(values * sizeof(int32_t));
  if (!at) return std::nullopt;
  return client::SharedMemoryRegion::Ref(name_, *at, values * sizeof(int32_t));
}

const int32_t* RequestRegion::At(const v1::RegionRef& ref) const {
  return reinterpret_cast<const int32_t*>(memory_->data() + ref.offset());
}

}  // namespace indexer::bench
