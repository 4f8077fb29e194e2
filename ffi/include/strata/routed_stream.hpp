// The route gate and the issuer walk of the routed expert stream.
//
// Header-only and free of CUDA and XLA headers on purpose: the same walk runs
// behind the CUDA backend, the simulated CPU link and the GPU-free unit test,
// so its rules are proven once, anywhere. The failure it guards against is a
// walk that copies an expert no token needs (wasted PCIe time), skips one that
// a token does need (wrong output), or deadlocks against its consumer.
//
// Rules (DESIGN.md, "The issuer walk"). For entry k of the chunk's stream list:
//   1. Ring rule: wait until k < consumed + ring. With layer frames (below),
//      wait until consumed >= need[k] instead.
//   2. Routed switch only. Depth rule: at most `depth` copies queued ahead of
//      the link; wait until the copy issued `depth` copies earlier has landed.
//   3. Routed switch only. Skip rule: if k's layer is published, its expert's
//      gate byte is 0 and the entry is not staged, skip it (touch nothing).
//      Re-checked while waiting in 1 and 2.
//   4. Otherwise copy it into slot k % ring (with frames, slot_of[k]).
//   5. issued = k + 1 (release) whether copied or skipped; wake waiters.
// Every wait honours the stop flag. One more wait, outside the rules and in
// both switch positions, only while the engine sets a hold (a chunk begun from
// the host before its program runs, DESIGN.md "Prestart"): at most `hold`
// entries ahead of the copies that have landed, so another stream's small
// copy queued meanwhile waits behind a few copies, not a ring of them.
//
// Layer frames (WalkConfig::slot_of and ::need, what the engine uses): the
// ring is F frames of one layer's experts each; layer o (in order among the
// layers that fetch) owns frame o % F, and expert e of it lands in that
// frame's row e, so the frame is the layer's weights as they are read, with
// no copy out. A frame is released when its layer's expert math is done, so
// `consumed` then counts released layers and need[k] is how many must be
// released before entry k's frame is free (o - F + 1).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

// One ring entry: a non-resident expert of one layer.
struct StreamEntry {
  int32_t layer = 0;
  int32_t expert = 0;
  // Copied through the Stager's pinned bounce buffers: its queue is in order,
  // so the entry can never be skipped.
  bool staged = false;
};

// What became of an entry. Written by the issuer before `issued` is released.
enum class EntryState : uint8_t { kPending = 0, kCopied = 1, kSkipped = 2 };

inline constexpr int kDefaultDepth = 16;
inline constexpr int kMinDepth = 1;
inline constexpr int kMaxDepth = 256;

// Clamps a requested depth to [kMinDepth, kMaxDepth]; `clamped` says whether
// the value changed so the caller can warn with both numbers.
inline int ClampDepth(int64_t requested, bool* clamped = nullptr) {
  int64_t used = std::clamp<int64_t>(requested, kMinDepth, kMaxDepth);
  if (clamped) *clamped = used != requested;
  return static_cast<int>(used);
}

// Validates a stream list against the model's shape. Returns an empty string
// when it is good, else a message naming the first bad entry.
inline std::string ValidateStreamList(const std::vector<StreamEntry>& entries,
                                      int64_t n_layers, int64_t n_experts) {
  if (n_layers < 0) return "negative layer count " + std::to_string(n_layers);
  if (n_experts < 0)
    return "negative expert count " + std::to_string(n_experts);
  int32_t prev_layer = -1;
  for (size_t k = 0; k < entries.size(); ++k) {
    const StreamEntry& e = entries[k];
    if (e.layer < 0 || e.layer >= n_layers)
      return "stream entry " + std::to_string(k) + " names layer " +
             std::to_string(e.layer) + ", outside the model's " +
             std::to_string(n_layers) + " layers";
    if (e.expert < 0 || e.expert >= n_experts)
      return "stream entry " + std::to_string(k) + " names expert " +
             std::to_string(e.expert) + ", outside the model's " +
             std::to_string(n_experts) + " experts";
    if (e.layer < prev_layer)
      return "stream entry " + std::to_string(k) + " (layer " +
             std::to_string(e.layer) + ") comes after layer " +
             std::to_string(prev_layer) + ": the list must be in layer order";
    prev_layer = e.layer;
  }
  return {};
}

