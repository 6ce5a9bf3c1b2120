// SelectGraphCache: one lane's CUDA graphs of a selection step's kernels, so that a step reaches
// the GPU as three stream operations: the input copy (pinned host -> device), one cudaGraphLaunch
// of the selector kernels, the result copy (device -> pinned host). The copies stay stream calls,
// not graph nodes: a graph that holds host copies takes longer from launch to completion than the
// same copies around a graph of kernels only (indexer-launch-probe measures both; docs/PERF.md).
//
// Graphs are keyed by topology only: the kernels' functions and block shapes, in order, which
// fixes which selector groups run and which decode kernel variant (a backend of one head_dim and
// storage has at most 4 x 2 x 2 of them). Everything else a plan changes from step to step --
// grids, shared memory, argument values -- is set on the cached executable graph before it is
// launched, node by node and only where it differs from that graph's previous launch
// (cudaGraphExecKernelNodeSetParams: host-side updates that apply from the next launch on). So a
// step that matches a cached topology costs zero to a few node updates plus one graph launch,
// and never a capture or an instantiation. The cache is an LRU of at most `capacity` graphs.
//
// The owner calls Clear() whenever it reallocates a device buffer a kernel argument points into.
//
// Not thread-safe: owned by one lane and used only by the call holding that lane. Graphs are
// built on, and must be launched on a stream of, the device current when Launch is called.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <list>

#include "engine/cuda/cuda_resources.h"
#include "kernels/cuda/launchers.h"

namespace indexer::engine {

// One selection step: copy in_bytes from in_src (pinned host) to in_dst (device), run
// `kernels`, copy out_bytes from out_src (device) to out_dst (pinned host). Both sizes > 0.
struct SelectStep {
  void* in_dst = nullptr;
  const void* in_src = nullptr;
  size_t in_bytes = 0;
  const kernels::cuda::LaunchList* kernels = nullptr;
  void* out_dst = nullptr;
  const void* out_src = nullptr;
  size_t out_bytes = 0;
};

struct GraphLaunchResult {
  cudaError_t error = cudaSuccess;
  // False when neither the kernels nor the result copy reached the stream (building, updating
  // or launching the graph failed; the graph is dropped): the caller may run the step without a
  // graph instead. The input copy may have been enqueued; enqueuing it again copies the same
  // bytes.
  bool enqueued = false;
  bool built = false;     // a graph was instantiated for this step
  int updated_nodes = 0;  // nodes of a cached graph whose parameters were set for this step
};

class SelectGraphCache {
 public:
  explicit SelectGraphCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  SelectGraphCache(const SelectGraphCache&) = delete;
  SelectGraphCache& operator=(const SelectGraphCache&) = delete;

  // Enqueues `step` on `stream`: the input copy, one launch of its kernels' graph (built on a
  // miss), the result copy.
  GraphLaunchResult Launch(const SelectStep& step, cudaStream_t stream);

  void Clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  static constexpr int kMaxKernels = kernels::cuda::LaunchList::kMaxLaunches;

  struct Entry {
    int num_kernels = 0;
    CudaGraph graph;
    std::array<cudaGraphNode_t, kMaxKernels> kernel_nodes{};
    // What the executable graph holds now (its last launch's parameters).
    std::array<kernels::cuda::KernelLaunch, kMaxKernels> launches{};
  };

  static bool SameTopology(const Entry& e, const kernels::cuda::LaunchList& list);
  // Builds and instantiates the graph of `list` into *e.
  static cudaError_t Build(const kernels::cuda::LaunchList& list, Entry* e);
  // Sets the parameters of e's executable graph that differ from `list`'s.
  static cudaError_t Update(const kernels::cuda::LaunchList& list, Entry* e, int* updated);
  // The cached graph for `list`, built or updated; nullptr on failure (*r says why).
  Entry* Prepare(const kernels::cuda::LaunchList& list, GraphLaunchResult* r);

  size_t capacity_;
  std::list<Entry> entries_;  // most recently used first
};

}  // namespace indexer::engine
