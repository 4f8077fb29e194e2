// XLA FFI handlers of the streaming engine: begin_chunk, publish, fetch (into
// outputs of its own, with fetch_piece for a layer's later pieces, or
// fetch_frame: the model reads the ring's frame), release and end_chunk; and
// dense_fetch / dense_wait, a layer's own weights from pinned host memory
// (dense_copy.hpp), which need no engine.
//
// One handler per target, templated on the platform `P`; handlers_cpu.cc and
// handlers_cuda.cc each define their platform and its seven handlers with
// STRATA_DEFINE_HANDLERS, which the module hands to Python by target
// (module.cc, `registrations()`). A platform names the execution context the
// call's first parameter decodes from (`P::StreamCtx`, a type for
// Ffi::Bind().Ctx<>): XLA's stream on CUDA, null on the CPU, which the engine
// takes as a void*; and its dense copies (`P::DenseCopy`, `P::DenseWait`).
//
// Each call's attributes decode into one struct (BeginAttrs, LayerAttrs,
// FetchAttrs, EndAttrs), by name: the names and integer widths below are the
// ones strata_jax/stream/ops.py writes, and a call must carry exactly its
// struct's attributes.
//
// Every call also decodes the device ordinal it runs on (XLA's FFI call
// context, set on the CPU and the GPU alike): a call whose `engine` attribute
// names an engine group reaches that group's engine of its device (several
// devices, one custom call under shard_map; engine.hpp, RegisterGroup).
//
// Every engine error comes back as an ffi::Error naming the call and the
// layer (a group member's at its chunk's end_chunk); nothing throws across
// the FFI boundary.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "xla/ffi/api/ffi.h"

namespace strata::handlers {

namespace ffi = xla::ffi;

// One platform's handler of one target; `target` is a key of
// strata_jax/native.py's TARGETS ("begin", "publish", ...).
struct Registration {
  const char* target;
  XLA_FFI_Handler* handler;
};
using Registrations = std::array<Registration, 9>;

// The handlers of platform "cpu" (handlers_cpu.cc) and, in a CUDA build, of
// platform "CUDA" (handlers_cuda.cc).
Registrations CpuRegistrations();
Registrations CudaRegistrations();

// begin_chunk's attributes. `mode`: ChunkMode.
struct BeginAttrs {
  int64_t engine;
  int32_t mode;
};

// publish's and release's attributes.
struct LayerAttrs {
  int64_t engine;
  int32_t layer;
};

// fetch's, fetch_piece's and fetch_frame's attributes: the layer and the
// piece of it the call readies (FetchPiece).
struct FetchAttrs {
  int64_t engine;
  int32_t layer;
  int32_t piece;
  int32_t pieces;
  int64_t row_begin;
  int64_t row_end;

