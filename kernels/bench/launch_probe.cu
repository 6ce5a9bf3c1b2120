// indexer-launch-probe: the host's cost of one small device round trip, the floor under every
// step the CUDA backend runs (docs/PERF.md, "The service against the echo floor"). One 16 KB
// upload from pinned memory, two tiny kernels and one download, handed to the GPU several ways:
// by the copy engine (a graph of all four, or a kernels-only graph plus copies, or four stream
// calls; the wait by cudaStreamSynchronize, by polling cudaStreamQuery, or on another thread),
// or as one graph whose copies are kernels reading and writing mapped pinned memory (the
// backend's form: kernels/cuda/step_copy.h), also waited for on a flag its last kernel raises.
// 2,000 times each with a pause between; prints the median time to launch, to wait and in all.
// Then the upload grows from 16 KB to 512 KB (a step's inputs span that range), by the copy
// engine (also as copies of 16 KB) and by the copy kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kernels/cuda/step_copy.h"

namespace {

constexpr int kValues = 4096;
constexpr int kRuns = 2000;
constexpr size_t kMaxUploadBytes = size_t{512} << 10;

__global__ void AddOne(const int* in, int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] + 1;
}

__global__ void Twice(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] *= 2;
}

// Tells a host thread spinning on mapped memory that the kernels before it have ended.
__global__ void RaiseFlag(volatile int* flag, int value) {
  __threadfence_system();
  *flag = value;
}

void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

struct Buffers {
  int* h_in = nullptr;
  int* h_out = nullptr;
  int* d_in = nullptr;
  int* d_out = nullptr;
  int n = kValues;
  size_t bytes = kValues * sizeof(int);
  int* flag = nullptr;  // mapped pinned host memory
};

// Adds AddOne then Twice after *prev (as roots when *prev is null); *prev becomes Twice.
void AddTwoKernels(Buffers& b, cudaGraph_t g, cudaGraphNode_t* prev) {
  void* add_args[] = {&b.d_in, &b.d_out, &b.n};
  void* twice_args[] = {&b.d_out, &b.n};
  cudaKernelNodeParams p{};
  p.gridDim = dim3(kValues / 256);
  p.blockDim = dim3(256);
  p.func = reinterpret_cast<void*>(AddOne);
  p.kernelParams = add_args;
  cudaGraphNode_t add;
  Check(cudaGraphAddKernelNode(&add, g, *prev ? prev : nullptr, *prev ? 1 : 0, &p), "kernel node");
  p.func = reinterpret_cast<void*>(Twice);
  p.kernelParams = twice_args;
  Check(cudaGraphAddKernelNode(prev, g, &add, 1, &p), "kernel node");
}

// Adds the backend's copy kernel (kernels/cuda/step_copy.h) after *prev; *prev becomes it.
void AddCopyNode(cudaGraph_t g, cudaGraphNode_t* prev, const void* src, void* dst, size_t bytes) {
  indexer::kernels::cuda::LaunchList list;
  Check(indexer::kernels::cuda::DescribeStepCopy(src, dst, static_cast<int64_t>(bytes), &list),
        "DescribeStepCopy");
  const indexer::kernels::cuda::KernelLaunch& l = list.items[0];
  void* args[indexer::kernels::cuda::KernelLaunch::kMaxArgs];
  l.ArgPointers(args);
  cudaKernelNodeParams p{};
  p.gridDim = l.grid;
  p.blockDim = l.block;
  p.func = const_cast<void*>(l.func);
  p.kernelParams = args;
  cudaGraphNode_t node;
  Check(cudaGraphAddKernelNode(&node, g, *prev ? prev : nullptr, *prev ? 1 : 0, &p), "copy node");
  *prev = node;
}

// One graph for the whole round trip with no copy engine: a copy kernel reads `upload` bytes of
// mapped pinned memory into device memory, AddOne, Twice, a copy kernel writes the results into
// mapped pinned memory; `flag_value` > 0 adds a kernel that raises the host flag last.
cudaGraphExec_t BuildKernelCopyGraph(Buffers& b, size_t upload, int flag_value) {
  cudaGraph_t g;
  Check(cudaGraphCreate(&g, 0), "cudaGraphCreate");
  cudaGraphNode_t prev = nullptr;
  AddCopyNode(g, &prev, b.h_in, b.d_in, upload);
  AddTwoKernels(b, g, &prev);
  AddCopyNode(g, &prev, b.d_out, b.h_out, b.bytes);
  if (flag_value > 0) {
    void* flag_args[] = {&b.flag, &flag_value};
    cudaKernelNodeParams p{};
    p.gridDim = dim3(1);
    p.blockDim = dim3(1);
    p.func = reinterpret_cast<void*>(RaiseFlag);
    p.kernelParams = flag_args;
    cudaGraphNode_t raise;
    Check(cudaGraphAddKernelNode(&raise, g, &prev, 1, &p), "flag node");
  }
  cudaGraphExec_t exec;
  Check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
  Check(cudaGraphDestroy(g), "cudaGraphDestroy");
  return exec;
}