// The routing counts of each (layer, expert) per chunk plus a per-layer
// published flag.
// One writer per layer per chunk (the publisher); the issuer and consumers
// read. The row is written before the flag is stored with release, and read
// only after the flag is loaded with acquire.
class RouteGate {
 public:
  RouteGate() = default;
  RouteGate(int n_layers, int n_experts) { Reset(n_layers, n_experts); }

  // Clears every row and flag. Must run before the walk starts (no reader).
  void Reset(int n_layers, int n_experts) {
    if (n_layers < 0 || n_experts < 0)
      throw std::invalid_argument("RouteGate: negative layer or expert count");
    if (n_layers != n_layers_ || n_experts != n_experts_) {
      n_layers_ = n_layers;
      n_experts_ = n_experts;
      counts_.assign(static_cast<size_t>(n_layers) * n_experts, 0);
      published_ = std::make_unique<std::atomic<uint8_t>[]>(
          static_cast<size_t>(std::max(n_layers, 1)));
    } else {
      std::fill(counts_.begin(), counts_.end(), 0);
    }
    for (int l = 0; l < n_layers_; ++l)
      published_[l].store(0, std::memory_order_release);
  }

  // Fills layer `layer`'s row from per-expert token counts and publishes it.
  // Returns false (and publishes nothing) for a layer outside the gate.
  bool Publish(int layer, const int32_t* counts) {
    if (layer < 0 || layer >= n_layers_) return false;
    int32_t* row = &counts_[static_cast<size_t>(layer) * n_experts_];
    for (int e = 0; e < n_experts_; ++e) row[e] = std::max<int32_t>(counts[e], 0);
    published_[layer].store(1, std::memory_order_release);
    return true;
  }

  bool Published(int layer) const {
    return layer >= 0 && layer < n_layers_ &&
           published_[layer].load(std::memory_order_acquire) != 0;
  }

  // Valid only after Published(layer) returned true on this thread.
  bool Routed(int layer, int expert) const { return Count(layer, expert) > 0; }
  // The tokens of the chunk routed to (layer, expert); the same validity.
  int32_t Count(int layer, int expert) const {
    return counts_[static_cast<size_t>(layer) * n_experts_ + expert];
  }

  int n_layers() const { return n_layers_; }
  int n_experts() const { return n_experts_; }

 private:
  int n_layers_ = -1;
  int n_experts_ = -1;
  std::vector<int32_t> counts_;
  std::unique_ptr<std::atomic<uint8_t>[]> published_;
};

// Counters shared by the issuer, the consumer and the publisher of a chunk.
class WalkState {
 public:
  // Prepares for a chunk of `n_entries`. Must run with no walk in progress.
  void Reset(int64_t n_entries) {
    issued.store(0, std::memory_order_relaxed);
    consumed.store(0, std::memory_order_relaxed);
    stop.store(false, std::memory_order_relaxed);
    state.assign(static_cast<size_t>(n_entries), EntryState::kPending);
  }

  // Wakes every waiter (issuer and consumer); call after any state change.
  void Notify() {
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
  }

  void RequestStop() {
    stop.store(true, std::memory_order_release);
    Notify();
  }
  bool Stopped() const { return stop.load(std::memory_order_acquire); }

  // Waits until `ready()` holds or stop is requested; returns ready(). The
  // predicate is re-evaluated at least every `poll` so conditions that nobody
  // notifies (a CUDA event landing) are still seen.
  template <class Pred>
  bool WaitUntil(Pred ready, std::chrono::microseconds poll) {
    while (true) {
      if (ready()) return true;
      if (Stopped()) return false;
      std::unique_lock<std::mutex> lock(mu_);
      if (ready()) return true;
      if (Stopped()) return false;
      cv_.wait_for(lock, poll);
    }
  }

  // Consumer side: waits until the issuer has passed entry k.
  bool WaitIssued(int64_t k, std::chrono::microseconds poll =
                                 std::chrono::microseconds(2000)) {
    return WaitUntil(
        [&] { return issued.load(std::memory_order_acquire) > k; }, poll);
  }

  // Consumer side: entry k's slot has been read; the issuer may reuse it.
  void Consume(int64_t k) {
    consumed.store(k + 1, std::memory_order_release);
    Notify();
  }