  FetchPiece Piece() const { return FetchPiece{piece, pieces, row_begin, row_end}; }
};

// end_chunk's attributes.
struct EndAttrs {
  int64_t engine;
};

}  // namespace strata::handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::strata::handlers::BeginAttrs,
    ::xla::ffi::StructMember<int64_t>("engine"),
    ::xla::ffi::StructMember<int32_t>("mode"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::strata::handlers::LayerAttrs,
    ::xla::ffi::StructMember<int64_t>("engine"),
    ::xla::ffi::StructMember<int32_t>("layer"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::strata::handlers::FetchAttrs,
    ::xla::ffi::StructMember<int64_t>("engine"),
    ::xla::ffi::StructMember<int32_t>("layer"),
    ::xla::ffi::StructMember<int32_t>("piece"),
    ::xla::ffi::StructMember<int32_t>("pieces"),
    ::xla::ffi::StructMember<int64_t>("row_begin"),
    ::xla::ffi::StructMember<int64_t>("row_end"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::strata::handlers::EndAttrs,
    ::xla::ffi::StructMember<int64_t>("engine"));

namespace strata::handlers {

using Buffer = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

// A group member's call (`id` names a group, FindEngineOn): `s` is what the
// engine answered. Its errors are deferred to the chunk's end_chunk, which
// fails with the chunk's first: the program runs on (a failed chunk's later
// calls answer at once, and its outputs are not read), so that every device
// of the mesh reaches the same collectives and ends its program; a device
// whose call failed while another waited in a collective for it would hang
// both. The first error also stops every other member's walk, whose next
// fetch then fails (deferred likewise), or, where it has not begun the chunk,
// its begin_chunk's (Engine::StopByPeer). begin_chunk starts a chunk afresh.
inline ffi::Error GroupAnswer(const char* call, int64_t id, int32_t ordinal, Engine* e,
                              Status s) {
  const bool end = std::string(call) == "end_chunk";
  if (!s.empty()) {
    s = "device " + std::to_string(ordinal) + ": " + s;
    if (e->Defer(s)) StopGroup(id, ordinal, e->program_chunks(), s);
  }
  if (!end) return ffi::Error::Success();
  s = e->TakeDeferred();
  if (!s.empty()) return ffi::Error::Internal("strata: " + s);
  int64_t totals[3];
  e->LastTotals(totals);
  GroupChunkEnded(id, ordinal, e->program_chunks(), totals);
  return ffi::Error::Success();
}

// Runs `fn(Engine*)` for the engine that attribute `id` names on device
// `ordinal` (FindEngineOn: engine `id`, or group `id`'s member there): a
// missing engine, an engine error and an exception all become an ffi::Error
// naming `call`; a group member's errors wait for end_chunk (GroupAnswer).
template <class Fn>
ffi::Error WithEngine(const char* call, int64_t id, int32_t ordinal, Fn fn) {
  Engine* e = nullptr;
  bool grouped = false;
  int64_t chunk = 0;  // a group member's begin_chunk: the chunk's number
  try {
    std::string why;
    e = FindEngineOn(id, ordinal, &grouped, &why);
    if (!e) return ffi::Error::Internal("strata: " + why);
    if (grouped && std::string(call) == "begin_chunk") chunk = e->EnterProgramChunk();
    const Status s = fn(e);
    if (chunk) e->BegunProgramChunk(chunk);
    if (grouped) return GroupAnswer(call, id, ordinal, e, s);
    return s.empty() ? ffi::Error::Success() : ffi::Error::Internal("strata: " + s);
  } catch (const std::exception& ex) {
    const std::string s = std::string(call) + ": " + ex.what();
    if (chunk) e->BegunProgramChunk(chunk);
    if (grouped && e) return GroupAnswer(call, id, ordinal, e, s);
    return ffi::Error::Internal("strata: " + s);
  } catch (...) {
    const std::string s = std::string(call) + ": unknown exception";
    if (chunk) e->BegunProgramChunk(chunk);
    if (grouped && e) return GroupAnswer(call, id, ordinal, e, s);
    return ffi::Error::Internal("strata: " + s);
  }
}

template <class P>
struct Handlers {
  // The handlers' first parameter: what P::StreamCtx decodes to.
  using Stream = typename ffi::CtxDecoding<typename P::StreamCtx>::Type;

  static void* Queue(Stream stream) { return static_cast<void*>(stream); }

  static ffi::Error Begin(Stream stream, int32_t ordinal, Buffer, Out, Out ids, BeginAttrs a) {
    return WithEngine("begin_chunk", a.engine, ordinal, [&](Engine* e) -> Status {
      ChunkMode m;
      if (!ParseChunkMode(a.mode, &m))
        return "begin_chunk: mode " + std::to_string(a.mode) +
               " is not 0 (stream, frames), 1 (routed-only) or 2 (stream, packed)";
      if (ids->element_type() != ffi::DataType::S32)
        return "begin_chunk: the ids output must be int32";
      return e->Begin(m, Queue(stream), ids->untyped_data(),
                      static_cast<int64_t>(ids->size_bytes()));
    });
  }

  static ffi::Error Publish(Stream stream, int32_t ordinal, Buffer, Buffer counts, Out,
                            LayerAttrs a) {
    return WithEngine("publish", a.engine, ordinal, [&](Engine* e) -> Status {
      if (counts.element_type() != ffi::DataType::S32 ||
          counts.element_count() != static_cast<size_t>(e->options().n_experts))
        return "publish, layer " + std::to_string(a.layer) +
               ": counts must be int32[" +
               std::to_string(e->options().n_experts) + "]";
      return e->Publish(a.layer, counts.untyped_data(), Queue(stream));
    });
  }

  // fetch: the layer's frame copied into outputs of fetch's own, one per
  // plane of the engine's plane table, then the token (`rets`).
  static ffi::Error Fetch(Stream stream, int32_t ordinal, Buffer, Buffer resident,
                          ffi::RemainingRets rets, FetchAttrs a) {
    return WithEngine("fetch", a.engine, ordinal, [&](Engine* e) -> Status {
      return FetchInto(e, stream, resident, rets, a);
    });
  }

  // fetch_piece: a later piece of fetch. The planes so far and `after` (the
  // last of `args`) only order the call: fetch writes the outputs, which XLA
  // aliases to them.
  static ffi::Error FetchPiece(Stream stream, int32_t ordinal, Buffer, Buffer resident,
                               ffi::RemainingArgs args, ffi::RemainingRets rets,
                               FetchAttrs a) {
    return WithEngine("fetch", a.engine, ordinal, [&](Engine* e) -> Status {
      if (args.size() != rets.size())
        return "fetch, layer " + std::to_string(a.layer) + ": fetch_piece takes " +
               std::to_string(args.size() - (args.size() > 0)) +
               " planes so far and `after`, and returns " +
               std::to_string(rets.size() - (rets.size() > 0)) +
               " planes and the token: one plane so far per plane returned";
      return FetchInto(e, stream, resident, rets, a);
    });
  }

  // fetch's and fetch_piece's work: `rets` is the planes, then the token.
  static Status FetchInto(Engine* e, Stream stream, const Buffer& resident,
                          const ffi::RemainingRets& rets, const FetchAttrs& a) {
    const std::string where = "fetch, layer " + std::to_string(a.layer) + ": ";
    const size_t n = rets.size() > 0 ? rets.size() - 1 : 0;  // the last is the token
    if (n < 1 || n > static_cast<size_t>(kMaxPlanes))
      return where + std::to_string(rets.size()) +
             " results; fetch returns one per plane (1 to " +
             std::to_string(kMaxPlanes) + "), then the token";
    void* out[kMaxPlanes];
    int64_t bytes[kMaxPlanes];
    for (size_t p = 0; p < n; ++p) {
      auto r = rets.get<Buffer>(p);
      if (r.has_error())
        return where + "plane " + std::to_string(p) + " output: " + r.error().message();
      out[p] = r.value()->untyped_data();
      bytes[p] = static_cast<int64_t>(r.value()->size_bytes());
    }
    return e->Fetch(a.layer, resident.untyped_data(),
                    static_cast<int64_t>(resident.size_bytes()), out, bytes,
                    static_cast<int>(n), Queue(stream), a.Piece());
  }

  // fetch_frame: the layer's frame readied in the ring, where the model reads it.
  static ffi::Error FetchFrame(Stream stream, int32_t ordinal, Buffer, Buffer resident, Out,
                               FetchAttrs a) {
    return WithEngine("fetch", a.engine, ordinal, [&](Engine* e) -> Status {
      return e->Fetch(a.layer, resident.untyped_data(),
                      static_cast<int64_t>(resident.size_bytes()), nullptr,
                      nullptr, 0, Queue(stream), a.Piece());
    });
  }

  // `after`: any output of the layer's expert math, so this runs after it.
  static ffi::Error Release(Stream stream, int32_t ordinal, Buffer, Buffer after, Out,
                            LayerAttrs a) {
    (void)after;
    return WithEngine("release", a.engine, ordinal, [&](Engine* e) -> Status {
      return e->Release(a.layer, Queue(stream));
    });
  }

  static ffi::Error End(Stream stream, int32_t ordinal, Buffer, Out stats, EndAttrs a) {
    return WithEngine("end_chunk", a.engine, ordinal, [&](Engine* e) -> Status {
      const int64_t want = 2LL * e->options().n_layers * 4;
      if (static_cast<int64_t>(stats->size_bytes()) != want)
        return "end_chunk: stats output must be int32[" +
               std::to_string(e->options().n_layers) + ", 2]";
      std::vector<int32_t> host(static_cast<size_t>(2 * e->options().n_layers));
      return e->End(host.data(), stats->untyped_data(), Queue(stream));
    });
  }

  // dense_fetch: the results (a layer's own weights) copied from the host
  // addresses `src`, one per result, after `after` (dense_copy.hpp).
  static ffi::Error DenseFetch(Stream stream, int32_t ordinal, Buffer after,
                               ffi::RemainingRets rets, int64_t key,
                               ffi::Span<const int64_t> src) {
    (void)after;
    const std::string where = "strata: dense_fetch of key " + std::to_string(key) + ": ";
    if (rets.size() != src.size())
      return ffi::Error::InvalidArgument(where + std::to_string(rets.size()) + " results, " +
                                         std::to_string(src.size()) +
                                         " source addresses: one per result");
    const size_t n = rets.size();
    std::vector<void*> dst(n);
    std::vector<int64_t> bytes(n);
    for (size_t i = 0; i < n; ++i) {
      auto r = rets.get<Buffer>(i);
      if (r.has_error())
        return ffi::Error::Internal(where + "result " + std::to_string(i) + ": " +
                                    r.error().message());
      dst[i] = r.value()->untyped_data();
      bytes[i] = static_cast<int64_t>(r.value()->size_bytes());
      if (src[i] == 0 && bytes[i] > 0)
        return ffi::Error::InvalidArgument(where + "result " + std::to_string(i) +
                                           " has a null source address");
    }
    try {
      const Status s = P::DenseCopy(Queue(stream), ordinal, key, src.begin(), dst.data(),
                                    bytes.data(), static_cast<int>(n));
      return s.empty() ? ffi::Error::Success() : ffi::Error::Internal("strata: " + s);
    } catch (const std::exception& ex) {
      return ffi::Error::Internal(where + ex.what());
    }
  }

  // dense_wait: XLA's stream waits for dense_fetch's copies of `key`. The
  // operands are the fetched arrays (aliased to the results), then `after`.
  static ffi::Error DenseWait(Stream stream, int32_t ordinal, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, int64_t key) {
    if (args.size() != rets.size() + 1)
      return ffi::Error::InvalidArgument(
          "strata: dense_wait of key " + std::to_string(key) + ": " +
          std::to_string(args.size()) + " operands, " + std::to_string(rets.size()) +
          " results: the fetched arrays (aliased to the results), then `after`");
    try {
      const Status s = P::DenseWait(Queue(stream), ordinal, key);
      return s.empty() ? ffi::Error::Success() : ffi::Error::Internal("strata: " + s);
    } catch (const std::exception& ex) {
      return ffi::Error::Internal(std::string("strata: dense_wait: ") + ex.what());
    }
  }

  // Bindings: the platform's context and the device ordinal, then one
  // .Arg/.Ret per line in the handler's order, then the call's attribute
  // struct.
  static auto Bind() {
    return ffi::Ffi::Bind()
        .template Ctx<typename P::StreamCtx>()
        .template Ctx<ffi::DeviceOrdinal>();  // the device the call runs on
  }
  static auto BeginBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Ret<Buffer>()   // token
        .template Ret<Buffer>()   // ids: int32[n], the next n staged
        .template Attrs<BeginAttrs>();
  }
  // publish (counts: int32[E]) and release (after: an output of the layer's
  // expert math): (token, one array) -> token, on a layer.
  static auto LayerBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Arg<Buffer>()   // the call's array
        .template Ret<Buffer>()   // token
        .template Attrs<LayerAttrs>();
  }
  static auto FetchBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Arg<Buffer>()   // resident: uint8 [R, blob] of the layer
        .RemainingRets()          // each plane [E, *plane shape], then the token
        .template Attrs<FetchAttrs>();
  }
  // fetch_piece: fetch's later pieces, which add their rows to the outputs of
  // the piece before (operands aliased to the results). `after` orders it
  // after the piece before's expert math by a data dependency: through an
  // optimization barrier on the token instead, XLA copied the aliased
  // operands (a whole layer's weights) before each piece.
  static auto FetchPieceBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Arg<Buffer>()   // resident: uint8 [R, blob] of the layer
        .RemainingArgs()          // each plane so far (aliased to its result),
                                  // then after: an output of the piece before's math
        .RemainingRets()          // each plane [E, *plane shape], then the token
        .template Attrs<FetchAttrs>();
  }
  static auto FetchFrameBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Arg<Buffer>()   // resident: uint8 [R, blob] of the layer
        .template Ret<Buffer>()   // token
        .template Attrs<FetchAttrs>();
  }
  static auto DenseFetchBinding() {
    return Bind()
        .template Arg<Buffer>()   // after: orders the copies after it
        .RemainingRets()          // the layer's arrays
        .template Attr<int64_t>("key")
        .template Attr<ffi::Span<const int64_t>>("src");
  }
  static auto DenseWaitBinding() {
    return Bind()
        .RemainingArgs()          // the fetched arrays (aliased), then after
        .RemainingRets()          // the same arrays
        .template Attr<int64_t>("key");
  }
  static auto EndBinding() {
    return Bind()
        .template Arg<Buffer>()   // token
        .template Ret<Buffer>()   // stats: int32[L, 2] (copied, skipped)
        .template Attrs<EndAttrs>();
  }
};

}  // namespace strata::handlers

