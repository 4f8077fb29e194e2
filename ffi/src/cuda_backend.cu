// The CUDA backend: the host store pinned (or staged through pinned bounce
// buffers), a ring of layer frames in three planes (the model reads a layer's
// experts in its frame), one copy stream with a `copied` event per slot and a
// `used` event per frame, and the issuer thread running the shared walk.
//
// Publication: publish copies the layer's routing counts to pinned host memory
// on XLA's stream, then either (publish_mode 0, the design's host callback)
// queues a cudaLaunchHostFunc whose callback fills the gate row, or
// (publish_mode 1) records the layer's `published` event, which the issuer
// polls and then fills the gate row itself. The callback holds XLA's stream
// until a driver thread has run it; the event holds nothing.
//
// The failures it guards against: a copy landing in a frame a layer's expert
// math is still reading (every copy into a frame waits on its `used` event,
// recorded by release after that math), a gate row
// from an earlier chunk's publish (Begin waits for every callback; an event
// counts only once this chunk's publish recorded it), a copy still in flight after a chunk was abandoned
// (Abort drains the copy stream), and a CUDA error escaping as a crash instead
// of a message naming the call and what it was doing.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "device_scope.hpp"
#include "engine.hpp"
#include "strata/thread_name.hpp"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Room left on the device beside the ring for XLA's own scratch and for the
// resident experts that are put on the device after prepare.
constexpr int64_t kRingMarginBytes = 256LL << 20;
// Bounce buffers of the staged path: enough for the copy of one blob to run
// while the stager threads fill the next ones.
constexpr int kBounceBuffers = 4;
constexpr int kStagerThreads = 2;
// Publish callbacks run when the device reaches them, possibly long after
// XLA enqueued them; this bounds how long the host waits for the stragglers.
constexpr std::chrono::seconds kCallbackWait{60};
constexpr std::chrono::seconds kAbortCallbackWait{10};
// How long a routed-only fetch waits for its layer's routing counts to land.
constexpr std::chrono::seconds kPublishWait{60};

std::string CudaError(const char* call, const std::string& context,
                      cudaError_t err) {
  std::string s = call;
  if (!context.empty()) s += "(" + context + ")";
  return s + ": " + cudaGetErrorString(err);
}

// `context` is evaluated only on failure, so building it costs nothing on the
// hot path.
#define STRATA_CUDA_RETURN(context, fn, ...)                 \
  do {                                                       \
    const cudaError_t strata_err_ = fn(__VA_ARGS__);         \
    if (strata_err_ != cudaSuccess)                          \
      return CudaError(#fn, (context), strata_err_);         \
  } while (0)

#define STRATA_CUDA_THROW(context, fn, ...)                              \
  do {                                                                   \
    const cudaError_t strata_err_ = fn(__VA_ARGS__);                     \
    if (strata_err_ != cudaSuccess)                                      \
      throw std::runtime_error(CudaError(#fn, (context), strata_err_));  \
  } while (0)

std::string GiB(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", bytes / double(1LL << 30));
  return buf;
}

std::string Entry(int64_t slot, const StreamEntry& e) {
  return "slot " + std::to_string(slot) + " <- layer " +
         std::to_string(e.layer) + " expert " + std::to_string(e.expert);
}

// cudaSetDevice's failure in `scope`, as a Status.
Status DeviceStatus(const DeviceScope& scope) {
  if (scope.error() == cudaSuccess) return {};
  return CudaError("cudaSetDevice", "device " + std::to_string(scope.device()),
                   scope.error());
}

// Makes the engine's device current for the rest of the scope (as `var`) and
// returns its error from the enclosing Status function if that fails.
#define STRATA_ENTER_DEVICE(var)            \
  DeviceScope var(opt_.device);             \
  if (Status strata_s_ = DeviceStatus(var); !strata_s_.empty()) return strata_s_

// Thrown out of the link when the walk is stopped while a staged entry waits
// for its bounce buffer: a cancellation, which must not read as an issuer
// failure.
struct WalkStopped {};

// Whether [p, p + bytes) is page-locked already (by XLA's pinned_host memory
// or another registration), so it can be copied from directly.
bool AlreadyPinned(const void* p, int64_t bytes) {
  const void* ends[2] = {p, static_cast<const uint8_t*>(p) + bytes - 1};
  for (const void* q : ends) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, q) != cudaSuccess) {
      cudaGetLastError();  // a failed query must not surface in a later call
      return false;
    }
    if (attr.type != cudaMemoryTypeHost) return false;
  }
  return true;
}

