// The CUDA backend's device kernels, reached through their launch helpers:
// int32 writes whose values travel as kernel arguments (a chunk's stats and
// token ids), and the split of packed expert blobs into their planes.
// CUDA builds only; each helper queues its work on the stream it is given and
// returns a Status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_util.hpp"
#include "engine.hpp"

namespace strata {
namespace STRATA_INTERNAL cuda {

// Writes the n int32 at `host` (which may die on return) into `out` on
// `stream` (a cudaStream_t), carried as kernel arguments: one launch for up to
// 256 ints, else one per 8,184 where the driver takes 32 KB of kernel
// arguments (`large_args`, CUDA 12.1+), or per 1,020 where it takes 4 KB.
Status LaunchIntWrites(const int32_t* host, void* out, int64_t n,
                       bool large_args, void* stream);

// The plane table as the split reads it: plane p's `bytes[p]` at
// `offset[p]` in each blob, for the first `n` planes.
struct PlaneTable {
  int n;
  int64_t offset[kMaxPlanes];
  int64_t bytes[kMaxPlanes];
};

// n packed blobs at `src` (blob bytes apart) into n rows of each plane of
// `planes` (plane p's rows bytes[p] apart at dst.plane[p]): on the device one
// SplitBlobs launch (16-byte words for a plane where it and its rows are
// 16-byte aligned, else bytes), from the host one strided copy per plane.
Status SplitIntoPlanes(const uint8_t* src, int64_t n, const Rows& dst,
                       int64_t blob, const PlaneTable& planes,
                       cudaMemcpyKind kind, cudaStream_t st);

}  // namespace cuda
}  // namespace strata
