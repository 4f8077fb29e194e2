// The backend-independent half of the streaming engine (see engine.hpp).
#include "engine.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include <pthread.h>
#include <unistd.h>

namespace strata {

std::atomic<bool> Engine::depth_line_printed_{false};

Status ValidatePlanes(const EngineOptions& opt) {
  const size_t n = opt.plane_bytes.size();
  if (opt.plane_offsets.size() != n)
    return "plane table: " + std::to_string(opt.plane_offsets.size()) +
           " plane offsets for " + std::to_string(n) +
           " plane sizes (one offset and one size per plane)";
  if (n < 1 || n > static_cast<size_t>(kMaxPlanes))
    return "plane table of " + std::to_string(n) + " planes: an expert blob has 1 to " +
           std::to_string(kMaxPlanes);
  int64_t end = 0;  // of the plane before
  for (size_t p = 0; p < n; ++p) {
    const int64_t o = opt.plane_offsets[p], b = opt.plane_bytes[p];
    const std::string name = "plane " + std::to_string(p);
    if (b < 1) return name + " has " + std::to_string(b) + " bytes; a plane needs at least one";
    if (o < end)
      return name + " starts at byte " + std::to_string(o) +
             (p == 0 ? std::string(", before the blob")
                     : ", inside plane " + std::to_string(p - 1) + " (which ends at " +
                           std::to_string(end) +
                           "): planes are in blob order and do not overlap");
    if (b > opt.blob_bytes - o)
      return name + " (bytes " + std::to_string(o) + ".." + std::to_string(o + b) +
             ") passes the end of the " + std::to_string(opt.blob_bytes) + "-byte blob";
    end = o + b;
  }
  return {};
}

Engine::Engine(const EngineOptions& opt) : opt_(opt) {
  depth_ = ClampDepth(opt.depth);
  // A frames ring: plane p's region [ring, plane_bytes[p]] after plane p-1's,
  // at the next multiple of kPlaneAlign.
  region_.assign(opt.plane_bytes.size(), 0);
  int64_t at = 0;
  for (size_t p = 0; p < opt.plane_bytes.size(); ++p) {
    region_[p] = at;
    at = (at + opt.ring * opt.plane_bytes[p] + kPlaneAlign - 1) / kPlaneAlign * kPlaneAlign;
  }
  ring_bytes_ = std::max(at, opt.ring * opt.blob_bytes);
  stores_.assign(static_cast<size_t>(opt.n_layers), nullptr);
  resident_.assign(static_cast<size_t>(opt.n_layers), {});
  gate_.Reset(opt.n_layers, opt.n_experts);
}

Engine::~Engine() = default;  // backends call Abort() in their destructors

Status Engine::SetLayerStore(int layer, const uint8_t* host, int64_t bytes) {
  if (in_chunk_) return "cannot change the host store during a chunk";
  if (layer < 0 || layer >= opt_.n_layers)
    return "layer " + std::to_string(layer) + " is outside the model's " +
           std::to_string(opt_.n_layers) + " layers";
  int64_t want = opt_.blob_bytes * opt_.n_experts;
  if (bytes != want)
    return "layer " + std::to_string(layer) + " store holds " +
           std::to_string(bytes) + " bytes; " + std::to_string(opt_.n_experts) +
           " experts of " + std::to_string(opt_.blob_bytes) + " bytes need " +
           std::to_string(want);
  if (!host) return "layer " + std::to_string(layer) + " store is null";
  stores_[layer] = host;
  prepared_ = false;
  return {};
}

Status Engine::SetPlan(const std::vector<StreamEntry>& stream,
                       const std::vector<std::vector<int32_t>>& resident) {
  if (in_chunk_) return "cannot change the stream plan during a chunk";
  Status s = ValidateStreamList(stream, opt_.n_layers, opt_.n_experts);
  if (!s.empty()) return s;
  if (static_cast<int>(resident.size()) != opt_.n_layers)
    return "resident plan has " + std::to_string(resident.size()) +
           " layers; the model has " + std::to_string(opt_.n_layers);
  // Every expert of a streamed layer is either resident or streamed, once.
  std::vector<std::vector<int32_t>> seen(opt_.n_layers,
                                         std::vector<int32_t>(opt_.n_experts, 0));
  for (const StreamEntry& e : stream) ++seen[e.layer][e.expert];
  for (int l = 0; l < opt_.n_layers; ++l) {
    for (int32_t e : resident[l]) {
      if (e < 0 || e >= opt_.n_experts)
        return "resident expert " + std::to_string(e) + " of layer " +
               std::to_string(l) + " is outside the model's " +
               std::to_string(opt_.n_experts) + " experts";
      ++seen[l][e];
    }
  }
  for (int l = 0; l < opt_.n_layers; ++l)
    for (int e = 0; e < opt_.n_experts; ++e)
      if (seen[l][e] > 1)
        return "expert " + std::to_string(e) + " of layer " +
               std::to_string(l) +
               " is planned more than once (resident and streamed, or "
               "streamed twice)";
  stream_ = stream;
  resident_ = resident;
  layer_begin_.assign(static_cast<size_t>(opt_.n_layers) + 1, 0);
  {
    size_t k = 0;
    for (int l = 0; l < opt_.n_layers; ++l) {
      layer_begin_[l] = static_cast<int64_t>(k);
      while (k < stream_.size() && stream_[k].layer == l) ++k;
    }
    layer_begin_[opt_.n_layers] = static_cast<int64_t>(k);
  }
  // Layer frames: the layers that fetch (any expert streamed or resident),
  // in order, take frames round robin.
  const int64_t F = frames();
  ord_.assign(static_cast<size_t>(opt_.n_layers), -1);
  int64_t o = 0;
  for (int l = 0; l < opt_.n_layers; ++l)
    if (layer_begin_[l + 1] > layer_begin_[l] || !resident_[l].empty())
      ord_[l] = o++;
  n_fetch_layers_ = o;
  slot_of_.assign(stream_.size(), 0);
  need_.assign(stream_.size(), 0);
  entry_of_.assign(static_cast<size_t>(opt_.n_layers) * opt_.n_experts, -1);
  for (size_t k = 0; k < stream_.size(); ++k) {
    entry_of_[static_cast<size_t>(stream_[k].layer) * opt_.n_experts +
              stream_[k].expert] = static_cast<int64_t>(k);
    const int64_t lo = ord_[stream_[k].layer];
    slot_of_[k] = F > 0 ? (lo % F) * opt_.n_experts + stream_[k].expert : 0;
    need_[k] = std::max<int64_t>(0, lo - F + 1);
  }
  prepared_ = false;
  return {};
}

Status Engine::CheckStores() const {
  for (int l = 0; l < opt_.n_layers; ++l)
    if (!stores_[l] && layer_begin_.size() > static_cast<size_t>(l) + 1 &&
        layer_begin_[l + 1] > layer_begin_[l])
      return "layer " + std::to_string(l) +
             " streams experts but has no host store";
  return {};
}

void Engine::JoinIssuer() { issuer_.Wait(); }

void Engine::Abort() {
  prestarted_.store(false, std::memory_order_release);
  state_.RequestStop();
  BackendAbort();
  JoinIssuer();
  hold_.store(0, std::memory_order_release);
  in_chunk_ = false;
}

void Engine::StopByPeer(int64_t chunk, const std::string& why) {
  std::lock_guard<std::mutex> lock(group_mu_);
  if (chunk < program_chunks_.load()) return;  // that chunk has ended here
  if (chunk == begun_chunk_) {
    peer_stop_ = why;
    state_.RequestStop();
  } else {  // not begun, or its begin_chunk is running: BegunProgramChunk
    peer_stops_ahead_.emplace(chunk, why);
  }
}

int64_t Engine::EnterProgramChunk() {
  std::lock_guard<std::mutex> lock(group_mu_);
  deferred_.clear();  // an earlier chunk's, whose end_chunk never ran
  last_error_.clear();
  return ++program_chunks_;
}

void Engine::BegunProgramChunk(int64_t chunk) {
  std::lock_guard<std::mutex> lock(group_mu_);
  begun_chunk_ = chunk;
  for (auto it = peer_stops_ahead_.begin();
       it != peer_stops_ahead_.end() && it->first <= chunk;) {
    if (it->first == chunk) {
      peer_stop_ = it->second;
      state_.RequestStop();
    }
    it = peer_stops_ahead_.erase(it);
  }
}

void Engine::ClearPeerStops() {
  std::lock_guard<std::mutex> lock(group_mu_);
  peer_stops_ahead_.clear();
}

std::string Engine::StoppedMessage() {
  std::lock_guard<std::mutex> lock(group_mu_);
  return peer_stop_.empty() ? std::string("the walk was stopped")
                            : "the walk was stopped: " + peer_stop_;
}

Status Engine::Fail(Status s) {
  Abort();
  return s;
}

namespace {
double HostNow() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Status Engine::Prestart(ChunkMode mode) {
  prestarted_.store(false, std::memory_order_release);  // a new one replaces it
  Status s = BeginChunk(mode, nullptr, /*prestart=*/true);
  if (!s.empty()) return "prestart: " + s;
  prestarted_.store(true, std::memory_order_release);
  return {};
}

Status Engine::StageIds(const int32_t* ids, int64_t n, bool reset) {
  if (n < 0) return "stage_ids: " + std::to_string(n) + " ids";
  if (n > 0 && !ids) return "stage_ids: null ids";
  std::lock_guard<std::mutex> lock(ids_mu_);
  if (reset) ids_.clear();
  else ids_.erase(ids_.begin(), ids_.begin() + ids_next_);  // those taken
  ids_next_ = 0;
  ids_.insert(ids_.end(), ids, ids + n);
  return {};
}

void Engine::SkipIds(int64_t n) {
  std::lock_guard<std::mutex> lock(ids_mu_);
  ids_next_ += std::min(n, static_cast<int64_t>(ids_.size()) - ids_next_);
}

Status Engine::HandOutIds(void* out, int64_t bytes, void* stream) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(int32_t));
  std::lock_guard<std::mutex> lock(ids_mu_);
  const int64_t left = static_cast<int64_t>(ids_.size()) - ids_next_;
  const int64_t first = ids_next_;
  ids_next_ += std::min(n, left);  // used up whatever happens next
  if (n > left)
    return "begin_chunk: the chunk takes " + std::to_string(n) +
           " token ids but " + std::to_string(left) +
           " are staged (StreamEngine.stage_ids stages each chunk's ids "
           "before the chunk is dispatched)";
  try {
    Status s = WriteInts(ids_.data() + first, out, bytes, stream);
    return s.empty() ? s : "begin_chunk: token ids: " + s;
  } catch (const std::exception& e) {
    return std::string("begin_chunk: token ids: ") + e.what();
  }
}