// By value, so the ints reach the device as kernel arguments, with the launch:
// no copy from pageable host memory (which may synchronize; End's host buffer
// dies on return), and nothing for the copy engines, where a chunk's token ids
// copied on another stream waited behind the walk's copies on the H200. N = 256
// for the stats; 8,184 for the ids (32,736 bytes: with the pointer and the
// count, under the 32,764 bytes of kernel arguments CUDA 12.1+ allows on sm_70+),
// or 1,020 (the 4 KB every driver takes) under a driver older than 12.1.
template <int N>
struct IntArgs {
  int32_t v[N];
};

template <int N>
__global__ void WriteIntArgs(IntArgs<N> v, int32_t* out, int n) {
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x))
    out[i] = v.v[i];
}

constexpr int kSmallInts = 256;
constexpr int kMidInts = 1020;
constexpr int kLargeInts = 8184;
static_assert(sizeof(IntArgs<kMidInts>) + sizeof(int32_t*) + sizeof(int) <= 4096,
              "kernel arguments over the 4,096 bytes of drivers before 12.1");
static_assert(sizeof(IntArgs<kLargeInts>) + sizeof(int32_t*) + sizeof(int) <= 32764,
              "kernel arguments over CUDA's 32,764-byte limit");

// Device-to-device split of n packed blobs into the three planes: one launch
// instead of a strided cudaMemcpy2DAsync per plane, which looked slow on the
// H200 (stream_bench --parts publication: 1,480 us per layer over the
// resident engine against 942 us for the same split done by XLA). Each block
// copies 16-byte words of one (row, plane) piece; the caller checks that
// `part` and every pointer are 16-byte aligned.
struct SplitArgs {
  const uint8_t* src;
  uint8_t* dst[3];
  int64_t blob;  // bytes from one packed blob to the next
  int64_t part;  // bytes of one plane's row
};

__global__ void SplitBlobs(SplitArgs a, int64_t blocks_per_piece) {
  const int64_t piece = blockIdx.x / blocks_per_piece;  // row * 3 + plane
  const int64_t row = piece / 3;
  const int plane = static_cast<int>(piece % 3);
  const uint4* src =
      reinterpret_cast<const uint4*>(a.src + row * a.blob + plane * a.part);
  uint4* dst = reinterpret_cast<uint4*>(a.dst[plane] + row * a.part);
  const int64_t words = a.part / 16;
  const int64_t stride = blocks_per_piece * blockDim.x;
  for (int64_t w = (blockIdx.x % blocks_per_piece) * blockDim.x + threadIdx.x;
       w < words; w += stride)
    dst[w] = src[w];
}

// Copies pageable blobs into pinned bounce buffers ahead of the issuer, in
// stream order: entry k goes through buffer k % n. Without it every copy from
// the pageable store would be staged by the driver on the issuer thread,
// stalling the walk's waits behind a host memcpy. Threads live for one walk:
// the issuer starts them and stops them before it returns.
class Stager {
 public:
  using Source = std::function<const uint8_t*(const StreamEntry&)>;