// A graph of `kernels` AddOne then Twice, between an upload and a download when `copies`.
cudaGraphExec_t BuildGraph(Buffers& b, bool copies) {
  cudaGraph_t g;
  Check(cudaGraphCreate(&g, 0), "cudaGraphCreate");
  cudaGraphNode_t prev = nullptr;
  if (copies) {
    Check(cudaGraphAddMemcpyNode1D(&prev, g, nullptr, 0, b.d_in, b.h_in, b.bytes,
                                   cudaMemcpyHostToDevice),
          "upload node");
  }
  AddTwoKernels(b, g, &prev);
  if (copies) {
    cudaGraphNode_t down;
    Check(cudaGraphAddMemcpyNode1D(&down, g, &prev, 1, b.h_out, b.d_out, b.bytes,
                                   cudaMemcpyDeviceToHost),
          "download node");
  }
  cudaGraphExec_t exec;
  Check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
  Check(cudaGraphDestroy(g), "cudaGraphDestroy");
  return exec;
}

// Times `launch` then `wait`, kRuns times with a 50 µs pause between runs.
template <typename Launch, typename Wait>
void Time(const char* name, Launch launch, Wait wait) {
  std::vector<double> launched, waited, total;
  for (int i = 0; i < kRuns; ++i) {
    const Clock::time_point t0 = Clock::now();
    launch();
    const Clock::time_point t1 = Clock::now();
    wait();
    const Clock::time_point t2 = Clock::now();
    launched.push_back(Micros(t1 - t0));
    waited.push_back(Micros(t2 - t1));
    total.push_back(Micros(t2 - t0));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::printf("%-46s launch p50 %6.2f us  wait p50 %6.2f us  total p50 %6.2f us\n", name,
              Median(launched), Median(waited), Median(total));
}

// Times launches of `graph` on `stream` whose end another thread waits for by
// cudaStreamSynchronize, as a lane's completion thread does.
void TimeWithWaiter(const char* name, cudaGraphExec_t graph, cudaStream_t stream) {
  std::atomic<int> launched{0}, seen{0};
  std::thread waiter([&] {
    for (int i = 0; i < kRuns; ++i) {
      while (launched.load() <= i) {
      }
      Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      seen.store(i + 1);
    }
  });
  Time(name, [&] {
    cudaGraphLaunch(graph, stream);
    launched.fetch_add(1);
  }, [&] {
    while (seen.load() < launched.load()) {
    }
  });
  waiter.join();
}

}  // namespace

