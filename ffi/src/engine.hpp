// The streaming engine behind the FFI handlers: configuration, the chunk
// protocol (begin / publish / fetch / end) and what both backends share.
//
// A backend supplies the link (how a ring entry is copied and how the
// consumer reads it) and publication (how a layer's counts reach the gate).
// Everything else — stream list, gate, walk state, the issuer thread's life,
// stats and trace lines — lives here once, so the CPU simulation exercises
// the same protocol the CUDA backend runs.
//
// Failure rule: an error anywhere in a chunk stops the walk, joins the issuer
// and leaves the engine ready for the next Begin. No thread outlives a failed
// chunk, and no handler throws across the FFI boundary.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/routed_stream.hpp"
#include "strata/worker.hpp"

namespace strata {

using Status = std::string;  // empty: ok; otherwise the message

enum class Backend : int32_t { kCpu = 0, kCuda = 1 };
// A chunk's mode (begin_chunk's and prestart's `mode`): streamed through the
// ring's layer frames, routed-only, or streamed through the packed ring. The
// ring's bytes are the same either way; a chunk chooses how it lays them out
// (StreamConfig.layout):
// - frames: one region per plane of the blob (EngineOptions' plane table),
//   each expert split into them as it crosses the link (strided copies, per
//   plane of a run), read in place where the model can (fetch_frame);
// - packed: whole blobs, slot s at s * blob_bytes, one copy per run of
//   adjacent experts on the link, which fetch splits into outputs of its own
//   on the device as each run lands. Fewer copies on the link, more work on
//   XLA's stream: the better layout where the link sets the pace.
// Routed-only chunks copy on XLA's stream straight into the frames.
enum class ChunkMode : int32_t { kStream = 0, kRoutedOnly = 1, kStreamPacked = 2 };
inline bool ParseChunkMode(int32_t v, ChunkMode* out) {
  if (v < 0 || v > 2) return false;
  *out = static_cast<ChunkMode>(v);
  return true;
}
inline bool Streams(ChunkMode m) { return m != ChunkMode::kRoutedOnly; }

// Bound to Python once, field for field, as strata_jax._native.EngineOptions
// (module.cc), which _native.Streamer takes whole; the defaults are these.
struct EngineOptions {
  int32_t backend = 0;
  int32_t n_layers = 0;
  int32_t n_experts = 0;
  int32_t routed = 0;
  int64_t blob_bytes = 0;
  int64_t ring = 0;  // slots: a whole number of layer frames of n_experts
  int32_t depth = kDefaultDepth;
  int32_t trace = 0;
  // Simulated link (CPU backend).
  double sim_bandwidth = 0.0;
  double sim_latency = 0.0;
  double sim_jitter = 0.0;
  uint64_t seed = 0;
  // CUDA backend: 1 = read the host store pinned (in place when it is packed
  // into pinned memory already, else copied into a pinned arena), falling back
  // to staging where pinning fails; 2 = stage through pinned bounce buffers
  // from the start (the fallback's path, which tests force).
  int32_t pin_mode = 1;
  int32_t device = 0;
  // CUDA backend: how a layer's routing reaches the gate. 0 = a host callback
  // (cudaLaunchHostFunc) on XLA's stream fills the row; 1 = an event recorded
  // after the counts' copy, polled by the issuer, which fills the row. The
  // default is StreamConfig's (publish="event").
  int32_t publish_mode = 1;
  // The plane table: each plane of an expert's blob (its gate, up and down
  // matrices, and their scales in a quantized format), in blob order: its
  // byte offset in the blob and its bytes. Ascending, not overlapping, within
  // blob_bytes, 1 to kMaxPlanes of them (ValidatePlanes).
  std::vector<int64_t> plane_offsets;
  std::vector<int64_t> plane_bytes;
};

// An expert's host blob is its planes (EngineOptions' plane table) at their
// offsets. A frames chunk holds each plane p in a region of its own,
// [ring, plane_bytes[p]], the regions back to back in the ring, each starting
// at a multiple of kPlaneAlign bytes; the planes are split out as they are
// copied in: `ring` slots are `ring / E` layer frames of E rows, a layer's
// expert e in row e of its frame, so each plane of a frame is one [E, ...]
// array of the layer, read where it landed.
inline constexpr int kMaxPlanes = 16;
inline constexpr int64_t kPlaneAlign = 256;

// An error naming what is wrong with `opt`'s plane table, or empty.
Status ValidatePlanes(const EngineOptions& opt);

// Where rows go: each plane's row of one expert (planes past the engine's
// count unused). Advance with Engine::At.
struct Rows {
  uint8_t* plane[kMaxPlanes];
};

// Per layer and chunk, as returned to Python.
struct LayerStats {
  int64_t streamed = 0;
  int64_t copied = 0;
  int64_t skipped = 0;
  int64_t bytes = 0;
};

// Which part of a layer one fetch readies (fetch's `piece`, `pieces`,
// `row_begin` and `row_end`). A layer fetched whole is piece 0 of 1. In
// pieces (streamed chunks only), the model runs the layer's expert math on the
// sorted rows [row_begin, row_end) after each piece's fetch: that fetch waits
// only for the copies of the experts with rows there (from the published
// routing counts; rows are sorted by expert id) and the pieces before it, and
// the last piece for the rest of the layer. Pieces come in order, all of them
// before the layer's release.
struct FetchPiece {
  int32_t piece = 0;
  int32_t pieces = 1;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// Fault injection for tests: at fetch of `layer`, fail (kError) or stop the
// walk as a cancellation would (kStop). Cleared after it fires once.
enum class Fault : int32_t { kNone = 0, kError = 1, kStop = 2 };

class Engine {
 public:
  explicit Engine(const EngineOptions& opt);
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Configuration, from Python, before the first chunk and between chunks.
  Status SetLayerStore(int layer, const uint8_t* host, int64_t bytes);
  Status SetPlan(const std::vector<StreamEntry>& stream,
                 const std::vector<std::vector<int32_t>>& resident);
  virtual Status Prepare() = 0;  // after the stores and plan are set