  Stager() = default;
  ~Stager() { Free(); }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  Status Allocate(int64_t blob, int n) {
    Free();
    blob_ = blob;
    STRATA_CUDA_RETURN(std::to_string(n) + " bounce buffers of " +
                           std::to_string(blob) + " bytes",
                       cudaHostAlloc, reinterpret_cast<void**>(&buf_),
                       static_cast<size_t>(blob * n), cudaHostAllocDefault);
    done_.assign(static_cast<size_t>(n), nullptr);
    for (int b = 0; b < n; ++b)
      // Blocking sync: the stager threads sleep on these instead of spinning
      // a core each while the link is busy.
      STRATA_CUDA_RETURN("bounce buffer " + std::to_string(b),
                         cudaEventCreateWithFlags, &done_[b],
                         cudaEventDisableTiming | cudaEventBlockingSync);
    filled_ = std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(n));
    n_ = n;
    return {};
  }

  void Free() {
    Stop();
    for (cudaEvent_t e : done_)
      if (e) cudaEventDestroy(e);
    done_.clear();
    if (buf_) cudaFreeHost(buf_);
    buf_ = nullptr;
    n_ = 0;
  }

  int buffers() const { return n_; }

  // Issuer thread, before the walk.
  void Start(const std::vector<StreamEntry>* entries, Source source,
             WalkState* st, int device) {
    Stop();
    entries_ = entries;
    source_ = std::move(source);
    st_ = st;
    device_ = device;
    stop_ = false;
    released_ = 0;
    next_.store(0);
    failed_.store(false);
    error_.clear();
    for (int b = 0; b < n_; ++b) filled_[b].store(-1);
    for (int t = 0; t < kStagerThreads; ++t)
      threads_.emplace_back([this] {
        NameThisThread("strata-stager");
        Work();
      });
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  // Issuer: waits until entry k sits in its buffer and returns the buffer.
  // Throws the stager's error, or WalkStopped when the walk was stopped.
  const uint8_t* WaitFilled(int64_t k, std::chrono::microseconds poll) {
    const int64_t b = k % n_;
    const bool ok = st_->WaitUntil(
        [&] {
          return failed_.load(std::memory_order_acquire) ||
                 filled_[b].load(std::memory_order_acquire) == k;
        },
        poll);
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(mu_);
      throw std::runtime_error("stager: " + error_);
    }
    if (!ok) throw WalkStopped{};
    return buf_ + b * blob_;
  }

  // Issuer: entry k's copy out of its buffer is queued on `stream`; the
  // buffer may be refilled once that copy has run.
  void Release(int64_t k, cudaStream_t stream) {
    const int64_t b = k % n_;
    STRATA_CUDA_THROW("bounce buffer " + std::to_string(b) + ", entry " +
                          std::to_string(k),
                      cudaEventRecord, done_[b], stream);
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = k + 1;
    }
    cv_.notify_all();
  }

 private:
  void Work() {
    cudaError_t err = cudaSetDevice(device_);
    if (err != cudaSuccess)
      return Fail(CudaError("cudaSetDevice",
                            "stager thread, device " + std::to_string(device_),
                            err));
    const int64_t n = static_cast<int64_t>(entries_->size());
    while (true) {
      // Claimed in order, so entry k - n_ is already claimed by a thread that
      // does not wait on k: no thread can starve another.
      const int64_t k = next_.fetch_add(1);
      if (k >= n) return;
      const int64_t b = k % n_;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || released_ > k - n_; });
        if (stop_) return;
      }
      // The last record of done_[b] is entry k - n_'s: entry k is not filled,
      // so the issuer cannot have recorded it again.
      if (k >= n_) {
        err = cudaEventSynchronize(done_[b]);
        if (err != cudaSuccess)
          return Fail(CudaError("cudaEventSynchronize",
                                "bounce buffer " + std::to_string(b) +
                                    " before entry " + std::to_string(k),
                                err));
      }
      std::memcpy(buf_ + b * blob_, source_((*entries_)[k]),
                  static_cast<size_t>(blob_));
      filled_[b].store(k, std::memory_order_release);
      st_->Notify();
    }
  }

  void Fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = msg;
    }
    failed_.store(true, std::memory_order_release);
    st_->Notify();
  }

  int64_t blob_ = 0;
  int n_ = 0;
  uint8_t* buf_ = nullptr;
  std::vector<cudaEvent_t> done_;  // per buffer: its last copy out has run
  std::unique_ptr<std::atomic<int64_t>[]> filled_;  // per buffer: entry held

  const std::vector<StreamEntry>* entries_ = nullptr;
  Source source_;
  WalkState* st_ = nullptr;
  int device_ = 0;
  std::vector<std::thread> threads_;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;        // under mu_
  int64_t released_ = 0;     // under mu_: entries whose copy out is queued
  std::string error_;        // under mu_
};

class CudaEngine;

// Shared by the engine and the publish callbacks (publish_mode 0). Callbacks
// run on a CUDA driver thread whenever the device reaches them, so they reach
// the engine only through this block, under its mutex; an engine destroyed
// with callbacks still queued detaches itself and leaks the block instead of
// leaving them a dangling pointer.
struct PublishHub {
  struct Ctx {
    PublishHub* hub;
    int layer;
  };
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending = 0;           // under mu
  CudaEngine* engine = nullptr;  // under mu; null once the engine is gone
  std::vector<Ctx> ctx;          // per layer; stable addresses
};

