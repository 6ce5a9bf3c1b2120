#include "kernels/cuda/select_batch.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "kernels/cuda/launchers.h"

namespace indexer::kernels::cuda {

int64_t SelectBatch::ScoreFloats() const {
  return std::max({decode.score_floats, prefill.score_floats, exact.score_floats, int64_t{1}});
}

size_t SelectBatch::DeviceBytes() const { return descs.size() * sizeof(SpanDesc) + DecodeIndexBytes(n_decode); }

void SelectBatch::WriteDevice(void* host) const {
  std::memcpy(host, descs.data(), descs.size() * sizeof(SpanDesc));
  WriteDecodeIndex(std::span<const SpanDesc>(descs.data(), n_decode),
                   static_cast<unsigned char*>(host) + descs.size() * sizeof(SpanDesc));
}

SelectBatch PlanSelectBatch(const std::vector<SpanDesc>& spans, const std::vector<SpanPath>& paths,
                            int num_sms, int head_dim, KeyStorage storage, DecodeTuning tuning) {
  SelectBatch b;
  for (SpanPath want : {SpanPath::kDecode, SpanPath::kPrefill, SpanPath::kExact}) {
    for (size_t i = 0; i < spans.size(); ++i) {
      if (paths[i] != want) continue;
      b.descs.push_back(spans[i]);
    }
    const size_t n = b.descs.size() - (b.n_decode + b.n_prefill + b.n_exact);
    (want == SpanPath::kDecode ? b.n_decode : want == SpanPath::kPrefill ? b.n_prefill : b.n_exact) = n;
  }
  SpanDesc* d = b.descs.data();
  const int chunk = tuning.chunk_blocks > 0 ? tuning.chunk_blocks : DecodeChunkBlocks(head_dim, storage);
  b.decode = PlanDecode(std::span<SpanDesc>(d, b.n_decode), num_sms, chunk);
  b.decode.warps_per_block = tuning.warps_per_block > 0 ? tuning.warps_per_block
                                                        : DecodeWarpsPerBlock(storage, b.decode.max_chunk_blocks);
  b.prefill = PlanPrefill(std::span<SpanDesc>(d + b.n_decode, b.n_prefill), PrefillRowTile(head_dim));
  b.exact = PlanPrefill(std::span<SpanDesc>(d + b.n_decode + b.n_prefill, b.n_exact), ExactRowTile(head_dim));
  return b;
}

cudaError_t DescribeSelectBatch(const SelectBatch& b, const SpanDesc* d_descs, KeyStorage storage,
                                int head_dim, PageTableParams pt, float* scores, int* counters,
                                LaunchList* out) {
  cudaError_t err = DescribeDecodeSelect(d_descs, d_descs + b.descs.size(), static_cast<int>(b.n_decode),
                                         b.decode, storage, head_dim, pt, scores, counters, out);
  if (err != cudaSuccess) return err;
  err = DescribePrefillSelect(d_descs + b.n_decode, static_cast<int>(b.n_prefill), b.prefill,
                              storage, head_dim, pt, scores, out);
  if (err != cudaSuccess) return err;
  return DescribeExactSelect(d_descs + b.n_decode + b.n_prefill, static_cast<int>(b.n_exact),
                             b.exact, storage, head_dim, pt, scores, out);
}

cudaError_t LaunchSelectBatch(const SelectBatch& b, const SpanDesc* d_descs, KeyStorage storage,
                              int head_dim, PageTableParams pt, float* scores, int* counters,
                              cudaStream_t stream) {
  LaunchList list;
  const cudaError_t err = DescribeSelectBatch(b, d_descs, storage, head_dim, pt, scores, counters, &list);
  return err != cudaSuccess ? err : list.Enqueue(stream);
}

}  // namespace indexer::kernels::cuda
