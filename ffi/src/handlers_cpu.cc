// The handlers for platform "cpu" (the simulated link). The CPU engine runs
// its copies on threads of its own and queues nothing on an XLA stream, so
// the handlers' stream is null: CpuPlatform's context decodes to nullptr
// without asking XLA for anything. Its dense copies are memcpy.
#include <cstring>
#include <optional>

#include "handlers.hpp"

namespace strata::handlers {
struct NoStream {};
struct CpuPlatform {
  using StreamCtx = NoStream;
  // The CPU's results are host memory: the copies are done when the call returns.
  static Status DenseCopy(void*, int, int64_t, const int64_t* src, void* const* dst,
                          const int64_t* bytes, int n) {
    for (int i = 0; i < n; ++i)
      std::memcpy(dst[i], reinterpret_cast<const void*>(src[i]), static_cast<size_t>(bytes[i]));
    return {};
  }
  static Status DenseWait(void*, int, int64_t) { return {}; }
};
}  // namespace strata::handlers

namespace xla::ffi {
template <>
struct CtxDecoding<::strata::handlers::NoStream> {
  using Type = void*;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return nullptr;
  }
};
}  // namespace xla::ffi

STRATA_DEFINE_HANDLERS(Cpu, ::strata::handlers::CpuPlatform)