enum class PublishMode : int32_t { kCallback = 0, kEvent = 1 };

class CudaEngine final : public Engine {
 public:
  explicit CudaEngine(const EngineOptions& opt)
      : Engine(opt), publish_(static_cast<PublishMode>(opt.publish_mode)) {
    hub_ = new PublishHub;
    hub_->engine = this;
    hub_->ctx.resize(static_cast<size_t>(std::max(opt.n_layers, 0)));
    for (int l = 0; l < opt.n_layers; ++l) hub_->ctx[l] = {hub_, l};
  }

  ~CudaEngine() override {
    Abort();
    DeviceScope dev(opt_.device);
    const bool drained = WaitCallbacks(kCallbackWait);
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      hub_->engine = nullptr;
    }
    // Synchronizes the device when the engine was prepared, so no publish
    // copy still targets pinned_counts_ (an engine never prepared ran none).
    ReleaseResources();
    if (drained) {
      if (pinned_counts_) cudaFreeHost(pinned_counts_);
      delete hub_;
    } else {
      // Their D2H copies may still target pinned_counts_: leak it with the hub.
      std::fprintf(stderr,
                   "strata: cuda engine destroyed with publish callbacks "
                   "still queued after %llds; leaking their buffers\n",
                   static_cast<long long>(kCallbackWait.count()));
    }
    cudaGetLastError();
  }

  // The CUDA half of construction, which can fail.
  Status Init() {
    STRATA_ENTER_DEVICE(dev);
    const int64_t n = std::max<int64_t>(
        1, static_cast<int64_t>(opt_.n_layers) * opt_.n_experts);
    STRATA_CUDA_RETURN("routing counts, " + std::to_string(n) + " int32",
                       cudaHostAlloc, reinterpret_cast<void**>(&pinned_counts_),
                       static_cast<size_t>(n) * sizeof(int32_t),
                       cudaHostAllocDefault);
    int driver = 0;
    STRATA_CUDA_RETURN("driver version", cudaDriverGetVersion, &driver);
    large_args_ = driver >= 12010;  // kernel arguments past 4 KB
    return {};
  }

  Status Prepare() override {
    if (in_chunk_) return "cannot prepare during a chunk";
    if (Status s = CheckStores(); !s.empty()) return s;
    if (opt_.pin_mode < 0 || opt_.pin_mode > 2)
      return "pin_mode " + std::to_string(opt_.pin_mode) +
             " is not 0 (cudaHostRegister), 1 (pinned arena) or 2 (staged)";
    STRATA_ENTER_DEVICE(dev);
    // The pinned counts, ring and events may still be targeted by the last
    // chunk's device work: its callbacks have run, and ReleaseResources
    // synchronizes the device first.
    if (!WaitCallbacks(kCallbackWait))
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

  // publish_mode 0: called by the publish callback with hub_->mu held; must
  // not call CUDA.
  void OnPublished(int layer) {
    gate_.Publish(layer, pinned_counts_ +
                             static_cast<int64_t>(layer) * opt_.n_experts);
    state_.Notify();
  }

  // publish_mode 1: publishes `layer`'s gate row once its counts have landed
  // in pinned memory: its publish of this chunk has run on the host (recorded) and the
  // device has passed the event recorded after the counts' copy. Returns
  // whether the row is published. The issuer (stream mode) and fetch
  // (routed-only, no issuer) call it, never both in one chunk: the gate keeps
  // one writer.
  bool PollPublished(int layer) {
    if (gate_.Published(layer)) return true;
    if (publish_ != PublishMode::kEvent) return false;
    if (!pub_recorded_[layer].load(std::memory_order_acquire)) return false;
    const cudaError_t err = cudaEventQuery(published_[layer]);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess)
      throw std::runtime_error(CudaError(
          "cudaEventQuery", "routing counts of layer " + std::to_string(layer),
          err));
    gate_.Publish(layer, pinned_counts_ +
                             static_cast<int64_t>(layer) * opt_.n_experts);
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
    const uint8_t* src = staging_
                             ? stager_.WaitFilled(k, kIssuerPoll)
                             : SourceBlob(e.layer, e.expert);
    // Packed blobs: one copy per run, split by fetch. Frames: split into the
    // three planes as it crosses the link, in as few copies as the layout
    // allows: each copy costs the link a few microseconds (the H200 lost 2.3%
    // of a routed chunk's link time to three copies per expert). One expert is
    // one strided copy whose rows are its three parts (plane to plane: the
    // ring's plane stride); a run of n adjacent experts is one strided copy
    // per plane, rows of a third of a blob.
    const size_t part = static_cast<size_t>(part_bytes());
    const Rows dst = SlotRows(slot0);
    if (packed()) {
      STRATA_CUDA_THROW(
          Entry(slot0, e) + (n > 1 ? " and the next " + std::to_string(n - 1) : ""),
          cudaMemcpyAsync, PackedSlot(slot0), src,
          static_cast<size_t>(n * opt_.blob_bytes), cudaMemcpyHostToDevice,
          copy_stream_);
    } else if (n == 1) {
      STRATA_CUDA_THROW(Entry(slot0, e), cudaMemcpy2DAsync, dst.part[0],
                        static_cast<size_t>(opt_.ring) * part, src, part, part,
                        static_cast<size_t>(kParts), cudaMemcpyHostToDevice,
                        copy_stream_);
    } else {
      for (int p = 0; p < kParts; ++p)
        STRATA_CUDA_THROW(
            Entry(slot0, e) + " and the next " + std::to_string(n - 1) +
                ", plane " + std::to_string(p),
            cudaMemcpy2DAsync, dst.part[p], part, src + p * part,
            static_cast<size_t>(opt_.blob_bytes), part, static_cast<size_t>(n),
            cudaMemcpyHostToDevice, copy_stream_);
    }
    for (int64_t j = 0; j < n; ++j)
      STRATA_CUDA_THROW(Entry(slot0 + j, stream_[k + j]), cudaEventRecord,
                        copied_[slot0 + j], copy_stream_);
    if (staging_) stager_.Release(k, copy_stream_);
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
    if (!WaitCallbacks(kCallbackWait))
      return "publish callbacks of the previous chunk have not run after " +
             std::to_string(kCallbackWait.count()) + " s";
    // The last chunk's issuer is joined: nothing reads these now. A layer's
    // event counts again only after this chunk's publish recorded it. The
    // last chunk's counts copy into the same pinned row may still be pending,
    // but it was queued on XLA's stream before this chunk's copy and event
    // (XLA runs a device's programs on one in-order compute stream), so when
    // this chunk's event completes the row holds this chunk's counts.
    for (int l = 0; l < opt_.n_layers; ++l)
      pub_recorded_[l].store(false, std::memory_order_relaxed);
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
        } run{staging_ ? &stager_ : nullptr};
        if (staging_)
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
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    const int64_t n = opt_.n_experts;
    const std::string what = "routing counts of layer " + std::to_string(layer);
    STRATA_CUDA_RETURN(what, cudaMemcpyAsync,
                       pinned_counts_ + layer * n, counts,
                       static_cast<size_t>(n) * sizeof(int32_t),
                       cudaMemcpyDeviceToHost, st);
    if (publish_ == PublishMode::kEvent) {
      STRATA_CUDA_RETURN(what, cudaEventRecord, published_[layer], st);
      pub_recorded_[layer].store(true, std::memory_order_release);
      return {};
    }
    {
      std::lock_guard<std::mutex> lock(hub_->mu);
      ++hub_->pending;
    }
    const cudaError_t err =
        cudaLaunchHostFunc(st, &CudaEngine::PublishLanded, &hub_->ctx[layer]);
    if (err != cudaSuccess) {
      {
        std::lock_guard<std::mutex> lock(hub_->mu);
        --hub_->pending;
      }
      hub_->cv.notify_all();
      return CudaError("cudaLaunchHostFunc", what, err);
    }
    return {};
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
    for (int p = 0; p < kParts; ++p)
      STRATA_CUDA_RETURN("plane " + std::to_string(p), cudaMemcpyAsync, dst.part[p],
                         src.part[p], static_cast<size_t>(n * part_bytes()),
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
    for (uint8_t* p : dst.part)
      STRATA_CUDA_RETURN("rows of skipped experts", cudaMemsetAsync, p, 0,
                         static_cast<size_t>(n * part_bytes()),
                         static_cast<cudaStream_t>(stream));
    return {};
  }

  Status WriteInts(const int32_t* host, void* out, int64_t bytes,
                   void* stream) override {
    if (bytes % static_cast<int64_t>(sizeof(int32_t)) != 0)
      return std::to_string(bytes) + " bytes are not a whole number of int32";
    STRATA_ENTER_DEVICE(dev);
    const int64_t n = bytes / static_cast<int64_t>(sizeof(int32_t));
    if (n <= kSmallInts) return LaunchWrites<kSmallInts>(host, out, n, stream);
    return large_args_ ? LaunchWrites<kLargeInts>(host, out, n, stream)
                       : LaunchWrites<kMidInts>(host, out, n, stream);
  }

  // One launch per N ints, each carrying them as its arguments.
  template <int N>
  Status LaunchWrites(const int32_t* host, void* out, int64_t n, void* stream) {
    auto v = std::make_unique<IntArgs<N>>();  // 32 KB: not on the stack
    for (int64_t off = 0; off < n; off += N) {
      int count = static_cast<int>(std::min<int64_t>(N, n - off));
      std::memcpy(v->v, host + off, static_cast<size_t>(count) * sizeof(int32_t));
      int32_t* dst = static_cast<int32_t*>(out) + off;
      void* args[] = {v.get(), &dst, &count};
      const unsigned blocks = static_cast<unsigned>((count + 255) / 256);
      STRATA_CUDA_RETURN("ints " + std::to_string(off) + ".." +
                             std::to_string(off + count) + " as kernel arguments",
                         cudaLaunchKernel,
                         reinterpret_cast<const void*>(&WriteIntArgs<N>),
                         dim3(blocks), dim3(256u), args, size_t{0},
                         static_cast<cudaStream_t>(stream));
    }
    return {};
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
      return "the chunk was stopped while waiting for the routing of layer " +
             std::to_string(layer);
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
    WaitCallbacks(kAbortCallbackWait);  // Begin waits again, unbounded by this
  }

  std::string Describe() const override {
    std::string s = "cuda device " + std::to_string(opt_.device) + ", ";
    switch (pin_path_) {
      case PinPath::kNone:
        s += "not prepared";
        break;
      case PinPath::kRegistered:
        s += "pinned (cudaHostRegister)";
        break;
      case PinPath::kArena:
        s += "pinned arena (cudaHostAlloc)";
        break;
      case PinPath::kStaged:
        s += "staged (pageable, " + std::to_string(stager_.buffers()) +
             " bounce buffers)";
        break;
    }
    if (!pin_note_.empty()) s += "; " + pin_note_;
    s += publish_ == PublishMode::kEvent ? "; publish by polled event"
                                         : "; publish by host callback";
    return s;
  }

 private:
  enum class PinPath { kNone, kRegistered, kArena, kStaged };

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
  // Longest run of adjacent experts queued together: 16 experts of
  // Qwen3-30B are 151 MB in three copies (one per plane), where the per-copy
  // cost (1.8% at one copy per 9.4 MB expert, measured) is gone, and still
  // an eighth of a layer. (8, one copy each, until the layer frames.)
  static constexpr int kMaxRun = 16;

  static constexpr std::chrono::microseconds kIssuerPoll{10};

  static void CUDART_CB PublishLanded(void* arg) {
    auto* ctx = static_cast<PublishHub::Ctx*>(arg);
    PublishHub* hub = ctx->hub;
    {
      std::lock_guard<std::mutex> lock(hub->mu);
      if (hub->engine) hub->engine->OnPublished(ctx->layer);
      --hub->pending;
    }
    hub->cv.notify_all();
  }

  // Returns whether every queued publish callback has run.
  bool WaitCallbacks(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(hub_->mu);
    return hub_->cv.wait_for(lock, timeout,
                             [&] { return hub_->pending == 0; });
  }

  // n packed blobs at `src` (blob bytes apart) into n rows of each plane:
  // on the device one SplitBlobs launch where everything is 16-byte aligned,
  // else (and from the host) one strided copy per plane.
  Status Split(const uint8_t* src, int64_t n, const Rows& dst,
               cudaMemcpyKind kind, cudaStream_t st) const {
    static_assert(kParts == 3, "SplitBlobs copies three planes");
    const size_t part = static_cast<size_t>(part_bytes());
    auto aligned = [](const void* p) {
      return reinterpret_cast<uintptr_t>(p) % 16 == 0;
    };
    if (kind == cudaMemcpyDeviceToDevice && n > 0 && part % 16 == 0 &&
        opt_.blob_bytes % 16 == 0 && aligned(src) && aligned(dst.part[0]) &&
        aligned(dst.part[1]) && aligned(dst.part[2])) {
      SplitArgs a{src, {dst.part[0], dst.part[1], dst.part[2]},
                  opt_.blob_bytes, static_cast<int64_t>(part)};
      constexpr int kThreads = 256;
      // About 64 KiB of words per block: enough blocks to fill the device
      // even for one row, few enough to keep each block streaming.
      const int64_t words = static_cast<int64_t>(part) / 16;
      const int64_t per_piece =
          std::max<int64_t>(1, std::min<int64_t>(64, words / 4096));
      const int64_t blocks = n * kParts * per_piece;
      void* args[] = {&a, const_cast<int64_t*>(&per_piece)};
      STRATA_CUDA_RETURN(std::to_string(n) + " rows, 3 planes",
                         cudaLaunchKernel,
                         reinterpret_cast<const void*>(&SplitBlobs),
                         dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                         args, size_t{0}, st);
      return {};
    }
    for (int p = 0; p < kParts; ++p)
      STRATA_CUDA_RETURN("plane " + std::to_string(p) + ", " + std::to_string(n) +
                             " rows",
                         cudaMemcpy2DAsync, dst.part[p], part, src + p * part,
                         static_cast<size_t>(opt_.blob_bytes), part,
                         static_cast<size_t>(n), kind, st);
    return {};
  }

  const uint8_t* SourceBlob(int layer, int expert) const {
    return src_[layer] + static_cast<int64_t>(expert) * opt_.blob_bytes;
  }

  // Ring, copy stream and events first: the ring is the allocation most
  // likely to fail, and pinning a large store before finding out is wasted.
  Status Allocate() {
    const int64_t blob = opt_.blob_bytes;
    const int64_t ring_bytes = opt_.ring * blob;
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
    published_.assign(static_cast<size_t>(opt_.n_layers), nullptr);
    for (int l = 0; l < opt_.n_layers; ++l)
      STRATA_CUDA_RETURN("published event of layer " + std::to_string(l),
                         cudaEventCreateWithFlags, &published_[l],
                         cudaEventDisableTiming);
    pub_recorded_ = std::make_unique<std::atomic<bool>[]>(
        static_cast<size_t>(std::max(opt_.n_layers, 1)));
    for (int l = 0; l < opt_.n_layers; ++l) pub_recorded_[l].store(false);
    used_recorded_ = std::make_unique<std::atomic<bool>[]>(
        static_cast<size_t>(std::max<int64_t>(n_frames, 1)));
    for (int64_t f = 0; f < n_frames; ++f) used_recorded_[f].store(false);

    Status s = PinStore();
    if (!s.empty()) return s;
    if (staging_) {
      s = stager_.Allocate(blob, kBounceBuffers);
      if (!s.empty()) return s;
      // The stager's queue is in order: the walk must not skip past it.
      for (StreamEntry& e : stream_) e.staged = true;
    }
    return {};
  }

  // Chooses where copies read the host store from, per opt_.pin_mode. A
  // store that cannot be pinned falls back to staging, with the reason kept
  // for Describe(): slower, but the chunk still runs.
  Status PinStore() {
    const int64_t bytes = opt_.blob_bytes * opt_.n_experts;
    src_ = stores_;
    std::string fallback;
    if (opt_.pin_mode == 0) {
      for (int l = 0; l < opt_.n_layers && fallback.empty(); ++l) {
        if (!stores_[l] || bytes == 0) continue;
        // Layers may share one store (tests do): register it once.
        if (std::find(stores_.begin(), stores_.begin() + l, stores_[l]) !=
            stores_.begin() + l)
          continue;
        void* p = const_cast<uint8_t*>(stores_[l]);
        const cudaError_t err = cudaHostRegister(
            p, static_cast<size_t>(bytes), cudaHostRegisterDefault);
        if (err == cudaSuccess) {
          registered_.push_back(p);
          continue;
        }
        cudaGetLastError();  // not sticky; keep it out of later calls
        if (err == cudaErrorHostMemoryAlreadyRegistered &&
            AlreadyPinned(p, bytes))
          continue;
        fallback = CudaError("cudaHostRegister",
                             "layer " + std::to_string(l) + " store, " +
                                 GiB(double(bytes)) + " GiB",
                             err);
      }
      if (fallback.empty()) {
        pin_path_ = PinPath::kRegistered;
        return {};
      }
      Unpin();
    } else if (opt_.pin_mode == 1) {
      // Stores packed straight into pinned memory (the Python side allocates
      // them with strata_pinned_alloc) are used in place: no second copy.
      bool in_place = true;
      for (int l = 0; l < opt_.n_layers && in_place; ++l)
        if (stores_[l] && bytes > 0) in_place = AlreadyPinned(stores_[l], bytes);
      if (in_place) {
        pin_path_ = PinPath::kArena;
        pin_note_ = "packed in place";
        return {};
      }
      int64_t layers = 0;
      for (int l = 0; l < opt_.n_layers; ++l) layers += stores_[l] ? 1 : 0;
      const int64_t total = layers * bytes;
      cudaError_t err = cudaSuccess;
      if (total > 0) {
        err = cudaHostAlloc(reinterpret_cast<void**>(&arena_),
                            static_cast<size_t>(total), cudaHostAllocDefault);
        if (err != cudaSuccess) {
          cudaGetLastError();
          arena_ = nullptr;
        }
      }
      if (err == cudaSuccess) {
        int64_t off = 0;
        for (int l = 0; l < opt_.n_layers; ++l) {
          if (!stores_[l]) continue;
          std::memcpy(arena_ + off, stores_[l], static_cast<size_t>(bytes));
          src_[l] = arena_ + off;
          off += bytes;
        }
        pin_path_ = PinPath::kArena;
        return {};
      }
      fallback = CudaError("cudaHostAlloc",
                           "pinned arena of " + GiB(double(total)) + " GiB", err);
    }
    pin_path_ = PinPath::kStaged;
    staging_ = true;
    if (!fallback.empty()) {
      pin_note_ = "fell back from pin_mode " + std::to_string(opt_.pin_mode) +
                  ": " + fallback;
      if (opt_.trace)
        std::fprintf(stderr, "strata: host store not pinned: %s\n",
                     pin_note_.c_str());
    }
    return {};
  }

  void Unpin() {
    for (void* p : registered_) cudaHostUnregister(p);
    registered_.clear();
    if (arena_) cudaFreeHost(arena_);
    arena_ = nullptr;
  }

  // Frees everything Prepare made; errors are ignored, there is no one left
  // to report them to.
  void ReleaseResources() {
    prepared_ = false;
    if (ring_ || copy_stream_ || !registered_.empty() || arena_)
      // Reads of the ring and copies from the store queued on XLA's streams
      // are not ours to sync one by one; the whole device is, rarely.
      cudaDeviceSynchronize();
    stager_.Free();
    for (cudaEvent_t e : copied_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : used_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : published_)
      if (e) cudaEventDestroy(e);
    copied_.clear();
    used_.clear();
    published_.clear();
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
    Unpin();
    src_.clear();
    pin_path_ = PinPath::kNone;
    pin_note_.clear();
    staging_ = false;
    cudaGetLastError();
  }

  const PublishMode publish_;
  PublishHub* hub_ = nullptr;
  int32_t* pinned_counts_ = nullptr;  // [L, E], written by D2H, read by the gate's writer
  // Per layer: recorded on XLA's stream after the counts' copy, and whether
  // this chunk's publish has recorded it (release, after the record).
  std::vector<cudaEvent_t> published_;
  std::unique_ptr<std::atomic<bool>[]> pub_recorded_;

  PinPath pin_path_ = PinPath::kNone;
  std::string pin_note_;
  std::vector<const uint8_t*> src_;  // per layer: where copies read from
  std::vector<void*> registered_;    // ranges this engine registered
  uint8_t* arena_ = nullptr;
  bool staging_ = false;
  Stager stager_;

  uint8_t* ring_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
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
  auto engine = std::make_unique<CudaEngine>(opt);
  Status s = engine->Init();
  if (!s.empty()) {
    *err = s;
    return nullptr;
  }
  return engine;
}

}  // namespace strata
