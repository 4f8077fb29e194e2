// The host store's side of the CUDA backend (see cuda_store.hpp): pinning it
// (HostStore) and, where it stays pageable, the Stager's bounce buffers.
#include "cuda_store.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "numa_scope.hpp"
#include "strata/thread_name.hpp"

namespace strata {
namespace STRATA_INTERNAL cuda {
namespace {

constexpr int kStagerThreads = 2;

}  // namespace

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

// ---- Stager -----------------------------------------------------------------

Status Stager::Allocate(int64_t blob, int n) {
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

void Stager::Free() {
  Stop();
  for (cudaEvent_t e : done_)
    if (e) cudaEventDestroy(e);
  done_.clear();
  if (buf_) cudaFreeHost(buf_);
  buf_ = nullptr;
  n_ = 0;
}

void Stager::Start(const std::vector<StreamEntry>* entries, Source source,
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

void Stager::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

const uint8_t* Stager::WaitFilled(int64_t k, std::chrono::microseconds poll) {
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

void Stager::Release(int64_t k, cudaStream_t stream) {
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

void Stager::Work() {
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

void Stager::Fail(const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = msg;
  }
  failed_.store(true, std::memory_order_release);
  st_->Notify();
}

// ---- HostStore --------------------------------------------------------------

Status HostStore::Pin(const EngineOptions& opt,
                      const std::vector<const uint8_t*>& stores) {
  const int64_t bytes = opt.blob_bytes * opt.n_experts;
  src_ = stores;
  std::string fallback;
  if (opt.pin_mode == 1) {
    // Stores packed straight into pinned memory (the Python side allocates
    // them in a PinnedBuffer, PinnedAlloc) are used in place: no second copy.
    bool in_place = true;
    for (int l = 0; l < opt.n_layers && in_place; ++l)
      if (stores[l] && bytes > 0) in_place = AlreadyPinned(stores[l], bytes);
    if (in_place) {
      pin_path_ = PinPath::kArena;
      pin_note_ = "packed in place";
      return {};
    }
    int64_t layers = 0;
    for (int l = 0; l < opt.n_layers; ++l) layers += stores[l] ? 1 : 0;
    const int64_t total = layers * bytes;
    cudaError_t err = cudaSuccess;
    if (total > 0) {
      NumaScope near(opt.device);  // the arena on the GPU's host node
      err = cudaHostAlloc(reinterpret_cast<void**>(&arena_),
                          static_cast<size_t>(total), cudaHostAllocDefault);
      numa_node_ = near.node();
      if (err != cudaSuccess) {
        cudaGetLastError();
        arena_ = nullptr;
      }
    }
    if (err == cudaSuccess) {
      int64_t off = 0;
      for (int l = 0; l < opt.n_layers; ++l) {
        if (!stores[l]) continue;
        std::memcpy(arena_ + off, stores[l], static_cast<size_t>(bytes));
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
    pin_note_ = "fell back from pin_mode " + std::to_string(opt.pin_mode) +
                ": " + fallback;
    if (opt.trace)
      std::fprintf(stderr, "strata: host store not pinned: %s\n",
                   pin_note_.c_str());
  }
  return {};
}

void HostStore::Unpin() {
  if (arena_) cudaFreeHost(arena_);
  arena_ = nullptr;
}

void HostStore::Reset() {
  Unpin();
  src_.clear();
  pin_path_ = PinPath::kNone;
  pin_note_.clear();
  numa_node_ = -1;
  staging_ = false;
}

}  // namespace cuda
}  // namespace strata
