// Makes a CUDA device current for a scope and puts the caller's device back,
// for the engine (handlers run on XLA's threads, whose current device is
// XLA's business) and the link probe (which must not move a caller's thread,
// CuPy's or torch's, to another GPU). CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

namespace strata {

class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device_) error_ = cudaSetDevice(device_);
  }
  ~DeviceScope() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  int device() const { return device_; }
  // cudaSetDevice's result (cudaSuccess when the device was current already).
  cudaError_t error() const { return error_; }

 private:
  int device_;
  int prev_ = -1;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace strata
