// The CUDA backend's engine: a ring of layer frames in one region per plane of
// the expert blob (the model reads a layer's experts in its frame), one copy
// stream with a `copied` event per slot and a `used` event per frame, and the
// issuer thread running the shared walk. Where the copies read the host store
// from (pinned, or staged through bounce buffers) is cuda_store's, how a
// layer's routing reaches the gate is cuda_publish's, and its kernels are
// cuda_kernels'.
//
// The failures it guards against: a copy landing in a frame a layer's expert
// math is still reading (every copy into a frame waits on its `used` event,
// recorded by release after that math), a gate row from an earlier chunk's
// publish (Begin waits for every callback; an event counts only once this
// chunk's publish recorded it), a copy still in flight after a chunk was
// abandoned (Abort drains the copy stream), and a CUDA error escaping as a
// crash instead of a message naming the call and what it was doing.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_kernels.hpp"
#include "cuda_publish.hpp"
#include "cuda_store.hpp"
#include "cuda_util.hpp"
#include "device_scope.hpp"
#include "engine.hpp"

namespace strata {
namespace STRATA_INTERNAL cuda {
namespace {

using Clock = std::chrono::steady_clock;

// Room left on the device beside the ring for XLA's own scratch and for the
// resident experts that are put on the device after prepare.
constexpr int64_t kRingMarginBytes = 256LL << 20;
// Bounce buffers of the staged path: enough for the copy of one blob to run
// while the stager threads fill the next ones.
constexpr int kBounceBuffers = 4;
// How long a routed-only fetch waits for its layer's routing counts to land.
constexpr std::chrono::seconds kPublishWait{60};

class CudaEngine final : public Engine, public PublishSink {
 public:
  explicit CudaEngine(const EngineOptions& opt)
      : Engine(opt),
        pub_(static_cast<PublishMode>(opt.publish_mode), opt.n_layers,
             opt.n_experts, this) {
    DescribePlanes();
  }

  ~CudaEngine() override {
    Abort();
    DeviceScope dev(opt_.device);
    const bool drained = pub_.Detach();
    // Synchronizes the device when the engine was prepared, so no publish
    // copy still targets the pinned counts (an engine never prepared ran
    // none).
    ReleaseResources();
    pub_.Free(drained);
    cudaGetLastError();
  }

  // The CUDA half of construction, which can fail.
  Status Init() {
    STRATA_ENTER_DEVICE(dev);
    if (Status s = pub_.AllocateCounts(); !s.empty()) return s;
    int driver = 0;
    STRATA_CUDA_RETURN("driver version", cudaDriverGetVersion, &driver);
    large_args_ = driver >= 12010;  // kernel arguments past 4 KB
    return {};
  }

  Status Prepare() override {
    if (in_chunk_) return "cannot prepare during a chunk";
    if (Status s = CheckStores(); !s.empty()) return s;
    if (opt_.pin_mode != 1 && opt_.pin_mode != 2)
      return "pin_mode " + std::to_string(opt_.pin_mode) +
             " is not 1 (pinned arena) or 2 (staged)";
    STRATA_ENTER_DEVICE(dev);
    // The pinned counts, ring and events may still be targeted by the last
    // chunk's device work: its callbacks have run, and ReleaseResources
    // synchronizes the device first.
    if (!pub_.WaitCallbacks(kCallbackWait))
      return "publish callbacks of the last chunk have not run after " +
             std::to_string(kCallbackWait.count()) + " s";
    ReleaseResources();
    const Status s = Allocate();
    if (!s.empty()) {
      ReleaseResources();
      return s;
    }
    prepared_ = true;
    return {};
  }

  // publish_mode 0: called by the publish callback with the hub's mutex held;
  // must not call CUDA.
  void OnPublished(int layer) override {
    gate_.Publish(layer, pub_.Counts(layer));
    state_.Notify();
  }