Status Engine::Begin(ChunkMode mode, void* stream, void* ids_out,
                     int64_t ids_bytes) {
  Status s = BeginOrAdopt(mode, stream);
  if (ids_bytes == 0) return s;
  if (!s.empty()) {
    SkipIds(ids_bytes / static_cast<int64_t>(sizeof(int32_t)));
    return s;
  }
  s = HandOutIds(ids_out, ids_bytes, stream);
  return s.empty() ? s : Fail(s);
}

Status Engine::BeginOrAdopt(ChunkMode mode, void* stream) {
  // The program of the chunk the host began (Prestart) adopts its walk, which
  // runs on without the hold; any other begin starts the chunk afresh.
  const bool adopt = prestarted_.exchange(false, std::memory_order_acq_rel);
  if (adopt && in_chunk_ && mode == mode_ && !state_.Stopped() &&
      !cancelled_.load(std::memory_order_acquire)) {
    hold_.store(0, std::memory_order_release);
    state_.Notify();
    return {};
  }
  if (adopt && walk_failed_ && opt_.trace)
    std::fprintf(stderr, "strata: the prestarted walk failed (%s); the chunk begins afresh\n",
                 walk_error_.c_str());
  return BeginChunk(mode, stream, /*prestart=*/false);
}

Status Engine::BeginChunk(ChunkMode mode, void* stream, bool prestart) {
  host_begin_ = HostNow();
  if (cancelled_.load(std::memory_order_acquire))
    return "begin_chunk: the prefill was cancelled (it raised in the caller); this "
           "queued chunk does not run";
  if (!prepared_)
    return "engine is not prepared: set every layer's host store and the "
           "stream plan, then call prepare()";
  // A chunk that failed before its end leaves its walk behind: stop it here
  // so a new chunk always starts clean.
  if (in_chunk_ || issuer_.busy()) Abort();
  Status s = BackendBegin(mode, stream);
  if (!s.empty()) return Fail(s);
  mode_ = mode;
  gate_.Reset(opt_.n_layers, opt_.n_experts);
  state_.Reset(static_cast<int64_t>(stream_.size()));
  fetched_ = released_ = 0;
  piece_layer_ = -1;
  piece_next_ = piece_count_ = 0;
  piece_k_ = 0;
  walk_failed_ = false;
  walk_error_.clear();
  {
    std::lock_guard<std::mutex> lock(group_mu_);
    peer_stop_.clear();  // a peer's stop of an earlier chunk
  }
  walk_result_ = WalkResult{};
  stats_.assign(static_cast<size_t>(opt_.n_layers), LayerStats{});
  for (int l = 0; l < opt_.n_layers; ++l)
    stats_[l].streamed = layer_begin_[l + 1] - layer_begin_[l];
  in_chunk_ = true;
  const bool walk = Streams(mode) && !stream_.empty();
  hold_.store(prestart && walk ? kPrestartHold : 0, std::memory_order_release);
  if (walk) {
    if (opt_.routed && opt_.trace && !depth_line_printed_.exchange(true))
      std::fprintf(stderr,
                   "strata: routed stream on: depth %d (requested %d), ring "
                   "%lld slots (%lld layer frames)\n",
                   depth_, opt_.depth, static_cast<long long>(opt_.ring),
                   static_cast<long long>(frames()));
    try {
      StartWalk();
    } catch (const std::exception& e) {  // the worker thread could not be made
      return Fail(std::string("begin_chunk: cannot start the issuer: ") + e.what());
    }
  }
  return {};
}

