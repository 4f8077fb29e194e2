// Registration of the handlers for platform "cpu" (the simulated link).
#include "handlers.hpp"

namespace h = strata::handlers;
namespace ffi = xla::ffi;

namespace {
ffi::Error BeginCpu(ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> o,
                    ffi::Result<ffi::AnyBuffer> ids, int64_t engine, int32_t mode) {
  return h::Begin(nullptr, t, o, ids, engine, mode);
}
// publish and release (h::LayerCall).
template <h::LayerCall H>
ffi::Error LayerCallCpu(ffi::AnyBuffer t, ffi::AnyBuffer a,
                        ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                        int32_t layer) {
  return H(nullptr, t, a, o, engine, layer);
}
ffi::Error FetchCpu(ffi::AnyBuffer t, ffi::AnyBuffer r,
                    ffi::Result<ffi::AnyBuffer> g, ffi::Result<ffi::AnyBuffer> u,
                    ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> o,
                    int64_t engine, int32_t layer, int32_t piece, int32_t pieces,
                    int64_t row_begin, int64_t row_end) {
  return h::Fetch(nullptr, t, r, g, u, d, o, engine, layer,
                  h::Piece(piece, pieces, row_begin, row_end));
}
ffi::Error FetchPieceCpu(ffi::AnyBuffer t, ffi::AnyBuffer r, ffi::AnyBuffer,
                         ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::Result<ffi::AnyBuffer> g,
                         ffi::Result<ffi::AnyBuffer> u,
                         ffi::Result<ffi::AnyBuffer> d,
                         ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                         int32_t layer, int32_t piece, int32_t pieces,
                         int64_t row_begin, int64_t row_end) {
  // The weights so far and `after` only order the call: fetch writes the
  // outputs, which XLA aliases to them.
  return FetchCpu(t, r, g, u, d, o, engine, layer, piece, pieces, row_begin,
                  row_end);
}
ffi::Error FetchFrameCpu(ffi::AnyBuffer t, ffi::AnyBuffer r,
                         ffi::Result<ffi::AnyBuffer> o, int64_t engine,
                         int32_t layer, int32_t piece, int32_t pieces,
                         int64_t row_begin, int64_t row_end) {
  return h::FetchFrame(nullptr, t, r, o, engine, layer,
                       h::Piece(piece, pieces, row_begin, row_end));
}
ffi::Error EndCpu(ffi::AnyBuffer t, ffi::Result<ffi::AnyBuffer> s,
                  int64_t engine) {
  return h::End(nullptr, t, s, engine);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataBeginCpu, BeginCpu,
                              h::BeginBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataPublishCpu, LayerCallCpu<h::Publish>,
                              h::LayerCallBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFetchCpu, FetchCpu,
                              h::FetchBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFetchPieceCpu, FetchPieceCpu,
                              h::FetchPieceBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFetchFrameCpu, FetchFrameCpu,
                              h::FetchFrameBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataReleaseCpu, LayerCallCpu<h::Release>,
                              h::LayerCallBinding(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataEndCpu, EndCpu,
                              h::EndBinding(ffi::Ffi::Bind()));