  // publish_mode 1: publishes `layer`'s gate row once its counts have landed
  // in pinned memory (Publisher::Landed). Returns whether the row is
  // published. The issuer (stream mode) and fetch (routed-only, no issuer)
  // call it, never both in one chunk: the gate keeps one writer.
  bool PollPublished(int layer) {
    if (gate_.Published(layer)) return true;
    if (!pub_.Landed(layer)) return false;
    gate_.Publish(layer, pub_.Counts(layer));
    return true;
  }

  // Link, on the issuer thread (see IssueWalk): entries k..k+n-1 into slots
  // slot0..slot0+n-1 as one copy. n > 1 is a run of adjacent experts of one
  // layer; the walk never forms runs of staged entries, so staging has n == 1.
  void IssueEntries(int64_t k, int64_t n, int64_t slot0) {
    const StreamEntry& e = stream_[k];
    if (!copy_started_) {
      STRATA_CUDA_THROW("copy window start", cudaEventRecord, t_copy0_,
                        copy_stream_);
      copy_started_ = true;
    }
    // The frame's last reader released it on XLA's stream (the walk saw that
    // release on the host). Never recorded means never read since the ring
    // was made: waiting on an unrecorded event would be a no-op anyway.
    const int64_t frame = slot0 / opt_.n_experts;
    if (relayout_) {
      // The last chunk laid the ring out the other way, so this chunk's
      // frame f overlaps others of that layout: its first copy waits for
      // every frame's last reader (XLA's stream is in order, so in effect
      // for the last chunk's last release).
      for (int64_t f = 0; f < frames(); ++f)
        if (used_recorded_[f].load(std::memory_order_acquire))
          STRATA_CUDA_THROW(Entry(slot0, e) + ", waiting for frame " +
                                std::to_string(f) + " of the other layout",
                            cudaStreamWaitEvent, copy_stream_, used_[f], 0u);
      relayout_ = false;
    }
    if (used_recorded_[frame].load(std::memory_order_acquire))
      STRATA_CUDA_THROW(Entry(slot0, e) + ", waiting for frame " +
                            std::to_string(frame) + "'s release",
                        cudaStreamWaitEvent, copy_stream_, used_[frame], 0u);
    const uint8_t* src = store_.staging()
                             ? stager_.WaitFilled(k, kIssuerPoll)
                             : SourceBlob(e.layer, e.expert);
    // Packed blobs: one copy per run, split by fetch. Frames: split into the
    // planes as it crosses the link, in as few copies as the layout allows:
    // each copy costs the link a few microseconds, a visible share of a routed
    // chunk's link time at one copy per plane and expert. Where the planes are
    // equal, evenly spaced in the blob and in the ring (the plain format), one
    // expert is one strided copy whose rows are its planes; otherwise, and for
    // a run of n adjacent experts, one strided copy per plane, n rows of the
    // plane's bytes (source pitch a blob).
    const Rows dst = SlotRows(slot0);
    if (packed()) {
      STRATA_CUDA_THROW(
          Entry(slot0, e) + (n > 1 ? " and the next " + std::to_string(n - 1) : ""),
          cudaMemcpyAsync, PackedSlot(slot0), src,
          static_cast<size_t>(n * opt_.blob_bytes), cudaMemcpyHostToDevice,
          copy_stream_);
    } else if (n == 1 && uniform_planes_) {
      const size_t bytes = static_cast<size_t>(plane_bytes(0));
      STRATA_CUDA_THROW(Entry(slot0, e), cudaMemcpy2DAsync, dst.plane[0],
                        static_cast<size_t>(uniform_dst_pitch_), src + plane_offset(0),
                        static_cast<size_t>(uniform_src_pitch_), bytes,
                        static_cast<size_t>(n_planes()), cudaMemcpyHostToDevice,
                        copy_stream_);
    } else {
      for (int p = 0; p < n_planes(); ++p) {
        const size_t bytes = static_cast<size_t>(plane_bytes(p));
        STRATA_CUDA_THROW(
            Entry(slot0, e) + (n > 1 ? " and the next " + std::to_string(n - 1) : "") +
                ", plane " + std::to_string(p),
            cudaMemcpy2DAsync, dst.plane[p], bytes, src + plane_offset(p),
            static_cast<size_t>(opt_.blob_bytes), bytes, static_cast<size_t>(n),
            cudaMemcpyHostToDevice, copy_stream_);
      }
    }
    for (int64_t j = 0; j < n; ++j)
      STRATA_CUDA_THROW(Entry(slot0 + j, stream_[k + j]), cudaEventRecord,
                        copied_[slot0 + j], copy_stream_);
    if (store_.staging()) stager_.Release(k, copy_stream_);
  }