  // Consumer side, layer frames: `layers` layers are done with their frames.
  void ReleaseLayers(int64_t layers) {
    consumed.store(layers, std::memory_order_release);
    Notify();
  }

  // Valid after issued > k was observed with acquire.
  EntryState entry_state(int64_t k) const { return state[k]; }

  std::atomic<int64_t> issued{0};
  std::atomic<int64_t> consumed{0};
  std::atomic<bool> stop{false};
  std::vector<EntryState> state;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

struct WalkConfig {
  int64_t ring = 1;     // ring slots; >= 1
  int depth = kDefaultDepth;  // clamped to [1, 256]; routed switch only
  bool routed = false;  // the routed switch
  std::chrono::microseconds poll{20};  // how often unnotified conditions are re-read
  // Longest run of entries queued as one copy (links with IssueRun only);
  // near the chunk's end IssueWalk also holds a run to half the entries left.
  int max_run = 1;
  // Layer frames: both set (one value per entry) or both null (the ring,
  // slot k % ring, need k - ring + 1 in entries consumed).
  const std::vector<int64_t>* slot_of = nullptr;
  const std::vector<int64_t>* need = nullptr;
  // While *hold > 0: entry k waits until k < hold or entry k - hold's copy
  // landed (a skipped entry counts as landed). The engine stores 0 and
  // notifies the walk state to lift it. Null: never held.
  const std::atomic<int64_t>* hold = nullptr;
};

// Whether a link can queue a run of adjacent entries as one copy:
//   void IssueRun(int64_t k, int64_t n, int64_t slot);
// (entries k..k+n-1 into slots slot..slot+n-1, no wrap).
template <class L, class = void>
struct HasIssueRun : std::false_type {};
template <class L>
struct HasIssueRun<L, std::void_t<decltype(std::declval<L&>().IssueRun(
                          int64_t{}, int64_t{}, int64_t{}))>> : std::true_type {};

// Whether a link publishes gate rows itself, polled by the walk:
//   void PollGate(int32_t layer);
// (the CUDA link: the layer's routing counts landed when an event recorded
// after their device-to-host copy has completed). Links without it are
// published to from outside (the CPU link's publish runs on XLA's thread).
template <class L, class = void>
struct HasPollGate : std::false_type {};
template <class L>
struct HasPollGate<L, std::void_t<decltype(std::declval<L&>().PollGate(
                          int32_t{}))>> : std::true_type {};

struct WalkResult {
  bool stopped = false;
  int64_t copied = 0;
  int64_t skipped = 0;
};

// The issuer walk, as a template over a link policy with:
//   void IssueCopy(int64_t k, int64_t slot, const StreamEntry& e);
//       Queues entry k's copy into `slot`. The link must not write the slot
//       before its previous occupant's consumer released it (its `used`
//       event); the walk guarantees that release was requested on the host
//       (k < consumed + ring, or consumed >= need[k] with frames), the link
//       orders the device side (cudaStreamWaitEvent).
//   bool CopyLanded(int64_t k);
//       Whether entry k's copy has landed (cudaEventQuery on copied[slot]).
// Returns how many entries were copied and skipped, or stopped = true.
template <class Link>
WalkResult IssueWalk(const std::vector<StreamEntry>& entries,
                     const WalkConfig& cfg, const RouteGate& gate,
                     WalkState& st, Link& link) {
  if (cfg.ring < 1)
    throw std::invalid_argument("IssueWalk: ring of " +
                                std::to_string(cfg.ring) +
                                " slots; it needs at least one");
  const int depth = ClampDepth(cfg.depth);
  const int64_t n = static_cast<int64_t>(entries.size());
  const bool frames = cfg.slot_of != nullptr;
  if (frames != (cfg.need != nullptr) ||
      (frames && (static_cast<int64_t>(cfg.slot_of->size()) != n ||
                  static_cast<int64_t>(cfg.need->size()) != n)))
    throw std::invalid_argument(
        "IssueWalk: slot_of and need must both be given, one per entry");
  auto slot_of = [&](int64_t k) {
    return frames ? (*cfg.slot_of)[k] : k % cfg.ring;
  };
  auto free_now = [&](int64_t k) {  // the ring rule for entry k
    const int64_t c = st.consumed.load(std::memory_order_acquire);
    return frames ? c >= (*cfg.need)[k] : k < c + cfg.ring;
  };
  WalkResult res;
  // Entry index of every copy issued, so the depth rule can query the copy
  // issued `depth` copies earlier. A ring of depth entries suffices.
  std::vector<int64_t> copy_entry(static_cast<size_t>(depth), -1);

  for (int64_t k = 0; k < n; ++k) {
    const StreamEntry& e = entries[k];
    auto skippable = [&] {
      if (!cfg.routed || e.staged) return false;
      if constexpr (HasPollGate<Link>::value) link.PollGate(e.layer);
      return gate.Published(e.layer) && !gate.Routed(e.layer, e.expert);
    };
    auto ring_ok = [&] { return free_now(k); };
    auto depth_ok = [&] {
      if (!cfg.routed || res.copied < depth) return true;
      return link.CopyLanded(copy_entry[res.copied % depth]);
    };
    auto hold_ok = [&](int64_t j) {
      if (!cfg.hold) return true;
      const int64_t h = cfg.hold->load(std::memory_order_acquire);
      if (h <= 0 || j < h) return true;
      return st.state[j - h] != EntryState::kCopied || link.CopyLanded(j - h);
    };

    bool skip = skippable();
    if (!skip) {
      bool ok = st.WaitUntil(
          [&] {
            if (skippable()) {
              skip = true;
              return true;
            }
            return ring_ok() && depth_ok() && hold_ok(k);
          },
          cfg.poll);
      if (!ok) {
        res.stopped = true;
        return res;
      }
    }
    if (skip) {
      st.state[k] = EntryState::kSkipped;
      ++res.skipped;
      st.issued.store(k + 1, std::memory_order_release);
      st.Notify();
      continue;
    }
    // Entries that the walk would issue right after this one, with nothing
    // to wait for, go out with it as one copy: fewer, larger copies keep the
    // link busier. A run holds adjacent experts of one layer (adjacent in
    // every host store) in adjacent slots, none staged, each copyable now by
    // the same rules as above.
    int64_t run = 1;
    if constexpr (HasIssueRun<Link>::value) {
      const int64_t slot0 = slot_of(k);
      // Routed: a run is at most half the depth. The depth rule counts
      // entries, and a run's entries land together, so a run of `depth`
      // could only go out once the run before it had wholly landed: the
      // link ran dry before each one. With half, one run is always
      // queued behind the one on the link.
      // Near the chunk's end a run holds at most half of the entries left
      // (16, 8, 4, 2, 1, 1 over the last 32): the last MoE layer's pieces
      // each wait for the copy that holds their last expert, so long runs
      // there would hold a piece's math back to the chunk's last copy.
      const int64_t limit = std::min<int64_t>(
          std::max<int64_t>(1, (n - k) / 2),
          cfg.routed ? std::min<int64_t>(cfg.max_run, std::max(1, depth / 2))
                     : static_cast<int64_t>(cfg.max_run));
      while (run < limit && k + run < n && !e.staged &&
             (frames ? slot_of(k + run) == slot0 + run : slot0 + run < cfg.ring)) {
        const int64_t j = k + run;
        const StreamEntry& f = entries[j];
        if (f.staged || f.layer != e.layer || f.expert != entries[j - 1].expert + 1)
          break;
        if (!free_now(j)) break;
        if (!hold_ok(j)) break;
        if (cfg.routed) {
          if (gate.Published(f.layer) && !gate.Routed(f.layer, f.expert)) break;
          // Copy number c needs copy c - depth landed; run < depth keeps that
          // copy out of this run, so copy_entry still names it.
          const int64_t c = res.copied + run;
          if (c >= depth && !link.CopyLanded(copy_entry[c % depth])) break;
        }
        ++run;
      }
      if (run > 1) link.IssueRun(k, run, slot0);
    }
    if (run == 1) link.IssueCopy(k, slot_of(k), e);
    for (int64_t j = k; j < k + run; ++j) {
      if (cfg.routed) copy_entry[res.copied % depth] = j;
      st.state[j] = EntryState::kCopied;
      ++res.copied;
    }
    k += run - 1;
    st.issued.store(k + 1, std::memory_order_release);
    st.Notify();
  }
  return res;
}

}  // namespace strata
