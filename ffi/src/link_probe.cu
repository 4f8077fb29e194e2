// Measures the host-to-device link: copies of `bytes` from host memory of one
// kind, the median of `reps` timed with CUDA events. It is the ceiling every
// streaming figure is reported against (BENCHMARK.md: 256 MB blocks, >= 10).
//
// `block` < `bytes` splits each repetition into back-to-back copies of
// `block` bytes on one stream, with an event recorded after each when
// `events` is set: the shape of the ring's traffic (one copy and one `copied`
// event per expert), so the probe says what the copy engine gives for it.
#include "link_probe.hpp"

#include "numa_scope.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_scope.hpp"

namespace strata {
namespace {

// "what: CUDA's reason", with CUDA's sticky last error cleared: every failure
// of the probe comes back this way.
Status Fail(const char* what, cudaError_t e) {
  cudaGetLastError();
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Times `reps` repetitions (after one warm-up) of `bytes` copied from `host`
// to a fresh device buffer on the current device, in `block`-byte copies on
// one stream, optionally recording an event after each; writes the median
// rate in GB/s.
Status TimeCopies(const void* host, int64_t bytes, int64_t block, int reps,
                  bool events, double* gbps_out) {
  cudaError_t e;
  if (block <= 0 || block > bytes) block = bytes;
  void* dev = nullptr;
  if ((e = cudaMalloc(&dev, bytes)) != cudaSuccess) return Fail("cudaMalloc", e);
  const int64_t n_blocks = (bytes + block - 1) / block;
  cudaStream_t s = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  std::vector<cudaEvent_t> marks(events ? static_cast<size_t>(n_blocks) : 0, nullptr);
  e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreate(&a);
  if (e == cudaSuccess) e = cudaEventCreate(&b);
  for (size_t i = 0; e == cudaSuccess && i < marks.size(); ++i)
    e = cudaEventCreateWithFlags(&marks[i], cudaEventDisableTiming);
  std::vector<double> rates;
  for (int i = 0; e == cudaSuccess && i < reps + 1; ++i) {  // the first is a warm-up
    e = cudaEventRecord(a, s);
    for (int64_t k = 0; e == cudaSuccess && k < n_blocks; ++k) {
      const int64_t off = k * block;
      const int64_t n = std::min(block, bytes - off);
      e = cudaMemcpyAsync(static_cast<char*>(dev) + off, static_cast<const char*>(host) + off,
                          static_cast<size_t>(n), cudaMemcpyHostToDevice, s);
      if (e == cudaSuccess && events) e = cudaEventRecord(marks[k], s);
    }
    if (e == cudaSuccess) e = cudaEventRecord(b, s);
    if (e == cudaSuccess) e = cudaEventSynchronize(b);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, a, b);
    if (e == cudaSuccess && i > 0) rates.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  const cudaError_t run_err = e;
  for (cudaEvent_t m : marks)
    if (m) cudaEventDestroy(m);
  if (a) cudaEventDestroy(a);
  if (b) cudaEventDestroy(b);
  if (s) cudaStreamDestroy(s);
  cudaFree(dev);
  if (run_err != cudaSuccess) return Fail("copy", run_err);
  std::sort(rates.begin(), rates.end());
  *gbps_out = rates.empty() ? 0.0 : rates[rates.size() / 2];
  return {};
}

}  // namespace

Status MeasureH2D(int device, int64_t bytes, int64_t block, int reps,
                  ProbeHost host_mode, bool events, double* gbps_out) {
  DeviceScope scope(device);  // before the host allocation: its context is this device's
  cudaError_t e = scope.error();
  if (e != cudaSuccess) return Fail("cudaSetDevice", e);
  void* host = nullptr;
  if (host_mode == ProbeHost::kHostAlloc) {
    if ((e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault)) != cudaSuccess)
      return Fail("cudaHostAlloc", e);
  } else {
    host = std::malloc(static_cast<size_t>(bytes));
    if (!host) return "malloc of " + std::to_string(bytes) + " bytes failed";
  }
  std::memset(host, 1, static_cast<size_t>(bytes));  // touch every page
  auto free_host = [&] {
    if (host_mode == ProbeHost::kHostAlloc) {
      cudaFreeHost(host);
    } else {
      if (host_mode == ProbeHost::kRegistered) cudaHostUnregister(host);
      std::free(host);
    }
  };
  if (host_mode == ProbeHost::kRegistered &&
      (e = cudaHostRegister(host, static_cast<size_t>(bytes), cudaHostRegisterDefault)) !=
          cudaSuccess) {
    std::free(host);
    return Fail("cudaHostRegister", e);
  }
  Status s = TimeCopies(host, bytes, block, reps, events, gbps_out);
  free_host();
  return s;
}

// The copy peak of the very pages the ring reads (the expert store's pinned
// arena), which a fresh probe buffer (another allocation, possibly other
// memory) need not match.
Status MeasureH2DFrom(int device, const void* host, int64_t bytes, int reps,
                      double* gbps_out) {
  DeviceScope scope(device);
  if (const cudaError_t e = scope.error(); e != cudaSuccess)
    return Fail("cudaSetDevice", e);
  return TimeCopies(host, bytes, bytes, reps, false, gbps_out);
}

// Pinned host memory for the expert store: Python packs the blobs straight
// into it, so the engine copies from it in place (pin mode "arena") without
// registering or duplicating the store.
Status PinnedAlloc(int64_t bytes, void** out, int device, int* numa_node) {
  *out = nullptr;
  NumaScope near(device);  // on the GPU's host node where device >= 0
  if (numa_node) *numa_node = near.node();
  const cudaError_t e = cudaHostAlloc(out, static_cast<size_t>(bytes), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    *out = nullptr;
    cudaGetLastError();
    return "cudaHostAlloc(" + std::to_string(bytes) + " bytes): " + cudaGetErrorString(e);
  }
  return {};
}

void PinnedFree(void* p) {
  if (p) cudaFreeHost(p);
}

}  // namespace strata
