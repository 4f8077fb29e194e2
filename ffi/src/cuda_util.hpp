// What the CUDA backend's files share: its error messages (CudaError and the
// macros that return or throw them), the formatting of its messages (GiB,
// Entry) and the device scope's failure as a Status. CUDA builds only.
//
// Internal linkage across files: everything of the backend that one of its
// files uses from another lives in namespace strata::cuda, opened with
// STRATA_INTERNAL (hidden visibility) wherever it is declared, so it links
// between the backend's objects but stays out of the library's dynamic symbol
// table, which exports the C API and the FFI handlers only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "device_scope.hpp"
#include "engine.hpp"

#define STRATA_INTERNAL __attribute__((visibility("hidden")))

namespace strata {
namespace STRATA_INTERNAL cuda {

inline std::string CudaError(const char* call, const std::string& context,
                             cudaError_t err) {
  std::string s = call;
  if (!context.empty()) s += "(" + context + ")";
  return s + ": " + cudaGetErrorString(err);
}

// `context` is evaluated only on failure, so building it costs nothing on the
// hot path.
#define STRATA_CUDA_RETURN(context, fn, ...)                 \
  do {                                                       \
    const cudaError_t strata_err_ = fn(__VA_ARGS__);         \
    if (strata_err_ != cudaSuccess)                          \
      return CudaError(#fn, (context), strata_err_);         \
  } while (0)

#define STRATA_CUDA_THROW(context, fn, ...)                              \
  do {                                                                   \
    const cudaError_t strata_err_ = fn(__VA_ARGS__);                     \
    if (strata_err_ != cudaSuccess)                                      \
      throw std::runtime_error(CudaError(#fn, (context), strata_err_));  \
  } while (0)

inline std::string GiB(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", bytes / double(1LL << 30));
  return buf;
}

inline std::string Entry(int64_t slot, const StreamEntry& e) {
  return "slot " + std::to_string(slot) + " <- layer " +
         std::to_string(e.layer) + " expert " + std::to_string(e.expert);
}

// cudaSetDevice's failure in `scope`, as a Status.
inline Status DeviceStatus(const DeviceScope& scope) {
  if (scope.error() == cudaSuccess) return {};
  return CudaError("cudaSetDevice", "device " + std::to_string(scope.device()),
                   scope.error());
}

// Makes the engine's device current for the rest of the scope (as `var`) and
// returns its error from the enclosing Status function if that fails. Used in
// the engine's methods: `opt_` is its EngineOptions.
#define STRATA_ENTER_DEVICE(var)            \
  DeviceScope var(opt_.device);             \
  if (Status strata_s_ = DeviceStatus(var); !strata_s_.empty()) return strata_s_

}  // namespace cuda
}  // namespace strata
