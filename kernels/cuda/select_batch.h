// SelectBatch: the host side of one batched selection on the GPU, shared by the CUDA backend,
// the GPU tests and the benchmark: orders spans by the path they take (decode, prefill, exact),
// plans each group, and describes or launches the three selectors on one stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "kernels/cuda/launchers.h"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/span_plan.h"

namespace indexer::kernels::cuda {

struct SelectBatch {
  std::vector<SpanDesc> descs;  // grouped: decode spans, then prefill, then exact
  size_t n_decode = 0, n_prefill = 0, n_exact = 0;
  DecodePlan decode;
  PrefillPlan prefill, exact;
  int64_t ScoreFloats() const;
  // The batch's device image, which callers upload and whose device address they pass as
  // `d_descs` below: the descriptors, then the decode spans' index (DecodeIndexBytes).
  size_t DeviceBytes() const;
  void WriteDevice(void* host) const;
};

// DeviceBytes of any batch of `spans` spans, at most (for staging sized before the plan).
inline size_t SelectBatchDeviceBytes(size_t spans) { return spans * sizeof(SpanDesc) + DecodeIndexBytes(spans); }

// `spans` in the caller's order with their paths (ChoosePath); plans every group, the decode
// group as `tuning` says where it sets a knob (the benchmark and the tests vary them).
SelectBatch PlanSelectBatch(const std::vector<SpanDesc>& spans, const std::vector<SpanPath>& paths,
                            int num_sms, int head_dim, KeyStorage storage, DecodeTuning tuning = {});

// Describes the launches of the groups of `batch` (appended to *out, in stream order), whose
// device image (WriteDevice) is at `d_descs`. `scores` holds
// batch.ScoreFloats() floats; `counters` batch.n_decode ints, zero. The groups share `scores`:
// they must run one after the other on one stream (or as a chain of graph nodes).
cudaError_t DescribeSelectBatch(const SelectBatch& batch, const SpanDesc* d_descs, KeyStorage storage,
                                int head_dim, PageTableParams pt, float* scores, int* counters,
                                LaunchList* out);

// DescribeSelectBatch, then LaunchList::Enqueue on `stream`.
cudaError_t LaunchSelectBatch(const SelectBatch& batch, const SpanDesc* d_descs, KeyStorage storage,
                              int head_dim, PageTableParams pt, float* scores, int* counters,
                              cudaStream_t stream);

}  // namespace indexer::kernels::cuda
