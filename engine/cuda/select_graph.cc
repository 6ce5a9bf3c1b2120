#include "engine/cuda/select_graph.h"

#include <utility>

namespace indexer::engine {
namespace {

using kernels::cuda::KernelLaunch;

cudaKernelNodeParams NodeParams(const KernelLaunch& l, void** args) {
  l.ArgPointers(args);
  cudaKernelNodeParams p{};
  p.func = const_cast<void*>(l.func);
  p.gridDim = l.grid;
  p.blockDim = l.block;
  p.sharedMemBytes = l.shared_bytes;
  p.kernelParams = args;
  p.extra = nullptr;
  return p;
}

}  // namespace

bool SelectGraphCache::SameTopology(const Entry& e, const kernels::cuda::LaunchList& list) {
  if (e.num_kernels != list.size) return false;
  for (int i = 0; i < list.size; ++i) {
    const KernelLaunch& a = e.launches[i];
    const KernelLaunch& b = list.items[i];
    if (a.func != b.func || a.block.x != b.block.x || a.block.y != b.block.y || a.block.z != b.block.z) {
      return false;
    }
  }
  return true;
}

cudaError_t SelectGraphCache::Build(const kernels::cuda::LaunchList& list, Entry* e) {
  cudaError_t err = e->graph.Create();
  if (err != cudaSuccess) return err;
  cudaGraph_t g = e->graph.graph();
  cudaGraphNode_t prev = nullptr;
  for (int i = 0; i < list.size; ++i) {
    void* args[KernelLaunch::kMaxArgs];
    const cudaKernelNodeParams p = NodeParams(list.items[i], args);
    err = cudaGraphAddKernelNode(&e->kernel_nodes[i], g, i == 0 ? nullptr : &prev, i == 0 ? 0 : 1,
                                 &p);
    if (err != cudaSuccess) return err;
    prev = e->kernel_nodes[i];
    e->launches[i] = list.items[i];
  }
  e->num_kernels = list.size;
  return e->graph.Instantiate();
}

cudaError_t SelectGraphCache::Update(const kernels::cuda::LaunchList& list, Entry* e,
                                     int* updated) {
  cudaGraphExec_t exec = e->graph.exec();
  for (int i = 0; i < list.size; ++i) {
    if (list.items[i].SameAs(e->launches[i])) continue;
    void* args[KernelLaunch::kMaxArgs];
    const cudaKernelNodeParams p = NodeParams(list.items[i], args);
    const cudaError_t err = cudaGraphExecKernelNodeSetParams(exec, e->kernel_nodes[i], &p);
    if (err != cudaSuccess) return err;
    e->launches[i] = list.items[i];
    ++*updated;
  }
  return cudaSuccess;
}

SelectGraphCache::Entry* SelectGraphCache::Prepare(const kernels::cuda::LaunchList& list,
                                                   GraphLaunchResult* r) {
  auto it = entries_.begin();
  while (it != entries_.end() && !SameTopology(*it, list)) ++it;
  if (it != entries_.end()) {
    entries_.splice(entries_.begin(), entries_, it);  // most recently used first
    r->error = Update(list, &entries_.front(), &r->updated_nodes);
  } else {
    while (entries_.size() >= capacity_) entries_.pop_back();
    entries_.emplace_front();
    r->error = Build(list, &entries_.front());
    r->built = r->error == cudaSuccess;
  }
  if (r->error == cudaSuccess) return &entries_.front();
  // A graph that failed to build or update is in an unknown state: drop it.
  (void)cudaGetLastError();
  entries_.pop_front();
  return nullptr;
}

GraphLaunchResult SelectGraphCache::Launch(const kernels::cuda::LaunchList& step,
                                           cudaStream_t stream) {
  GraphLaunchResult r;
  if (step.size == 0) {
    r.error = cudaErrorInvalidValue;
    return r;
  }
  Entry* e = Prepare(step, &r);
  if (e == nullptr) return r;
  r.error = cudaGraphLaunch(e->graph.exec(), stream);
  if (r.error != cudaSuccess) {
    (void)cudaGetLastError();
    entries_.pop_front();  // a graph whose launch failed is in an unknown state
    return r;
  }
  r.enqueued = true;
  return r;
}

}  // namespace indexer::engine
