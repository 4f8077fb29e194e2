// dense_fetch and dense_wait (Engine(dense="host")): a decoder layer's own
// weights, held in pinned host memory, copied into buffers XLA allocated for
// them, one layer ahead of the layer that reads them.
//
// dense_fetch copies each host range (its `src` attribute: one address per
// result) into its result. On the CPU at once (memcpy). On CUDA on a copy
// stream of the device, after the work queued on XLA's stream so far (an
// event recorded there, which the copy stream waits on: every earlier user of
// the results' memory is done before a byte lands), ending in an event kept
// under the call's `key`. dense_wait makes XLA's stream wait on that event;
// its operands are the fetched arrays (aliased to its results) and `after`,
// which orders it. So a layer's copies run while the layer before computes,
// and nothing reads them before they land.
#pragma once

#include <cstdint>

#include "engine.hpp"

namespace strata {

// The CUDA side (dense_copy.cu, CUDA builds only): `n` copies of
// `bytes[i]` from host address `src[i]` to device address `dst[i]` on device
// `ordinal`, as described above.
Status DenseCopyCuda(void* xla_stream, int ordinal, int64_t key, const int64_t* src,
                     void* const* dst, const int64_t* bytes, int n);
Status DenseWaitCuda(void* xla_stream, int ordinal, int64_t key);

}  // namespace strata