// Defines the nine handlers of platform `P` as C functions
// Strata<Target><Suffix> (StrataBeginCpu, ...) and `<Suffix>Registrations()`,
// which lists them by target.
#define STRATA_DEFINE_HANDLERS(Suffix, P)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataBegin##Suffix,                            \
                                ::strata::handlers::Handlers<P>::Begin,         \
                                ::strata::handlers::Handlers<P>::BeginBinding()); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataPublish##Suffix,                          \
                                ::strata::handlers::Handlers<P>::Publish,       \
                                ::strata::handlers::Handlers<P>::LayerBinding()); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataFetch##Suffix,                            \
                                ::strata::handlers::Handlers<P>::Fetch,         \
                                ::strata::handlers::Handlers<P>::FetchBinding()); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                \
      StrataFetchPiece##Suffix, ::strata::handlers::Handlers<P>::FetchPiece,    \
      ::strata::handlers::Handlers<P>::FetchPieceBinding());                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                \
      StrataFetchFrame##Suffix, ::strata::handlers::Handlers<P>::FetchFrame,    \
      ::strata::handlers::Handlers<P>::FetchFrameBinding());                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRelease##Suffix,                          \
                                ::strata::handlers::Handlers<P>::Release,       \
                                ::strata::handlers::Handlers<P>::LayerBinding()); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataEnd##Suffix,                              \
                                ::strata::handlers::Handlers<P>::End,           \
                                ::strata::handlers::Handlers<P>::EndBinding()); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                \
      StrataDenseFetch##Suffix, ::strata::handlers::Handlers<P>::DenseFetch,    \
      ::strata::handlers::Handlers<P>::DenseFetchBinding());                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                \
      StrataDenseWait##Suffix, ::strata::handlers::Handlers<P>::DenseWait,      \
      ::strata::handlers::Handlers<P>::DenseWaitBinding());                     \
  ::strata::handlers::Registrations strata::handlers::Suffix##Registrations() { \
    return {{{"begin", StrataBegin##Suffix},                                    \
             {"publish", StrataPublish##Suffix},                                \
             {"fetch", StrataFetch##Suffix},                                    \
             {"fetch_piece", StrataFetchPiece##Suffix},                         \
             {"fetch_frame", StrataFetchFrame##Suffix},                         \
             {"release", StrataRelease##Suffix},                                \
             {"end", StrataEnd##Suffix},                                        \
             {"dense_fetch", StrataDenseFetch##Suffix},                         \
             {"dense_wait", StrataDenseWait##Suffix}}};                         \
  }
