// The CUDA backend's publication path (see cuda_publish.hpp).
#include "cuda_publish.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace strata {
namespace STRATA_INTERNAL cuda {

Publisher::Publisher(PublishMode mode, int n_layers, int n_experts,
                     PublishSink* engine)
    : mode_(mode), n_layers_(n_layers), n_experts_(n_experts) {
  hub_ = new PublishHub;
  hub_->engine = engine;
  hub_->ctx.resize(static_cast<size_t>(std::max(n_layers, 0)));
  for (int l = 0; l < n_layers; ++l) hub_->ctx[l] = {hub_, l};
}

Status Publisher::AllocateCounts() {
  const int64_t n = std::max<int64_t>(
      1, static_cast<int64_t>(n_layers_) * n_experts_);
  STRATA_CUDA_RETURN("routing counts, " + std::to_string(n) + " int32",
                     cudaHostAlloc, reinterpret_cast<void**>(&pinned_counts_),
                     static_cast<size_t>(n) * sizeof(int32_t),
                     cudaHostAllocDefault);
  return {};
}

Status Publisher::CreateEvents() {
  published_.assign(static_cast<size_t>(n_layers_), nullptr);
  for (int l = 0; l < n_layers_; ++l)
    STRATA_CUDA_RETURN("published event of layer " + std::to_string(l),
                       cudaEventCreateWithFlags, &published_[l],
                       cudaEventDisableTiming);
  pub_recorded_ = std::make_unique<std::atomic<bool>[]>(
      static_cast<size_t>(std::max(n_layers_, 1)));
  for (int l = 0; l < n_layers_; ++l) pub_recorded_[l].store(false);
  return {};
}

void Publisher::DestroyEvents() {
  for (cudaEvent_t e : published_)
    if (e) cudaEventDestroy(e);
  published_.clear();
}

void CUDART_CB Publisher::PublishLanded(void* arg) {
  auto* ctx = static_cast<PublishHub::Ctx*>(arg);
  PublishHub* hub = ctx->hub;
  {
    std::lock_guard<std::mutex> lock(hub->mu);
    if (hub->engine) hub->engine->OnPublished(ctx->layer);
    --hub->pending;
  }
  hub->cv.notify_all();
}

bool Publisher::WaitCallbacks(std::chrono::seconds timeout) {
  std::unique_lock<std::mutex> lock(hub_->mu);
  return hub_->cv.wait_for(lock, timeout,
                           [&] { return hub_->pending == 0; });
}

bool Publisher::Detach() {
  const bool drained = WaitCallbacks(kCallbackWait);
  {
    std::lock_guard<std::mutex> lock(hub_->mu);
    hub_->engine = nullptr;
  }
  return drained;
}

void Publisher::Free(bool drained) {
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
}

void Publisher::ResetChunk() {
  for (int l = 0; l < n_layers_; ++l)
    pub_recorded_[l].store(false, std::memory_order_relaxed);
}

Status Publisher::Publish(int layer, const void* counts, cudaStream_t st) {
  const int64_t n = n_experts_;
  const std::string what = "routing counts of layer " + std::to_string(layer);
  STRATA_CUDA_RETURN(what, cudaMemcpyAsync,
                     pinned_counts_ + layer * n, counts,
                     static_cast<size_t>(n) * sizeof(int32_t),
                     cudaMemcpyDeviceToHost, st);
  if (mode_ == PublishMode::kEvent) {
    STRATA_CUDA_RETURN(what, cudaEventRecord, published_[layer], st);
    pub_recorded_[layer].store(true, std::memory_order_release);
    return {};
  }
  {
    std::lock_guard<std::mutex> lock(hub_->mu);
    ++hub_->pending;
  }
  const cudaError_t err =
      cudaLaunchHostFunc(st, &Publisher::PublishLanded, &hub_->ctx[layer]);
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

bool Publisher::Landed(int layer) {
  if (mode_ != PublishMode::kEvent) return false;
  if (!pub_recorded_[layer].load(std::memory_order_acquire)) return false;
  const cudaError_t err = cudaEventQuery(published_[layer]);
  if (err == cudaErrorNotReady) return false;
  if (err != cudaSuccess)
    throw std::runtime_error(CudaError(
        "cudaEventQuery", "routing counts of layer " + std::to_string(layer),
        err));
  return true;
}

}  // namespace cuda
}  // namespace strata
