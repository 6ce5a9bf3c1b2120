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

cudaError_t SelectGraphCache::Build(const SelectStep& step, Entry* e) {
  cudaError_t err = e->graph.Create();
  if (err != cudaSuccess) return err;
  cudaGraph_t g = e->graph.graph();
  err = cudaGraphAddMemcpyNode1D(&e->in_node, g, nullptr, 0, step.in_dst, step.in_src, step.in_bytes,
                                 cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return err;
  cudaGraphNode_t prev = e->in_node;
  const kernels::cuda::LaunchList& list = *step.kernels;
  for (int i = 0; i < list.size; ++i) {
    void* args[KernelLaunch::kMaxArgs];
    const cudaKernelNodeParams p = NodeParams(list.items[i], args);
    err = cudaGraphAddKernelNode(&e->kernel_nodes[i], g, &prev, 1, &p);
    if (err != cudaSuccess) return err;
    prev = e->kernel_nodes[i];
    e->launches[i] = list.items[i];
  }
  e->num_kernels = list.size;
  err = cudaGraphAddMemcpyNode1D(&e->out_node, g, &prev, 1, step.out_dst, step.out_src, step.out_bytes,
                                 cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return err;
  e->in = Copy{step.in_dst, step.in_src, step.in_bytes};
  e->out = Copy{step.out_dst, step.out_src, step.out_bytes};
  return e->graph.Instantiate();
}

cudaError_t SelectGraphCache::Update(const SelectStep& step, Entry* e, int* updated) {
  cudaGraphExec_t exec = e->graph.exec();
  const Copy in{step.in_dst, step.in_src, step.in_bytes};
  if (!(in == e->in)) {
    const cudaError_t err = cudaGraphExecMemcpyNodeSetParams1D(exec, e->in_node, in.dst, in.src, in.bytes,
                                                               cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return err;
    e->in = in;
    ++*updated;
  }
  const kernels::cuda::LaunchList& list = *step.kernels;
  for (int i = 0; i < list.size; ++i) {
    if (list.items[i].SameAs(e->launches[i])) continue;
    void* args[KernelLaunch::kMaxArgs];
    const cudaKernelNodeParams p = NodeParams(list.items[i], args);
    const cudaError_t err = cudaGraphExecKernelNodeSetParams(exec, e->kernel_nodes[i], &p);
    if (err != cudaSuccess) return err;
    e->launches[i] = list.items[i];
    ++*updated;
  }
  const Copy out{step.out_dst, step.out_src, step.out_bytes};
  if (!(out == e->out)) {
    const cudaError_t err = cudaGraphExecMemcpyNodeSetParams1D(exec, e->out_node, out.dst, out.src,
                                                               out.bytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return err;
    e->out = out;
    ++*updated;
  }
  return cudaSuccess;
}

GraphLaunchResult SelectGraphCache::Launch(const SelectStep& step, cudaStream_t stream) {
  GraphLaunchResult r;
  if (step.kernels == nullptr || step.in_bytes == 0 || step.out_bytes == 0) {
    r.error = cudaErrorInvalidValue;  // zero-length copies cannot be graph nodes
    return r;
  }
  auto it = entries_.begin();
  while (it != entries_.end() && !SameTopology(*it, *step.kernels)) ++it;
  if (it != entries_.end()) {
    entries_.splice(entries_.begin(), entries_, it);  // most recently used first
    r.error = Update(step, &entries_.front(), &r.updated_nodes);
  } else {
    while (entries_.size() >= capacity_) entries_.pop_back();
    entries_.emplace_front();
    r.error = Build(step, &entries_.front());
    r.built = r.error == cudaSuccess;
  }
  if (r.error == cudaSuccess) r.error = cudaGraphLaunch(entries_.front().graph.exec(), stream);
  if (r.error != cudaSuccess) {
    // A graph that failed to build, update or launch is in an unknown state: drop it.
    (void)cudaGetLastError();
    entries_.pop_front();
    return r;
  }
  r.enqueued = true;
  return r;
}

}  // namespace indexer::engine
