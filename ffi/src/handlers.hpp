// XLA FFI handlers of the streaming engine: begin_chunk, publish, fetch (into
// outputs of its own, with fetch_piece for a layer's later pieces, or
// fetch_frame: the model reads the ring's frame),
// release and end_chunk. One templated implementation; the CPU and CUDA registrations
// (handlers_cpu.cc, handlers_cuda.cc) differ only in how the platform stream
// is bound. Every engine error comes back as an ffi::Error naming the call
// and the layer; nothing throws across the FFI boundary.
#pragma once

#include <exception>
#include <utility>
#include <string>
#include <vector>

#include "engine.hpp"
#include "xla/ffi/api/ffi.h"

namespace strata::handlers {

namespace ffi = xla::ffi;

inline ffi::Error ToError(const Status& s) {
  return s.empty() ? ffi::Error::Success() : ffi::Error::Internal("strata: " + s);
}

inline Engine* Lookup(int64_t id, Status* err) {
  Engine* e = FindEngine(id);
  if (!e)
    *err = "no engine with id " + std::to_string(id) +
           " (closed, or made in another process)";
  return e;
}

template <class Fn>
ffi::Error Guard(const char* call, Fn fn) {
  try {
    return ToError(fn());
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string("strata: ") + call + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string("strata: ") + call +
                                ": unknown exception");
  }
}

inline ffi::Error Begin(void* stream, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                        ffi::Result<ffi::AnyBuffer> ids, int64_t engine,
                        int32_t mode) {
  return Guard("begin_chunk", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    ChunkMode m;
    if (!ParseChunkMode(mode, &m))
      return "begin_chunk: mode " + std::to_string(mode) +
             " is not 0 (stream, frames), 1 (routed-only) or 2 (stream, packed)";
    if (ids->element_type() != ffi::DataType::S32)
      return "begin_chunk: the ids output must be int32";
    return e->Begin(m, stream, ids->untyped_data(),
                    static_cast<int64_t>(ids->size_bytes()));
  });
}

inline ffi::Error Publish(void* stream, ffi::AnyBuffer, ffi::AnyBuffer counts,
                          ffi::Result<ffi::AnyBuffer>, int64_t engine,
                          int32_t layer) {
  return Guard("publish", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    if (counts.element_type() != ffi::DataType::S32 ||
        counts.element_count() != static_cast<size_t>(e->options().n_experts))
      return "publish, layer " + std::to_string(layer) +
             ": counts must be int32[" +
             std::to_string(e->options().n_experts) + "]";
    return e->Publish(layer, counts.untyped_data(), stream);
  });
}

// fetch's piece attributes (engine.hpp, FetchPiece).
inline FetchPiece Piece(int32_t piece, int32_t pieces, int64_t row_begin,
                        int64_t row_end) {
  return FetchPiece{piece, pieces, row_begin, row_end};
}

// fetch and fetch_piece: into outputs of fetch's own. fetch_piece's outputs
// are its gate/up/down operands (aliased: the earlier pieces' rows stay).
inline ffi::Error Fetch(void* stream, ffi::AnyBuffer, ffi::AnyBuffer resident,
                        ffi::Result<ffi::AnyBuffer> gate,
                        ffi::Result<ffi::AnyBuffer> up,
                        ffi::Result<ffi::AnyBuffer> down,
                        ffi::Result<ffi::AnyBuffer>, int64_t engine,
                        int32_t layer, const FetchPiece& piece) {
  return Guard("fetch", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    void* const out[kParts] = {gate->untyped_data(), up->untyped_data(),
                               down->untyped_data()};
    const int64_t bytes[kParts] = {static_cast<int64_t>(gate->size_bytes()),
                                   static_cast<int64_t>(up->size_bytes()),
                                   static_cast<int64_t>(down->size_bytes())};
    return e->Fetch(layer, resident.untyped_data(),
                    static_cast<int64_t>(resident.size_bytes()), out, bytes,
                    stream, piece);
  });
}

inline ffi::Error FetchFrame(void* stream, ffi::AnyBuffer,
                             ffi::AnyBuffer resident, ffi::Result<ffi::AnyBuffer>,
                             int64_t engine, int32_t layer,
                             const FetchPiece& piece) {
  return Guard("fetch", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    return e->Fetch(layer, resident.untyped_data(),
                    static_cast<int64_t>(resident.size_bytes()), nullptr,
                    nullptr, stream, piece);
  });
}

