// What the module calls into CUDA outside an engine: the host-to-device link
// probe and pinned host memory for the expert store. Defined in link_probe.cu,
// or in cuda_stub.cc (every call fails, saying so) in a build without CUDA.
#pragma once

#include <cstdint>

#include "engine.hpp"

namespace strata {

// The host memory a probe copies from.
enum class ProbeHost : int32_t { kPageable = 0, kHostAlloc = 1, kRegistered = 2 };

// The median rate in GB/s (into `gbps`) of `reps` timed repetitions (after
// one warm-up) of `bytes` copied from fresh host memory of kind `host` to the
// device, in back-to-back copies of `block` bytes (`bytes` when block <= 0),
// recording an event after each when `events` is set. Arguments are the
// caller's to check (bytes > 0, reps >= 1).
Status MeasureH2D(int device, int64_t bytes, int64_t block, int reps,
                  ProbeHost host, bool events, double* gbps);

// The same out of host memory the caller owns, valid for `bytes` until this
// returns (non-null, bytes > 0 and reps >= 1: the caller's to check).
Status MeasureH2DFrom(int device, const void* host, int64_t bytes, int reps,
                      double* gbps);

// `bytes` of pinned host memory (cudaHostAlloc, portable) into `out`, which
// PinnedFree gives back. With `device` >= 0, allocated preferring that GPU's
// host NUMA node (NumaScope); `numa_node` (if given) gets the node, or -1.
Status PinnedAlloc(int64_t bytes, void** out, int device = -1,
                   int* numa_node = nullptr);
void PinnedFree(void* p);

}  // namespace strata
