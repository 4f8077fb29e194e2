// Measures the host-to-device link: pinned (cudaHostAlloc) copies of `bytes`,
// the median of `reps` timed with CUDA events. It is the ceiling every
// streaming figure is reported against (BENCHMARK.md: 256 MB blocks, >= 10).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

extern "C" int strata_measure_h2d(int device, int64_t bytes, int reps, int pinned,
                                  double* gbps_out, char* err, int64_t errlen) {
  auto fail = [&](const char* what, cudaError_t e) {
    std::snprintf(err, static_cast<size_t>(errlen), "%s: %s", what, cudaGetErrorString(e));
    return 1;
  };
  cudaError_t e;
  if ((e = cudaSetDevice(device)) != cudaSuccess) return fail("cudaSetDevice", e);
  void* host = nullptr;
  void* dev = nullptr;
  std::vector<char> pageable;
  if (pinned) {
    if ((e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault)) != cudaSuccess)
      return fail("cudaHostAlloc", e);
  } else {
    pageable.resize(static_cast<size_t>(bytes));
    host = pageable.data();
  }
  std::fill_n(static_cast<char*>(host), bytes, 1);  // touch every page
  if ((e = cudaMalloc(&dev, bytes)) != cudaSuccess) {
    if (pinned) cudaFreeHost(host);
    return fail("cudaMalloc", e);
  }
  cudaStream_t s;
  cudaEvent_t a, b;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> rates;
  for (int i = 0; i < reps + 1; ++i) {  // the first is a warm-up
    cudaEventRecord(a, s);
    cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s);
    cudaEventRecord(b, s);
    if ((e = cudaEventSynchronize(b)) != cudaSuccess) break;
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i > 0) rates.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  cudaFree(dev);
  if (pinned) cudaFreeHost(host);
  if (e != cudaSuccess) return fail("copy", e);
  std::sort(rates.begin(), rates.end());
  *gbps_out = rates.empty() ? 0.0 : rates[rates.size() / 2];
  return 0;
}