Status Engine::Publish(int layer, const void* counts, void* stream) {
  if (!in_chunk_) return "publish outside a chunk (begin_chunk not run)";
  if (layer < 0 || layer >= opt_.n_layers)
    return Fail("publish: layer " + std::to_string(layer) +
                " is outside the model's " + std::to_string(opt_.n_layers) +
                " layers");
  Status s = BackendPublish(layer, counts, stream);
  if (!s.empty()) return Fail("publish, layer " + std::to_string(layer) + ": " + s);
  return {};
}

namespace {
// The layer `ord` names among those that fetch, for messages.
int LayerOfOrd(const std::vector<int64_t>& ord, int64_t o) {
  for (size_t l = 0; l < ord.size(); ++l)
    if (ord[l] == o) return static_cast<int>(l);
  return -1;
}
}  // namespace

Status Engine::Fetch(int layer, const void* resident, int64_t resident_bytes,
                     void* const* out, const int64_t* out_bytes, int n_out,
                     void* stream, const FetchPiece& piece) {
  const bool whole = piece.pieces == 1;
  const std::string where =
      "fetch, layer " + std::to_string(layer) +
      (whole ? std::string()
             : ", piece " + std::to_string(piece.piece) + " of " +
                   std::to_string(piece.pieces)) +
      ": ";
  if (Status s = CheckFetch(where, layer, resident_bytes, out, out_bytes, n_out,
                            piece);
      !s.empty())
    return s;
  if (Status s = CheckFetchMayRun(where, layer, out, piece); !s.empty())
    return s;
  const FetchRows rows = FetchTargets(ord_[layer], out, whole);
  if (piece.piece == 0) {
    if (Status s = CopyResidentRows(where, layer, resident, rows, stream);
        !s.empty())
      return s;
    piece_layer_ = layer;
    piece_count_ = piece.pieces;
    piece_next_ = 0;
    piece_k_ = layer_begin_[layer];
  }
  int64_t k_end = 0;
  if (Status s = PieceEntries(where, layer, piece, &k_end); !s.empty())
    return s;
  Status s = Streams(mode_) ? ReadStreamed(where, layer, k_end, rows, stream)
                            : ReadRoutedOnly(where, layer, rows.base, stream);
  if (!s.empty()) return s;
  if (out && !packed() && whole) {
    s = CopyRows(rows.frame, opt_.n_experts, rows.outs, stream);
    if (!s.empty()) return Fail(where + "copy out of the frame: " + s);
  }
  piece_k_ = k_end;
  if (++piece_next_ == piece_count_) {
    piece_layer_ = -1;
    ++fetched_;
  }
  return {};
}

