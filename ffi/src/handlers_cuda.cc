// The handlers for platform "CUDA": CudaPlatform's context is XLA's stream,
// on which the engine queues its copies, events and host callbacks.
#include <cuda_runtime_api.h>

#include "handlers.hpp"

namespace strata::handlers {
struct CudaPlatform {
  using StreamCtx = ::xla::ffi::PlatformStream<cudaStream_t>;
};
}  // namespace strata::handlers

STRATA_DEFINE_HANDLERS(Cuda, ::strata::handlers::CudaPlatform)
