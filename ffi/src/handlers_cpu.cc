// The handlers for platform "cpu" (the simulated link). The CPU engine runs
// its copies on threads of its own and queues nothing on an XLA stream, so
// the handlers' stream is null: CpuPlatform's context decodes to nullptr
// without asking XLA for anything.
#include <optional>

#include "handlers.hpp"

namespace strata::handlers {
struct NoStream {};
struct CpuPlatform {
  using StreamCtx = NoStream;
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