  // The chunk protocol, from the FFI handlers. `stream` is the platform
  // stream (cudaStream_t) or null on the CPU. Begin also hands the chunk its
  // token ids: the next `ids_bytes / 4` of those staged (StageIds) go to
  // `ids_out` on `stream` (none when ids_bytes is 0).
  Status Begin(ChunkMode mode, void* stream, void* ids_out = nullptr,
               int64_t ids_bytes = 0);
  // From the host, before the chunks are dispatched: appends their int32 ids
  // (each chunk's padded ids, start and length, in dispatch order) to the
  // staged queue; `reset` drops what is left in it first (only with no chunk
  // of this engine queued: a prefill's start, or after a failed one). Each
  // begin_chunk that asks for ids takes the next ones, in the order the
  // handlers run, which is the order the chunks were dispatched; one that
  // fails still uses its ids up, so the chunks after it keep theirs. They
  // reach the device as kernel arguments on XLA's stream, not as a copy: a
  // host-to-device copy queued on another stream while the walk's copies
  // stream waits for the copy stream's queue to drain.
  Status StageIds(const int32_t* ids, int64_t n, bool reset);
  // From the host, just before a prefill dispatches its first chunk, with no
  // chunk of this engine queued: runs that chunk's begin now, so the issuer
  // and the link start while the host is still launching the program,
  // before its begin_chunk runs. Until the program's own
  // begin_chunk adopts the walk (same mode), the walk holds itself to
  // kPrestartHold entries ahead of the copies landed, so that a copy another
  // stream queues meanwhile (a caller's; the prefill's own ids need none, see
  // StageIds) meets a shallow queue. A begin_chunk of another mode, and
  // Abort, drop it.
  Status Prestart(ChunkMode mode);
  Status Publish(int layer, const void* counts, void* stream);
  // Readies `layer`'s frame on `stream`: its resident experts copied in from
  // the cache, its skipped rows zeroed, its copies waited for. `out` and
  // `out_bytes`: null (the model reads the frame itself, FramePlanes), or one
  // output per plane, [E, plane_bytes[p]] each, to copy the frame into
  // (a packed chunk requires them: residents, zeros and the split of each
  // copied run go straight there).
  // Layers fetch in order, each after the one before released its frame.
  // `piece`: the part of the layer this call readies (FetchPiece).
  // `n_out`: the outputs given (n_planes() of them, else an error).
  Status Fetch(int layer, const void* resident, int64_t resident_bytes,
               void* const* out, const int64_t* out_bytes, int n_out,
               void* stream, const FetchPiece& piece = {});
  // After `layer`'s expert math on `stream`: its frame may take the layer
  // `frames()` later.
  Status Release(int layer, void* stream);
  Status End(int32_t* stats_host, void* stats_out, void* stream);

