// Built when CUDA support is off: the CUDA engine is unavailable with a
// message that says how to get it.
#include "engine.hpp"

namespace strata {
std::unique_ptr<Engine> MakeCudaEngine(const EngineOptions&, Status* err) {
  *err =
      "strata_jax was built without CUDA support; install the CUDA toolkit "
      "(nvcc) and reinstall with `pip install --no-build-isolation -e .` "
      "(or -Ccmake.define.STRATA_CUDA=ON to make a missing toolkit an error)";
  return nullptr;
}
}  // namespace strata