int main() {
  Buffers b;
  Check(cudaHostAlloc(&b.h_in, kMaxUploadBytes, cudaHostAllocMapped), "cudaHostAlloc");
  Check(cudaHostAlloc(&b.h_out, b.bytes, cudaHostAllocMapped), "cudaHostAlloc");
  Check(cudaHostAlloc(&b.flag, sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
  *b.flag = 0;
  Check(cudaMalloc(&b.d_in, kMaxUploadBytes), "cudaMalloc");
  Check(cudaMalloc(&b.d_out, b.bytes), "cudaMalloc");
  cudaStream_t st;
  Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  const cudaGraphExec_t whole = BuildGraph(b, true);
  const cudaGraphExec_t kernels_only = BuildGraph(b, false);
  Check(cudaGraphUpload(whole, st), "cudaGraphUpload");
  Check(cudaGraphUpload(kernels_only, st), "cudaGraphUpload");

  const auto sync = [&] { Check(cudaStreamSynchronize(st), "cudaStreamSynchronize"); };
  const auto poll = [&] {
    while (cudaStreamQuery(st) == cudaErrorNotReady) {
    }
  };
  const auto stream_calls = [&] {
    cudaMemcpyAsync(b.d_in, b.h_in, b.bytes, cudaMemcpyHostToDevice, st);
    AddOne<<<kValues / 256, 256, 0, st>>>(b.d_in, b.d_out, b.n);
    Twice<<<kValues / 256, 256, 0, st>>>(b.d_out, b.n);
    cudaMemcpyAsync(b.h_out, b.d_out, b.bytes, cudaMemcpyDeviceToHost, st);
  };
  Time("graph: upload, 2 kernels, download; sync", [&] { cudaGraphLaunch(whole, st); }, sync);
  Time("graph: upload, 2 kernels, download; poll", [&] { cudaGraphLaunch(whole, st); }, poll);
  Time("copies around a graph of 2 kernels; sync", [&] {
    cudaMemcpyAsync(b.d_in, b.h_in, b.bytes, cudaMemcpyHostToDevice, st);
    cudaGraphLaunch(kernels_only, st);
    cudaMemcpyAsync(b.h_out, b.d_out, b.bytes, cudaMemcpyDeviceToHost, st);
  }, sync);
  Time("four stream calls; sync", stream_calls, sync);
  Time("four stream calls; poll", stream_calls, poll);

  // The whole graph, waited for by another thread (as a lane's completion thread waits).
  TimeWithWaiter("graph; another thread syncs", whole, st);

  for (size_t kb : {16, 64, 128, 256, 512}) {
    char name[64];
    std::snprintf(name, sizeof(name), "%zu KB upload around the graph; sync", kb);
    Time(name, [&] {
      cudaMemcpyAsync(b.d_in, b.h_in, kb << 10, cudaMemcpyHostToDevice, st);
      cudaGraphLaunch(kernels_only, st);
      cudaMemcpyAsync(b.h_out, b.d_out, b.bytes, cudaMemcpyDeviceToHost, st);
    }, sync);
  }
  // The same bytes in copies of 16 KB each: whether what a large copy adds is per copy.
  for (size_t kb : {64, 256}) {
    char name[64];
    std::snprintf(name, sizeof(name), "%zu KB as %zu uploads of 16 KB; sync", kb, kb / 16);
    Time(name, [&] {
      for (size_t at = 0; at < (kb << 10); at += size_t{16} << 10) {
        cudaMemcpyAsync(reinterpret_cast<char*>(b.d_in) + at, reinterpret_cast<char*>(b.h_in) + at,
                        size_t{16} << 10, cudaMemcpyHostToDevice, st);
      }
      cudaGraphLaunch(kernels_only, st);
      cudaMemcpyAsync(b.h_out, b.d_out, b.bytes, cudaMemcpyDeviceToHost, st);
    }, sync);
  }

  // No copy engine: the SMs read the upload from mapped pinned memory and write the results into
  // it, all in one graph.
  const cudaGraphExec_t kernel_copies = BuildKernelCopyGraph(b, size_t{16} << 10, 0);
  Check(cudaGraphUpload(kernel_copies, st), "cudaGraphUpload");
  const auto launch_copies = [&] { cudaGraphLaunch(kernel_copies, st); };
  Time("graph: copy kernel, 2 kernels, copy kernel; sync", launch_copies, sync);
  Time("graph: copy kernel, 2 kernels, copy kernel; poll", launch_copies, poll);
  TimeWithWaiter("graph: kernel copies; another thread syncs", kernel_copies, st);
  // Waited for on a flag the graph's last kernel raises in mapped memory: no driver call.
  {
    const cudaGraphExec_t flag_graph = BuildKernelCopyGraph(b, size_t{16} << 10, 1);
    Check(cudaGraphUpload(flag_graph, st), "cudaGraphUpload");
    Time("graph: kernel copies; spin on a mapped flag", [&] {
      *b.flag = 0;
      cudaGraphLaunch(flag_graph, st);
    }, [&] {
      while (*reinterpret_cast<volatile int*>(b.flag) == 0) {
      }
    });
    Check(cudaStreamSynchronize(st), "sync");
  }
  for (size_t kb : {1, 64, 128, 256, 512}) {
    const cudaGraphExec_t g = BuildKernelCopyGraph(b, kb << 10, 0);
    Check(cudaGraphUpload(g, st), "cudaGraphUpload");
    char name[64];
    std::snprintf(name, sizeof(name), "%zu KB by copy kernel in the graph; sync", kb);
    Time(name, [&] { cudaGraphLaunch(g, st); }, sync);
  }
  // The copy kernels' results are the stream path's.
  for (int i = 0; i < kValues; ++i) b.h_in[i] = i;
  Check(cudaGraphLaunch(kernel_copies, st), "launch");
  Check(cudaStreamSynchronize(st), "sync");
  for (int i = 0; i < kValues; ++i) {
    if (b.h_out[i] != 2 * (i + 1)) {
      std::fprintf(stderr, "copy kernels: value %d is %d, expected %d\n", i, b.h_out[i],
                   2 * (i + 1));
      return 1;
    }
  }
  Check(cudaGetLastError(), "the runs");
  return 0;
}