  // The slot's event may since carry a later entry's copy; the copy stream
  // is in order, so its landing implies entry k's.
  bool CopyLanded(int64_t k) {
    const int64_t slot = slot_of_[k];
    const cudaError_t err = cudaEventQuery(copied_[slot]);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    throw std::runtime_error(CudaError(
        "cudaEventQuery",
        "copy of entry " + std::to_string(k) + ", slot " + std::to_string(slot),
        err));
  }

 protected:
  Status BackendBegin(ChunkMode mode, void* stream) override {
    if (!copy_stream_) return "cuda engine is not prepared";
    // A chunk of the other layout than the last one's (routed-only chunks
    // write frames) must not copy into the ring before every read of the
    // last layout is done (IssueEntries). Set before the walk starts, read
    // and cleared by the issuer; a chunk that never copies leaves it set, which
    // only makes the next chunk's first copy wait a little longer than needed.
    const bool packed = mode == ChunkMode::kStreamPacked;
    if (packed != ring_packed_) {
      relayout_ = true;
      ring_packed_ = packed;
    }
    // A callback of the previous chunk landing after the gate reset would
    // publish a stale row into this chunk.
    if (!pub_.WaitCallbacks(kCallbackWait))
      return "publish callbacks of the previous chunk have not run after " +
             std::to_string(kCallbackWait.count()) + " s";
    // The last chunk's issuer is joined: nothing reads these now. A layer's
    // event counts again only after this chunk's publish recorded it. The
    // last chunk's counts copy into the same pinned row may still be pending,
    // but it was queued on XLA's stream before this chunk's copy and event
    // (XLA runs a device's programs on one in-order compute stream), so when
    // this chunk's event completes the row holds this chunk's counts.
    pub_.ResetChunk();
    STRATA_ENTER_DEVICE(dev);
    timed_ = false;
    copy_started_ = false;
    // A Prestart has no XLA stream yet: its chunk is timed from the copy
    // stream, before the first copy.
    STRATA_CUDA_RETURN("chunk timing start", cudaEventRecord, t_begin_,
                       stream ? static_cast<cudaStream_t>(stream) : copy_stream_);
    return {};
  }

  Status BackendEnd(void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    STRATA_CUDA_RETURN("chunk timing end", cudaEventRecord, t_end_,
                       static_cast<cudaStream_t>(stream));
    timed_ = true;
    return {};
  }

  Status Timing(double* out) const override {
    if (!timed_) return "no finished chunk to time";
    STRATA_ENTER_DEVICE(dev);
    const cudaError_t q = cudaEventQuery(t_end_);
    if (q == cudaErrorNotReady) return "the chunk's device work has not finished";
    float ms = 0.f;
    STRATA_CUDA_RETURN("chunk time", cudaEventElapsedTime, &ms, t_begin_, t_end_);
    out[0] = ms;
    out[1] = out[2] = out[3] = 0.0;
    if (copy_started_) {
      STRATA_CUDA_RETURN("copy window", cudaEventElapsedTime, &ms, t_copy0_,
                         t_copy1_);
      out[1] = ms;
      STRATA_CUDA_RETURN("copy lead", cudaEventElapsedTime, &ms, t_begin_,
                         t_copy0_);
      out[2] = ms;
      STRATA_CUDA_RETURN("copy tail", cudaEventElapsedTime, &ms, t_copy1_,
                         t_end_);
      out[3] = ms;
    }
    return {};
  }