Status Engine::CheckFetch(const std::string& where, int layer,
                          int64_t resident_bytes, void* const* out,
                          const int64_t* out_bytes, int n_out,
                          const FetchPiece& piece) {
  const bool whole = piece.pieces == 1;
  if (!in_chunk_) return where + "outside a chunk (begin_chunk not run)";
  if (layer < 0 || layer >= opt_.n_layers)
    return Fail(where + "outside the model's " + std::to_string(opt_.n_layers) +
                " layers");
  if (piece.pieces < 1 || piece.piece < 0 || piece.piece >= piece.pieces ||
      piece.row_begin < 0 || piece.row_end < piece.row_begin)
    return Fail(where + "bad piece (piece " + std::to_string(piece.piece) +
                " of " + std::to_string(piece.pieces) + ", rows " +
                std::to_string(piece.row_begin) + ".." +
                std::to_string(piece.row_end) + ")");
  if (!whole && !Streams(mode_))
    return Fail(where + "a routed-only chunk fetches each layer whole");
  const int64_t blob = opt_.blob_bytes;
  if (out && n_out != n_planes())
    return Fail(where + std::to_string(n_out) + " outputs; the plane table has " +
                std::to_string(n_planes()) + " planes (one output per plane)");
  for (int p = 0; out && p < n_planes(); ++p)
    if (out_bytes[p] != plane_bytes(p) * opt_.n_experts)
      return Fail(where + "plane " + std::to_string(p) + " output of " +
                  std::to_string(out_bytes[p]) + " bytes; expected " +
                  std::to_string(plane_bytes(p) * opt_.n_experts) + " (" +
                  std::to_string(opt_.n_experts) + " experts x " +
                  std::to_string(plane_bytes(p)) + " bytes)");
  const int64_t o = ord_[layer];
  if (o < 0)
    return Fail(where + "the stream plan has no experts for this layer (a "
                        "dense layer?)");
  if (piece.piece > 0) {
    // A later piece of the layer being fetched: the pieces come in order.
    if (piece_layer_ != layer || piece.piece != piece_next_ ||
        piece.pieces != piece_count_)
      return Fail(where + (piece_layer_ < 0
                               ? std::string("its piece 0 was not fetched")
                               : "layer " + std::to_string(piece_layer_) +
                                     " fetches piece " +
                                     std::to_string(piece_next_) + " of " +
                                     std::to_string(piece_count_) + " next"));
  } else if (piece_layer_ >= 0) {
    return Fail(where + "layer " + std::to_string(piece_layer_) +
                " fetched " + std::to_string(piece_next_) + " of its " +
                std::to_string(piece_count_) +
                " pieces (each piece of a layer before the next layer)");
  } else if (o != fetched_ || fetched_ != released_) {
    if (fetched_ != released_)
      return Fail(where + "layer " + std::to_string(LayerOfOrd(ord_, released_)) +
                  " has not released its frame (release after a layer's expert "
                  "math, before the next layer's fetch)");
    return Fail(where + "out of order: layer " +
                std::to_string(LayerOfOrd(ord_, fetched_)) +
                " fetches next (each layer once per chunk, in order)");
  }
  const int64_t n_res = static_cast<int64_t>(resident_[layer].size());
  if (resident_bytes != blob * n_res)
    return Fail(where + "resident operand of " +
                std::to_string(resident_bytes) + " bytes; the plan has " +
                std::to_string(n_res) + " resident experts (" +
                std::to_string(blob * n_res) + " bytes)");
  return {};
}

