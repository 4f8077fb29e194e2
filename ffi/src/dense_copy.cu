// dense_fetch's and dense_wait's CUDA side (dense_copy.hpp): one copy stream
// per device, made on first use, and two events per key (the point XLA's
// stream had reached at the fetch, and the copies' end).
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <utility>

#include "cuda_util.hpp"
#include "dense_copy.hpp"

namespace strata {
namespace {

using cuda::CudaError;

struct Copies {
  cudaStream_t stream = nullptr;
  std::map<int64_t, std::pair<cudaEvent_t, cudaEvent_t>> events;  // key -> (reached, done)
};

std::mutex g_mu;
std::map<int, Copies> g_devices;  // by ordinal; kept for the process's life

// The device's copies, its stream made on first use; with the device current.
Status DeviceCopies(int ordinal, Copies** out) {
  Copies& c = g_devices[ordinal];
  if (!c.stream) {
    cudaStream_t s = nullptr;
    STRATA_CUDA_RETURN("dense copies, device " + std::to_string(ordinal),
                       cudaStreamCreateWithFlags, &s, cudaStreamNonBlocking);
    c.stream = s;
  }
  *out = &c;
  return {};
}

}  // namespace

Status DenseCopyCuda(void* xla_stream, int ordinal, int64_t key, const int64_t* src,
                     void* const* dst, const int64_t* bytes, int n) {
  DeviceScope scope(ordinal);
  if (Status s = cuda::DeviceStatus(scope); !s.empty()) return s;
  std::lock_guard<std::mutex> lock(g_mu);
  Copies* c = nullptr;
  if (Status s = DeviceCopies(ordinal, &c); !s.empty()) return s;
  auto it = c->events.find(key);
  if (it == c->events.end()) {
    cudaEvent_t reached = nullptr, done = nullptr;
    STRATA_CUDA_RETURN("dense_fetch", cudaEventCreateWithFlags, &reached,
                       cudaEventDisableTiming);
    const cudaError_t err = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      cudaEventDestroy(reached);
      return CudaError("cudaEventCreateWithFlags", "dense_fetch", err);
    }
    it = c->events.emplace(key, std::make_pair(reached, done)).first;
  }
  const auto [reached, done] = it->second;
  auto xla = static_cast<cudaStream_t>(xla_stream);
  STRATA_CUDA_RETURN("dense_fetch", cudaEventRecord, reached, xla);
  STRATA_CUDA_RETURN("dense_fetch", cudaStreamWaitEvent, c->stream, reached, 0);
  for (int i = 0; i < n; ++i)
    STRATA_CUDA_RETURN("dense_fetch, array " + std::to_string(i), cudaMemcpyAsync, dst[i],
                       reinterpret_cast<const void*>(src[i]), static_cast<size_t>(bytes[i]),
                       cudaMemcpyHostToDevice, c->stream);
  STRATA_CUDA_RETURN("dense_fetch", cudaEventRecord, done, c->stream);
  return {};
}

Status DenseWaitCuda(void* xla_stream, int ordinal, int64_t key) {
  DeviceScope scope(ordinal);
  if (Status s = cuda::DeviceStatus(scope); !s.empty()) return s;
  std::lock_guard<std::mutex> lock(g_mu);
  auto dev = g_devices.find(ordinal);
  if (dev == g_devices.end() || !dev->second.events.count(key))
    return "dense_wait: no dense_fetch of key " + std::to_string(key) + " on device " +
           std::to_string(ordinal) + " before it";
  STRATA_CUDA_RETURN("dense_wait", cudaStreamWaitEvent, static_cast<cudaStream_t>(xla_stream),
                     dev->second.events[key].second, 0);
  return {};
}

}  // namespace strata