  // Stops and joins everything of the current chunk; the engine stays usable.
  // Not safe while a handler runs on another thread: see Cancel.
  void Abort();

  // Safe from any thread while handlers run: stops the current chunk's walk
  // (its next fetch fails) and makes every later begin_chunk fail until
  // Uncancel. The caller then waits for the chunks it queued to end (in
  // error) before Abort. Without it, a chunk queued behind the one being
  // aborted would reset the walk state under the abort.
  void Cancel() {
    cancelled_.store(true, std::memory_order_release);
    state_.RequestStop();
  }
  void Uncancel() { cancelled_.store(false, std::memory_order_release); }

  // Group members (several devices, RegisterGroup) count their programs'
  // chunks: every device runs every program of the group, so chunk n is the
  // same chunk on every member. A member whose chunk n failed stops chunk n
  // on the others (StopGroup): StopByPeer stops this engine's walk now where
  // chunk n is the one running, at its begin_chunk where it has not begun,
  // and not at all where it has ended; its next fetch fails naming `why`.
  // Safe from any thread.
  void StopByPeer(int64_t chunk, const std::string& why);
  // The begin_chunk handler of a group member: Enter before Begin (returns
  // the chunk's number, and forgets the last chunk's errors), Begun after it
  // (applies a peer's stop of the chunk that came before its begin).
  int64_t EnterProgramChunk();
  void BegunProgramChunk(int64_t chunk);
  // Drops peers' stops of chunks that have not begun (the host's abort: the
  // chunks it dispatched have all ended).
  void ClearPeerStops();
  int64_t program_chunks() const { return program_chunks_.load(); }
  // A group member's handlers defer their errors to end_chunk (handlers.hpp:
  // the program runs on, so every device reaches the same collectives): the
  // chunk's first error is kept here. Defer returns whether `s` is the first.
  bool Defer(const Status& s) {
    std::lock_guard<std::mutex> lock(group_mu_);
    if (!deferred_.empty()) return false;
    deferred_ = s;
    return true;
  }
  // The chunk's first deferred error (empty: none), for its end_chunk; kept
  // as last_error() until the next begin_chunk (EnterProgramChunk).
  Status TakeDeferred() {
    std::lock_guard<std::mutex> lock(group_mu_);
    Status s;
    s.swap(deferred_);
    if (!s.empty()) last_error_ = s;
    return s;
  }
  // The error a group member's last chunk ended with (its end_chunk's), or
  // empty: each device's own cause, where the program reports one of them.
  std::string last_error() {
    std::lock_guard<std::mutex> lock(group_mu_);
    return last_error_;
  }
  // The device ordinal this engine serves in its group (RegisterGroup), or
  // -1: not in a group. Set once, before any chunk; the trace lines name it.
  int32_t group_ordinal() const { return group_ordinal_.load(std::memory_order_acquire); }
  void JoinGroup(int32_t ordinal) { group_ordinal_.store(ordinal, std::memory_order_release); }
  // The last ended chunk's ring entries, copied and skipped (all layers).
  void LastTotals(int64_t out[3]) const {
    for (int i = 0; i < 3; ++i) out[i] = last_totals_[i];
  }