  void StartWalk() override {
    // Events are polled: nothing notifies a landing.
    WalkConfig cfg = MakeWalkConfig(kIssuerPoll);
    cfg.max_run = kMaxRun;
    issuer_.Run([this, cfg] {
      try {
        STRATA_CUDA_THROW("issuer thread, device " + std::to_string(opt_.device),
                          cudaSetDevice, opt_.device);
        struct StagerRun {
          Stager* stager;
          ~StagerRun() {
            if (stager) stager->Stop();
          }
        } run{store_.staging() ? &stager_ : nullptr};
        if (store_.staging())
          stager_.Start(
              &stream_,
              [this](const StreamEntry& e) { return SourceBlob(e.layer, e.expert); },
              &state_, opt_.device);
        Link link{this};
        walk_result_ = IssueWalk(stream_, cfg, gate_, state_, link);
        if (copy_started_)
          STRATA_CUDA_THROW("copy window end", cudaEventRecord, t_copy1_,
                            copy_stream_);
      } catch (const WalkStopped&) {
        walk_result_.stopped = true;
      } catch (const std::exception& e) {
        walk_error_ = e.what();
        walk_failed_ = true;
        state_.RequestStop();
      }
    });
  }

  Status BackendPublish(int layer, const void* counts, void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    return pub_.Publish(layer, counts, static_cast<cudaStream_t>(stream));
  }

  Status WaitCopied(int64_t k, int64_t slot, void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    // Orders the device only; the host never waits for the copies.
    STRATA_CUDA_RETURN("waiting for entry " + std::to_string(k) + " (" +
                           Entry(slot, stream_[k]) + ") and the copies before it",
                       cudaStreamWaitEvent, static_cast<cudaStream_t>(stream),
                       copied_[slot], 0u);
    return {};
  }

  Status ReleaseFrame(int layer, int64_t frame, int64_t, int64_t,
                      void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    STRATA_CUDA_RETURN("frame " + std::to_string(frame) + " of layer " +
                           std::to_string(layer),
                       cudaEventRecord, used_[frame],
                       static_cast<cudaStream_t>(stream));
    used_recorded_[frame].store(true, std::memory_order_release);
    return {};
  }

  Status CopyRows(const Rows& src, int64_t n, const Rows& dst,
                  void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    for (int p = 0; p < n_planes(); ++p)
      STRATA_CUDA_RETURN("plane " + std::to_string(p), cudaMemcpyAsync, dst.plane[p],
                         src.plane[p], static_cast<size_t>(n * plane_bytes(p)),
                         cudaMemcpyDeviceToDevice,
                         static_cast<cudaStream_t>(stream));
    return {};
  }

  uint8_t* RingBase() const override { return ring_; }

  Status CopyDirect(int layer, int expert, int64_t n, const Rows& dst,
                    void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    // From a pageable store the driver stages the blobs before returning:
    // synchronous on this thread, still ordered on the stream, and correct.
    // Routed-only chunks are small, so the slow path is acceptable here.
    if (Status s = Split(SourceBlob(layer, expert), n, dst,
                         cudaMemcpyHostToDevice,
                         static_cast<cudaStream_t>(stream));
        !s.empty())
      return "layer " + std::to_string(layer) + " experts " +
             std::to_string(expert) + ".." + std::to_string(expert + n - 1) +
             " from the host store: " + s;
    return {};
  }

  Status CopyResident(const uint8_t* src, int64_t n, const Rows& dst,
                      void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    if (Status s = Split(src, n, dst, cudaMemcpyDeviceToDevice,
                         static_cast<cudaStream_t>(stream));
        !s.empty())
      return std::to_string(n) + " resident experts: " + s;
    return {};
  }

  Status ZeroRows(const Rows& dst, int64_t n, void* stream) override {
    STRATA_ENTER_DEVICE(dev);
    for (int p = 0; p < n_planes(); ++p)
      STRATA_CUDA_RETURN("rows of skipped experts, plane " + std::to_string(p),
                         cudaMemsetAsync, dst.plane[p], 0,
                         static_cast<size_t>(n * plane_bytes(p)),
                         static_cast<cudaStream_t>(stream));
    return {};
  }

