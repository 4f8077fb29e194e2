// GPU-free test of the routed issuer walk (strata/routed_stream.hpp) against
// the simulated link (strata/sim_link.hpp), with real threads and atomics.
//
// Each simulated chunk runs three threads, as the engine does: the issuer
// (IssueWalk), the consumer (walks the layers in order like fetch: waits for
// issued > k, reads and checks the slot of every copied entry, releases it)
// and the publisher (publishes each layer's routing when the consumer reaches
// it, after a random delay, like the host callback after the router). On every
// chunk it asserts:
//   - every routed entry is copied exactly once, into slot k % ring, and the
//     consumer reads its own bytes;
//   - only unrouted, non-staged entries of published layers are skipped;
//   - never more than `depth` copies are queued (switch on);
//   - no copy is issued past the ring nor writes a slot still being read;
//   - issued covers every entry;
//   - with the switch off nothing is skipped.
// Besides: bad input, a stop mid-walk, a link that publishes the gate itself,
// the hold of a chunk begun from the host, and the issuer's worker thread.
// Exit status 0 when every check held; the first failures are printed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "strata/routed_stream.hpp"
#include "strata/worker.hpp"
#include "strata/sim_link.hpp"

namespace {

int g_failures = 0;
int64_t g_runs = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                               \
  do {                                                                 \
    ++g_checks;                                                        \
    if (!(cond)) {                                                     \
      if (++g_failures <= 20) {                                        \
        std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__,    \
                     __LINE__, #cond);                                 \
        std::fprintf(stderr, __VA_ARGS__);                             \
        std::fprintf(stderr, "\n");                                    \
      }                                                                \
    }                                                                  \
  } while (0)

using strata::EntryState;
using strata::RouteGate;
using strata::SimLink;
using strata::SimLinkOptions;
using strata::StreamEntry;
using strata::WalkConfig;
using strata::WalkResult;
using strata::WalkState;

// A model's host store: every (layer, expert) blob filled with bytes derived
// from its identity, so a slot holding the wrong expert is caught.
struct Store {
  int n_layers, n_experts;
  int64_t blob_bytes;
  std::vector<uint8_t> bytes;
  Store(int L, int E, int64_t b) : n_layers(L), n_experts(E), blob_bytes(b) {
    bytes.resize(static_cast<size_t>(L) * E * b);
    for (int l = 0; l < L; ++l)
      for (int e = 0; e < E; ++e)
        for (int64_t i = 0; i < b; ++i)
          bytes[(static_cast<size_t>(l) * E + e) * b + i] =
              static_cast<uint8_t>((l * 131 + e * 31 + i * 7 + 1) & 0xff);
  }
  const uint8_t* blob(int l, int e) const {
    return bytes.data() + (static_cast<size_t>(l) * n_experts + e) * blob_bytes;
  }
};

struct Chunk {
  std::string name;
  int n_layers = 1, n_experts = 1;
  std::vector<StreamEntry> entries;
  std::vector<std::vector<int32_t>> counts;  // [layer][expert]
  WalkConfig cfg;
  SimLinkOptions link;
  // Publisher: delay before each layer's routing lands (microseconds), and
  // whether every layer is published before the walk starts.
  int max_publish_delay_us = 0;
  bool publish_all_first = false;
  bool publish_none = false;
  // Consumer: wait this long before starting (lets the issuer run ahead).
  int consumer_start_delay_us = 0;
  // > 0: layer frames (WalkConfig::slot_of / need), the engine's ring: layer
  // l's expert e in slot (l % frames) * n_experts + e, released per layer.
  int frames = 0;
};

// Records what the walk asked of the link, then forwards to the SimLink.
struct RecordingLink {
  SimLink* link;
  int64_t ring;
  const std::vector<int64_t>* slot_of = nullptr;  // frames: the expected slots
  int64_t want(int64_t k) const { return slot_of ? (*slot_of)[k] : k % ring; }
  std::vector<int> copies;  // per entry
  std::vector<int64_t> slots;
  int64_t bad_slot = 0;
  // Each copy's entries in issue order (a run's count once, a single copy 1).
  std::vector<int64_t> copy_sizes{};
  bool in_run = false;
  void IssueCopy(int64_t k, int64_t slot, const StreamEntry& e) {
    if (!in_run) copy_sizes.push_back(1);
    ++copies[k];
    slots[k] = slot;
    if (slot != want(k)) ++bad_slot;
    link->IssueCopy(k, slot, e);
  }
  bool CopyLanded(int64_t k) { return link->CopyLanded(k); }
  // A run of adjacent entries as one copy: checked, then forwarded entry by
  // entry so the simulated link still checks every slot's ring rule.
  const std::vector<StreamEntry>* entries = nullptr;
  int64_t runs = 0, bad_run = 0, longest_run = 0;
  void IssueRun(int64_t k, int64_t n, int64_t slot) {
    ++runs;
    copy_sizes.push_back(n);
    longest_run = std::max(longest_run, n);
    const auto& es = *entries;
    if (n < 2 || slot != want(k) || slot + n > ring ||
        want(k + n - 1) != slot + n - 1)
      ++bad_run;
    // at most half of the chunk's entries left
    if (n > std::max<int64_t>(1, (static_cast<int64_t>(es.size()) - k) / 2)) ++bad_run;
    for (int64_t j = k; j < k + n; ++j) {
      if (es[j].staged) ++bad_run;
      if (j > k && (es[j].layer != es[k].layer || es[j].expert != es[j - 1].expert + 1))
        ++bad_run;
      in_run = true;
      IssueCopy(j, slot + (j - k), es[j]);
      in_run = false;
    }
  }
};

struct Outcome {
  WalkResult res;
  std::vector<int> copies;
  std::vector<int64_t> copy_sizes;
  int64_t runs = 0;
  int64_t max_queued = 0;
};

Outcome RunChunk(const Chunk& c) {
  Store store(c.n_layers, c.n_experts, 64 + (c.n_experts % 5) * 8);
  const int64_t n = static_cast<int64_t>(c.entries.size());
  WalkConfig cfg = c.cfg;
  std::vector<int64_t> slot_of, need;
  if (c.frames > 0) {
    cfg.ring = static_cast<int64_t>(c.frames) * c.n_experts;
    for (const StreamEntry& e : c.entries) {
      slot_of.push_back(static_cast<int64_t>(e.layer % c.frames) * c.n_experts +
                        e.expert);
      need.push_back(std::max<int64_t>(0, e.layer - c.frames + 1));
    }
    cfg.slot_of = &slot_of;
    cfg.need = &need;
  }
  std::vector<uint8_t> ring(static_cast<size_t>(cfg.ring * store.blob_bytes));
  SimLink link(
      [&](const StreamEntry& e) { return store.blob(e.layer, e.expert); },
      store.blob_bytes, ring.data(), cfg.ring, c.link);
  if (c.frames > 0) link.SetNeed(&need);
  RouteGate gate(c.n_layers, c.n_experts);
  WalkState st;
  st.Reset(n);
  link.BeginChunk(&st);
  RecordingLink rec{&link, cfg.ring, c.frames > 0 ? &slot_of : nullptr,
                    std::vector<int>(n, 0), std::vector<int64_t>(n, -1)};
  rec.entries = &c.entries;

  if (c.publish_all_first)
    for (int l = 0; l < c.n_layers; ++l) gate.Publish(l, c.counts[l].data());

  std::atomic<int> reached{-1};
  std::atomic<bool> consumer_done{false};
  Outcome out;

  std::thread issuer([&] {
    out.res = strata::IssueWalk(c.entries, cfg, gate, st, rec);
  });
  std::thread publisher([&] {
    if (c.publish_all_first || c.publish_none) return;
    std::mt19937 rng(static_cast<unsigned>(n * 7 + c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      while (reached.load(std::memory_order_acquire) < l &&
             !consumer_done.load())
        std::this_thread::yield();
      if (c.max_publish_delay_us > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(
            std::uniform_int_distribution<int>(0, c.max_publish_delay_us)(
                rng)));
      gate.Publish(l, c.counts[l].data());
      st.Notify();
    }
  });
  std::thread consumer([&] {
    if (c.consumer_start_delay_us > 0)
      std::this_thread::sleep_for(
          std::chrono::microseconds(c.consumer_start_delay_us));
    int64_t k = 0;
    for (int l = 0; l < c.n_layers; ++l) {
      reached.store(l, std::memory_order_release);
      const int64_t layer_k0 = k;
      for (; k < n && c.entries[k].layer == l; ++k) {
        const StreamEntry& e = c.entries[k];
        bool ok = st.WaitIssued(k);
        CHECK(ok, "[%s] consumer: walk stopped before entry %lld",
              c.name.c_str(), (long long)k);
        if (!ok) {
          consumer_done = true;
          return;
        }
        bool routed = c.counts[e.layer][e.expert] > 0;
        EntryState s = st.entry_state(k);
        if (routed)
          CHECK(s == EntryState::kCopied,
                "[%s] routed entry %lld (layer %d expert %d) not copied",
                c.name.c_str(), (long long)k, e.layer, e.expert);
        if (s == EntryState::kCopied) {
          int64_t slot = rec.want(k);
          CHECK(link.WaitCopied(k, slot, st), "[%s] copy %lld never landed",
                c.name.c_str(), (long long)k);
          CHECK(std::memcmp(link.Slot(slot), store.blob(e.layer, e.expert),
                            store.blob_bytes) == 0,
                "[%s] entry %lld read foreign bytes from slot %lld",
                c.name.c_str(), (long long)k, (long long)slot);
          if (c.frames == 0) link.ReleaseSlot(k, slot);
        }
        if (c.frames == 0) st.Consume(k);
      }
      if (c.frames > 0) {
        // The layer's expert math is done: its frame is free, the whole
        // layer's slots at once. Re-read them first: nothing may have
        // landed in the frame while the layer was being read.
        for (int64_t j = layer_k0; j < k; ++j) {
          const StreamEntry& e = c.entries[j];
          if (st.entry_state(j) != EntryState::kCopied) continue;
          CHECK(std::memcmp(link.Slot(rec.want(j)), store.blob(e.layer, e.expert),
                            store.blob_bytes) == 0,
                "[%s] entry %lld overwritten before its layer released it",
                c.name.c_str(), (long long)j);
          link.ReleaseSlot(j, rec.want(j));
        }
        st.ReleaseLayers(l + 1);
      }
    }
    consumer_done = true;
  });
  issuer.join();
  consumer.join();
  publisher.join();
  link.Drain();

  CHECK(!out.res.stopped, "[%s] walk reported a stop", c.name.c_str());
  CHECK(st.issued.load() == n, "[%s] issued %lld of %lld entries",
        c.name.c_str(), (long long)st.issued.load(), (long long)n);
  CHECK(rec.bad_slot == 0, "[%s] %lld copies into a slot other than k %% ring",
        c.name.c_str(), (long long)rec.bad_slot);
  CHECK(rec.bad_run == 0, "[%s] %lld runs break the run rules", c.name.c_str(),
        (long long)rec.bad_run);
  // Routed: a run is at most half the depth, so one is always queued behind
  // the one on the link (the depth rule counts entries).
  if (c.cfg.routed)
    CHECK(rec.longest_run <= std::max(1, strata::ClampDepth(c.cfg.depth) / 2),
          "[%s] a run of %lld entries with depth %d (routed: at most depth / 2)",
          c.name.c_str(), (long long)rec.longest_run, c.cfg.depth);
  if (c.cfg.max_run <= 1)
    CHECK(rec.runs == 0, "[%s] %lld runs with max_run %d", c.name.c_str(),
          (long long)rec.runs, c.cfg.max_run);
  g_runs += rec.runs;
  CHECK(link.ring_violations() == 0, "[%s] %lld copies issued past the ring",
        c.name.c_str(), (long long)link.ring_violations());
  CHECK(link.slot_violations() == 0,
        "[%s] %lld copies overwrote a slot still in use", c.name.c_str(),
        (long long)link.slot_violations());
  int64_t copied = 0, skipped = 0;
  for (int64_t k = 0; k < n; ++k) {
    const StreamEntry& e = c.entries[k];
    bool routed = c.counts[e.layer][e.expert] > 0;
    EntryState s = st.entry_state(k);
    CHECK(s != EntryState::kPending, "[%s] entry %lld left pending",
          c.name.c_str(), (long long)k);
    CHECK(rec.copies[k] == (s == EntryState::kCopied ? 1 : 0),
          "[%s] entry %lld copied %d times (state %d)", c.name.c_str(),
          (long long)k, rec.copies[k], (int)s);
    if (s == EntryState::kSkipped) {
      ++skipped;
      CHECK(c.cfg.routed, "[%s] entry %lld skipped with the switch off",
            c.name.c_str(), (long long)k);
      CHECK(!routed, "[%s] routed entry %lld skipped", c.name.c_str(),
            (long long)k);
      CHECK(!e.staged, "[%s] staged entry %lld skipped", c.name.c_str(),
            (long long)k);
      CHECK(!c.publish_none, "[%s] entry %lld skipped with nothing published",
            c.name.c_str(), (long long)k);
    } else {
      ++copied;
    }
    // Routing published before the walk: every unrouted, non-staged entry
    // must be skipped (switch on), so the skip is exact, not best-effort.
    if (c.publish_all_first && c.cfg.routed && !routed && !e.staged)
      CHECK(s == EntryState::kSkipped,
            "[%s] entry %lld unrouted and published before the walk, but "
            "copied",
            c.name.c_str(), (long long)k);
  }
  CHECK(copied == out.res.copied && skipped == out.res.skipped,
        "[%s] walk counts %lld/%lld differ from states %lld/%lld",
        c.name.c_str(), (long long)out.res.copied,
        (long long)out.res.skipped, (long long)copied, (long long)skipped);
  out.max_queued = link.max_queued();
  if (c.cfg.routed) {
    int depth = strata::ClampDepth(c.cfg.depth);
    CHECK(out.max_queued <= depth, "[%s] %lld copies queued, depth %d",
          c.name.c_str(), (long long)out.max_queued, depth);
  }
  out.copies = rec.copies;
  out.copy_sizes = rec.copy_sizes;
  out.runs = rec.runs;
  return out;
}

Chunk RandomChunk(std::mt19937_64& rng, int index) {
  auto uni = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  Chunk c;
  c.name = "random-" + std::to_string(index);
  c.n_layers = uni(1, 6);
  c.n_experts = uni(1, 24);
  double p_stream = std::uniform_real_distribution<double>(0.2, 1.0)(rng);
  double p_unrouted = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  double p_staged = uni(0, 2) == 0 ? 0.2 : 0.0;
  // Half the chunks keep ids in order (no profile), where adjacent experts
  // can go out as runs.
  const int sorted_order = uni(0, 1);
  size_t max_layer = 0;
  c.counts.assign(c.n_layers, std::vector<int32_t>(c.n_experts, 0));
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<int> experts;
    for (int e = 0; e < c.n_experts; ++e) {
      c.counts[l][e] = std::bernoulli_distribution(p_unrouted)(rng)
                           ? 0
                           : uni(1, 100);
      if (std::bernoulli_distribution(p_stream)(rng)) experts.push_back(e);
    }
    if (sorted_order == 0)
      std::shuffle(experts.begin(), experts.end(), rng);  // profile order
    for (int e : experts)
      c.entries.push_back(
          {l, e, std::bernoulli_distribution(p_staged)(rng)});
    max_layer = std::max(max_layer, experts.size());
  }
  c.cfg.ring = uni(1, static_cast<int>(max_layer) * 2 + 2);
  c.frames = uni(0, 1) ? 0 : uni(1, 3);
  c.cfg.depth = uni(0, 3) == 0 ? uni(-3, 300) : uni(1, 8);
  c.cfg.routed = uni(0, 3) != 0;
  c.cfg.poll = std::chrono::microseconds(uni(5, 50));
  c.cfg.max_run = uni(0, 2) == 0 ? 1 : uni(2, 8);
  c.link.bandwidth = uni(0, 1) ? 0.0 : 2e6 * uni(1, 50);
  c.link.latency = uni(0, 1) ? 0.0 : 1e-6 * uni(1, 200);
  c.link.jitter = uni(0, 2) == 0 ? 1e-6 * uni(1, 300) : 0.0;
  c.link.seed = static_cast<uint64_t>(index);
  c.max_publish_delay_us = uni(0, 400);
  c.consumer_start_delay_us = uni(0, 3) == 0 ? uni(0, 2000) : 0;
  int mode = uni(0, 9);
  c.publish_all_first = mode == 0;
  c.publish_none = mode == 1;
  return c;
}

// A chunk whose layers are all streamed, with a given routing pattern.
Chunk FixedChunk(const std::string& name, int L, int E, int ring, int depth,
                 bool routed, int unrouted_every) {
  Chunk c;
  c.name = name;
  c.n_layers = L;
  c.n_experts = E;
  c.counts.assign(L, std::vector<int32_t>(E, 0));
  for (int l = 0; l < L; ++l)
    for (int e = 0; e < E; ++e) {
      c.counts[l][e] =
          (unrouted_every > 0 && (e + l) % unrouted_every == 0) ? 0 : 3;
      c.entries.push_back({l, e, false});
    }
  c.cfg.ring = ring;
  c.cfg.depth = depth;
  c.cfg.routed = routed;
  return c;
}

void TestFixed() {
  // 1. Everything published up front: the skip is exact.
  {
    Chunk c = FixedChunk("fixed-published-first", 4, 16, 20, 4, true, 2);
    c.publish_all_first = true;
    Outcome o = RunChunk(c);
    CHECK(o.res.skipped == 4 * 8, "skipped %lld of 32 unrouted",
          (long long)o.res.skipped);
  }
  // 2. Nothing published: nothing skipped, even with the switch on.
  {
    Chunk c = FixedChunk("fixed-unpublished", 3, 8, 10, 2, true, 2);
    c.publish_none = true;
    Outcome o = RunChunk(c);
    CHECK(o.res.skipped == 0, "skipped %lld with nothing published",
          (long long)o.res.skipped);
  }
  // 3. Switch off, everything published, a slow link and a consumer that
  //    starts late: nothing is skipped, and the queue runs as far ahead as
  //    the ring allows (no depth rule).
  {
    Chunk c = FixedChunk("fixed-switch-off", 2, 12, 24, 2, false, 2);
    c.publish_all_first = true;
    c.link.latency = 200e-6;
    c.consumer_start_delay_us = 5000;
    Outcome o = RunChunk(c);
    CHECK(o.res.skipped == 0, "switch off skipped %lld",
          (long long)o.res.skipped);
    CHECK(o.max_queued > 2, "switch off queued at most %lld: depth applied",
          (long long)o.max_queued);
  }
  // 4. The same with the switch on: at most depth queued.
  {
    Chunk c = FixedChunk("fixed-switch-on-depth", 2, 12, 24, 2, true, 0);
    c.link.latency = 200e-6;
    c.consumer_start_delay_us = 5000;
    Outcome o = RunChunk(c);
    CHECK(o.max_queued <= 2, "queued %lld with depth 2",
          (long long)o.max_queued);
  }
  // 5. A ring of one slot: the walk and the consumer alternate.
  {
    Chunk c = FixedChunk("fixed-ring-1", 3, 5, 1, 16, true, 3);
    c.max_publish_delay_us = 100;
    RunChunk(c);
  }
  // 6. Staged entries are never skipped.
  {
    Chunk c = FixedChunk("fixed-staged", 2, 10, 12, 4, true, 1);  // all unrouted
    for (auto& e : c.entries) e.staged = (e.expert % 2 == 0);
    c.publish_all_first = true;
    Outcome o = RunChunk(c);
    CHECK(o.res.copied == 10 && o.res.skipped == 10,
          "staged: copied %lld skipped %lld, want 10/10",
          (long long)o.res.copied, (long long)o.res.skipped);
  }
  // 6b. Runs: with the switch off and the ring free, adjacent experts go out
  //     several to a copy, within max_run; with the switch on, never past the
  //     depth and never over an unrouted expert whose routing is known.
  {
    Chunk c = FixedChunk("fixed-runs-off", 2, 16, 32, 16, false, 0);
    c.cfg.max_run = 4;
    c.consumer_start_delay_us = 2000;
    Outcome o = RunChunk(c);
    CHECK(o.runs >= 8, "switch off, free ring: %lld runs, want >= 8",
          (long long)o.runs);
    CHECK(o.res.copied == 32, "runs copied %lld of 32", (long long)o.res.copied);
  }
  // 6c. Near the chunk's end a run holds at most half of the entries left: 32 entries, a
  //     free ring and max_run 16 go out as 16, 8, 4, 2, 1, 1 (the last layer's pieces wait
  //     for the copy that holds their last expert).
  {
    Chunk c = FixedChunk("fixed-runs-tail", 1, 32, 32, 16, false, 0);
    c.cfg.max_run = 16;
    c.consumer_start_delay_us = 2000;
    Outcome o = RunChunk(c);
    const std::vector<int64_t> want = {16, 8, 4, 2, 1, 1};
    std::string got;
    for (int64_t s : o.copy_sizes) got += std::to_string(s) + " ";
    CHECK(o.copy_sizes == want, "runs at the chunk's end: %s, want 16 8 4 2 1 1",
          got.c_str());
  }
  {
    Chunk c = FixedChunk("fixed-runs-routed", 3, 16, 48, 4, true, 3);
    c.cfg.max_run = 8;
    c.publish_all_first = true;
    c.link.latency = 100e-6;
    Outcome o = RunChunk(c);
    CHECK(o.res.skipped == 16, "runs, routing known: skipped %lld of 16 unrouted",
          (long long)o.res.skipped);
  }
  // 7. Depth outside 1..256 is clamped.
  {
    bool clamped = false;
    CHECK(strata::ClampDepth(0, &clamped) == 1 && clamped, "depth 0 -> 1");
    CHECK(strata::ClampDepth(1000, &clamped) == 256 && clamped, "1000 -> 256");
    CHECK(strata::ClampDepth(16, &clamped) == 16 && !clamped, "16 stays");
    Chunk c = FixedChunk("fixed-depth-0", 2, 6, 8, 0, true, 2);
    c.link.latency = 100e-6;
    Outcome o = RunChunk(c);
    CHECK(o.max_queued <= 1, "depth 0 clamped to 1, queued %lld",
          (long long)o.max_queued);
  }
  // 8. An empty chunk completes at once.
  {
    Chunk c = FixedChunk("fixed-empty", 2, 4, 4, 16, true, 0);
    c.entries.clear();
    auto t0 = std::chrono::steady_clock::now();
    Outcome o = RunChunk(c);
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    CHECK(o.res.copied == 0 && o.res.skipped == 0, "empty chunk did work");
    CHECK(ms < 100, "empty chunk took %.1f ms", ms);
  }
}

void TestBadInput() {
  std::vector<StreamEntry> entries = {{0, 0, false}, {1, 3, false}};
  CHECK(strata::ValidateStreamList(entries, 2, 4).empty(), "valid list");
  std::string m = strata::ValidateStreamList(entries, 2, 3);
  CHECK(m.find("expert 3") != std::string::npos, "bad expert: '%s'", m.c_str());
  m = strata::ValidateStreamList(entries, 1, 4);
  CHECK(m.find("layer 1") != std::string::npos, "bad layer: '%s'", m.c_str());
  m = strata::ValidateStreamList(entries, -1, 4);
  CHECK(m.find("negative layer count") != std::string::npos, "'%s'", m.c_str());
  m = strata::ValidateStreamList(entries, 2, -2);
  CHECK(m.find("negative expert count") != std::string::npos, "'%s'",
        m.c_str());
  std::vector<StreamEntry> backwards = {{1, 0, false}, {0, 0, false}};
  m = strata::ValidateStreamList(backwards, 2, 4);
  CHECK(m.find("layer order") != std::string::npos, "'%s'", m.c_str());

  bool threw = false;
  try {
    RouteGate g(-1, 4);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "negative gate size accepted");

  threw = false;
  try {
    RouteGate gate(1, 1);
    WalkState st;
    st.Reset(1);
    WalkConfig cfg;
    cfg.ring = 0;
    struct NullLink {
      void IssueCopy(int64_t, int64_t, const StreamEntry&) {}
      bool CopyLanded(int64_t) { return true; }
    } link;
    strata::IssueWalk(std::vector<StreamEntry>{{0, 0, false}}, cfg, gate, st,
                      link);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("ring of 0") != std::string::npos;
  }
  CHECK(threw, "a ring of 0 slots was accepted");
}

// A stop requested mid-walk ends the walk and the link within 100 ms with
// no thread left running; the next walk on the same link works.
void TestStop() {
  const int L = 4, E = 64;
  Store store(L, E, 256);
  std::vector<StreamEntry> entries;
  for (int l = 0; l < L; ++l)
    for (int e = 0; e < E; ++e) entries.push_back({l, e, false});
  const int64_t ring_slots = 16;
  std::vector<uint8_t> ring(ring_slots * store.blob_bytes);
  SimLinkOptions opt;
  opt.latency = 20e-3;  // a very slow link: the walk is mid-chunk for seconds
  SimLink link([&](const StreamEntry& e) { return store.blob(e.layer, e.expert); },
               store.blob_bytes, ring.data(), ring_slots, opt);
  RouteGate gate(L, E);
  WalkState st;
  for (int round = 0; round < 2; ++round) {
    st.Reset(static_cast<int64_t>(entries.size()));
    gate.Reset(L, E);
    link.BeginChunk(&st);
    WalkConfig cfg;
    cfg.ring = ring_slots;
    cfg.depth = 4;
    cfg.routed = true;
    WalkResult res;
    std::thread issuer(
        [&] { res = strata::IssueWalk(entries, cfg, gate, st, link); });
    std::thread consumer([&] {
      for (int64_t k = 0; k < static_cast<int64_t>(entries.size()); ++k) {
        if (!st.WaitIssued(k)) return;
        if (st.entry_state(k) == EntryState::kCopied) {
          if (!link.WaitCopied(k, k % ring_slots, st)) return;
          link.ReleaseSlot(k, k % ring_slots);
        }
        st.Consume(k);
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    auto t0 = std::chrono::steady_clock::now();
    st.RequestStop();
    issuer.join();
    consumer.join();
    link.Abort();
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    CHECK(res.stopped, "round %d: walk did not report the stop", round);
    CHECK(ms < 100, "round %d: stop took %.1f ms", round, ms);
    CHECK(st.issued.load() < static_cast<int64_t>(entries.size()),
          "round %d: walk finished before the stop", round);
  }
  link.Shutdown();
  CHECK(!link.running(), "link worker still running after shutdown");

  // The next walk after the stops: a full chunk, fast link.
  Chunk c = FixedChunk("after-stop", 3, 8, 6, 4, true, 2);
  c.max_publish_delay_us = 50;
  RunChunk(c);
}

// A link that publishes the gate itself (the CUDA link polls an event): the
// walk must poll it for the layer it is at, before deciding, and skip what
// the published row leaves unrouted; with the switch off it must not poll.
void TestPollGate() {
  const int L = 3, E = 8;
  std::vector<std::vector<int32_t>> counts(L, std::vector<int32_t>(E, 0));
  for (int l = 0; l < L; ++l)
    for (int e = 0; e < E; ++e) counts[l][e] = (e + l) % 3 == 0 ? 2 : 0;
  std::vector<StreamEntry> entries;
  for (int l = 0; l < L; ++l)
    for (int e = 0; e < E; ++e) entries.push_back({l, e, false});
  struct PollLink {
    RouteGate* gate;
    const std::vector<std::vector<int32_t>>* counts;
    std::vector<int> polls_of_layer = std::vector<int>(3, 0);
    int64_t copies = 0;
    int32_t last_layer_polled = -1;
    int bad_order = 0;
    void IssueCopy(int64_t, int64_t, const StreamEntry&) { ++copies; }
    bool CopyLanded(int64_t) { return true; }
    void PollGate(int32_t layer) {
      if (layer < last_layer_polled) ++bad_order;
      last_layer_polled = layer;
      ++polls_of_layer[layer];
      // Lands on the second poll of a layer: the walk must poll again.
      if (polls_of_layer[layer] >= 2 && !gate->Published(layer))
        gate->Publish(layer, (*counts)[layer].data());
    }
  };
  for (bool routed : {true, false}) {
    RouteGate gate(L, E);
    WalkState st;
    st.Reset(static_cast<int64_t>(entries.size()));
    WalkConfig cfg;
    cfg.ring = 64;
    cfg.depth = 4;
    cfg.routed = routed;
    PollLink link{&gate, &counts};
    const WalkResult res = strata::IssueWalk(entries, cfg, gate, st, link);
    int64_t want_copied = 0;
    int polls = 0;
    for (int l = 0; l < L; ++l) {
      polls += link.polls_of_layer[l];
      for (int e = 0; e < E; ++e) {
        // The row lands on a layer's second poll; the walk polls again
        // while it waits, so even the layer's first entry sees it.
        const bool copied = !routed || counts[l][e] > 0;
        want_copied += copied;
        const EntryState s = st.entry_state(l * E + e);
        CHECK(s == (copied ? EntryState::kCopied : EntryState::kSkipped),
              "poll gate, routed=%d: layer %d expert %d state %d", routed, l, e,
              int(s));
      }
    }
    CHECK(res.copied == want_copied && res.copied == link.copies,
          "poll gate, routed=%d: copied %lld, want %lld (link saw %lld)", routed,
          (long long)res.copied, (long long)want_copied, (long long)link.copies);
    CHECK(res.copied + res.skipped == static_cast<int64_t>(entries.size()),
          "poll gate: copied + skipped != entries");
    CHECK(routed ? polls > 0 : polls == 0,
          "poll gate, routed=%d: %d polls", routed, polls);
    CHECK(link.bad_order == 0, "poll gate: a layer polled after a later one");
  }
}

// The hold of a chunk begun from the host (WalkConfig::hold): while it is set
// the walk runs at most `hold` entries ahead of the copies that landed, runs
// included, in both switch positions; a skipped entry counts as landed;
// lifting it (0, then a notify) lets the walk run to the end; a stop ends a
// held walk at once.
void TestHold() {
  const int L = 3, E = 16, H = 5;
  std::vector<StreamEntry> entries;
  for (int l = 0; l < L; ++l)
    for (int e = 0; e < E; ++e) entries.push_back({l, e, false});
  const int64_t n = static_cast<int64_t>(entries.size());
  struct HoldLink {
    std::atomic<int64_t> landed{0};  // entries < landed have landed
    std::atomic<int64_t> issued_copies{0};
    std::atomic<int64_t> worst_ahead{0};  // max over issues of (last entry + 1 - landed)
    void Note(int64_t last) {
      const int64_t ahead = last + 1 - landed.load();
      int64_t w = worst_ahead.load();
      while (ahead > w && !worst_ahead.compare_exchange_weak(w, ahead)) {}
    }
    void IssueCopy(int64_t k, int64_t, const StreamEntry&) {
      ++issued_copies;
      Note(k);
    }
    void IssueRun(int64_t k, int64_t run, int64_t) {
      ++issued_copies;
      Note(k + run - 1);
    }
    bool CopyLanded(int64_t k) { return k < landed.load(); }
  };
  auto wait_issued = [](WalkState& st, int64_t want) {
    for (int i = 0; i < 2000 && st.issued.load() < want; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    // Long enough for a walk that would run past `want` to have done so.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return st.issued.load();
  };
  for (bool routed : {false, true}) {
    RouteGate gate(L, E);
    WalkState st;
    st.Reset(n);
    std::atomic<int64_t> hold{H};
    WalkConfig cfg;
    cfg.ring = n;
    cfg.depth = 64;
    cfg.routed = routed;
    cfg.max_run = 4;
    cfg.poll = std::chrono::microseconds(50);
    cfg.hold = &hold;
    HoldLink link;
    WalkResult res;
    std::thread walk([&] { res = strata::IssueWalk(entries, cfg, gate, st, link); });
    CHECK(wait_issued(st, H) == H, "hold, routed=%d: %lld issued, want %d",
          routed, (long long)st.issued.load(), H);
    link.landed = 3;  // entries 0..2 landed: the walk may reach entry 7
    CHECK(wait_issued(st, 3 + H) == 3 + H, "hold, routed=%d: %lld issued after "
          "3 landed, want %d", routed, (long long)st.issued.load(), 3 + H);
    CHECK(link.worst_ahead.load() <= H, "hold, routed=%d: %lld entries ahead of "
          "the landed ones, hold %d", routed, (long long)link.worst_ahead.load(), H);
    if (routed) {
      // Layer 0 published with only expert 0 routed: what is left of it is
      // skipped and counts as landed for the hold.
      std::vector<int32_t> counts(E, 0);
      counts[0] = 1;
      gate.Publish(0, counts.data());
      st.Notify();
      // Entries 8..15 skipped: the walk reaches entry E + H - 1, whose entry
      // H back is layer 1's first copy, not landed.
      CHECK(wait_issued(st, E + H) == E + H, "hold, routed: %lld issued after "
            "the skips, want %d", (long long)st.issued.load(), E + H);
    }
    hold.store(0);  // adopted
    st.Notify();
    link.landed = n;
    walk.join();
    CHECK(!res.stopped && res.copied + res.skipped == n,
          "hold, routed=%d: walk ended at %lld of %lld (stopped %d)", routed,
          (long long)(res.copied + res.skipped), (long long)n, res.stopped);
    // Routed: layer 0's experts past the first 3 + H issued before its row.
    CHECK(routed ? res.skipped == E - (3 + H) : res.skipped == 0,
          "hold, routed=%d: %lld skipped", routed, (long long)res.skipped);
  }
  // A stop ends a held walk.
  RouteGate gate(L, E);
  WalkState st;
  st.Reset(n);
  std::atomic<int64_t> hold{H};
  WalkConfig cfg;
  cfg.ring = n;
  cfg.hold = &hold;
  cfg.poll = std::chrono::microseconds(50);
  HoldLink link;
  WalkResult res;
  std::thread walk([&] { res = strata::IssueWalk(entries, cfg, gate, st, link); });
  wait_issued(st, H);
  const auto t0 = std::chrono::steady_clock::now();
  st.RequestStop();
  walk.join();
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - t0).count();
  CHECK(res.stopped && ms < 100, "hold: a stop took %.1f ms (stopped %d)", ms,
        res.stopped);
}

}  // namespace

// The issuer's thread: one thread for every job, jobs in turn, Wait() returns
// only after the job (and its captures) are done, busy() follows the job, and
// the destructor waits for a running job.
void TestWorker() {
  std::atomic<int> ran{0};
  std::thread::id first{}, other{};
  {
    strata::Worker w("strata-test");
    CHECK(!w.busy(), "worker: busy before any job");
    w.Wait();  // nothing to wait for
    w.Run([&] { first = std::this_thread::get_id(); ++ran; });
    w.Wait();
    CHECK(!w.busy() && ran.load() == 1, "worker: first job not done after Wait");
    std::atomic<bool> release{false};
    w.Run([&] {
      while (!release.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
      other = std::this_thread::get_id();
      ++ran;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(w.busy(), "worker: not busy while its job waits");
    CHECK(ran.load() == 1, "worker: Wait-less job finished early");
    release = true;
    w.Wait();
    CHECK(ran.load() == 2 && other == first, "worker: second job on another thread");
    CHECK(first != std::this_thread::get_id(), "worker: job ran on the caller");
    auto token = std::make_shared<int>(7);
    std::weak_ptr<int> seen = token;
    w.Run([token, &ran] { ran += *token - 6; });
    token.reset();
    w.Wait();
    CHECK(seen.expired(), "worker: a job's captures outlive Wait");
    w.Run([] { throw std::runtime_error("planted"); });  // reported, not fatal
    w.Wait();
    w.Run([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ++ran;
    });
    bool refused = false;
    try {
      w.Run([&] { ran += 100; });  // the last job still runs
    } catch (const std::logic_error&) {
      refused = true;
    }
    CHECK(refused, "worker: a second job was taken while one ran");
  }  // the destructor waits for the last job
  CHECK(ran.load() == 4, "worker: destructor did not wait for the job (ran %d)", ran.load());
}

int main(int argc, char** argv) {
  int n_random = argc > 1 ? std::atoi(argv[1]) : 60;
  uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20261130;
  TestBadInput();
  TestFixed();
  TestStop();
  TestPollGate();
  TestHold();
  TestWorker();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < n_random; ++i) RunChunk(RandomChunk(rng, i));
  std::printf("routed_stream_test: %d random chunks (seed %llu), %lld runs, %d "
              "checks, %d failures\n",
              n_random, (unsigned long long)seed, (long long)g_runs, g_checks,
              g_failures);
  return g_failures == 0 ? 0 : 1;
}