Status Engine::CheckFetchMayRun(const std::string& where, int layer,
                                void* const* out, const FetchPiece& piece) {
  if (piece.piece == 0 && fault_.load() != 0 && fault_layer_ == layer) {
    Fault f = static_cast<Fault>(fault_.exchange(0));
    if (f == Fault::kError) return Fail(where + "injected fault");
    if (f == Fault::kStop) state_.RequestStop();
  }
  // A stop (cancellation, or an error elsewhere) fails the chunk even when the
  // walk had already issued this layer: the caller asked for it to end.
  if (state_.Stopped())
    return Fail(where + (walk_failed_ ? "the issuer failed: " + walk_error_
                                      : StoppedMessage()));
  if (packed() && !out)
    return Fail(where + "a packed chunk is read through fetch's outputs, not in place "
                        "(fetch_frame is for frames chunks)");
  return {};
}

Engine::FetchRows Engine::FetchTargets(int64_t o, void* const* out,
                                       bool whole) const {
  // Where rows go. Packed: straight to the outputs (the ring only holds the
  // copied blobs, slot s at s * blob). Frames: the layer's frame, copied out
  // to the outputs afterwards where there are outputs.
  FetchRows rows;
  rows.frame = SlotRows((o % frames()) * opt_.n_experts);
  rows.base = rows.frame;
  if (packed())
    for (int p = 0; p < n_planes(); ++p) rows.base.plane[p] = static_cast<uint8_t*>(out[p]);
  rows.outs = Rows{};
  if (out)
    for (int p = 0; p < n_planes(); ++p) rows.outs.plane[p] = static_cast<uint8_t*>(out[p]);
  rows.copy_out = out && !packed() && !whole;  // frames, row by row
  return rows;
}

Status Engine::CopyResidentRows(const std::string& where, int layer,
                                const void* resident, const FetchRows& rows,
                                void* stream) {
  const int64_t blob = opt_.blob_bytes;
  const int64_t n_res = static_cast<int64_t>(resident_[layer].size());
  const uint8_t* res = static_cast<const uint8_t*>(resident);
  Status s;
  // Rows are indexed by expert id and host blobs sit in expert order, so
  // adjacent experts move as one copy (runs); fewer calls on XLA's stream.
  const std::vector<int32_t>& res_ids = resident_[layer];
  for (int64_t r = 0; r < n_res;) {
    int64_t n = 1;
    while (r + n < n_res && res_ids[r + n] == res_ids[r] + n) ++n;
    s = CopyResident(res + r * blob, n, At(rows.base, res_ids[r]), stream);
    if (s.empty() && rows.copy_out)
      s = CopyRows(At(rows.frame, res_ids[r]), n, At(rows.outs, res_ids[r]),
                   stream);
    if (!s.empty()) return Fail(where + s);
    r += n;
  }
  return {};
}

Status Engine::PieceEntries(const std::string& where, int layer,
                            const FetchPiece& piece, int64_t* k_end) {
  // The entries this piece reads: up to the last one whose expert has rows in
  // [row_begin, row_end) (rows are sorted by expert id: the routing counts
  // say which), the rest of the layer for its last piece.
  *k_end = layer_begin_[layer + 1];
  if (piece.piece + 1 < piece.pieces) {
    *k_end = piece_k_;
    Status s = WaitPublished(layer);
    if (!s.empty()) return Fail(where + s);
    int64_t row = 0;
    for (int e = 0; e < opt_.n_experts && row < piece.row_end; ++e) {
      const int64_t c = gate_.Count(layer, e);
      if (c > 0 && row + c > piece.row_begin) {
        const int64_t k = entry_of_[static_cast<size_t>(layer) * opt_.n_experts + e];
        if (k >= 0) *k_end = std::max(*k_end, k + 1);
      }
      row += c;
    }
  }
  return {};
}

bool Engine::AdjacentEntries(int64_t a, int64_t b) const {
  return stream_[b].expert == stream_[a].expert + (b - a);
}

Status Engine::ReadStreamed(const std::string& where, int layer, int64_t k_end,
                            const FetchRows& rows, void* stream) {
  const int64_t blob = opt_.blob_bytes;
  LayerStats& st = stats_[layer];
  const int64_t kb = piece_k_;
  Status s;
  // Frames: the copies land where the model reads them: nothing to copy
  // out, only the skipped rows to zero and one wait, on the piece's last
  // copy. Packed: each run split out as soon as it lands.
  if (k_end > kb && !state_.WaitIssued(k_end - 1))
    return Fail(where + (walk_failed_ ? "the issuer failed: " + walk_error_
                                      : StoppedMessage()));
  int64_t last = -1;
  for (int64_t k = kb; k < k_end;) {
    const bool copied = state_.entry_state(k) == EntryState::kCopied;
    int64_t n = 1;
    while (k + n < k_end && AdjacentEntries(k, k + n) &&
           (state_.entry_state(k + n) == EntryState::kCopied) == copied &&
           !(copied && (packed() || rows.copy_out) && n == kSplitRun))
      ++n;
    const int64_t expert = stream_[k].expert;
    if (copied) {
      st.copied += n;
      st.bytes += n * blob;
      last = k + n - 1;
      if (packed() || rows.copy_out) {
        // Split (packed) or copied out (frames) run by run, each of at
        // most kSplitRun experts as soon as it lands, so that little of
        // it is left for after the layer's last copy.
        s = WaitCopied(last, slot_of_[last], stream);
        if (!s.empty()) return Fail(where + s);
        s = packed() ? CopyResident(PackedSlot(slot_of_[k]), n,
                                    At(rows.base, expert), stream)
                     : CopyRows(At(rows.frame, expert), n,
                                At(rows.outs, expert), stream);
        if (!s.empty())
          return Fail(where + (packed() ? "split of the ring's blobs: "
                                        : "copy out of the frame: ") + s);
      }
    } else {
      // No token reads them.
      s = ZeroRows(At(rows.copy_out ? rows.outs : rows.base, expert), n, stream);
      if (!s.empty()) return Fail(where + s);
      st.skipped += n;
    }
    k += n;
  }
  if (last >= 0 && !packed() && !rows.copy_out) {
    s = WaitCopied(last, slot_of_[last], stream);
    if (!s.empty()) return Fail(where + s);
  }
  return {};
}

