// Measures the host-to-device link: copies of `bytes` from host memory of one
// kind, the median of `reps` timed with CUDA events. It is the ceiling every
// streaming figure is reported against (BENCHMARK.md: 256 MB blocks, >= 10).
//
// `block` < `bytes` splits each repetition into back-to-back copies of
// `block` bytes on one stream, with an event recorded after each when
// `events` is set: the shape of the ring's traffic (one copy and one `copied`
// event per expert), so the probe says what the copy engine gives for it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "device_scope.hpp"

namespace {

enum HostMode { kPageable = 0, kHostAlloc = 1, kRegistered = 2 };

// Writes "what: CUDA's reason" to `err`, clears CUDA's sticky last error and
// returns 1: every failure of the probe comes back this way.
int Fail(char* err, int64_t errlen, const char* what, cudaError_t e) {
  std::snprintf(err, static_cast<size_t>(errlen), "%s: %s", what, cudaGetErrorString(e));
  cudaGetLastError();
  return 1;
}

// Times `reps` repetitions (after one warm-up) of `bytes` copied from `host`
// to a fresh device buffer on the current device, in `block`-byte copies on
// one stream, optionally recording an event after each; writes the median
// rate in GB/s.
int TimeCopies(const void* host, int64_t bytes, int64_t block, int reps,
               int events, double* gbps_out, char* err, int64_t errlen) {
  auto fail = [&](const char* what, cudaError_t e) { return Fail(err, errlen, what, e); };
  cudaError_t e;
  if (block <= 0 || block > bytes) block = bytes;
  void* dev = nullptr;
  if ((e = cudaMalloc(&dev, bytes)) != cudaSuccess) return fail("cudaMalloc", e);
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
  if (run_err != cudaSuccess) return fail("copy", run_err);
  std::sort(rates.begin(), rates.end());
  *gbps_out = rates.empty() ? 0.0 : rates[rates.size() / 2];
  return 0;
}

}  // namespace

extern "C" int strata_measure_h2d(int device, int64_t bytes, int64_t block, int reps,
                                     int host_mode, int events, double* gbps_out, char* err,
                                     int64_t errlen) {
  if (bytes <= 0 || reps < 1 || host_mode < 0 || host_mode > 2) {
    std::snprintf(err, static_cast<size_t>(errlen),
                  "bad probe arguments: bytes %lld, reps %d, host_mode %d",
                  static_cast<long long>(bytes), reps, host_mode);
    return 1;
  }
  strata::DeviceScope scope(device);  // before the host allocation: its context is this device's
  cudaError_t e = scope.error();
  if (e != cudaSuccess) return Fail(err, errlen, "cudaSetDevice", e);
  void* host = nullptr;
  if (host_mode == kHostAlloc) {
    if ((e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault)) != cudaSuccess)
      return Fail(err, errlen, "cudaHostAlloc", e);
  } else {
    host = std::malloc(static_cast<size_t>(bytes));
    if (!host) {
      std::snprintf(err, static_cast<size_t>(errlen), "malloc of %lld bytes failed",
                    static_cast<long long>(bytes));
      return 1;
    }
  }
  std::memset(host, 1, static_cast<size_t>(bytes));  // touch every page
  auto free_host = [&] {
    if (host_mode == kHostAlloc) {
      cudaFreeHost(host);
    } else {
      if (host_mode == kRegistered) cudaHostUnregister(host);
      std::free(host);
    }
  };
  if (host_mode == kRegistered &&
      (e = cudaHostRegister(host, static_cast<size_t>(bytes), cudaHostRegisterDefault)) !=
          cudaSuccess) {
    std::free(host);
    return Fail(err, errlen, "cudaHostRegister", e);
  }
  const int rc = TimeCopies(host, bytes, block, reps, events, gbps_out, err, errlen);
  free_host();
  return rc;
}

// The same measure out of host memory the caller owns (the expert store's pinned
// arena): the copy peak of the very pages the ring reads, which a fresh probe
// buffer (another allocation, possibly other memory) need not match. The caller
// keeps `host` valid for `bytes` until this returns.
extern "C" int strata_measure_h2d_from(int device, const void* host, int64_t bytes, int reps,
                                          double* gbps_out, char* err, int64_t errlen) {
  if (!host || bytes <= 0 || reps < 1) {
    std::snprintf(err, static_cast<size_t>(errlen),
                  "bad probe arguments: host %p, bytes %lld, reps %d", host,
                  static_cast<long long>(bytes), reps);
    return 1;
  }
  strata::DeviceScope scope(device);
  if (const cudaError_t e = scope.error(); e != cudaSuccess)
    return Fail(err, errlen, "cudaSetDevice", e);
  return TimeCopies(host, bytes, bytes, reps, 0, gbps_out, err, errlen);
}

// Pinned host memory for the expert store: Python packs the blobs straight
// into it, so the engine copies from it in place (pin mode "arena") without
// registering or duplicating the store. Returns null and the reason when
// cudaHostAlloc fails.
extern "C" void* strata_pinned_alloc(int64_t bytes, char* err, int64_t errlen) {
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    std::snprintf(err, static_cast<size_t>(errlen), "cudaHostAlloc(%lld bytes): %s",
                  static_cast<long long>(bytes), cudaGetErrorString(e));
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

extern "C" void strata_pinned_free(void* p) {
  if (p) cudaFreeHost(p);
}
