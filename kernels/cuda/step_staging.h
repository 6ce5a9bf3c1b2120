// StepStaging: the host side of one device step -- key writes, then span selections -- laid out
// in one input buffer (copied to the device in one copy) and one output buffer (copied back in
// one copy), and the host work around them: filling the inputs, planning the selection batch,
// describing the launches and scattering the outputs into the callers' memory. The CUDA backend,
// the GPU tests and the kernel benchmark all stage through it, so the descriptors they run are
// built one way.
//
// Input buffer: [SelectBatch image: descriptors, decode index][AppendArgs x writes]
//               [InputChunk x device input chunks]
//               [per write: keys | block table | layer starts][per span: block table |
//               attention pages | queries], then, on the device only, the keys and queries
// that come from device memory (device_inputs.h copies them there). Output buffer: [InputScan
// x device input chunks][per span with host outputs: block ids | page-table rows | context
// lengths]; spans whose outputs are in device memory are written there directly. Offsets are
// 16-byte aligned (the append kernel reads keys as 16-byte vectors; regions start 256-byte
// aligned).
//
// Use: Plan, size the buffers (input_bytes to copy, device_input_bytes on the device,
// output_bytes), WriteInputs into the pinned input buffer, copy input_bytes to the device,
// launch Describe's list, copy the outputs back, Scatter. The CUDA backend's copies are kernels
// around Describe's list, all in one graph (step_copy.h). Not thread-safe; one staging per step
// in flight.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels/cuda/device_inputs.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/select_batch.h"
#include "kernels/cuda/span_desc.h"
#include "kernels/cuda/span_plan.h"
#include "kernels/select_types.h"

namespace indexer::kernels::cuda {

// One span to select. `host` is read from host memory (block table, attention pages, queries)
// and its outputs are where Scatter writes; `keys` is the device address of its layer's pool.
struct StagedSpan {
  SpanSelect host;
  const void* keys = nullptr;
  SpanPath path = SpanPath::kDecode;
};

// Page ids in block tables are staged as id - first; each must then lie in [0, count).
struct PageRange {
  int64_t first = 0;
  int64_t count = INT64_MAX;
};

// Where the key writes store: layer l of the pool is at pool + l * layer_bytes (device).
struct WriteTarget {
  void* pool = nullptr;
  int64_t layer_bytes = 0;
};

class StepStaging {
 public:
  // Lays out `writes` and `spans` (whose memory must stay valid until Scatter).
  void Plan(std::span<const KeyWrite> writes, std::span<const StagedSpan> spans, int head_dim,
            KeyStorage storage, PageTableParams page_table);

  int64_t input_bytes() const { return in_bytes_; }
  int64_t device_input_bytes() const { return device_in_bytes_; }
  int64_t output_bytes() const { return out_bytes_; }
  bool has_device_inputs() const { return !chunks_.empty(); }
  bool has_writes() const { return !writes_.empty(); }
  bool has_spans() const { return !spans_.empty(); }

  // Fills `host_in` (input_bytes) with the inputs for an input buffer at `device_in` and an
  // output buffer at `device_out`, and plans the selection batch over `num_sms`
  // multiprocessors (PlanSelectBatch, with `tuning`). Returns the first block-table page id
  // outside `pages` (nothing staged is then usable), or nullopt.
  std::optional<int32_t> WriteInputs(char* host_in, char* device_in, char* device_out,
                                     PageRange pages, WriteTarget target, int num_sms,
                                     DecodeTuning tuning = {});

  // The device image's parts, for callers that launch one selector themselves (the benchmark):
  // the descriptors at `device_in`, the decode index after them.
  const SpanDesc* DeviceDescs(const char* device_in) const {
    return reinterpret_cast<const SpanDesc*>(device_in);
  }
  const void* DeviceDecodeIndex(const char* device_in) const {
    return device_in + batch_.descs.size() * sizeof(SpanDesc);
  }

  // After WriteInputs: the selection batch, the scratch it needs, and its launches (the copy of
  // device inputs, the append kernel when there are writes, then the selectors) reading the
  // inputs at `device_in` and writing the outputs at `device_out`. `scores` holds ScoreFloats()
  // floats; `counters` DecodeCounters() ints, zero.
  const SelectBatch& batch() const { return batch_; }
  int64_t ScoreFloats() const { return batch_.ScoreFloats(); }
  size_t DecodeCounters() const { return std::max<size_t>(batch_.n_decode, 1); }
  cudaError_t Describe(const char* device_in, char* device_out, float* scores, int* counters,
                       LaunchList* out) const;

  // Copies every span's host outputs from `host_out` (the output buffer's copy) to its host
  // pointers, and sets the non-finite flags of device inputs.
  void Scatter(const char* host_out) const;

  // After the outputs are back: what the copy of write `i`'s keys, or span `i`'s queries, found
  // (the largest magnitude, and whether every value fits f16), when they came from device
  // memory; nullopt for host inputs.
  std::optional<Bf16Range> WriteScan(size_t i, const char* host_out) const;
  std::optional<Bf16Range> SpanScan(size_t i, const char* host_out) const;

 private:
  // A device input's chunks: [first, first + count) of chunks_, -1 for a host input.
  struct DeviceInput {
    int64_t first = -1, count = 0;
  };
  struct WritePlace {
    int64_t keys = 0, table = 0, starts = 0, blocks = 0, key_bytes = 0;
    int64_t first_block = 0;  // the staged table and starts are relative to it
    DeviceInput device;
  };
  struct SpanPlace {
    int64_t table = 0, attn = 0, queries = 0, ids = 0, page_table = 0, context_lens = 0;
    int64_t visible = 0;
    DeviceInput device;
  };
  // A device input copied to `dst` (offset into the device input buffer) in chunks.
  struct PlannedChunk {
    const uint16_t* src = nullptr;
    int64_t dst = 0;
    int64_t values = 0;
  };

  // Plans the copy of `values` device values at `src` to `dst`.
  DeviceInput PlanDeviceInput(const uint16_t* src, int64_t dst, int64_t values);
  // Reduces a device input's chunk scans; sets *nonfinite.
  Bf16Range ReduceScans(const DeviceInput& in, const char* host_out, bool* nonfinite) const;

  std::span<const KeyWrite> writes_;
  std::span<const StagedSpan> spans_;
  int head_dim_ = 128;
  KeyStorage storage_ = KeyStorage::kBf16;
  PageTableParams page_table_;
  int64_t args_offset_ = 0;  // the AppendArgs array
  int64_t chunks_offset_ = 0;  // the InputChunk array
  int64_t max_tokens_x_layers_ = 0;
  std::vector<WritePlace> write_places_;
  std::vector<SpanPlace> span_places_;
  std::vector<PlannedChunk> chunks_;
  int64_t in_bytes_ = 0;
  int64_t device_in_bytes_ = 0;
  int64_t out_bytes_ = 0;
  std::vector<SpanDesc> descs_;
  std::vector<SpanPath> paths_;
  SelectBatch batch_;
};

}  // namespace indexer::kernels::cuda
