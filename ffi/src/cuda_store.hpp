// Where the CUDA backend's copies read the host store from: the store pinned
// in place (cudaHostRegister), copied into a pinned arena (cudaHostAlloc), or
// left pageable and staged through pinned bounce buffers by the Stager's
// threads, ahead of the issuer. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_util.hpp"
#include "engine.hpp"

namespace strata {
namespace STRATA_INTERNAL cuda {

// Thrown out of the link when the walk is stopped while a staged entry waits
// for its bounce buffer: a cancellation, which must not read as an issuer
// failure.
struct WalkStopped {};

// Whether [p, p + bytes) is page-locked already (by XLA's pinned_host memory
// or another registration), so it can be copied from directly.
bool AlreadyPinned(const void* p, int64_t bytes);

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

  // n pinned buffers of `blob` bytes each, and an event per buffer.
  Status Allocate(int64_t blob, int n);
  // Stops the threads and frees the buffers and events; errors are ignored.
  void Free();

  int buffers() const { return n_; }

  // Issuer thread, before the walk.
  void Start(const std::vector<StreamEntry>* entries, Source source,
             WalkState* st, int device);

  // Stops and joins the stager threads.
  void Stop();

  // Issuer: waits until entry k sits in its buffer and returns the buffer.
  // Throws the stager's error, or WalkStopped when the walk was stopped.
  const uint8_t* WaitFilled(int64_t k, std::chrono::microseconds poll);

  // Issuer: entry k's copy out of its buffer is queued on `stream`; the
  // buffer may be refilled once that copy has run.
  void Release(int64_t k, cudaStream_t stream);

 private:
  // A stager thread: fills the buffers with the entries it claims, in order.
  void Work();
  // Keeps the first error and wakes the issuer, which throws it.
  void Fail(const std::string& msg);

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

// How the host store is read (HostStore::path), for Describe().
enum class PinPath { kNone, kArena, kStaged };

// The host store as the link's copies read it, per layer, once Pin chose how.
// The Stager that a staged store needs is the engine's, beside it.
class HostStore {
 public:
  HostStore() = default;
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // Chooses where copies read the host store (`stores`, per layer) from:
  // opt.pin_mode 1, the stores in place when they are pinned already (packed
  // into a pinned block by the Python side), else a pinned arena they are
  // copied into; 2, staging through the Stager's pinned bounce buffers. A
  // store that cannot be pinned falls back to staging, with the reason kept
  // for Describe(): slower, but the chunk still runs.
  Status Pin(const EngineOptions& opt, const std::vector<const uint8_t*>& stores);
  // Frees the arena Pin made.
  void Unpin();
  // Unpins and forgets the choice (PinPath::kNone, nothing to read from).
  void Reset();

  // Whether Pin made an arena that is still held.
  bool holds_pinned() const { return arena_ != nullptr; }
  // Copies go through the Stager's bounce buffers.
  bool staging() const { return staging_; }
  PinPath path() const { return pin_path_; }
  const std::string& note() const { return pin_note_; }
  // The host NUMA node Pin's arena was allocated on (NumaScope), or -1.
  int numa_node() const { return numa_node_; }
  // Where the copies read `expert` of `layer` from.
  const uint8_t* Blob(int layer, int expert, int64_t blob_bytes) const {
    return src_[layer] + static_cast<int64_t>(expert) * blob_bytes;
  }

 private:
  PinPath pin_path_ = PinPath::kNone;
  std::string pin_note_;
  std::vector<const uint8_t*> src_;  // per layer: where copies read from
  uint8_t* arena_ = nullptr;
  int numa_node_ = -1;
  bool staging_ = false;
};

}  // namespace cuda
}  // namespace strata
