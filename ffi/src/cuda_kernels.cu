// The CUDA backend's device kernels and their launch helpers (see
// cuda_kernels.hpp). A kernel is launched from the file that defines it, so
// each one's launches live here beside it.
#include "cuda_kernels.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

namespace strata {
namespace STRATA_INTERNAL cuda {
namespace {

// By value, so the ints reach the device as kernel arguments, with the launch:
// no copy from pageable host memory (which may synchronize; End's host buffer
// dies on return), and nothing for the copy engines, where a copy of a chunk's
// token ids queued on another stream would wait behind the walk's copies.
// N = 256 for the stats; 8,184 for the ids (32,736 bytes: with the pointer and
// the count, under the 32,764 bytes of kernel arguments CUDA 12.1+ allows on
// sm_70+), or 1,020 (the 4 KB every driver takes) under a driver older than
// 12.1.
template <int N>
struct IntArgs {
  int32_t v[N];
};

template <int N>
__global__ void WriteIntArgs(IntArgs<N> v, int32_t* out, int n) {
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x))
    out[i] = v.v[i];
}

constexpr int kSmallInts = 256;
constexpr int kMidInts = 1020;
constexpr int kLargeInts = 8184;
static_assert(sizeof(IntArgs<kMidInts>) + sizeof(int32_t*) + sizeof(int) <= 4096,
              "kernel arguments over the 4,096 bytes of drivers before 12.1");
static_assert(sizeof(IntArgs<kLargeInts>) + sizeof(int32_t*) + sizeof(int) <= 32764,
              "kernel arguments over CUDA's 32,764-byte limit");

// One launch per N ints, each carrying them as its arguments.
template <int N>
Status LaunchWrites(const int32_t* host, void* out, int64_t n, void* stream) {
  auto v = std::make_unique<IntArgs<N>>();  // 32 KB: not on the stack
  for (int64_t off = 0; off < n; off += N) {
    int count = static_cast<int>(std::min<int64_t>(N, n - off));
    std::memcpy(v->v, host + off, static_cast<size_t>(count) * sizeof(int32_t));
    int32_t* dst = static_cast<int32_t*>(out) + off;
    void* args[] = {v.get(), &dst, &count};
    const unsigned blocks = static_cast<unsigned>((count + 255) / 256);
    STRATA_CUDA_RETURN("ints " + std::to_string(off) + ".." +
                           std::to_string(off + count) + " as kernel arguments",
                       cudaLaunchKernel,
                       reinterpret_cast<const void*>(&WriteIntArgs<N>),
                       dim3(blocks), dim3(256u), args, size_t{0},
                       static_cast<cudaStream_t>(stream));
  }
  return {};
}

// Device-to-device split of n packed blobs into their planes: one launch for
// all of them instead of a strided cudaMemcpy2DAsync per plane, copies of
// short rows that take longer than this kernel's streaming of the same bytes.
// Each block copies one (row, plane) piece: 16-byte words where the plane is
// `wide` (the caller checks that its offset, size, the blob and every pointer
// are 16-byte aligned), else bytes.
struct SplitArgs {
  const uint8_t* src;
  uint8_t* dst[kMaxPlanes];
  int64_t offset[kMaxPlanes];  // of each plane in a blob
  int64_t bytes[kMaxPlanes];   // of each plane's row
  int32_t wide[kMaxPlanes];    // 1: copy in 16-byte words
  int64_t blob;                // bytes from one packed blob to the next
  int32_t planes;
};

__global__ void SplitBlobs(SplitArgs a, int64_t blocks_per_piece) {
  const int64_t piece = blockIdx.x / blocks_per_piece;  // row * planes + plane
  const int64_t row = piece / a.planes;
  const int plane = static_cast<int>(piece % a.planes);
  const uint8_t* src = a.src + row * a.blob + a.offset[plane];
  uint8_t* dst = a.dst[plane] + row * a.bytes[plane];
  const int64_t stride = blocks_per_piece * blockDim.x;
  const int64_t first = (blockIdx.x % blocks_per_piece) * blockDim.x + threadIdx.x;
  if (a.wide[plane]) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t w = first, words = a.bytes[plane] / 16; w < words; w += stride)
      d[w] = s[w];
  } else {
    for (int64_t b = first; b < a.bytes[plane]; b += stride) dst[b] = src[b];
  }
}

}  // namespace

Status LaunchIntWrites(const int32_t* host, void* out, int64_t n,
                       bool large_args, void* stream) {
  if (n <= kSmallInts) return LaunchWrites<kSmallInts>(host, out, n, stream);
  return large_args ? LaunchWrites<kLargeInts>(host, out, n, stream)
                    : LaunchWrites<kMidInts>(host, out, n, stream);
}

Status SplitIntoPlanes(const uint8_t* src, int64_t n, const Rows& dst,
                       int64_t blob, const PlaneTable& planes,
                       cudaMemcpyKind kind, cudaStream_t st) {
  auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  if (n <= 0) return {};
  if (kind == cudaMemcpyDeviceToDevice) {
    SplitArgs a{};
    a.src = src;
    a.blob = blob;
    a.planes = planes.n;
    int64_t widest = 0;  // bytes of the largest plane
    for (int p = 0; p < planes.n; ++p) {
      a.dst[p] = dst.plane[p];
      a.offset[p] = planes.offset[p];
      a.bytes[p] = planes.bytes[p];
      a.wide[p] = blob % 16 == 0 && planes.offset[p] % 16 == 0 &&
                  planes.bytes[p] % 16 == 0 && aligned(src) && aligned(dst.plane[p]);
      widest = std::max(widest, planes.bytes[p]);
    }
    constexpr int kThreads = 256;
    // About 64 KiB of words per block of the largest plane: enough blocks to
    // fill the device even for one row, few enough to keep each block
    // streaming.
    const int64_t per_piece =
        std::max<int64_t>(1, std::min<int64_t>(64, widest / 16 / 4096));
    const int64_t blocks = n * planes.n * per_piece;
    void* args[] = {&a, const_cast<int64_t*>(&per_piece)};
    STRATA_CUDA_RETURN(std::to_string(n) + " rows, " + std::to_string(planes.n) + " planes",
                       cudaLaunchKernel,
                       reinterpret_cast<const void*>(&SplitBlobs),
                       dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                       args, size_t{0}, st);
    return {};
  }
  for (int p = 0; p < planes.n; ++p) {
    const size_t bytes = static_cast<size_t>(planes.bytes[p]);
    STRATA_CUDA_RETURN("plane " + std::to_string(p) + ", " + std::to_string(n) +
                           " rows",
                       cudaMemcpy2DAsync, dst.plane[p], bytes, src + planes.offset[p],
                       static_cast<size_t>(blob), bytes,
                       static_cast<size_t>(n), kind, st);
  }
  return {};
}

}  // namespace cuda
}  // namespace strata