  Status WriteInts(const int32_t* host, void* out, int64_t bytes,
                   void* stream) override {
    if (bytes % static_cast<int64_t>(sizeof(int32_t)) != 0)
      return std::to_string(bytes) + " bytes are not a whole number of int32";
    STRATA_ENTER_DEVICE(dev);
    const int64_t n = bytes / static_cast<int64_t>(sizeof(int32_t));
    return LaunchIntWrites(host, out, n, large_args_, stream);
  }

  // Blocks XLA's enqueue thread until the device has run this layer's
  // publish: acceptable for the small routed-only chunks that use it.
  Status WaitPublished(int layer) override {
    STRATA_ENTER_DEVICE(dev);
    const Clock::time_point deadline = Clock::now() + kPublishWait;
    bool late = false;
    std::string error;
    const bool ok = state_.WaitUntil(
        [&] {
          try {
            if (PollPublished(layer)) return true;
          } catch (const std::exception& e) {
            error = e.what();
            return true;
          }
          late = Clock::now() > deadline;
          return late;
        },
        std::chrono::microseconds(5));
    if (!error.empty()) return error;
    if (!ok)
      return "waiting for the routing of layer " + std::to_string(layer) + ": " +
             StoppedMessage();
    if (late)
      return "routing of layer " + std::to_string(layer) +
             " was not published within " +
             std::to_string(kPublishWait.count()) +
             " s (did its publish run before its fetch?)";
    return {};
  }

  void BackendAbort() override {
    // Joined here, before the drain, so no copy is queued after it.
    JoinIssuer();
    DeviceScope dev(opt_.device);
    if (copy_stream_) {
      // Copies queued before the stop may still be running; none may land in
      // a ring slot once the chunk is over.
      const cudaError_t err = cudaStreamSynchronize(copy_stream_);
      if (err != cudaSuccess && opt_.trace)
        std::fprintf(stderr, "strata: abort: %s\n",
                     CudaError("cudaStreamSynchronize", "copy stream", err)
                         .c_str());
    }
    pub_.WaitCallbacks(kAbortCallbackWait);  // Begin waits again, unbounded by this
  }

  std::string Describe() const override {
    std::string s = "cuda device " + std::to_string(opt_.device) + ", ";
    switch (store_.path()) {
      case PinPath::kNone:
        s += "not prepared";
        break;
      case PinPath::kArena:
        s += "pinned arena (cudaHostAlloc";
        if (store_.numa_node() >= 0)
          s += ", NUMA node " + std::to_string(store_.numa_node());
        s += ")";
        break;
      case PinPath::kStaged:
        s += "staged (pageable, " + std::to_string(stager_.buffers()) +
             " bounce buffers)";
        break;
    }
    if (!store_.note().empty()) s += "; " + store_.note();
    s += pub_.mode() == PublishMode::kEvent ? "; publish by polled event"
                                            : "; publish by host callback";
    return s;
  }

 private:
  struct Link {
    CudaEngine* engine;
    void IssueCopy(int64_t k, int64_t slot, const StreamEntry&) {
      engine->IssueEntries(k, 1, slot);
    }
    bool CopyLanded(int64_t k) { return engine->CopyLanded(k); }
    void PollGate(int32_t layer) { engine->PollPublished(layer); }
    void IssueRun(int64_t k, int64_t n, int64_t slot0) {
      engine->IssueEntries(k, n, slot0);
    }
  };
  // Longest run of adjacent experts queued together: long enough that the
  // link's per-copy cost is negligible (16 experts of Qwen3-30B are 151 MB in
  // one copy per plane), short enough to stay an eighth of a layer (and near
  // the chunk's end IssueWalk halves it as entries run out).
  static constexpr int kMaxRun = 16;

  static constexpr std::chrono::microseconds kIssuerPoll{10};

