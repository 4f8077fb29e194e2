// Built when CUDA support is off: the CUDA engine, the link probe and pinned
// host memory are unavailable, with a message that says how to get them.
#include "engine.hpp"
#include "link_probe.hpp"

namespace strata {

std::unique_ptr<Engine> MakeCudaEngine(const EngineOptions&, Status* err) {
  *err =
      "strata_jax was built without CUDA support; install the CUDA toolkit "
      "(nvcc) and reinstall with `pip install --no-build-isolation -e .` "
      "(or -Ccmake.define.STRATA_CUDA=ON to make a missing toolkit an error)";
  return nullptr;
}

namespace {
constexpr const char kNoCuda[] = "strata_jax was built without CUDA support";
}  // namespace

Status MeasureH2D(int, int64_t, int64_t, int, ProbeHost, bool, double*) { return kNoCuda; }

Status MeasureH2DFrom(int, const void*, int64_t, int, double*) { return kNoCuda; }

Status PinnedAlloc(int64_t, void** out, int, int* numa_node) {
  *out = nullptr;
  if (numa_node) *numa_node = -1;
  return kNoCuda;
}

void PinnedFree(void*) {}

}  // namespace strata
