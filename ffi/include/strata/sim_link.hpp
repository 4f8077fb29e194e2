// The simulated link of the CPU backend: a copy worker thread that moves blobs
// from a host store into host ring slots, in order, at a configurable
// bandwidth and per-copy latency (optionally jittery).
//
// It stands in for the PCIe link, the copy stream and its events so the real
// issuer walk runs with real threads and atomics on a machine without a GPU.
// Events are per-slot sequence numbers: copied_[slot] = k + 1 once entry k's
// copy into the slot landed; used_[slot] = k + 1 once the consumer finished
// reading entry k from it. Like cudaStreamWaitEvent on the copy stream, the
// worker waits for the slot's previous occupant to be used before it writes.
//
// The link also keeps the checks the tests assert on (copies past the ring,
// queue depth), so a broken walk shows up as a counted violation rather than
// as silently wrong bytes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "strata/routed_stream.hpp"
#include "strata/thread_name.hpp"

namespace strata {

// One plane of a ring laid out in planes: each blob's `bytes` at `src` go to
// slot s's row of the plane's region, ring + region + s * bytes.
struct RingPlane {
  int64_t src;
  int64_t bytes;
  int64_t region;
};

struct SimLinkOptions {
  double bandwidth = 0.0;  // bytes per second; 0 or less means unlimited
  double latency = 0.0;    // seconds added to every copy
  double jitter = 0.0;     // up to this many extra seconds, uniform, per copy
  uint64_t seed = 0;
};

class SimLink {
 public:
  // `source(entry)` returns the host blob of an entry (blob_bytes long).
  using Source = std::function<const uint8_t*(const StreamEntry&)>;

  // The ring holds whole blobs, slot s at ring + s * blob_bytes, unless a
  // chunk lays it out in planes (BeginChunk).
  SimLink(Source source, int64_t blob_bytes, uint8_t* ring, int64_t ring_slots,
          SimLinkOptions options)
      : source_(std::move(source)),
        blob_bytes_(blob_bytes),
        ring_(ring),
        ring_slots_(ring_slots),
        opt_(options),
        rng_(options.seed),
        copied_(static_cast<size_t>(ring_slots)),
        used_(static_cast<size_t>(ring_slots)),
        occupant_(static_cast<size_t>(ring_slots), -1) {
    for (auto& c : copied_) c.store(0);
    for (auto& u : used_) u.store(0);
  }
  SimLink(const SimLink&) = delete;
  SimLink& operator=(const SimLink&) = delete;
  ~SimLink() { Shutdown(); }

  // Prepares for a chunk: forgets slot history, starts the worker if needed.
  // `state` is notified whenever a copy lands, so waits wake promptly.
  // `planes`: this chunk's layout of the ring, each copy split into these
  // planes as it lands (the engine's layer frames); none: whole blobs.
  void BeginChunk(WalkState* state, std::vector<RingPlane> planes = {}) {
    Drain();
    std::lock_guard<std::mutex> lock(mu_);
    state_ = state;
    planes_ = std::move(planes);
    for (auto& c : copied_) c.store(0, std::memory_order_relaxed);
    for (auto& u : used_) u.store(0, std::memory_order_relaxed);
    std::fill(occupant_.begin(), occupant_.end(), -1);
    landed_upto_.store(0);
    copies_issued_ = 0;
    copies_landed_.store(0);
    max_queued_ = 0;
    ring_violations_ = 0;
    abort_.store(false);
    if (!worker_.joinable()) {
      quit_ = false;
      worker_ = std::thread([this] {
        NameThisThread("strata-simlink");
        Run();
      });
    }
  }

  // Layer frames: the walk's need table (WalkConfig::need), against which a
  // copy issued too early is counted as a ring violation. Null: the ring.
  void SetNeed(const std::vector<int64_t>* need) {
    std::lock_guard<std::mutex> lock(mu_);
    need_ = need;
  }

  // Policy interface used by IssueWalk.
  void IssueCopy(int64_t k, int64_t slot, const StreamEntry& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_) {
      const int64_t c = state_->consumed.load(std::memory_order_acquire);
      if (need_ ? c < (*need_)[k] : k >= c + ring_slots_) ++ring_violations_;
    }
    Job job{k, slot, occupant_[slot], source_(e)};
    occupant_[slot] = k;
    jobs_.push_back(job);
    ++copies_issued_;
    int64_t queued = copies_issued_ - copies_landed_.load();
    if (queued > max_queued_) max_queued_ = queued;
    cv_.notify_all();
  }
  bool CopyLanded(int64_t k) const {
    return landed_upto_.load(std::memory_order_acquire) > k;
  }

