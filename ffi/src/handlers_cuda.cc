// Registration of the handlers for platform "CUDA". The same templated
// handlers as the CPU registration; only the platform stream is bound, so the
// engine queues its copies, events and host callbacks on XLA's own stream.
#include <cuda_runtime_api.h>

#include "handlers.hpp"

namespace h = strata::handlers;
namespace ffi = xla::ffi;

namespace {
ffi::Error BeginCuda(cudaStream_t stream, ffi::AnyBuffer t,
                     ffi::Result<ffi::AnyBuffer> o,
                     ffi::Result<ffi::AnyBuffer> ids, int64_t engine,
                     int32_t mode) {
  return h::Begin(static_cast<void*>(stream), t, o, ids, engine, mode);
}
// publish and release (h::LayerCall).
template <h::LayerCall H>
ffi::Error LayerCallCuda(cudaStream_t stream, ffi::AnyBuffer t, ffi::AnyBuffer a,
                         ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                         int32_t layer) {
  return H(static_cast<void*>(stream), t, a, o, engine, layer);
}
ffi::Error FetchCuda(cudaStream_t stream, ffi::AnyBuffer t, ffi::AnyBuffer r,
                     ffi::Result<ffi::AnyBuffer> g,
                     ffi::Result<ffi::AnyBuffer> u,
                     ffi::Result<ffi::AnyBuffer> d,
                     ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                     int32_t layer, int32_t piece, int32_t pieces,
                     int64_t row_begin, int64_t row_end) {
  return h::Fetch(static_cast<void*>(stream), t, r, g, u, d, o, engine, layer,
                  h::Piece(piece, pieces, row_begin, row_end));
}
ffi::Error FetchPieceCuda(cudaStream_t stream, ffi::AnyBuffer t,
                          ffi::AnyBuffer r, ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::Result<ffi::AnyBuffer> g,
                          ffi::Result<ffi::AnyBuffer> u,
                          ffi::Result<ffi::AnyBuffer> d,
                          ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                          int32_t layer, int32_t piece, int32_t pieces,
                          int64_t row_begin, int64_t row_end) {
  // The weights so far and `after` only order the call: fetch writes the
  // outputs, which XLA aliases to them.
  return FetchCuda(stream, t, r, g, u, d, o, engine, layer, piece, pieces,
                   row_begin, row_end);
}
ffi::Error FetchFrameCuda(cudaStream_t stream, ffi::AnyBuffer t,
                          ffi::AnyBuffer r, ffi::Result<ffi::AnyBuffer> o,
                          int64_t engine, int32_t layer, int32_t piece,
                          int32_t pieces, int64_t row_begin, int64_t row_end) {
  return h::FetchFrame(static_cast<void*>(stream), t, r, o, engine, layer,
                       h::Piece(piece, pieces, row_begin, row_end));
}
ffi::Error EndCuda(cudaStream_t stream, ffi::AnyBuffer t,
                   ffi::Result<ffi::AnyBuffer> s, int64_t engine) {
  return h::End(static_cast<void*>(stream), t, s, engine);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataBeginCuda, BeginCuda,
    h::BeginBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataPublishCuda, LayerCallCuda<h::Publish>,
    h::LayerCallBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataFetchCuda, FetchCuda,
    h::FetchBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataFetchPieceCuda, FetchPieceCuda,
    h::FetchPieceBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataFetchFrameCuda, FetchFrameCuda,
    h::FetchFrameBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataReleaseCuda, LayerCallCuda<h::Release>,
    h::LayerCallBinding(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    StrataEndCuda, EndCuda,
    h::EndBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