// `after`: any output of the layer's expert math, so this runs after it.
inline ffi::Error Release(void* stream, ffi::AnyBuffer, ffi::AnyBuffer after,
                          ffi::Result<ffi::AnyBuffer>, int64_t engine,
                          int32_t layer) {
  (void)after;
  return Guard("release", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    return e->Release(layer, stream);
  });
}

inline ffi::Error End(void* stream, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> stats,
                      int64_t engine) {
  return Guard("end_chunk", [&]() -> Status {
    Status err;
    Engine* e = Lookup(engine, &err);
    if (!e) return err;
    const int64_t want = 2LL * e->options().n_layers * 4;
    if (static_cast<int64_t>(stats->size_bytes()) != want)
      return "end_chunk: stats output must be int32[" +
             std::to_string(e->options().n_layers) + ", 2]";
    std::vector<int32_t> host(static_cast<size_t>(2 * e->options().n_layers));
    return e->End(host.data(), stats->untyped_data(), stream);
  });
}

// Bindings: one .Arg/.Ret/.Attr per line. `b` is Ffi::Bind(), with the
// platform stream's .Ctx on CUDA.
template <class B>
auto BeginBinding(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Ret<ffi::AnyBuffer>()   // token
      .template Ret<ffi::AnyBuffer>()   // ids: int32[n], the next n staged
      .template Attr<int64_t>("engine")
      .template Attr<int32_t>("mode");
}
// publish (counts: int32[E]) and release (after: an output of the layer's
// expert math) take the same operands: (token, one array) -> token, on a
// layer.
using LayerCall = ffi::Error (*)(void*, ffi::AnyBuffer, ffi::AnyBuffer,
                                 ffi::Result<ffi::AnyBuffer>, int64_t, int32_t);
template <class B>
auto LayerCallBinding(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Arg<ffi::AnyBuffer>()   // the call's array
      .template Ret<ffi::AnyBuffer>()   // token
      .template Attr<int64_t>("engine")
      .template Attr<int32_t>("layer");
}
template <class B>
auto PieceAttrs(B b) {
  return std::move(b)
      .template Attr<int32_t>("piece")
      .template Attr<int32_t>("pieces")
      .template Attr<int64_t>("row_begin")
      .template Attr<int64_t>("row_end");
}
// fetch's and fetch_piece's results and attributes, after their operands.
template <class B>
auto FetchResults(B b) {
  return PieceAttrs(std::move(b)
      .template Ret<ffi::AnyBuffer>()   // gate: [E, H, I]
      .template Ret<ffi::AnyBuffer>()   // up: [E, H, I]
      .template Ret<ffi::AnyBuffer>()   // down: [E, I, H]
      .template Ret<ffi::AnyBuffer>()   // token
      .template Attr<int64_t>("engine")
      .template Attr<int32_t>("layer"));
}
template <class B>
auto FetchBinding(B b) {
  return FetchResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Arg<ffi::AnyBuffer>()); // resident: [R, blob] of the layer
}
// fetch_piece: fetch's later pieces, which add their rows to the outputs of
// the piece before (operands aliased to the results). `after` orders it after
// the piece before's expert math by a data dependency: through an
// optimization barrier on the token instead, XLA copied the aliased operands
// (a whole layer's weights) before each piece.
template <class B>
auto FetchPieceBinding(B b) {
  return FetchResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Arg<ffi::AnyBuffer>()   // resident: [R, blob] of the layer
      .template Arg<ffi::AnyBuffer>()   // gate so far (aliased to the result)
      .template Arg<ffi::AnyBuffer>()   // up so far
      .template Arg<ffi::AnyBuffer>()   // down so far
      .template Arg<ffi::AnyBuffer>()); // after: an output of the piece before's math
}
template <class B>
auto FetchFrameBinding(B b) {
  return PieceAttrs(std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Arg<ffi::AnyBuffer>()   // resident: [R, blob] of the layer
      .template Ret<ffi::AnyBuffer>()   // token
      .template Attr<int64_t>("engine")
      .template Attr<int32_t>("layer"));
}
template <class B>
auto EndBinding(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // token
      .template Ret<ffi::AnyBuffer>()   // stats: int32[L, 2] (copied, skipped)
      .template Attr<int64_t>("engine");
}

}  // namespace strata::handlers