  void InjectFault(int layer, Fault fault) {
    fault_layer_ = layer;
    fault_.store(static_cast<int32_t>(fault));
  }
  bool WalkActive() const { return issuer_.busy(); }
  // The walk's hold: kPrestartHold from a Prestart until its program adopts
  // it, else 0.
  int64_t hold() const { return hold_.load(std::memory_order_acquire); }
  int64_t chunks() const { return chunks_; }
  // Device timing of the last finished chunk, where the backend keeps it:
  // out[0] = begin to end on the compute stream (a prestarted chunk's begin
  // is recorded on the copy stream, at the Prestart), out[1] = first copy
  // start to last copy end on the copy stream, out[2] = begin to the first
  // copy's start, out[3] = the last copy's end to end (1..3 are 0 when
  // nothing was copied), in ms.
  // Returns an error when unavailable (CPU backend, or the chunk's device
  // work has not finished).
  virtual Status Timing(double* out) const {
    (void)out;
    return "device timing is kept by the CUDA backend only";
  }
  // Host steady-clock seconds (CLOCK_MONOTONIC, Python's time.monotonic) at
  // which the last chunk began (its begin_chunk handler, or the Prestart its
  // program adopted) and its end_chunk handler ran.
  void HostTimes(double* out) const {
    out[0] = host_begin_;
    out[1] = host_end_;
  }
  const EngineOptions& options() const { return opt_; }
  int depth() const { return depth_; }
  // Layer frames in the ring, and the frame `layer` uses (-1: it fetches
  // nothing, a layer with no experts in the plan).
  int64_t frames() const {
    return opt_.n_experts > 0 ? opt_.ring / opt_.n_experts : 0;
  }
  int64_t frame_of(int layer) const {
    return layer >= 0 && layer < opt_.n_layers && ord_[layer] >= 0
               ? ord_[layer] % frames()
               : -1;
  }
  // The ring's plane regions after Prepare, plane p [ring, plane_bytes(p)]:
  // frame f's rows start at row f * n_experts.
  Rows FramePlanes() const { return SlotRows(0); }
  int n_planes() const { return static_cast<int>(opt_.plane_bytes.size()); }
  int64_t plane_bytes(int p) const { return opt_.plane_bytes[p]; }
  int64_t plane_offset(int p) const { return opt_.plane_offsets[p]; }
  // Bytes the ring needs: ring whole blobs (packed), or the plane regions
  // (frames), whichever is more.
  int64_t RingBytes() const { return ring_bytes_; }

 protected:
  // Backend hooks.
  virtual Status BackendBegin(ChunkMode mode, void* stream) = 0;
  virtual void StartWalk() = 0;  // runs IssueWalk on issuer_ (stream mode)
  virtual Status BackendPublish(int layer, const void* counts,
                                void* stream) = 0;
  // Orders `stream` after entry k's copy into `slot` and every copy issued
  // before it (the link copies in order).
  virtual Status WaitCopied(int64_t k, int64_t slot, void* stream) = 0;
  // `layer` (entries k0..k1-1) is done with `frame` once `stream` has run
  // what is queued on it: the link may write the frame after that.
  virtual Status ReleaseFrame(int layer, int64_t frame, int64_t k0,
                              int64_t k1, void* stream) = 0;
  // Copies n rows of each plane from `src` to `dst` (device to device).
  virtual Status CopyRows(const Rows& src, int64_t n, const Rows& dst,
                          void* stream) = 0;
  // The ring's memory (ring * blob_bytes), null before Prepare made it.
  virtual uint8_t* RingBase() const = 0;
  // Copies experts expert..expert+n-1 of `layer` straight from the host store
  // into `dst` (routed-only).
  virtual Status CopyDirect(int layer, int expert, int64_t n, const Rows& dst,
                            void* stream) = 0;
  // Splits n packed blobs (blob bytes apart) at `src`, on the device (the
  // resident cache, or the packed ring), into the n rows at `dst` of each
  // plane.
  virtual Status CopyResident(const uint8_t* src, int64_t n, const Rows& dst,
                              void* stream) = 0;
  // Zero-fills n rows of each plane at `dst` (experts no token reads).
  virtual Status ZeroRows(const Rows& dst, int64_t n, void* stream) = 0;
  // Writes `bytes` of int32 from host memory (which may die on return) into
  // `out`, on `stream`: the chunk's stats (End) and its token ids (Begin).
  virtual Status WriteInts(const int32_t* host, void* out, int64_t bytes,
                           void* stream) = 0;
  // The chunk's last device work is queued on `stream` (after WriteInts).
  virtual Status BackendEnd(void* stream) {
    (void)stream;
    return {};
  }
  // Waits until layer's routing is in the gate (routed-only fetch).
  virtual Status WaitPublished(int layer) = 0;
  virtual void BackendAbort() = 0;
  virtual std::string Describe() const = 0;

