// The CPU backend ("simulated device"): the ring (the planes' regions of layer
// frames, or packed blobs, as on the GPU) is host memory, the link is
// SimLink's copy worker (in order, with a configurable bandwidth, latency and
// jitter) and events are per-slot sequence numbers. It runs the real walk with
// real threads and atomics, so CI exercises the whole engine without a GPU.
#include <chrono>
#include <cstring>
#include <thread>

#include "engine.hpp"
#include "strata/sim_link.hpp"
#include "strata/thread_name.hpp"

namespace strata {
namespace {

class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(const EngineOptions& opt) : Engine(opt) {}
  ~CpuEngine() override {
    Abort();
    if (link_) link_->Shutdown();
  }

  Status Prepare() override {
    if (in_chunk_) return "cannot prepare during a chunk";
    if (Status s = CheckStores(); !s.empty()) return s;
    if (link_) link_->Shutdown();
    ring_.assign(static_cast<size_t>(RingBytes()), 0);
    SimLinkOptions lo;
    lo.bandwidth = opt_.sim_bandwidth;
    lo.latency = opt_.sim_latency;
    lo.jitter = opt_.sim_jitter;
    lo.seed = opt_.seed;
    link_ = std::make_unique<SimLink>(
        [this](const StreamEntry& e) { return HostBlob(e.layer, e.expert); },
        opt_.blob_bytes, ring_.data(), opt_.ring, lo);
    link_->SetNeed(&need_);
    prepared_ = true;
    return {};
  }

 protected:
  Status BackendBegin(ChunkMode mode, void*) override {
    // Each chunk lays the ring out its own way (packed blobs or frame planes).
    // Nothing of the last chunk reads the ring any more: its fetches copied
    // what they read out before their handlers returned.
    std::vector<RingPlane> planes;
    if (mode != ChunkMode::kStreamPacked)
      for (int p = 0; p < n_planes(); ++p)
        planes.push_back({plane_offset(p), plane_bytes(p), PlaneRegion(p)});
    link_->BeginChunk(&state_, std::move(planes));
    return {};
  }

  void StartWalk() override {
    // Landings notify the walk; the poll is only a backstop.
    const WalkConfig cfg = MakeWalkConfig(std::chrono::microseconds(200));
    issuer_.Run([this, cfg] {
      try {
        walk_result_ = IssueWalk(stream_, cfg, gate_, state_, *link_);
      } catch (const std::exception& e) {
        walk_error_ = e.what();
        walk_failed_ = true;
        state_.RequestStop();
      }
    });
  }

  Status BackendPublish(int layer, const void* counts, void*) override {
    gate_.Publish(layer, static_cast<const int32_t*>(counts));
    state_.Notify();
    return {};
  }

  Status WaitCopied(int64_t k, int64_t slot, void*) override {
    // The link lands copies in order: entry k's landing implies the earlier.
    if (!link_->WaitCopied(k, slot, state_))
      return "entry " + std::to_string(k) + " was in flight: " + StoppedMessage();
    return {};
  }

  Status ReleaseFrame(int, int64_t, int64_t k0, int64_t k1, void*) override {
    // On the CPU the expert math that read the frame has run: release now.
    for (int64_t k = k0; k < k1; ++k)
      if (state_.entry_state(k) == EntryState::kCopied)
        link_->ReleaseSlot(k, slot_of_[k]);
    return {};
  }

  Status CopyRows(const Rows& src, int64_t n, const Rows& dst, void*) override {
    for (int p = 0; p < n_planes(); ++p)
      std::memcpy(dst.plane[p], src.plane[p], static_cast<size_t>(n * plane_bytes(p)));
    return {};
  }

  uint8_t* RingBase() const override {
    return ring_.empty() ? nullptr : const_cast<uint8_t*>(ring_.data());
  }

  Status CopyDirect(int layer, int expert, int64_t n, const Rows& dst,
                    void*) override {
    // Routed-only copies cross the same simulated link: charge its time.
    double seconds = opt_.sim_latency;
    if (opt_.sim_bandwidth > 0)
      seconds += n * opt_.blob_bytes / opt_.sim_bandwidth;
    if (seconds > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    Split(HostBlob(layer, expert), n, dst);
    return {};
  }

  Status CopyResident(const uint8_t* src, int64_t n, const Rows& dst,
                      void*) override {
    Split(src, n, dst);
    return {};
  }

  Status ZeroRows(const Rows& dst, int64_t n, void*) override {
    for (int p = 0; p < n_planes(); ++p)
      std::memset(dst.plane[p], 0, static_cast<size_t>(n * plane_bytes(p)));
    return {};
  }

  Status WriteInts(const int32_t* host, void* out, int64_t bytes,
                   void*) override {
    std::memcpy(out, host, static_cast<size_t>(bytes));
    return {};
  }

  Status WaitPublished(int layer) override {
    // On the CPU, publish runs synchronously before fetch in program order.
    if (!gate_.Published(layer))
      return "routing of layer " + std::to_string(layer) +
             " was not published before its fetch";
    return {};
  }

  void BackendAbort() override {
    if (link_) link_->Abort();
  }

  std::string Describe() const override {
    const int32_t d = group_ordinal();
    return d < 0 ? std::string("cpu simulated link")
                 : "cpu simulated link, device " + std::to_string(d);
  }

 private:
  // n packed blobs at `src` into n rows of each plane.
  void Split(const uint8_t* src, int64_t n, const Rows& dst) const {
    for (int64_t j = 0; j < n; ++j)
      for (int p = 0; p < n_planes(); ++p)
        std::memcpy(dst.plane[p] + j * plane_bytes(p),
                    src + j * opt_.blob_bytes + plane_offset(p),
                    static_cast<size_t>(plane_bytes(p)));
  }

  std::vector<uint8_t> ring_;
  std::unique_ptr<SimLink> link_;
};

}  // namespace

std::unique_ptr<Engine> MakeCpuEngine(const EngineOptions& opt, Status* err) {
  (void)err;
  return std::make_unique<CpuEngine>(opt);
}

}  // namespace strata