  // n packed blobs at `src` (blob bytes apart) into n rows of each plane
  // (SplitIntoPlanes).
  Status Split(const uint8_t* src, int64_t n, const Rows& dst,
               cudaMemcpyKind kind, cudaStream_t st) const {
    return SplitIntoPlanes(src, n, dst, opt_.blob_bytes, table_, kind, st);
  }

  // The plane table as SplitIntoPlanes reads it, and whether one strided copy
  // moves an expert into a frames ring: every plane of one size, at one
  // stride in the blob (uniform_src_pitch_) and in the ring
  // (uniform_dst_pitch_).
  void DescribePlanes() {
    table_.n = n_planes();
    for (int p = 0; p < n_planes(); ++p) {
      table_.offset[p] = plane_offset(p);
      table_.bytes[p] = plane_bytes(p);
    }
    uniform_planes_ = true;
    uniform_src_pitch_ = n_planes() > 1 ? plane_offset(1) - plane_offset(0) : plane_bytes(0);
    uniform_dst_pitch_ = n_planes() > 1 ? PlaneRegion(1) - PlaneRegion(0) : plane_bytes(0);
    for (int p = 1; p < n_planes(); ++p)
      uniform_planes_ = uniform_planes_ && plane_bytes(p) == plane_bytes(0) &&
                        plane_offset(p) - plane_offset(p - 1) == uniform_src_pitch_ &&
                        PlaneRegion(p) - PlaneRegion(p - 1) == uniform_dst_pitch_;
  }

  const uint8_t* SourceBlob(int layer, int expert) const {
    return store_.Blob(layer, expert, opt_.blob_bytes);
  }

  // Ring, copy stream and events first: the ring is the allocation most
  // likely to fail, and pinning a large store before finding out is wasted.
  Status Allocate() {
    const int64_t blob = opt_.blob_bytes;
    const int64_t ring_bytes = RingBytes();
    size_t free_bytes = 0, total_bytes = 0;
    STRATA_CUDA_RETURN("device " + std::to_string(opt_.device), cudaMemGetInfo,
                       &free_bytes, &total_bytes);
    if (static_cast<int64_t>(free_bytes) < ring_bytes + kRingMarginBytes)
      return "ring of " + std::to_string(opt_.ring) + " slots x " +
             std::to_string(blob) + " bytes = " + GiB(double(ring_bytes)) +
             " GiB does not fit: " + GiB(double(free_bytes)) +
             " GiB free on device " + std::to_string(opt_.device) +
             " (JAX preallocates 75% of GPU memory; set "
             "XLA_PYTHON_CLIENT_MEM_FRACTION lower, or make the ring smaller)";
    STRATA_CUDA_RETURN("ring of " + std::to_string(opt_.ring) + " slots x " +
                           std::to_string(blob) + " bytes",
                       cudaMalloc, reinterpret_cast<void**>(&ring_),
                       static_cast<size_t>(ring_bytes));
    STRATA_CUDA_RETURN("copy stream", cudaStreamCreateWithFlags, &copy_stream_,
                       cudaStreamNonBlocking);
    // A ring never written holds zeros, not garbage, wherever it is read.
    STRATA_CUDA_RETURN("zeroing the ring", cudaMemset, ring_, 0,
                       static_cast<size_t>(ring_bytes));
    copied_.assign(static_cast<size_t>(opt_.ring), nullptr);
    for (int64_t slot = 0; slot < opt_.ring; ++slot)
      STRATA_CUDA_RETURN("copied event of slot " + std::to_string(slot),
                         cudaEventCreateWithFlags, &copied_[slot],
                         cudaEventDisableTiming);
    const int64_t n_frames = frames();
    used_.assign(static_cast<size_t>(n_frames), nullptr);
    for (int64_t f = 0; f < n_frames; ++f)
      STRATA_CUDA_RETURN("used event of frame " + std::to_string(f),
                         cudaEventCreateWithFlags, &used_[f],
                         cudaEventDisableTiming);
    for (cudaEvent_t* ev : {&t_begin_, &t_end_, &t_copy0_, &t_copy1_})
      STRATA_CUDA_RETURN("timing event", cudaEventCreate, ev);
    if (Status s = pub_.CreateEvents(); !s.empty()) return s;
    used_recorded_ = std::make_unique<std::atomic<bool>[]>(
        static_cast<size_t>(std::max<int64_t>(n_frames, 1)));
    for (int64_t f = 0; f < n_frames; ++f) used_recorded_[f].store(false);

    Status s = store_.Pin(opt_, stores_);
    if (!s.empty()) return s;
    if (store_.staging()) {
      s = stager_.Allocate(blob, kBounceBuffers);
      if (!s.empty()) return s;
      // The stager's queue is in order: the walk must not skip past it.
      for (StreamEntry& e : stream_) e.staged = true;
    }
    return {};
  }