  // Consumer side (the fetch handler): waits until entry k's copy into
  // `slot` landed. Returns false when the walk was stopped first.
  bool WaitCopied(int64_t k, int64_t slot, WalkState& st) {
    return st.WaitUntil(
        [&] { return copied_[slot].load(std::memory_order_acquire) > k; },
        std::chrono::microseconds(2000));
  }
  const uint8_t* Slot(int64_t slot) const {
    return ring_ + slot * blob_bytes_;
  }
  // Consumer side: the slot's `used` event for entry k.
  void ReleaseSlot(int64_t k, int64_t slot) {
    used_[slot].store(k + 1, std::memory_order_release);
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

  // Drops queued copies that have not started (after a stop) and waits for
  // the one in progress, so no copy lands after the chunk ended.
  void Abort() {
    abort_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.clear();
      cv_.notify_all();
    }
    Drain();
  }

  // Waits until every queued copy has landed or was dropped.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
  }

  void Shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
      jobs_.clear();
      cv_.notify_all();
    }
    if (worker_.joinable()) worker_.join();
  }

  bool running() const { return worker_.joinable(); }
  int64_t max_queued() const { return max_queued_; }
  int64_t ring_violations() const { return ring_violations_.load(); }
  int64_t slot_violations() const { return slot_violations_.load(); }
  int64_t copies_landed() const { return copies_landed_.load(); }
  int64_t blob_bytes() const { return blob_bytes_; }

 private:
  struct Job {
    int64_t k;
    int64_t slot;
    int64_t previous;  // entry that last occupied the slot, or -1
    const uint8_t* src;
  };

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return quit_ || !jobs_.empty(); });
      if (quit_) break;
      Job job = jobs_.front();
      jobs_.pop_front();
      busy_ = true;
      // Like cudaStreamWaitEvent(copy_stream, used[slot]): the previous
      // occupant must have been read before the slot is overwritten.
      if (job.previous >= 0) {
        cv_.wait(lock, [&] {
          return quit_ || abort_.load() ||
                 used_[job.slot].load(std::memory_order_acquire) >
                     job.previous;
        });
        if (quit_ || abort_.load()) {
          busy_ = false;
          idle_cv_.notify_all();
          if (quit_) break;
          continue;
        }
      }
      double seconds = opt_.latency;
      if (opt_.bandwidth > 0) seconds += blob_bytes_ / opt_.bandwidth;
      if (opt_.jitter > 0)
        seconds += std::uniform_real_distribution<double>(0, opt_.jitter)(rng_);
      // The transfer time, spent waiting on the condition variable so that a
      // stop or shutdown interrupts it at once.
      if (seconds > 0 &&
          cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                       [&] { return quit_ || abort_.load(); })) {
        busy_ = false;
        idle_cv_.notify_all();
        if (quit_) break;
        continue;
      }
      lock.unlock();
      if (used_[job.slot].load(std::memory_order_acquire) <= job.previous &&
          job.previous >= 0)
        ++slot_violations_;
      // planes_ changes only in BeginChunk, after Drain: no copy runs then.
      if (planes_.empty()) {
        std::memcpy(ring_ + job.slot * blob_bytes_, job.src,
                    static_cast<size_t>(blob_bytes_));
      } else {
        for (const RingPlane& p : planes_)
          std::memcpy(ring_ + p.region + job.slot * p.bytes, job.src + p.src,
                      static_cast<size_t>(p.bytes));
      }
      // Count the landing before publishing it: the walk may issue the next
      // copy as soon as it sees landed_upto_, and the queue-depth check must
      // not count this copy as still queued then.
      copies_landed_.fetch_add(1);
      copied_[job.slot].store(job.k + 1, std::memory_order_release);
      landed_upto_.store(job.k + 1, std::memory_order_release);
      // Notify while still busy: Drain() returns only after this, so the
      // walk state is never touched once its owner has drained the link.
      if (WalkState* st = state_) st->Notify();
      lock.lock();
      busy_ = false;
      idle_cv_.notify_all();
    }
    busy_ = false;
    idle_cv_.notify_all();
  }

  Source source_;
  int64_t blob_bytes_;
  uint8_t* ring_;
  int64_t ring_slots_;
  std::vector<RingPlane> planes_;  // this chunk's; empty: whole blobs
  const std::vector<int64_t>* need_ = nullptr;
  SimLinkOptions opt_;
  std::mt19937_64 rng_;

  std::vector<std::atomic<int64_t>> copied_;
  std::vector<std::atomic<int64_t>> used_;
  std::vector<int64_t> occupant_;
  std::atomic<int64_t> landed_upto_{0};
  std::atomic<int64_t> copies_landed_{0};
  std::atomic<int64_t> ring_violations_{0};
  std::atomic<int64_t> slot_violations_{0};
  std::atomic<bool> abort_{false};
  int64_t copies_issued_ = 0;
  int64_t max_queued_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Job> jobs_;
  bool busy_ = false;
  bool quit_ = false;
  WalkState* state_ = nullptr;
  std::thread worker_;
};

}  // namespace strata
