// Publication in the CUDA backend: how a layer's routing counts reach the
// gate. Publish copies the layer's counts to pinned host memory on XLA's
// stream, then either (publish_mode 0, the design's host callback) queues a
// cudaLaunchHostFunc whose callback fills the gate row, or (publish_mode 1)
// records the layer's `published` event, which the issuer polls and then
// fills the gate row itself. The callback holds XLA's stream until a driver
// thread has run it; the event holds nothing. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda_util.hpp"
#include "engine.hpp"

namespace strata {
namespace STRATA_INTERNAL cuda {

// Publish callbacks run when the device reaches them, possibly long after
// XLA enqueued them; this bounds how long the host waits for the stragglers.
constexpr std::chrono::seconds kCallbackWait{60};
constexpr std::chrono::seconds kAbortCallbackWait{10};

enum class PublishMode : int32_t { kCallback = 0, kEvent = 1 };

// Who fills the gate row when a publish callback runs (publish_mode 0): the
// engine. Called on a CUDA driver thread with the hub's mutex held; must not
// call CUDA.
class PublishSink {
 public:
  virtual void OnPublished(int layer) = 0;

 protected:
  ~PublishSink() = default;
};

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
  int64_t pending = 0;            // under mu
  PublishSink* engine = nullptr;  // under mu; null once the engine is gone
  std::vector<Ctx> ctx;           // per layer; stable addresses
};

// The engine's publication path: the pinned routing counts, the hub of the
// publish callbacks and the per-layer `published` events. Its CUDA calls run
// on the engine's device, made current by the caller.
class Publisher {
 public:
  Publisher(PublishMode mode, int n_layers, int n_experts, PublishSink* engine);
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  PublishMode mode() const { return mode_; }

  // The pinned counts, [L, E]: part of the engine's construction (Init).
  Status AllocateCounts();
  // The per-layer `published` events and their recorded flags (Prepare).
  Status CreateEvents();
  // Destroys the `published` events; errors are ignored.
  void DestroyEvents();

  // Returns whether every queued publish callback has run.
  bool WaitCallbacks(std::chrono::seconds timeout);
  // The engine is going: waits up to kCallbackWait for the queued callbacks,
  // then detaches the engine from the hub. Returns whether they all ran.
  bool Detach();
  // After Detach and the device sync: frees the pinned counts and the hub
  // when the callbacks `drained`, else leaks them (their D2H copies may still
  // target the counts) and says so.
  void Free(bool drained);

  // Begin: no layer's event counts until this chunk's publish recorded it.
  void ResetChunk();
  // Queues `layer`'s counts (device memory) to the pinned row on `st`, then
  // its callback or its event.
  Status Publish(int layer, const void* counts, cudaStream_t st);
  // publish_mode 1: whether `layer`'s counts have landed in pinned memory:
  // its publish of this chunk has run on the host (recorded) and the device
  // has passed the event recorded after the counts' copy. Always false for
  // publish_mode 0. Throws when the event cannot be queried.
  bool Landed(int layer);
  // `layer`'s row of the pinned counts.
  const int32_t* Counts(int layer) const {
    return pinned_counts_ + static_cast<int64_t>(layer) * n_experts_;
  }

 private:
  static void CUDART_CB PublishLanded(void* arg);

  const PublishMode mode_;
  const int n_layers_;
  const int n_experts_;
  PublishHub* hub_ = nullptr;
  int32_t* pinned_counts_ = nullptr;  // [L, E], written by D2H, read by the gate's writer
  // Per layer: recorded on XLA's stream after the counts' copy, and whether
  // this chunk's publish has recorded it (release, after the record).
  std::vector<cudaEvent_t> published_;
  std::unique_ptr<std::atomic<bool>[]> pub_recorded_;
};

}  // namespace cuda
}  // namespace strata