  // This chunk lays its copies out in the packed ring (else in frames).
  bool packed() const { return mode_ == ChunkMode::kStreamPacked; }
  // Byte offset of plane p's region ([ring, plane_bytes(p)]) in the ring.
  int64_t PlaneRegion(int p) const { return region_[p]; }
  // Ring slot `slot` in a frames chunk: its row in each plane's region. All
  // null before Prepare.
  Rows SlotRows(int64_t slot) const {
    Rows r{};
    if (uint8_t* base = RingBase())
      for (int p = 0; p < n_planes(); ++p)
        r.plane[p] = base + region_[p] + slot * plane_bytes(p);
    return r;
  }
  // Ring slot `slot` in a packed chunk: its whole blob.
  uint8_t* PackedSlot(int64_t slot) const {
    return RingBase() + slot * opt_.blob_bytes;
  }
  // `base` advanced by `expert` rows.
  Rows At(const Rows& base, int64_t expert) const {
    Rows r = base;
    for (int p = 0; p < n_planes(); ++p) r.plane[p] += expert * plane_bytes(p);
    return r;
  }
  const uint8_t* HostBlob(int layer, int expert) const {
    return stores_[layer] + static_cast<int64_t>(expert) * opt_.blob_bytes;
  }
  // The walk's rules for this engine; `poll` is how often the backend's
  // unnotified conditions (a CUDA event landing) are re-read.
  WalkConfig MakeWalkConfig(std::chrono::microseconds poll) const {
    WalkConfig cfg;
    cfg.ring = opt_.ring;
    cfg.depth = depth_;
    cfg.routed = opt_.routed != 0;
    cfg.poll = poll;
    cfg.hold = &hold_;
    cfg.slot_of = &slot_of_;
    cfg.need = &need_;
    return cfg;
  }
  // Entries a prestarted walk may run ahead of its landed copies before the
  // program adopts it: two of the CUDA link's longest runs, so the link stays
  // busy (one run lands while the next is queued) and another stream's copy
  // waits behind at most about 300 MB (5.4 ms at 55 GB/s) for Qwen3-30B.
  static constexpr int64_t kPrestartHold = 32;
  // Begin's work for a program (`prestart` false) or for Prestart (true: the
  // walk starts held, and `stream` is null).
  Status BeginChunk(ChunkMode mode, void* stream, bool prestart);
  // Begin without the ids: adopts a prestarted walk or begins the chunk.
  Status BeginOrAdopt(ChunkMode mode, void* stream);
  // Begin's ids: the next staged ones into `out`; on any failure the ids are
  // used up all the same.
  Status HandOutIds(void* out, int64_t bytes, void* stream);
  // The next n staged ids are used up unread (a begin_chunk that failed).
  void SkipIds(int64_t n);
  // Both backends' Prepare: every layer that streams experts has a store.
  Status CheckStores() const;
  void JoinIssuer();
  Status Fail(Status s);  // aborts the chunk and returns s