  // Frees everything Prepare made; errors are ignored, there is no one left
  // to report them to.
  void ReleaseResources() {
    prepared_ = false;
    if (ring_ || copy_stream_ || store_.holds_pinned())
      // Reads of the ring and copies from the store queued on XLA's streams
      // are not ours to sync one by one; the whole device is, rarely.
      cudaDeviceSynchronize();
    stager_.Free();
    for (cudaEvent_t e : copied_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : used_)
      if (e) cudaEventDestroy(e);
    pub_.DestroyEvents();
    copied_.clear();
    used_.clear();
    for (cudaEvent_t* ev : {&t_begin_, &t_end_, &t_copy0_, &t_copy1_}) {
      if (*ev) cudaEventDestroy(*ev);
      *ev = nullptr;
    }
    timed_ = false;
    used_recorded_.reset();
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    copy_stream_ = nullptr;
    if (ring_) cudaFree(ring_);
    ring_ = nullptr;
    store_.Reset();
    cudaGetLastError();
  }

  Publisher pub_;  // the pinned counts, the callbacks' hub, the events

  HostStore store_;  // where copies read the host store from
  Stager stager_;    // the bounce buffers of a staged store

  uint8_t* ring_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
  PlaneTable table_{};  // DescribePlanes
  bool uniform_planes_ = false;
  int64_t uniform_src_pitch_ = 0, uniform_dst_pitch_ = 0;
  std::vector<cudaEvent_t> copied_;  // per slot, recorded on copy_stream_
  std::vector<cudaEvent_t> used_;    // per frame, recorded on XLA's stream
  // The layout of the last chunk that began, and whether the next copy must
  // wait for every frame's last reader (BackendBegin).
  bool ring_packed_ = false;
  bool relayout_ = false;
  // Written by Release before it releases the frame (consumed, release); read
  // by the issuer after it saw that release.
  std::unique_ptr<std::atomic<bool>[]> used_recorded_;
  // Timing of the last chunk: begin/end on XLA's stream, first copy start and
  // last copy end on the copy stream. copy_started_ is written by the issuer
  // and read after End joined it.
  cudaEvent_t t_begin_ = nullptr, t_end_ = nullptr;
  cudaEvent_t t_copy0_ = nullptr, t_copy1_ = nullptr;
  bool timed_ = false;
  bool copy_started_ = false;
  bool large_args_ = false;  // the driver takes 32 KB of kernel arguments
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Engine> MakeCudaEngine(const EngineOptions& opt, Status* err) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *err = std::string("no CUDA device visible (cudaGetDeviceCount: ") +
           cudaGetErrorString(e) + ")";
    return nullptr;
  }
  if (count == 0) {
    *err = "no CUDA device visible (cudaGetDeviceCount: 0 devices)";
    return nullptr;
  }
  if (opt.device < 0 || opt.device >= count) {
    *err = "CUDA device " + std::to_string(opt.device) + " requested; " +
           std::to_string(count) + " visible (0.." +
           std::to_string(count - 1) + ")";
    return nullptr;
  }
  auto engine = std::make_unique<cuda::CudaEngine>(opt);
  Status s = engine->Init();
  if (!s.empty()) {
    *err = s;
    return nullptr;
  }
  return engine;
}

}  // namespace strata
