// The handlers for platform "CUDA": CudaPlatform's context is XLA's stream,
// on which the engine queues its copies, events and host callbacks; its dense
// copies are dense_copy.cu's.
#include <cuda_runtime_api.h>

#include "dense_copy.hpp"
#include "handlers.hpp"

namespace strata::handlers {
struct CudaPlatform {
  using StreamCtx = ::xla::ffi::PlatformStream<cudaStream_t>;
  static Status DenseCopy(void* stream, int ordinal, int64_t key, const int64_t* src,
                          void* const* dst, const int64_t* bytes, int n) {
    return DenseCopyCuda(stream, ordinal, key, src, dst, bytes, n);
  }
  static Status DenseWait(void* stream, int ordinal, int64_t key) {
    return DenseWaitCuda(stream, ordinal, key);
  }
};
}  // namespace strata::handlers

STRATA_DEFINE_HANDLERS(Cuda, ::strata::handlers::CudaPlatform)