Status Engine::ReadRoutedOnly(const std::string& where, int layer,
                              const Rows& base, void* stream) {
  const int64_t blob = opt_.blob_bytes;
  LayerStats& st = stats_[layer];
  const int64_t k0 = layer_begin_[layer], k1 = layer_begin_[layer + 1];
  Status s;
  if (k1 > k0) {
    s = WaitPublished(layer);
    if (!s.empty()) return Fail(where + s);
  }
  for (int64_t k = k0; k < k1;) {
    const StreamEntry& e = stream_[k];
    const bool routed = gate_.Routed(e.layer, e.expert);
    int64_t n = 1;
    while (k + n < k1 && AdjacentEntries(k, k + n) &&
           gate_.Routed(e.layer, stream_[k + n].expert) == routed)
      ++n;
    const Rows row = At(base, e.expert);
    if (routed) {
      s = CopyDirect(e.layer, e.expert, n, row, stream);
      st.copied += n;
      st.bytes += n * blob;
    } else {
      s = ZeroRows(row, n, stream);
      st.skipped += n;
    }
    if (!s.empty()) return Fail(where + s);
    k += n;
  }
  return {};
}

Status Engine::Release(int layer, void* stream) {
  const std::string where = "release, layer " + std::to_string(layer) + ": ";
  if (!in_chunk_) return where + "outside a chunk (begin_chunk not run)";
  if (layer < 0 || layer >= opt_.n_layers)
    return Fail(where + "outside the model's " + std::to_string(opt_.n_layers) +
                " layers");
  if (piece_layer_ == layer)
    return Fail(where + "fetched " + std::to_string(piece_next_) + " of its " +
                std::to_string(piece_count_) + " pieces");
  const int64_t o = ord_[layer];
  if (o < 0 || o != released_ || fetched_ != released_ + 1)
    return Fail(where + (fetched_ == released_
                             ? std::string("no fetched layer to release")
                             : "layer " +
                                   std::to_string(LayerOfOrd(ord_, released_)) +
                                   " is the one fetched"));
  Status s = ReleaseFrame(layer, o % frames(), layer_begin_[layer],
                          layer_begin_[layer + 1], stream);
  if (!s.empty()) return Fail(where + s);
  ++released_;
  state_.ReleaseLayers(released_);
  return {};
}

Status Engine::End(int32_t* stats_host, void* stats_out, void* stream) {
  if (!in_chunk_) return "end_chunk outside a chunk (begin_chunk not run)";
  if (piece_layer_ >= 0)
    return Fail("end_chunk: layer " + std::to_string(piece_layer_) + " fetched " +
                std::to_string(piece_next_) + " of its " +
                std::to_string(piece_count_) + " pieces");
  if (fetched_ != released_)
    return Fail("end_chunk: layer " + std::to_string(LayerOfOrd(ord_, released_)) +
                " was fetched but never released");
  // A chunk that fetched fewer layers than the plan has may leave the walk
  // waiting for frames nobody will release: stop it, so the join cannot wait
  // forever (the check below then fails the chunk).
  if (Streams(mode_) && released_ < n_fetch_layers_)
    state_.RequestStop();
  JoinIssuer();
  if (walk_failed_) return Fail("the issuer failed: " + walk_error_);
  if (Streams(mode_) && !stream_.empty()) {
    // What fetch read must be what the walk decided, entry for entry in sum.
    int64_t copied = 0, skipped = 0;
    for (const LayerStats& ls : stats_) {
      copied += ls.copied;
      skipped += ls.skipped;
    }
    if (walk_result_.stopped || copied != walk_result_.copied ||
        skipped != walk_result_.skipped)
      return Fail("end_chunk: fetch read " + std::to_string(copied) +
                  " copied and " + std::to_string(skipped) +
                  " skipped entries, the walk " +
                  (walk_result_.stopped
                       ? std::string("stopped")
                       : std::to_string(walk_result_.copied) + " and " +
                             std::to_string(walk_result_.skipped)) +
                  " (a fetch missing for a layer?)");
  }
  for (int l = 0; l < opt_.n_layers; ++l) {
    stats_host[2 * l] = static_cast<int32_t>(stats_[l].copied);
    stats_host[2 * l + 1] = static_cast<int32_t>(stats_[l].skipped);
  }
  Status s = WriteInts(stats_host, stats_out,
                        static_cast<int64_t>(opt_.n_layers) * 2 * 4, stream);
  if (!s.empty()) return Fail("end_chunk: " + s);
  s = BackendEnd(stream);
  if (!s.empty()) return Fail("end_chunk: " + s);
  ++chunks_;
  host_end_ = HostNow();
  int64_t n = 0, copied = 0, skipped = 0;
  for (const LayerStats& ls : stats_) {
    n += ls.streamed;
    copied += ls.copied;
    skipped += ls.skipped;
  }
  last_totals_[0] = n;
  last_totals_[1] = copied;
  last_totals_[2] = skipped;
  if (opt_.trace) {
    std::fprintf(stderr,
                 "strata: chunk %lld (%s%s, %s): ring entries %lld, copied "
                 "%lld, skipped %lld\n",
                 static_cast<long long>(chunks_),
                 Streams(mode_) ? (opt_.routed ? "routed stream" : "stream all")
                                : "routed-only",
                 Streams(mode_) ? (packed() ? ", packed ring" : ", layer frames") : "",
                 Describe().c_str(), static_cast<long long>(n),
                 static_cast<long long>(copied),
                 static_cast<long long>(skipped));
  }
  in_chunk_ = false;
  return {};
}