  EngineOptions opt_;
  int depth_ = kDefaultDepth;
  // Each plane's region in a frames ring (PlaneRegion), and the ring's bytes.
  std::vector<int64_t> region_;
  int64_t ring_bytes_ = 0;
  std::vector<const uint8_t*> stores_;         // per layer [E, blob]
  std::vector<StreamEntry> stream_;            // the chunk's stream list
  std::vector<int64_t> layer_begin_;           // first entry of each layer
  std::vector<std::vector<int32_t>> resident_; // per layer: resident experts
  // Layer frames (SetPlan): per layer, its place among the layers that fetch
  // (-1: none); per entry, its slot and how many layers must have released
  // their frames before it is copied (WalkConfig::need).
  std::vector<int64_t> ord_;
  std::vector<int64_t> slot_of_;
  std::vector<int64_t> need_;
  int64_t n_fetch_layers_ = 0;          // layers with an ord_
  // Per (layer, expert): its entry in stream_, or -1 (resident, or not in
  // the plan).
  std::vector<int64_t> entry_of_;
  // The layer being fetched in pieces (-1: none), its piece count, the next
  // piece and the first entry that piece has not read yet.
  int piece_layer_ = -1;
  int32_t piece_count_ = 0, piece_next_ = 0;
  int64_t piece_k_ = 0;
  // A packed chunk's fetch splits copied blobs into its outputs (and a frames
  // chunk with outputs copies rows out) in runs of at most this many experts,
  // each as soon as it lands, so that the split of a layer does not all wait
  // for its last copy and run in the chunk's tail.
  static constexpr int64_t kSplitRun = 8;
  int64_t fetched_ = 0, released_ = 0;  // layers, this chunk
  RouteGate gate_;
  WalkState state_;
  Worker issuer_{"strata-issuer"};  // runs each chunk's walk
  WalkResult walk_result_;  // the issuer's, read after it is joined
  std::atomic<bool> walk_failed_{false};
  std::string walk_error_;

  bool in_chunk_ = false;
  bool prepared_ = false;
  ChunkMode mode_ = ChunkMode::kStream;
  std::vector<LayerStats> stats_;
  int64_t chunks_ = 0;
  double host_begin_ = 0.0, host_end_ = 0.0;
  std::atomic<int32_t> fault_{0};
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> prestarted_{false};  // a Prestart not yet adopted
  std::atomic<int64_t> hold_{0};         // the walk's hold (WalkConfig::hold)
  int fault_layer_ = -1;
  std::mutex ids_mu_;           // StageIds (host thread) vs Begin (XLA's)
  std::vector<int32_t> ids_;    // staged ids, under ids_mu_
  int64_t ids_next_ = 0;        // the next one to take, under ids_mu_
  static std::atomic<bool> depth_line_printed_;
  // Group members (StopByPeer, Defer), under group_mu_: the reason a peer
  // stopped this chunk's walk, peers' stops of chunks not begun yet (by
  // number), the chunk's first deferred error and the last chunk's; the
  // program chunks entered (begin_chunk handlers run, whether they began
  // well or not) and begun.
  std::mutex group_mu_;
  std::string peer_stop_;
  std::map<int64_t, std::string> peer_stops_ahead_;
  Status deferred_;
  std::string last_error_;
  std::atomic<int64_t> program_chunks_{0};
  int64_t begun_chunk_ = 0;
  std::atomic<int32_t> group_ordinal_{-1};
  int64_t last_totals_[3] = {0, 0, 0};
  // "the walk was stopped", with the peer's reason where a peer stopped it.
  std::string StoppedMessage();

 private:
  // Fetch's steps, in the order it runs them. Each takes `where`, the prefix
  // of its messages, and fails the chunk (Fail) on an error it returns, but
  // for a fetch outside a chunk, which has no chunk to fail.

