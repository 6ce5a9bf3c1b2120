// SelectGraphCache: one lane's CUDA graphs of a step's kernels, so that a step reaches the GPU
// as one cudaGraphLaunch: the kernel that reads its inputs out of mapped pinned memory, its key
// writes and selectors, the kernel that writes its outputs back (kernels/cuda/step_copy.h).
//
// Graphs are keyed by topology only: the kernels' functions and block shapes, in order, which
// fixes which selector groups run and which decode kernel variant (a backend of one head_dim and
// storage has at most 4 x 2 x 2 of them). Everything else a plan changes from step to step --
// grids, shared memory, argument values, the copies' sizes -- is set on the cached executable
// graph before it is launched, node by node and only where it differs from that graph's previous
// launch (cudaGraphExecKernelNodeSetParams: host-side updates that apply from the next launch
// on). So a step that matches a cached topology costs zero to a few node updates plus one graph
// launch, and never a capture or an instantiation. The cache is an LRU of at most `capacity`
// graphs.
//
// The owner calls Clear() whenever it reallocates a buffer a kernel argument points into.
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

struct GraphLaunchResult {
  cudaError_t error = cudaSuccess;
  // False when nothing reached the stream (building, updating or launching the graph failed; the
  // graph is dropped): the caller may run the step without a graph instead.
  bool enqueued = false;
  bool built = false;     // a graph was instantiated for this step
  int updated_nodes = 0;  // nodes of a cached graph whose parameters were set for this step
};

class SelectGraphCache {
 public:
  explicit SelectGraphCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  SelectGraphCache(const SelectGraphCache&) = delete;
  SelectGraphCache& operator=(const SelectGraphCache&) = delete;

  // Enqueues one launch of the graph of `step` (at least one kernel) on `stream`, built on a miss.
  GraphLaunchResult Launch(const kernels::cuda::LaunchList& step, cudaStream_t stream);

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