namespace {
// An engine belongs to the process that made it: after fork() the child has a
// copy of the registry but none of the engines' threads (the issuer, the
// simulated link's worker, ...). Joining or waiting on those there would hang
// or end the process, so a child finds no engine of its parent's, and
// destroying one only drops the copy, touching nothing of it.
struct Registered {
  std::unique_ptr<Engine> engine;
  pid_t pid;  // the process that made it
};
std::mutex g_registry_mu;
std::map<int64_t, Registered>& Registry() {
  static auto* r = new std::map<int64_t, Registered>();
  return *r;
}
// The registry's mutex, held by another thread at the fork, would stay locked
// in the child: hold it across fork() so both sides resume with it unlocked.
void GuardRegistryAcrossFork() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork([] { g_registry_mu.lock(); }, [] { g_registry_mu.unlock(); },
                   [] { g_registry_mu.unlock(); });
  });
}
}  // namespace

namespace {
// A group (RegisterGroup): its members' engine ids by device ordinal, and the
// summed trace line's tally per program chunk: members ended, their totals.
struct Group {
  std::map<int32_t, int64_t> member;  // ordinal -> engine id
  pid_t pid;
  bool trace = false;
  struct Tally {
    size_t ended = 0;
    int64_t totals[3] = {0, 0, 0};
  };
  std::map<int64_t, Tally> tally;  // by program chunk
};
std::map<int64_t, Group>& Groups() {
  static auto* g = new std::map<int64_t, Group>();
  return *g;
}
// The smallest id that no registered engine or group holds and no group names as a member,
// with the registry's mutex held. An engine made after another was closed takes its id
// again: the id is an attribute of the programs' custom calls, so the programs of engines
// made alike, one after another, are the same HLO and a compilation cache serves them. No
// program of a closed engine runs after it (Engine.close and a failed prefill wait for
// theirs), and a handle destroys its engine once.
int64_t FreeIdLocked() {
  std::set<int64_t> taken;
  for (const auto& [id, r] : Registry()) taken.insert(id);
  for (const auto& [id, g] : Groups()) {
    taken.insert(id);
    for (const auto& [ordinal, engine] : g.member) taken.insert(engine);
  }
  int64_t id = 1;
  while (taken.count(id)) ++id;
  return id;
}

// A live engine of this process, with the registry's mutex held.
Engine* FindLocked(int64_t id) {
  auto it = Registry().find(id);
  if (it == Registry().end() || it->second.pid != getpid()) return nullptr;
  return it->second.engine.get();
}
}  // namespace