  // Where one fetch writes: `frame`, the layer's frame; `base`, where its rows
  // go (the frame, or a packed chunk's outputs); `outs`, the outputs (null
  // planes without them); `copy_out`, whether a frames chunk with outputs
  // copies its rows out run by run (fetched in pieces).
  struct FetchRows {
    Rows frame;
    Rows base;
    Rows outs;
    bool copy_out;
  };
  // Checks the call against the chunk, the model, the plan and the pieces
  // fetched before it, and the resident operand's size.
  Status CheckFetch(const std::string& where, int layer, int64_t resident_bytes,
                    void* const* out, const int64_t* out_bytes, int n_out,
                    const FetchPiece& piece);
  // Fires a fault injected for this layer, then fails the fetch of a stopped
  // walk, and that of a packed chunk without outputs.
  Status CheckFetchMayRun(const std::string& where, int layer, void* const* out,
                          const FetchPiece& piece);
  // Where the fetch of the layer `o`-th among those that fetch writes (its
  // frame is o % frames()).
  FetchRows FetchTargets(int64_t o, void* const* out, bool whole) const;
  // Piece 0: the layer's resident experts from `resident` into their rows
  // (copied out too where `copy_out`).
  Status CopyResidentRows(const std::string& where, int layer,
                          const void* resident, const FetchRows& rows,
                          void* stream);
  // The end (exclusive) of the entries this piece reads, into `k_end`.
  Status PieceEntries(const std::string& where, int layer,
                      const FetchPiece& piece, int64_t* k_end);
  // Whether entry b's expert is entry a's plus b - a: the two are in one run
  // of adjacent experts (the callers keep them in one layer).
  bool AdjacentEntries(int64_t a, int64_t b) const;
  // A streamed chunk: waits for the walk to issue entries piece_k_..k_end-1,
  // then readies their rows run by run: copied runs split (packed) or copied
  // out (frames with outputs, in pieces) as each lands, else one wait on the
  // piece's last copy; skipped runs zeroed.
  Status ReadStreamed(const std::string& where, int layer, int64_t k_end,
                      const FetchRows& rows, void* stream);
  // A routed-only chunk: waits for the layer's routing, then copies its routed
  // experts straight from the host store into `base` and zeroes the rest.
  Status ReadRoutedOnly(const std::string& where, int layer, const Rows& base,
                        void* stream);
};

std::unique_ptr<Engine> MakeCpuEngine(const EngineOptions& opt, Status* err);
// Defined only in builds with CUDA; otherwise returns null with a message.
std::unique_ptr<Engine> MakeCudaEngine(const EngineOptions& opt, Status* err);

// Process-wide registry: FFI attributes carry an engine id, the smallest one free (a
// closed engine's id is taken again by the next engine made: engine.cc, FreeIdLocked).
int64_t RegisterEngine(std::unique_ptr<Engine> engine);
Engine* FindEngine(int64_t id);
bool DestroyEngine(int64_t id);

// Engine groups: several devices, one engine each (its own host store, ring,
// link, issuer and gate). A group has an id of its own, among the engines'
// ids, which the FFI calls of a program run on every device carry (under
// shard_map one custom call runs once per device); each call reaches the
// member of the device it runs on, by the device ordinal in XLA's FFI call
// context. `ordinals[i]` is engine `engines[i]`'s device. The members must
// agree on layers, experts and blob bytes (one program's shapes serve all).
// Returns the group's id, or 0 with `err`.
int64_t RegisterGroup(const std::vector<int64_t>& engines,
                      const std::vector<int32_t>& ordinals, std::string* err);
bool DestroyGroup(int64_t id);
// The engine an FFI call with attribute `id` reaches on device `ordinal`:
// engine `id` itself, whatever the device (one engine, as before groups), or
// group `id`'s member on that device (`grouped` true). Null with `why`.
Engine* FindEngineOn(int64_t id, int32_t ordinal, bool* grouped, std::string* why);
// Stops program chunk `chunk` (Engine::StopByPeer) on every member of group
// `id` but the one on `ordinal`, whose chunk failed with `why`.
void StopGroup(int64_t id, int32_t ordinal, int64_t chunk, const std::string& why);
// Member `ordinal` of group `id` ended its `chunk`-th program chunk with
// `totals` (ring entries, copied, skipped): once every member has, the group's
// summed trace line is printed (trace on).
void GroupChunkEnded(int64_t id, int32_t ordinal, int64_t chunk,
                     const int64_t totals[3]);

}  // namespace strata