int64_t RegisterGroup(const std::vector<int64_t>& engines,
                      const std::vector<int32_t>& ordinals, std::string* err) {
  GuardRegistryAcrossFork();
  std::lock_guard<std::mutex> lock(g_registry_mu);
  if (engines.empty() || engines.size() != ordinals.size()) {
    *err = "an engine group takes one engine per device: " +
           std::to_string(engines.size()) + " engines for " +
           std::to_string(ordinals.size()) + " device ordinals";
    return 0;
  }
  Group g;
  g.pid = getpid();
  const Engine* first = nullptr;
  for (size_t i = 0; i < engines.size(); ++i) {
    Engine* e = FindLocked(engines[i]);
    const std::string name = "engine " + std::to_string(engines[i]);
    if (!e) {
      *err = name + " does not exist (closed, or made in another process)";
      return 0;
    }
    if (ordinals[i] < 0) {
      *err = name + ": device ordinal " + std::to_string(ordinals[i]) + " is negative";
      return 0;
    }
    if (!g.member.emplace(ordinals[i], engines[i]).second) {
      *err = "device ordinal " + std::to_string(ordinals[i]) +
             " is given twice: one engine per device";
      return 0;
    }
    if (e->group_ordinal() >= 0) {
      *err = name + " is in a group already (device " +
             std::to_string(e->group_ordinal()) + ")";
      return 0;
    }
    for (size_t j = 0; j < i; ++j)
      if (engines[j] == engines[i]) {
        *err = name + " is given twice: one engine per device";
        return 0;
      }
    const EngineOptions& o = e->options();
    if (first && (o.n_layers != first->options().n_layers ||
                  o.n_experts != first->options().n_experts ||
                  o.blob_bytes != first->options().blob_bytes ||
                  o.plane_bytes != first->options().plane_bytes ||
                  o.plane_offsets != first->options().plane_offsets)) {
      *err = name + " has " + std::to_string(o.n_layers) + " layers of " +
             std::to_string(o.n_experts) + " experts of " + std::to_string(o.blob_bytes) +
             " bytes, engine " + std::to_string(engines[0]) + " " +
             std::to_string(first->options().n_layers) + " of " +
             std::to_string(first->options().n_experts) + " of " +
             std::to_string(first->options().blob_bytes) +
             " (or other planes): a group's members hold the same shapes";
      return 0;
    }
    if (!first) first = e;
    g.trace = g.trace || o.trace != 0;
  }
  for (size_t i = 0; i < engines.size(); ++i) FindLocked(engines[i])->JoinGroup(ordinals[i]);
  const int64_t id = FreeIdLocked();
  Groups()[id] = std::move(g);
  return id;
}

bool DestroyGroup(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Groups().find(id);
  if (it == Groups().end()) return false;
  if (it->second.pid == getpid())
    for (const auto& [ordinal, engine] : it->second.member)
      if (Engine* e = FindLocked(engine)) e->JoinGroup(-1);
  Groups().erase(it);
  return true;
}

Engine* FindEngineOn(int64_t id, int32_t ordinal, bool* grouped, std::string* why) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  *grouped = false;
  if (Engine* e = FindLocked(id)) return e;
  auto g = Groups().find(id);
  if (g == Groups().end() || g->second.pid != getpid()) {
    *why = "no engine with id " + std::to_string(id) +
           " (closed, or made in another process)";
    return nullptr;
  }
  *grouped = true;
  auto m = g->second.member.find(ordinal);
  if (m == g->second.member.end()) {
    std::string have;
    for (const auto& [o, engine] : g->second.member)
      have += (have.empty() ? "" : ", ") + std::to_string(o);
    *why = "engine group " + std::to_string(id) + " has no engine on device ordinal " +
           std::to_string(ordinal) + " (its devices: " + have +
           "): run the program on the group's devices";
    return nullptr;
  }
  Engine* e = FindLocked(m->second);
  if (!e)
    *why = "engine group " + std::to_string(id) + ": the engine of device ordinal " +
           std::to_string(ordinal) + " (id " + std::to_string(m->second) +
           ") was closed";
  return e;
}

void StopGroup(int64_t id, int32_t ordinal, int64_t chunk, const std::string& why) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto g = Groups().find(id);
  if (g == Groups().end() || g->second.pid != getpid()) return;
  for (const auto& [o, engine] : g->second.member)
    if (o != ordinal)
      if (Engine* e = FindLocked(engine)) e->StopByPeer(chunk, why);
}

void GroupChunkEnded(int64_t id, int32_t ordinal, int64_t chunk,
                     const int64_t totals[3]) {
  (void)ordinal;
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Groups().find(id);
  if (it == Groups().end() || !it->second.trace) return;
  Group& g = it->second;
  Group::Tally& t = g.tally[chunk];
  ++t.ended;
  for (int i = 0; i < 3; ++i) t.totals[i] += totals[i];
  if (t.ended == g.member.size()) {
    std::fprintf(stderr,
                 "strata: chunk %lld, %zu devices summed: ring entries %lld, copied "
                 "%lld, skipped %lld\n",
                 static_cast<long long>(chunk), g.member.size(),
                 static_cast<long long>(t.totals[0]), static_cast<long long>(t.totals[1]),
                 static_cast<long long>(t.totals[2]));
    g.tally.erase(chunk);
  }
  // A chunk that failed on some member never completes its tally.
  while (!g.tally.empty() && g.tally.begin()->first < chunk - 64)
    g.tally.erase(g.tally.begin());
}

int64_t RegisterEngine(std::unique_ptr<Engine> engine) {
  GuardRegistryAcrossFork();
  std::lock_guard<std::mutex> lock(g_registry_mu);
  const int64_t id = FreeIdLocked();
  Registry()[id] = Registered{std::move(engine), getpid()};
  return id;
}

Engine* FindEngine(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  if (it == Registry().end() || it->second.pid != getpid()) return nullptr;
  return it->second.engine.get();
}

bool DestroyEngine(int64_t id) {
  std::unique_ptr<Engine> doomed;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto it = Registry().find(id);
    if (it == Registry().end()) return false;
    if (it->second.pid != getpid()) {
      (void)it->second.engine.release();  // the parent's: left as it is
      Registry().erase(it);
      return true;
    }
    doomed = std::move(it->second.engine);
    Registry().erase(it);
  }
  doomed->Abort();
  return true;
}

}  // namespace strata
